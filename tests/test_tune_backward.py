"""`fadsl tune --backward` on the CPU: the backward block's variants written into the spec
(fadsl/frontend/rewrite.py's rewrite_backward), each checked by the front end and the
target, the input first and no block twice; the compile step and the no-GPU stop; the CLI's
--list and its refusals. The timing is bench_backward's (GPU)."""

from __future__ import annotations

from dataclasses import replace

import functools

import pytest

from conftest import ROOT
from fadsl.cli import main
from fadsl.frontend.rewrite import rewrite_backward
from fadsl.pipeline import compile_source
from fadsl.tools import tune_backward
from fadsl.targets.sm90.backward.tune_space import knobs_of, label_of
from fadsl.tools.tune_build import OK, Built

HDIM64 = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
HOPPER = (ROOT / "examples" / "fa3_hopper.fa").read_text()


@functools.cache
def variants_of(text: str):
    """backward_variants, once per spec (each variant goes through every pass)."""
    return tune_backward.backward_variants(text, "h.fa")


def test_rewrite_backward_sets_adds_and_removes_lines_of_the_block_only():
    text = rewrite_backward(
        HOPPER,
        {"stages": "2", "early_dv": "off", "deterministic": "on", "dq_lag": "off", "late_v": "off"},
        {"dQ": None, "dK": None, "dV": None},
        "t",
    )
    assert "dQ:" in HOPPER.split("backward {")[1]
    bwd = compile_source(text, "t.fa").kernel.backward
    assert (bwd.stages, bwd.early_dv, bwd.deterministic, bwd.dq_red) == (2, False, True, False)
    assert not bwd.dkv_tma  # (dK's and dV's lines taken out: their default, from registers)
    assert "kernel t {" in text and "dQ:" not in text.split("backward {")[1]
    assert "# was 3" in text  # the replaced line's comment says what it was
    # the forward's own `stages` and `overlap` lines are untouched
    head_before, head_after = HOPPER.split("backward {")[0], text.split("backward {")[0]
    assert head_after == head_before.replace("kernel fa3_hopper", "kernel t")
    red = rewrite_backward(HDIM64, {}, {"dQ": "rf -red.add-> gmem"}, "u")
    assert compile_source(red, "u.fa").kernel.backward.dq_red


def test_rewrite_backward_needs_a_block():
    plain = (ROOT / "tests" / "specs" / "sm90" / "fa3_q_ring.fa").read_text()
    with pytest.raises(ValueError, match="no backward block"):
        rewrite_backward(plain, {"stages": "3"}, {}, "x")


def test_the_variants_of_head_dim_256():
    """head_dim 256's split consumer has one order, dQ path and ring size: its knob is B_c
    (80 or 64), under the causal mask in either CTA order, and the input's block with dQ
    converted in the main kernel or with a later CTA's K and V prefetched; every variant is
    admitted."""
    text = (ROOT / "examples" / "fa3_hdim256_causal.fa").read_text()
    compiled, variants = variants_of(text)
    assert variants[0].backward == compiled.kernel.backward
    admitted = [v.backward for v in variants if v.backward is not None]
    assert len(admitted) == len(variants) == 6
    first = compiled.kernel.backward.longest_first
    assert {(b.block_n, b.longest_first, b.fused_convert, b.prefetch_kv) for b in admitted} == {
        (n, first, False, False) for n in (80, 64) for first in (False, True)
    } | {(80, first, True, False), (80, first, False, True)}
    assert all(b.dq_red and not b.overlap and b.stages == 2 for b in admitted)
    assert label_of(admitted[0]) == "B_c 80, B_r 64, plain, dQ red.add, stages 2"
    fused = next(b for b in admitted if b.fused_convert)
    assert label_of(fused).endswith(", dQ converted in-kernel")
    prefetched = next(b for b in admitted if b.prefetch_kv)
    assert label_of(prefetched).endswith(", K and V prefetched")
    assert len({knobs_of(b) for b in admitted}) == 6


