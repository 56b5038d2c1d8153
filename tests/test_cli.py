"""The command line: exit codes, output, and no tracebacks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from fadsl.cli import main

SPEC = "examples/fa2_kernel1.fa"


FADSL = str(Path(sys.executable).parent / "fadsl")  # the installed console script


def run(*args, cwd=ROOT):
    return subprocess.run([FADSL, *args], capture_output=True, text=True, cwd=cwd)


def test_check_prints_the_configuration(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["check", SPEC, "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert "examples/fa2_kernel1.fa: ok" in out
    assert "registers not checked (--no-compile)" in out
    assert "B_r = 64, B_c = 64, head_dim = 128" in out
    assert "V         gmem -cp.async-> smem[cta] -ldmatrix.trans-> rf" in out


def test_explain_shows_the_plan_and_the_syncs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", SPEC, "--no-nvcc"]) == 0
    out = capsys.readouterr().out
    assert "smem total: 32768 bytes" in out
    assert "region 0: Q (live q_g2s..q_s2r) and O (live o_r2s..o_s2g) are never live at once" in out
    assert out.count(">> __syncthreads()") == 4
    assert "WAR on K/V (aliased): k_s2r -> v_g2s (warps cross)" in out


def test_explain_json(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", SPEC, "--json", "--no-nvcc"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["smem_total"] == 32768
    assert {b["buffer"]: b["shares_with"] for b in data["smem"]}["K"] == ["V"]
    syncs = [i for p in data["schedule"] for i in p["items"] if "sync" in i]
    assert all(s["serves"] for s in syncs)


def test_explain_with_alias_off(tmp_path, capsys):
    spec = tmp_path / "off.fa"
    spec.write_text(
        (ROOT / SPEC).read_text().replace("swizzle none", "swizzle none\n  smem_alias off")
    )
    assert main(["explain", str(spec), "--no-nvcc"]) == 0
    out = capsys.readouterr().out
    assert "smem total: 65536 bytes" in out and out.count(">> __syncthreads()") == 2


def test_compile_writes_one_file_per_dtype(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["compile", SPEC, "-o", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["fa2_kernel1_bf16.cu", "fa2_kernel1_fp16.cu", "fadsl"]
    headers = sorted(p.name for p in (tmp_path / "fadsl").iterdir())
    assert headers == ["params.cuh", "sm80.cuh", "sm80_ptx.cuh"]


def test_bad_spec_exits_2_with_a_located_message(tmp_path):
    spec = tmp_path / "bad.fa"
    spec.write_text((ROOT / SPEC).read_text().replace("warps    4", "warps    3"))
    proc = run("check", str(spec))
    assert proc.returncode == 2
    assert f"{spec}:7:12: warps = 3 is not a power of two" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_file_exits_2_without_traceback():
    proc = run("check", "no/such.fa")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "no/such.fa" in proc.stderr


@pytest.mark.parametrize("command", ["check", "explain", "compile", "bench"])
def test_every_command_has_help(command):
    proc = run(command, "--help")
    assert proc.returncode == 0 and "usage: fadsl" in proc.stdout


def test_version():
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.startswith("fadsl ")


def test_bench_without_a_gpu_says_so():
    proc = run("bench", SPEC)
    if proc.returncode == 0:
        pytest.skip("a GPU is present")
    assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr


def test_an_unexpected_exception_is_exit_3_with_one_line(monkeypatch, capsys):
    import fadsl.cli.common

    def broken(source, file):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(fadsl.cli.common, "compile_source", broken)
    assert main(["check", str(ROOT / SPEC)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "internal error: RuntimeError: boom" in err and "please report" in err


def test_an_output_path_that_is_a_file_is_exit_1(tmp_path):
    target = tmp_path / "out"
    target.write_text("not a folder")
    proc = run("compile", SPEC, "-o", str(target))
    assert proc.returncode == 1, proc.stderr
    assert f"the output path '{target}' is a file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_output_folder_under_a_file_is_exit_1(tmp_path):
    (tmp_path / "f").write_text("")
    proc = run("compile", SPEC, "-o", str(tmp_path / "f" / "out"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert str(tmp_path / "f") in proc.stderr


def test_bench_reports_a_bad_spec_before_looking_for_a_gpu(tmp_path):
    spec = tmp_path / "bad.fa"
    spec.write_text((ROOT / SPEC).read_text().replace("warps    4", "warps    3"))
    proc = run("bench", str(spec))
    assert proc.returncode == 2
    assert f"{spec}:7:12: warps = 3 is not a power of two" in proc.stderr
    assert "GPU" not in proc.stderr


def test_a_folder_given_as_the_spec_is_exit_2(tmp_path):
    proc = run("check", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"cannot read '{tmp_path}'" in proc.stderr


def test_bench_hidden_must_be_a_multiple_of_head_dim():
    proc = run("bench", "examples/fa3_hdim64.fa", "--hidden", "2000")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "--hidden 2000 is not a multiple of the spec's head_dim 64" in proc.stderr
    assert "GPU" not in proc.stderr  # refused before looking for one


def test_bench_hidden_and_heads_exclude_each_other():
    proc = run("bench", SPEC, "--hidden", "2048", "--heads", "16")
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


@pytest.mark.parametrize("option", ["--heads", "--hidden", "--tokens", "--runs", "--rounds"])
def test_bench_counts_must_be_positive(option):
    proc = run("bench", SPEC, option, "0")
    assert proc.returncode == 2 and f"argument {option}: must be positive, got 0" in proc.stderr


def test_bench_against_a_bad_spec_is_reported_before_looking_for_a_gpu(tmp_path):
    spec = tmp_path / "bad.fa"
    spec.write_text((ROOT / SPEC).read_text().replace("warps    4", "warps    3"))
    proc = run("bench", SPEC, "--against", str(spec))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{spec}:7:12: warps = 3 is not a power of two" in proc.stderr
    assert "GPU" not in proc.stderr


def test_bench_against_must_time_the_same_problem():
    proc = run("bench", "examples/fa3_hdim64.fa", "--against", "examples/fa3_hopper.fa")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        "--against examples/fa3_hopper.fa: head_dim 128, mask none; the spec's are head_dim 64"
        in proc.stderr
    )
    assert "GPU" not in proc.stderr
    proc = run("bench", "examples/fa3_hdim64.fa", "--against", "examples/fa2_hdim64.fa")
    assert proc.returncode == 0 or "GPU" in proc.stderr  # same head_dim and mask: accepted


def test_bench_takes_an_8bit_spec_and_checks_its_against_before_looking_for_a_gpu():
    """An 8-bit spec is timed as it is called (fadsl.tools.bench.operands); an --against spec
    must write O in the same type."""
    for spec, dtype in (("examples/serving/fa3_varlen_causal.fa", "e4m3"), (SPEC, "e5m2")):
        proc = run("bench", spec, "--dtype", dtype)  # a 16-bit spec (varlen, padded)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert f"--dtype {dtype}: the spec compiles bf16, fp16" in proc.stderr
    proc = run("bench", "examples/fa3_fp8_hdim128.fa", "--dtype", "e5m2", "--seqlens", "256")
    if proc.returncode == 0:
        pytest.skip("a GPU is present (it ran)")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "needs a CUDA GPU" in proc.stderr
    fp16 = "tests/specs/fp8/fa3_fp8_hdim128_fp16.fa"
    proc = run("bench", "examples/fa3_fp8_hdim128_causal.fa", "--causal", "--against", fp16)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"--against {fp16}: writes O in fp16; the spec's O is bf16" in proc.stderr
    assert "GPU" not in proc.stderr


def test_bench_table_compares_each_variant_with_each_backend_and_the_kernel():
    from fadsl.tools import bench

    result = {
        "rows": [
            {
                "seqlen": 2048,
                "batch": 8,
                "tflops": {"fadsl": 500.0, "fadsl:q2": 520.0, "cudnn": 400.0},
            }
        ],
        "resources": {},
    }
    head, line = bench.table(result).splitlines()
    assert head.split()[-3:] == ["fadsl/cudnn", "fadsl:q2/cudnn", "fadsl:q2/fadsl"]
    assert line.split()[-3:] == ["1.25", "1.30", "1.04"]
