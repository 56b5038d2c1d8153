"""The compile-based register check: ptxas's report read right, spilling kernels refused on
the tile or warps line unless the spec opts in, a clean skip without a compiler, and (with
nvcc) the specs that spill in practice."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

import fadsl.build.spill_check as spill_check
from conftest import ROOT
from fadsl.cli import main
from fadsl.build.nvrtc import Usage, nvcc, parse_resource_usage
from fadsl.build.spill_check import check_registers, register_cap
from fadsl.errors import SpecError
from fadsl.pipeline import compile_source
from fadsl.targets.sm80.caps import CAPABILITIES

PIPELINED = (ROOT / "examples" / "fa2_pipelined.fa").read_text()
HDIM64 = (ROOT / "examples" / "fa2_hdim64.fa").read_text()

# What nvcc 13 prints for a kernel that spills (sm_90a), and for one that calls a
# function it did not inline (two sets of properties).
SPILLING_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z21k_bf16_kernelN5fadsl9FwdParamsE' for 'sm_90a'
ptxas info    : Function properties for _Z21k_bf16_kernelN5fadsl9FwdParamsE
    56 bytes stack frame, 148 bytes spill stores, 140 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
ptxas info    : Compile time = 512.000 ms
"""
CALLING_LOG = """\
ptxas info    : Function properties for helper
    32 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'k' for 'sm_80'
ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, 16 bytes cumulative stack size, 528 bytes cmem[0]
"""


def test_ptxas_report_of_a_spilling_kernel():
    assert parse_resource_usage(SPILLING_LOG) == Usage(255, 148, 140, 56, 0)
    assert parse_resource_usage(SPILLING_LOG).spills


def test_ptxas_report_takes_the_largest_over_the_functions():
    usage = parse_resource_usage(CALLING_LOG)
    assert (usage.registers, usage.stack_bytes, usage.spills) == (96, 32, True)


