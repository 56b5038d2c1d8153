"""The sm_90a prototype (emit/sm90): generated wgmma header up to date, and, where nvcc is
installed, the kernel compiles for sm_90a with no spills and uses TMA, wgmma, mbarriers and
setmaxnreg; an over-budget SMEM plan is refused at compile time."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SM90 = ROOT / "emit" / "sm90"
SOURCE = SM90 / "prototype" / "fa3_fwd.cu"
NVCC = shutil.which("nvcc")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_wgmma", SM90 / "gen_wgmma.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wgmma_header_matches_its_generator():
    gen = _generator()
    assert gen.OUT.read_text() == gen.render(), "run python3 emit/sm90/gen_wgmma.py"


def test_wgmma_wrappers_name_every_accumulator_register():
    text = _generator().render()
    for n in (64, 80, 128, 176, 256):
        block = text[text.index(f"struct Wgmma<{n}>") :]
        block = block[: block.index("};")]
        regs = n // 2
        # SS: regs outputs, then desc_a, desc_b, scale_d, trans_a, trans_b
        assert f"m64n{n}k16.f32.bf16.bf16 {{%0, " in block
        assert f"%{regs - 1}}}, %{regs}, %{regs + 1}, p, 1, 1, %{regs + 3}, %{regs + 4};" in block
        # RS: regs outputs, 4 A registers, desc_b, scale_d, trans_b
        assert (
            f"%{regs - 1}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p"
            in block
        )
        assert block.count(f'"+f"(d[{regs - 1}])') == 4 and f"d[{regs}]" not in block


def _nvcc(defines: list[str], out: Path, kind: str) -> subprocess.CompletedProcess:
    cmd = [NVCC, "-gencode=arch=compute_90a,code=sm_90a", f"-{kind}", "-O3", "--resource-usage"]
    cmd += ["-std=c++17", f"-I{ROOT / 'emit' / 'common' / 'include'}", f"-I{SM90 / 'include'}"]
    cmd += [f"-I{ROOT / 'emit' / 'common' / 'include' / 'fadsl'}"]  # params.cuh, a neighbour
    cmd += [*defines, str(SOURCE), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True)


CONFIGS = {
    "d64_3wg_causal": ["-DFA3_HEAD_DIM=64", "-DFA3_WGS=3", "-DFA3_BLOCK_N=128", "-DFA3_CAUSAL=1"],
    "d128_2wg": ["-DFA3_HEAD_DIM=128", "-DFA3_WGS=2", "-DFA3_BLOCK_N=128"],
    "d128_1wg_3stages_fp16": [
        "-DFA3_HEAD_DIM=128",
        "-DFA3_WGS=1",
        "-DFA3_STAGES=3",
        "-DFA3_DTYPE=fp16",
        "-DFA3_CAUSAL=1",
    ],
    "d256_2wg": ["-DFA3_HEAD_DIM=256", "-DFA3_WGS=2", "-DFA3_BLOCK_N=80"],
}


@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prototype_compiles_for_sm90a_without_spills(name, tmp_path):
    ptx = tmp_path / "k.ptx"
    res = _nvcc(CONFIGS[name], ptx, "ptx")
    assert res.returncode == 0, res.stderr
    text = ptx.read_text()
    for needle in (
        "wgmma.mma_async",
        "cp.async.bulk.tensor",
        "mbarrier.try_wait.parity",
        "setmaxnreg",
    ):
        assert needle in text, needle
    ptxas = Path(NVCC).with_name("ptxas")
    res = subprocess.run(
        [str(ptxas), "-arch=sm_90a", "-O3", "-v", str(ptx), "-o", str(tmp_path / "k.cubin")],
        capture_output=True,
        text=True,
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", log), log
    assert "warning" not in log.lower() and "serialized" not in log, log


@pytest.mark.nvcc
@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_smem_plan_over_the_sm90_limit_is_refused(tmp_path):
    defines = ["-DFA3_HEAD_DIM=256", "-DFA3_WGS=1", "-DFA3_BLOCK_N=112"]
    res = _nvcc(defines, tmp_path / "k.cubin", "cubin")
    assert res.returncode != 0
    assert "SMEM over the sm_90 limit" in res.stdout + res.stderr
