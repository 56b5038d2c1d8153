"""The emitter: golden CUDA under generated/, determinism, and nvcc compile checks."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import EXAMPLES, ROOT
from fadsl.codegen import context, header_text, render
from fadsl.pipeline import compile_file

GENERATED = ROOT / "generated"


def test_generated_cuda_is_current(example, golden):
    compiled = compile_file(example.relative_to(ROOT))
    for source in render(compiled):
        golden.check(GENERATED / source.filename, source.text)
    golden.check(GENERATED / "fadsl" / "sm80.cuh", header_text())


def test_rendering_is_deterministic(example):
    compiled = compile_file(example.relative_to(ROOT))
    assert render(compiled) == render(compile_file(example.relative_to(ROOT)))


def test_every_sync_is_rendered_with_its_hazards(example):
    """The .cu holds exactly the plan's syncs, in order, each commented with its hazards."""
    compiled = compile_file(example.relative_to(ROOT))
    source, *_ = render(compiled)
    emitted = re.findall(r"__syncthreads\(\)|__syncwarp\(\)|cp_async_wait<(\d+)>", source.text)
    planned = []
    for sync in compiled.kernel.syncs():
        planned.append(str(sync.groups) if sync.kind.name == "CP_ASYNC_WAIT" else "")
    kernel_part = source.text.split("_kernel(", 1)[1]
    emitted = [
        m.group(1) or ""
        for m in re.finditer(
            r"__syncthreads\(\);|__syncwarp\(\);|cp_async_wait<(\d+)>\(\);", kernel_part
        )
    ]
    assert emitted == planned
    for sync in compiled.kernel.syncs():
        for hazard in sync.serves:
            assert hazard.describe() in source.text


def test_context_offsets_match_the_plan(example):
    compiled = compile_file(example.relative_to(ROOT))
    for dtype in compiled.kernel.config.dtypes:
        ctx = context(compiled, dtype)
        assert ctx["smem_bytes"] == compiled.kernel.smem_bytes
        for buf in compiled.kernel.buffers:
            assert ctx["buffers"][buf.name]["offset"] == buf.offset


def _nvcc() -> str | None:
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None
    )


ARCHS = {
    "sm_80": ["-arch=sm_80"],
    "sm_90a": ["-gencode=arch=compute_90a,code=sm_90a"],
}


def ptxas_report(cu: Path, arch: str) -> dict[str, int]:
    cmd = [_nvcc(), "-std=c++17", "-O3", "-cubin", "--resource-usage", *ARCHS[arch]]
    cmd += ["-o", str(cu.with_suffix(f".{arch}.cubin")), str(cu)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert "warning" not in text.lower(), text
    numbers = {}
    for key, pattern in {
        "registers": r"Used (\d+) registers",
        "stack": r"(\d+) bytes stack frame",
        "spill_stores": r"(\d+) bytes spill stores",
        "spill_loads": r"(\d+) bytes spill loads",
        "static_smem": r"(\d+) bytes smem",
    }.items():
        match = re.search(pattern, text)
        numbers[key] = int(match.group(1)) if match else 0
    return numbers


@pytest.mark.nvcc
@pytest.mark.skipif(_nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_kernels_compile_without_spills(spec, tmp_path):
    """Every dtype for sm_80 and sm_90a: no spills, no stack, all SMEM dynamic and as planned."""
    compiled = compile_file(spec.relative_to(ROOT))
    (tmp_path / "fadsl").mkdir()
    (tmp_path / "fadsl" / "sm80.cuh").write_text(header_text())
    jobs = []
    for source in render(compiled):
        cu = tmp_path / source.filename
        cu.write_text(source.text)
        assert f"constexpr int kSmemBytes = {compiled.kernel.smem_bytes};" in source.text
        jobs += [(cu, arch) for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        reports = list(pool.map(lambda job: (job, ptxas_report(*job)), jobs))
    for (cu, arch), report in reports:
        where = f"{cu.name} {arch}: {report}"
        assert report["spill_stores"] == report["spill_loads"] == 0, where
        assert report["stack"] == 0, where
        assert report["static_smem"] == 0, where
        assert 0 < report["registers"] <= 255, where
