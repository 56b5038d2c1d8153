"""The varlen backward without a GPU (issue 40): each (head_dim, mask, softcap) of
fadsl.attention_varlen builds its backward (NVRTC, sm_90a) as fadsl.attention_varlen loads
it (dispatch.serving_variant), with no spill except where the compiler is known to spill a
few bytes (SPILLS, pinned so that more fails). The kernels' numbers are
tests/test_gpu_backward_varlen.py's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fadsl.codegen.render import render_backward
from fadsl.pipeline import compile_source
from fadsl.runtime import dispatch

try:
    from fadsl.build.nvrtc import compile_cubin, compiler_id

    COMPILER = compiler_id()
except Exception:  # no cuda-bindings' NVRTC here
    COMPILER = None

NONE = (-1, -1)
# (causal, window_size, softcap): what a call can ask for
CALLS = [
    (True, NONE, 0),
    (False, NONE, 0),
    (True, (32, 0), 0),
    (False, (64, 16), 0),
    (False, NONE, 30),
    (True, NONE, 30),
    (False, (64, 16), 30),
]
CASES = [(head_dim, *call) for head_dim in (128, 64) for call in CALLS]
# The main kernel's spill stores (bytes) at most, where NVRTC 13.5 spills (2026-11-29): a
# softcap with a mask at head_dim 128 (B_r 64, SOFTCAP_BACKWARD; the padded backward of the
# same block fits): the sequence's lengths and rows held in registers cost 3-4 of them.
SPILLS = {(128, True, NONE, 30): 12, (128, False, (64, 16), 30): 16}


@pytest.mark.nvcc
@pytest.mark.skipif(COMPILER is None, reason="needs NVRTC (cuda-bindings)")
@pytest.mark.parametrize("head_dim, causal, window, softcap", CASES)
def test_each_call_builds_its_backward(head_dim, causal, window, softcap, tmp_path: Path):
    name = dispatch.shipped_serving_spec("varlen", (9, 0), head_dim)
    settings = dispatch.serving_settings(causal, window, softcap)
    compiled = compile_source(dispatch.serving_variant(name, settings), f"{name}.fa")
    assert compiled.kernel.config.features.varlen and compiled.kernel.backward is not None
    source = next(
        s
        for s in render_backward(compiled.kernel, compiled.target, compiled.file)
        if s.dtype.value == "bf16"
    )  # fmt: skip  (fp16 takes the same registers)
    assert "static constexpr bool kVarlen = true;" in source.text
    log = compile_cubin(source.text, source.filename, source.kernel_name, "sm_90a", tmp_path).log
    spills = {
        kernel: int(stores)
        for kernel, stores in re.findall(
            r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores", log, re.S
        )
    }
    assert len(spills) == 3, log  # preprocess, main, convert_dq
    main = spills.pop(source.kernel_name)
    assert set(spills.values()) == {0}, log
    assert main <= SPILLS.get((head_dim, causal, window, softcap), 0), log
