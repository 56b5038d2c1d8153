"""The head_dim 256 backward without a GPU (issue 40, item 4): each (mask, window, softcap)
fadsl.attention can ask of the shipped head_dim 256 specs builds its three backward kernels
(NVRTC, sm_90a) in bf16 and fp16 with no spill, and so does B_c 64 (the same kernel with 32
accumulator registers fewer). The consumers' registers are read from the SASS where
nvdisasm is installed: the most the split consumer uses stays under setmaxnreg's 240, the
numbers of 2026-11-30 (NVRTC 13.5) pinned as bounds so that a change that costs registers
shows (a softcap: 238 of 240). The GPU runs them in tests/test_gpu_backward.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fadsl._data import data_dir
from fadsl.codegen.render import render_backward
from fadsl.frontend.rewrite import rewrite_backward
from fadsl.pipeline import compile_source
from fadsl.runtime.dispatch import attention_variant

try:
    from fadsl.build.nvrtc import compile_cubin, compiler_id

    COMPILER = compiler_id()
except Exception:  # no cuda-bindings' NVRTC here
    COMPILER = None

NONE = (-1, -1)
# (spec, causal, window_size, softcap, B_c) -> the most registers the main kernel's SASS
# names (the consumers'; bf16 and fp16 alike), NVRTC 13.5, 2026-11-30: the bounds a change
# must not pass (240, setmaxnreg's, is where ptxas would spill); B_c 64's one more since the
# split consumer's descriptors are built once a product (2026-12-02: its m-block loop 1,047
# -> 774 instructions at B_c 80)
CASES = {
    ("fa3_hdim256", False, NONE, 0, 80): 224,
    ("fa3_hdim256_causal", True, NONE, 0, 80): 226,
    ("fa3_hdim256", False, (128, 64), 0, 80): 224,
    ("fa3_hdim256_causal", True, (256, 0), 0, 80): 233,
    ("fa3_hdim256", False, NONE, 30, 80): 238,
    ("fa3_hdim256_causal", True, NONE, 30, 80): 238,
    ("fa3_hdim256", False, (128, 64), 50, 80): 237,
    ("fa3_hdim256", False, NONE, 0, 64): 188,
    ("fa3_hdim256_causal", True, NONE, 30, 64): 208,
}


def _source(spec: str, causal: bool, window, softcap, block_n: int):
    base = data_dir("examples").joinpath(f"{spec}.fa").read_text()
    name, text = attention_variant(spec, base, causal, window, softcap)
    if block_n != 80:
        text = rewrite_backward(text, {"tile": f"B_r = 64, B_c = {block_n}"}, {}, f"{name}_bc")
        name = f"{name}_bc"
    compiled = compile_source(text, f"{name}.fa")
    assert compiled.kernel.config.head_dim == 256 and compiled.kernel.backward is not None
    assert compiled.kernel.backward.block_n == block_n
    return compiled


def _most_register(cubin: bytes, kernel: str) -> int | None:
    """One more than the highest register the kernel's SASS names (None: no nvdisasm)."""
    from fadsl.tools.sass import disassemble, nvdisasm

    tool = nvdisasm()
    if tool is None:
        return None
    sass = disassemble(cubin, tool)
    body = re.search(rf"\.text\.{kernel}:\n(.*?)(?=\n\s*\.section|\Z)", sass, re.S)[1]
    return 1 + max(int(r) for r in re.findall(r"\bR(\d+)\b", body))


@pytest.mark.nvcc
@pytest.mark.skipif(COMPILER is None, reason="needs NVRTC (cuda-bindings)")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("spec, causal, window, softcap, block_n", list(CASES))
def test_each_call_builds_its_backward(
    spec, causal, window, softcap, block_n, dtype, tmp_path: Path
):
    compiled = _source(spec, causal, window, softcap, block_n)
    (source,) = [
        s
        for s in render_backward(compiled.kernel, compiled.target, compiled.file)
        if s.dtype.value == dtype
    ]
    assert "bwd_consumer_split<Cfg>" in source.text
    cubin = compile_cubin(source.text, source.filename, source.kernel_name, "sm_90a", tmp_path)
    spills = {
        kernel: (int(stores), int(loads))
        for kernel, stores, loads in re.findall(
            r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads",
            cubin.log,
            re.S,
        )
    }
    assert len(spills) == 3 and set(spills.values()) == {
        (0, 0)
    }, cubin.log  # preprocess, main, convert_dq
    assert "bytes stack frame" not in re.sub(r"0 bytes stack frame", "", cubin.log), cubin.log
    used = _most_register(cubin.cubin, source.kernel_name)
    if used is not None:  # (nvdisasm installed)
        assert used <= CASES[spec, causal, window, softcap, block_n] <= 240, used


@pytest.mark.nvcc
@pytest.mark.skipif(COMPILER is None, reason="needs NVRTC (cuda-bindings)")
def test_packed_sequences_build_too(tmp_path: Path):
    """`varlen on` at head_dim 256 (no shipped serving spec; a spec of one's own): the split
    consumer reads the sequence's rows and lengths as the padded one's, without spills (237
    registers, causal, NVRTC 13.5). Not yet run on a GPU."""
    base = data_dir("examples").joinpath("fa3_hdim256_causal.fa").read_text()
    text = base.replace("kernel fa3_hdim256_causal", "kernel packed256")
    text = text.replace("  mask       causal\n", "  mask       causal\n  varlen     on\n")
    compiled = compile_source(text, "packed256.fa")
    source = render_backward(compiled.kernel, compiled.target, compiled.file)[0]
    assert "static constexpr bool kVarlen = true;" in source.text
    cubin = compile_cubin(source.text, source.filename, source.kernel_name, "sm_90a", tmp_path)
    stores = re.findall(r"(\d+) bytes spill stores", cubin.log)
    assert stores == ["0", "0", "0"], cubin.log
    used = _most_register(cubin.cubin, source.kernel_name)
    assert used is None or used <= 237, used


@pytest.mark.nvcc
@pytest.mark.skipif(COMPILER is None, reason="needs NVRTC (cuda-bindings)")
def test_the_traced_split_backward_builds(tmp_path: Path, monkeypatch):
    """FADSL_BWD_TRACE (sm90_bwd_trace.cuh's m-block timeline): bwd_consumer_split and
    bwd_producer_split stamp their marks too; the plain build's source has none."""
    from fadsl.build import cache

    import fadsl

    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    kern = fadsl.load(str(data_dir("examples").joinpath("fa3_hdim256.fa")), verbose=False)
    backward = kern._backward_kernels()
    dtype = kern.config.dtypes[0]
    source = backward.source(dtype)
    assert "FADSL_BWD_TRACE" not in source and "bwd_consumer_split<Cfg>" in source
    traced = cache.development_build(backward.request(dtype, "sm_90a"), {"FADSL_BWD_TRACE": 1})
    assert b"fadsl_bwd_trace" in traced.cubin and b"fadsl_bwd_ctas" in traced.cubin