def test_the_variants_of_head_dim_64():
    compiled, variants = variants_of(HDIM64)
    base = compiled.kernel.backward
    assert variants[0].backward == base and variants[0].text == HDIM64
    admitted = [v for v in variants if v.backward is not None]
    knobs = [knobs_of(v.backward) for v in admitted]
    assert len(knobs) == len(set(knobs))  # no block twice, the input's not again
    assert {v.backward.block_m for v in admitted} == {64, 128}
    assert {v.backward.dq_red for v in admitted} == {False, True}
    for v in admitted:  # each label says its block, and its text compiles to it
        assert v.label == label_of(v.backward)
        assert compile_source(v.text, "v.fa").kernel.backward.text() == v.backward.text()
    refused = [v for v in variants if v.backward is None]
    assert refused and all(
        "SMEM plan needs" in v.reason or v.reason.startswith("B_r = 80 needs head_dim 128")
        # (B_r 64 splits dQ by keys at head_dim 64: no meeting to leave out)
        or v.reason.startswith("dq_lag on") and "dQ split by keys" in v.reason
        for v in refused
    )
    assert any(v.label.startswith("B_r 80") for v in refused)
    # dQ one m-block behind (after dV or before it): tried with red.add only, admitted at B_r 128
    for order in (", dq_lag,", ", dq_lag_first,"):
        lagged = [v for v in variants if order in v.label]
        assert lagged and all("dQ red.add" in v.label for v in lagged)
        assert any(v.backward is not None and v.backward.block_m == 128 for v in lagged)
    # a third stage fits B_r 128 only without dQ's staging buffer
    assert any(v.backward.block_m == 128 and v.backward.stages == 3 for v in admitted)
    assert all(
        v.backward.dq_red for v in admitted if v.backward.block_m == 128 and v.backward.stages == 3
    )


def test_under_the_causal_mask_the_input_block_is_tried_longest_first():
    causal = (ROOT / "examples" / "fa3_causal.fa").read_text()
    compiled, variants = variants_of(causal)
    first = [v for v in variants if v.backward is not None and v.backward.longest_first]
    assert len(first) == 1 and ", longest first" in first[0].label
    base = compiled.kernel.backward
    # the input's, order flipped
    assert first[0].backward.text() == replace(base, longest_first=True).text()
    _, plain = variants_of(HOPPER)  # no mask: every CTA does the same work
    assert not any(v.backward is not None and v.backward.longest_first for v in plain)


def test_head_dim_128_refuses_b_r_128_and_takes_80():
    _, variants = variants_of(HOPPER)
    wide = [v for v in variants if v.label.startswith("B_r 128")]
    assert wide and all(v.backward is None and "needs head_dim 64" in v.reason for v in wide)
    admitted = [v for v in variants if v.backward is not None]
    assert {v.backward.block_m for v in admitted} == {64, 80}
    for v in admitted:  # dS's path follows the tile: stored transposed at B_r 80, else by
        # st.shared or (the knob) by stmatrix, each B_r 64 block both ways
        stmatrix = "dS: rf -stmatrix-> smem[cta]" in " ".join(v.text.split())
        assert stmatrix == (v.backward.block_m == 80 or v.backward.ds_stmatrix), v.label
        assert v.backward.ds_stmatrix == ("dS stmatrix" in v.label), v.label
    sixty_four = [v.backward for v in admitted if v.backward.block_m == 64]
    by_stmatrix = [b.text() for b in sixty_four if b.ds_stmatrix]
    assert by_stmatrix and {t.replace(" ds=stmatrix", "") for t in by_stmatrix} == {
        b.text() for b in sixty_four if not b.ds_stmatrix
    }
    assert not any(v.backward.ds_stmatrix for v in admitted if v.backward.block_m == 80)
    # a third stage fits B_r 80 only without dQ's staging buffer
    eighty = [v.backward for v in admitted if v.backward.block_m == 80]
    assert {b.stages for b in eighty} == {2, 3}
    assert all(b.dq_red for b in eighty if b.stages == 3)


