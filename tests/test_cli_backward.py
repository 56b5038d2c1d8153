"""The command line and the build for a spec with a backward block (CPU): compile writes the
backward's sources, explain lists its proved syncs, bench --backward refuses what it cannot
time, check compiles the backward's kernels too, and the op's autograd is wired."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from fadsl.build.resources import can_compile
from fadsl.cli import main
from fadsl.codegen.render import render_backward
from fadsl.pipeline import compile_file
from fadsl.targets.sm90.backward.protocol import Params, WarpRole, protocol
from fadsl.tools import bench_backward

TRAINING = "examples/fa3_hopper.fa"


def test_compile_writes_the_backward_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["compile", TRAINING, "-o", str(tmp_path)]) == 0
    for dtype in ("bf16", "fp16"):
        text = (tmp_path / f"fa3_hopper_bwd_{dtype}.cu").read_text()
        for kernel in ("", "_preprocess", "_convert_dq"):
            assert "void __launch_bounds__" in text
            assert re.search(rf"fa3_hopper_bwd_{dtype}{kernel}\(const __grid_constant__", text)
    # sm90_bwd.cuh and some of its sections
    for header in (
        "sm90_bwd.cuh",
        "sm90_bwd_producer.cuh",
        "sm90_bwd_dq_reduce.cuh",
        "sm90_bwd_consumer.cuh",
        "sm90_bwd_prep.cuh",
    ):
        assert (tmp_path / "fadsl" / header).exists()


def test_a_forward_only_spec_writes_no_backward(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["compile", "tests/specs/sm90/fa3_q_ring.fa", "-o", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("*_bwd_*.cu"))


def test_backward_sources_follow_the_block():
    compiled = compile_file(ROOT / TRAINING)
    bwd = compiled.kernel.backward
    source, *_ = render_backward(compiled.kernel, compiled.target, "x.fa")
    assert f"BwdConfig<__nv_bfloat16, 128, {bwd.block_m}, {bwd.block_n}, {bwd.consumers}" in (
        source.text
    )
    (cfg,) = re.findall(r"struct Cfg : BwdConfig<(.*?)> \{", source.text)
    flags = [x.strip() for x in cfg.split(",")][7:]  # deterministic, overlap, early_dv, dq_red
    on = {True: "true", False: "false"}
    assert flags == [on[bwd.deterministic], on[bwd.overlap], on[bwd.early_dv], on[bwd.dq_red]]
    assert f"static constexpr int kConsumerRegs = {bwd.consumer_regs};" in source.text


def test_explain_lists_the_protocols_syncs(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", TRAINING, "--no-compile"]) == 0
    out = capsys.readouterr().out
    section = out.split("Backward syncs", 1)[1]
    bwd = compile_file(ROOT / TRAINING).kernel.backward
    plan = protocol(Params.of(bwd, 128))
    assert plan.params.overlap and plan.params.dq_transposed  # the example's block
    syncs = sum(1 for role in WarpRole for item in plan.role(role) if item.is_sync)
    assert section.count("  >> ") == syncs > 20
    # (the example's `dq_lag on`: dS^T handed over by mbarriers, no meeting at kBarDS)
    assert "bar.sync kBarDS" not in section and plan.params.dq_lag
    assert "mbarrier.arrive ds_full[buffer i % 2]" in section
    assert "mbarrier.try_wait.parity ds_empty[buffer i % 2] parity (i / 2 - 1) & 1" in section
    assert (
        "mbarrier.try_wait.parity q_empty[ring slot i % stages] parity ((i / stages) & 1) ^ 1"
        in (section)
    )


def test_bench_backward_refuses_a_forward_only_spec(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["bench", "--backward", "tests/specs/sm90/fa3_q_ring.fa"]) == 1
    assert "has no backward block" in capsys.readouterr().err


def test_bench_backward_refuses_a_forward_only_variant(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    text = (ROOT / TRAINING).read_text()
    head, _ = text.split("backward {", 1)
    plain = tmp_path / "plain.fa"
    plain.write_text(head.rstrip() + "\n}\n")
    assert main(["bench", "--backward", TRAINING, "--against", str(plain)]) == 1
    assert f"{plain} has no backward block" in capsys.readouterr().err


def test_the_backward_table_reads_its_rows():
    result = {
        "kernel": "k",
        "causal": True,
        "rows": [{"seqlen": 2048, "tflops": {"fadsl": 450.0, "cudnn": 500.0, "fa4": 600.0}}],
    }
    text = bench_backward.table(result)
    assert "k backward (causal)" in text
    assert "450.0" in text and "0.90" in text and "0.75" in text


@pytest.mark.nvcc
@pytest.mark.skipif(not can_compile(), reason="needs NVRTC (cuda-bindings) or nvcc")
def test_check_refuses_a_spilling_backward(capsys, monkeypatch, tmp_path):
    """The backward's kernels are compiled by check like the forward's: at 200 registers the
    consumers spill, and check says so at the backward block."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / TRAINING).read_text()
    text = re.sub(
        r"(backward \{\n(?:.*\n)*?    registers  producer = 24, consumers = )240",
        r"\g<1>200",
        text,
    )
    assert "consumers = 200" in text
    spec = tmp_path / "spilling.fa"
    spec.write_text(text)
    code = main(["check", str(spec)])
    err = capsys.readouterr().err
    assert code == 2 and "the backward's kernels spill" in err, err
