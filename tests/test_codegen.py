"""The emitter: golden CUDA under generated/, determinism, and nvcc compile checks."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import EXAMPLES, ROOT
from fadsl.codegen.render import HEADERS, context, read_header, render, render_backward
from fadsl.ir import Sync
from fadsl.targets.sm80 import caps as sm80
from fadsl.pipeline import compile_file
from fadsl.build.resources import ARCH_FLAGS, can_compile, ptxas_usage

GENERATED = ROOT / "generated"


def sources(compiled):
    return render(compiled.kernel, compiled.target, compiled.file)


def backward_sources(compiled):
    """The backward's sources of a spec with a backward block (else none)."""
    if compiled.kernel.backward is None:
        return ()
    return render_backward(compiled.kernel, compiled.target, compiled.file)


def test_generated_cuda_is_current(example, golden):
    compiled = compile_file(example.relative_to(ROOT))
    for variant in compiled.variants:  # `cluster 2`: its cluster-free variant too
        for source in render(variant.kernel, variant.target, variant.file):
            golden.check(GENERATED / source.filename, source.text)
    for source in backward_sources(compiled):
        golden.check(GENERATED / source.filename, source.text)
    for name in HEADERS:
        golden.check(GENERATED / name, read_header(name))


SERVING = sorted((ROOT / "examples" / "serving").glob("*.fa"))


@pytest.mark.parametrize("spec", SERVING, ids=[p.stem for p in SERVING])
def test_generated_serving_cuda_is_current(spec, golden):
    """The serving specs fadsl.attention_varlen / attention_with_kvcache rewrite, as shipped."""
    compiled = compile_file(spec.relative_to(ROOT))
    for source in sources(compiled) + backward_sources(compiled):
        golden.check(GENERATED / source.filename, source.text)


MODIFIERS = sorted((ROOT / "examples" / "modifiers").glob("*.fa"))


@pytest.mark.parametrize("spec", MODIFIERS, ids=[p.stem for p in MODIFIERS])
def test_generated_modifier_cuda_is_current(spec, golden):
    """The score and mask modifier examples (issue 41), forward and backward, their inputs
    passed by name (not run by the examples' GPU tests, which pass none)."""
    compiled = compile_file(spec.relative_to(ROOT))
    for source in sources(compiled) + backward_sources(compiled):
        golden.check(GENERATED / source.filename, source.text)


def test_rendering_is_deterministic(example):
    compiled = compile_file(example.relative_to(ROOT))
    again = compile_file(example.relative_to(ROOT))
    assert sources(compiled) == sources(again)
    assert backward_sources(compiled) == backward_sources(again)


def test_every_sync_is_rendered_with_its_hazards(example):
    """The kernel holds exactly the plan's syncs, in order, each commented with its hazards.
    The mainloop body is rendered twice: the loop over unmasked blocks, then the masked one."""
    compiled = compile_file(example.relative_to(ROOT))
    if compiled.target.name != "sm_80":
        pytest.skip("sm_80's template; sm_90a's: tests/test_sm90_codegen.py")
    source, *_ = sources(compiled)
    body = source.text.split("_kernel(", 1)[1].split("_launch(", 1)[0]
    emitted = re.findall(r"(__syncthreads\(\)|__syncwarp\(\)|cp_async_wait<\d+>\(\));", body)
    planned = []
    kernel = compiled.kernel
    for sync in (*kernel.prologue, *kernel.mainloop, *kernel.mainloop, *kernel.epilogue):
        if not isinstance(sync, Sync):
            continue
        match sync.kind:
            case sm80.CP_ASYNC_WAIT:
                planned.append(f"cp_async_wait<{sync.groups}>()")
            case sm80.SYNCWARP | sm80.SYNCTHREADS:
                planned.append(sync.kind.name)
            case _:
                raise AssertionError(sync.kind)
    assert emitted == planned
    for sync in compiled.kernel.syncs():
        for hazard in sync.serves:
            assert hazard.describe() in body


def test_context_offsets_match_the_plan(example):
    compiled = compile_file(example.relative_to(ROOT))
    if compiled.target.name != "sm_80":
        pytest.skip("sm_80's slots; sm_90a's: tests/test_sm90_codegen.py")
    for dtype in compiled.kernel.config.dtypes:
        ctx = context(compiled.kernel, compiled.target, compiled.file, dtype)
        assert ctx["smem_bytes"] == compiled.kernel.smem_bytes
        for buf in compiled.kernel.buffers:
            assert ctx["buffers"][buf.name]["offset"] == buf.offset


@pytest.mark.nvcc
@pytest.mark.skipif(not can_compile(), reason="needs NVRTC (cuda-bindings) or nvcc")
@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_kernels_compile_without_spills(spec):
    """Every dtype for sm_80 and sm_90a, the backward's kernels too: no warnings, spills or
    stack; all SMEM dynamic, as planned."""
    compiled = compile_file(spec.relative_to(ROOT))
    jobs = []
    archs = [arch for arch, _ in compiled.target.capabilities.archs]
    for source in sources(compiled):
        assert f"constexpr int kSmemBytes = {compiled.kernel.smem_bytes};" in source.text
        jobs += [(source, arch) for arch in ARCH_FLAGS if arch in archs]
    for source in backward_sources(compiled):  # the backward's three kernels
        jobs += [(source, arch) for arch in ARCH_FLAGS if arch in archs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        reports = list(pool.map(lambda job: (job, ptxas_usage(*job)), jobs))
    for (source, arch), usage in reports:
        where = f"{source.filename} {arch}: {usage}"
        assert usage["warnings"] == 0, where
        assert usage["spill_store_bytes"] == usage["spill_load_bytes"] == 0, where
        assert usage["stack_bytes"] == 0, where
        assert not usage["wgmma_serialized"], where  # ptxas C7512: no MMA overlap
        assert usage["static_smem_bytes"] == 0, where
        assert 0 < usage["registers"] <= 255, where