# What NVRTC 13.0 prints (its log, sm_90a) for a backward whose dV product was issued before
# the dS^T store (dv_before_meeting at B_r 80 until 2026-11-30): no spill, the wgmma serialized.
SERIALIZED_LOG = """\
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are \
serialized due to insufficient register resources for the function 'fa3_hopper_bwd_bf16'
ptxas info    : Function properties for fa3_hopper_bwd_bf16
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""


def test_serialized_wgmma_is_read_and_counts_as_short_of_registers():
    usage = parse_resource_usage(SERIALIZED_LOG)
    assert usage == Usage(168, wgmma_serialized=True)
    assert usage.short_of_registers and not usage.spills
    assert usage.shortfall() == "its wgmma serialized (ptxas C7512)"
    clean = parse_resource_usage(SERIALIZED_LOG.split("\n", 2)[2])
    assert not clean.wgmma_serialized and not clean.short_of_registers and clean.shortfall() == ""
    assert parse_resource_usage(SPILLING_LOG).short_of_registers


def test_a_report_without_registers_is_an_error():
    with pytest.raises(ValueError, match="Used N registers"):
        parse_resource_usage("ptxas fatal   : something else\n")


def test_register_cap_per_thread():
    assert [register_cap(CAPABILITIES, 32 * w) for w in (1, 4, 8, 16)] == [255, 255, 255, 128]


def _fake(usage: Usage):
    calls = []

    def compiler(source, arch):
        calls.append((source.dtype.value, arch))
        return usage

    return compiler, calls


def test_every_dtype_and_architecture_is_compiled():
    compiler, calls = _fake(Usage(200))
    check = check_registers(compile_source(PIPELINED, "p.fa"), compiler, "fake")
    assert sorted(calls) == [
        ("bf16", "sm_80"),
        ("bf16", "sm_90a"),
        ("fp16", "sm_80"),
        ("fp16", "sm_90a"),
    ]
    assert check.ran and check.compiler == "fake" and len(check.rows) == 4


def test_a_spilling_kernel_is_refused_on_the_tile_line():
    compiler, _ = _fake(Usage(255, 216, 200, 96))
    with pytest.raises(SpecError) as err:
        check_registers(compile_source(PIPELINED, "p.fa"), compiler, "fake")
    (diag,) = err.value.diagnostics
    assert (diag.loc.line, diag.loc.col) == (10, 3)  # `tile     B_r = 128, B_c = 32`
    assert "does not fit the 255-register limit per thread: it uses 255 registers" in diag.message
    assert "216 bytes of spill stores, 200 of loads, a 96-byte stack frame" in diag.message
    assert "'spills allow'" in diag.message
    assert "\n      tile     B_r = 128, B_c = 32\n      ^" in str(err.value)


def test_a_stack_frame_alone_is_refused():
    compiler, _ = _fake(Usage(100, stack_bytes=16))
    with pytest.raises(SpecError, match="a 16-byte stack frame"):
        check_registers(compile_source(PIPELINED, "p.fa"), compiler, "fake")


def test_a_kernel_with_serialized_wgmma_is_refused():
    compiler, _ = _fake(Usage(168, wgmma_serialized=True))
    with pytest.raises(SpecError) as err:
        check_registers(compile_source(PIPELINED, "p.fa"), compiler, "fake")
    (diag,) = err.value.diagnostics
    assert "it uses 168 registers and ptxas serialized its wgmma" in diag.message
    assert "(ptxas C7512)" in diag.message and "'spills allow'" in diag.message


def test_with_many_threads_the_message_is_on_the_warps_line_and_names_the_cap():
    spec = HDIM64.replace("B_r = 64", "B_r = 256").replace("warps    4 ", "warps    16")
    compiler, _ = _fake(Usage(128, 80, 56, 24))
    with pytest.raises(SpecError) as err:
        check_registers(compile_source(spec, "h.fa"), compiler, "fake")
    (diag,) = err.value.diagnostics
    assert diag.loc.line == 8 and spec.split("\n")[7].lstrip().startswith("warps")
    assert "the 128 registers per thread that 512 threads allow" in diag.message
    assert "use at most 8 warps" in diag.message


def test_spills_allow_accepts_a_spilling_kernel():
    spec = PIPELINED.replace("  swizzle xor(3, 3, 4)", "  swizzle xor(3, 3, 4)\n  spills allow")
    compiled = compile_source(spec, "p.fa")
    assert compiled.kernel.config.allow_spills
    compiler, _ = _fake(Usage(255, 216, 200, 96))
    check = check_registers(compiled, compiler, "fake")
    assert check.allowed_spills and all(row.usage.spills for row in check.rows)


def test_spills_takes_allow_or_refuse():
    spec = PIPELINED.replace("  swizzle xor(3, 3, 4)", "  swizzle xor(3, 3, 4)\n  spills maybe")
    with pytest.raises(SpecError, match="unknown spills 'maybe'; expected 'refuse' or 'allow'"):
        compile_source(spec, "p.fa")
    refuse = PIPELINED.replace("  swizzle xor(3, 3, 4)", "  swizzle xor(3, 3, 4)\n  spills refuse")
    assert not compile_source(refuse, "p.fa").kernel.config.allow_spills


def test_without_a_compiler_check_and_explain_say_so(monkeypatch, capsys):
    monkeypatch.setattr(spill_check, "nvcc_compiler", lambda: None)
    monkeypatch.chdir(ROOT)
    assert main(["check", "examples/fa2_pipelined.fa"]) == 0
    assert "registers not checked (no CUDA compiler: neither NVRTC (cuda-bindings) nor nvcc)" in (
        capsys.readouterr().out
    )
    assert main(["explain", "examples/fa2_pipelined.fa"]) == 0
    assert "Resources: not checked (no CUDA compiler: neither NVRTC (cuda-bindings) nor nvcc)" in (
        capsys.readouterr().out
    )
    assert main(["explain", "examples/fa2_pipelined.fa", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["resources"] == [] and data["compiler"].startswith("no CUDA compiler")


def test_check_with_a_fake_compiler_prints_the_registers(monkeypatch, capsys):
    compiler, _ = _fake(Usage(247))
    monkeypatch.setattr(spill_check, "find_compiler", lambda: (compiler, "fake 1.0"))
    monkeypatch.chdir(ROOT)
    assert main(["check", "examples/fa2_pipelined.fa"]) == 0
    out = capsys.readouterr().out
    assert "  registers bf16: 247 sm_80, 247 sm_90a; fp16: 247 sm_80, 247 sm_90a" in out
    assert "(cap 255; fake 1.0; no spills)" in out


def test_check_refuses_a_spilling_kernel_with_exit_2(monkeypatch, capsys, tmp_path):
    compiler, _ = _fake(Usage(255, 8, 8, 0))
    monkeypatch.setattr(spill_check, "find_compiler", lambda: (compiler, "fake 1.0"))
    spec = tmp_path / "p.fa"
    spec.write_text(PIPELINED)
    assert main(["check", str(spec)]) == 2
    assert f"{spec}:10:3: the kernel does not fit" in capsys.readouterr().err
    assert main(["check", str(spec), "--no-compile"]) == 0


# --- with nvcc: the specs a new user wrote that spill on sm_90a --------------------------

LISTED = {
    # Each is refused: by the compiled kernel's spills, or by the estimate before compiling.
    "fa2_pipelined_B_c_64": (PIPELINED.replace("B_c = 32", "B_c = 64"), "the kernel does not fit"),
    "fa2_pipelined_B_r_64_B_c_256": (
        PIPELINED.replace("B_r = 128, B_c = 32", "B_r = 64, B_c = 256"),
        "S accumulators (128)",
    ),
    "fa2_hdim64_B_r_256_warps_16": (
        HDIM64.replace("B_r = 64", "B_r = 256").replace("warps    4 ", "warps    16"),
        "the 128 registers per thread that 512 threads allow",
    ),
}


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("name", sorted(LISTED))
def test_specs_that_spill_are_refused(name, tmp_path, capsys):
    text, message = LISTED[name]
    spec = tmp_path / f"{name}.fa"
    spec.write_text(text)
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
def test_the_bench_spec_that_spills_opts_in(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["check", "tests/specs/bench/fa2_pipelined_r128_w4.fa"]) == 0
    out = capsys.readouterr().out
    assert "spills allowed: bf16 sm_80 216 B" in out


@pytest.mark.nvcc
@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
def test_explain_prints_what_ptxas_reports(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", "examples/fa2_kernel1.fa"]) == 0
    out = capsys.readouterr().out
    assert "at most 255 registers per thread" in out
    assert "bf16 sm_90a  178 registers, 0 B spills, 0 B stack" in out


def test_an_sm90a_kernel_that_spills_is_refused_on_the_registers_line():
    spec = (Path(__file__).resolve().parents[1] / "examples" / "fa3_hopper.fa").read_text()
    compiler, _ = _fake(Usage(168, 64, 64, 32))
    with pytest.raises(SpecError) as err:
        check_registers(compile_source(spec, "fa3.fa"), compiler, "fake")
    (diag,) = err.value.diagnostics
    assert spec.split("\n")[diag.loc.line - 1].lstrip().startswith("registers")
    assert "the 240 registers per consumer thread (setmaxnreg)" in diag.message
    assert "warps" not in diag.message