def test_without_a_gpu_the_variants_compile_then_it_stops(monkeypatch):
    asked = []

    def fake_build_all(jobs, workers):
        for job in jobs:
            asked.append(job)
            yield Built(job.name, OK, compiled=compile_source(job.text, f"{job.name}.fa"))

    monkeypatch.setattr(tune_backward, "build_all", fake_build_all)
    monkeypatch.setattr(tune_backward, "_gpu", lambda: False)
    with pytest.raises(tune_backward.NoGPUError, match="compiled into the cubin cache"):
        tune_backward.tune_backward(HDIM64, "h.fa", seqlens=(1024,), hidden=2048, log=lambda s: 0)
    assert asked and all(job.backward and job.dtypes == ("bf16",) for job in asked)
    _, variants = variants_of(HDIM64)
    assert len(asked) == sum(v.backward is not None for v in variants)


def test_the_cli_lists_the_variants(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["tune", "--backward", "--list", "examples/fa3_hdim64.fa"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("(the input)")
    assert out[0].startswith("B_r 128, dq_lag_first, dQ red.add")
    assert any("[refused: the backward's SMEM plan needs" in line for line in out)


@pytest.mark.parametrize(
    "extra, word",
    [(["--budget", "2"], "--budget"), (["--knobs", "stages"], "--knobs"), (["--fresh"], "--fresh")],
)
def test_the_cli_refuses_the_forward_search_options(capsys, monkeypatch, extra, word):
    monkeypatch.chdir(ROOT)
    assert main(["tune", "--backward", "examples/fa3_hdim64.fa", *extra]) == 1
    assert f"leave out {word}" in capsys.readouterr().err


def test_the_cli_refuses_a_forward_only_spec(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["tune", "--backward", "--list", "tests/specs/sm90/fa3_q_ring.fa"]) == 1
    assert "has no backward block" in capsys.readouterr().err


def test_the_result_table_names_the_variants_not_fadsl():
    """The timing's contenders are the variants' labels (and SDPA's backends): the table puts
    the winner first and its ratio to each, with no contender called "fadsl"."""
    _, variants = variants_of(HOPPER)
    first, second = [v.label for v in variants if v.backward is not None][:2]
    timing = {
        "kernel": "fa3_hopper",
        "causal": False,
        "rows": [{"seqlen": 1024, "tflops": {first: 400.0, second: 440.0, "cudnn": 400.0}}],
    }
    result = tune_backward.BackwardTuneResult(first, variants, timing=timing, winner=second)
    result.scores = {first: 400.0, second: 440.0}
    lines = result.table().splitlines()
    assert any(second in line and "<- best" in line for line in lines)
    header = next(line for line in lines if line.startswith("seqlen"))
    assert header.index(second) < header.index(first) < header.index("cudnn")  # winner first
    assert lines[-1].split()[-2:] == ["1.10", "1.10"]  # 440 / 400 against each


def test_a_deterministic_block_tries_the_dq_writer_at_both_register_splits():
    """With `deterministic on` dQ's third path is the staged one with writer warps, each at
    the block's registers and at 32/232; without `deterministic` it is never tried; labels
    name the split; the split-by-keys blocks (head_dim 64, B_r 64) are refused at the key."""
    # (on the grid: the example's `scheduler persistent` refuses `deterministic on`)
    det = rewrite_backward(
        HDIM64,
        {"deterministic": "on", "scheduler": "grid", "dq_lag": "off", "dq_first": "off"},
        {"dQ": None},
        "d",
    )
    _, variants = variants_of(det)
    writers = [v for v in variants if v.backward is not None and v.backward.dq_writer]
    assert writers and all(v.backward.deterministic for v in writers)
    splits = {(v.backward.producer_regs, v.backward.consumer_regs) for v in writers}
    assert (32, 232) in splits and len(splits) == 2
    assert all(v.label == label_of(v.backward) and "staged+writer" in v.label for v in writers)
    assert all(v.label.endswith(("registers 24/240", "registers 32/232")) for v in writers)
    # the lagged orders too (the writer warps take the lagged staging), at both splits
    lagged = {(v.backward.dq_first, v.backward.producer_regs) for v in writers if v.backward.dq_lag}
    assert lagged == {(False, 24), (False, 32), (True, 24), (True, 32)}, lagged
    refused = [v for v in variants if v.backward is None and "writer" in v.label]
    assert any("split by keys" in v.reason for v in refused if v.label.startswith("B_r 64"))
    _, plain = variants_of(HDIM64)
    assert not any("writer" in v.label for v in plain)
