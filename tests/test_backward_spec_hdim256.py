"""head_dim 256's backward block (sm90_bwd_split.cuh: the consumers split head_dim): its
tile, SMEM plan, located refusals and explain (the block's grammar and checks:
tests/test_backward_spec.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from conftest import ROOT
from fadsl.codegen.render import render_backward
from fadsl.ir import GradRole
from fadsl.pipeline import compile_file, compile_source
from fadsl.targets.sm90.backward import validate as sm90_backward
from fadsl.targets.sm90.backward.plan_smem import plan_smem
from fadsl.tools.report import explain_data, explain_text
from test_backward_spec import (
    FILE,
    assert_error,
    variant,
)

# --- head_dim 256: the consumers split head_dim (sm90_bwd_split.cuh) ---------------------

HDIM256 = ROOT / "examples" / "fa3_hdim256.fa"


def hdim256_text(old: str | None = None, new: str = "") -> str:
    text = HDIM256.read_text()
    if old is not None:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def test_head_dim_256_takes_the_split_tile():
    """The example's block, and `backward {}` alone: B_r 64, B_c 80, P and dS through SMEM by
    stmatrix, dQ added from registers (the defaults at head_dim 256)."""
    written = compile_file(HDIM256.relative_to(ROOT)).kernel.backward
    start = hdim256_text().index("  backward {")
    bare = compile_source(hdim256_text()[:start] + "  backward {}\n}\n", FILE).kernel.backward
    for bwd in (written, bare):
        assert (bwd.block_m, bwd.block_n, bwd.consumers, bwd.stages) == (64, 80, 2, 2)
        assert bwd.dq_red and not (bwd.deterministic or bwd.overlap or bwd.early_dv)
        paths = {t.role: t.path_text() for t in bwd.tensors}
        for role in (GradRole.P, GradRole.DS):
            assert paths[role] == "rf -stmatrix-> smem[cta] -wgmma-> rf"
        assert paths[GradRole.DQ] == "rf -red.add-> gmem"
        assert [t.role for t in bwd.tensors].index(GradRole.P) + 1 == [
            t.role for t in bwd.tensors
        ].index(GradRole.DS)
    b_c_64 = compile_source(hdim256_text("B_r = 64, B_c = 80 ", "B_r = 64, B_c = 64 "), FILE)
    assert b_c_64.kernel.backward.block_n == 64


def test_head_dim_256_smem_plan():
    """research/backward-hdim256.md's plan: K, V 40 KB each, Q 2 slots, dO a ring of its own
    of 1 slot, P and dS double-buffered, no dQ staging, 5 mbarrier pairs' worth: 223,032
    bytes with the base's slack (B_c 64: 198,456)."""
    bwd = compile_file(HDIM256.relative_to(ROOT)).kernel.backward
    plan = plan_smem(bwd, 256)
    assert [(b.name, b.offset, b.nbytes) for b in plan.buffers] == [
        ("K", 0, 40960),
        ("V", 40960, 40960),
        ("Q", 81920, 65536),
        ("dO", 147456, 32768),
        ("P", 180224, 20480),
        ("dS", 200704, 20480),
        ("dQ", 221184, 0),
        ("LSE", 221184, 512),
        ("D", 221696, 256),
        ("mbarriers", 221952, 56),
    ]
    assert plan.total + 1024 == 223032 <= sm90_backward.SMEM_LIMIT
    assert plan_smem(dataclasses.replace(bwd, block_n=64), 256).total + 1024 == 198456
    source = render_backward(*(lambda c: (c.kernel, c.target, "x.fa"))(compile_file(HDIM256)))[0]
    assert "static constexpr int kOffP = 180224;" in source.text
    assert '#include "fadsl/sm90_bwd_split.cuh"' in source.text
    assert "bwd_consumer_split<Cfg>(P, smem, block, warpgroup - 1);" in source.text


# (old line part, new line part, the line part and token the error sits at, message)
LOCATED_256 = [
    ("B_r = 64, B_c = 80 ", "B_r = 80, B_c = 80 ", "    tile       B_r = 80", "80", "B_r = 80: at head_dim 256 the backward steps through the queries 64 at a time, wgmma's M of S and dP (B_r = 64)"),
    ("B_r = 64, B_c = 80 ", "B_r = 64, B_c = 128 ", "B_c = 128 ", "128", "B_c = 128: at head_dim 256 each of the 2 consumer warpgroups computes S and dP for B_c / 2 keys and holds dK^T and dV^T of all B_c keys for its 128 columns (2 B_c fp32 registers a thread): B_c = 80 or 64 fit in 240 registers"),
    ("deterministic off", "deterministic on", "deterministic on", "deterministic", "deterministic on: its ordered dQ adds go through a staging buffer in SMEM, and at head_dim 256 dQ's staging does not fit beside K, V, Q, dO, P and dS (FlashAttention-3 has no deterministic mode there either); leave it off"),
    ("overlap    off", "overlap    on", "    overlap    on", "overlap", "overlap on: that consumer's order issues dQ before dV and dK; at head_dim 256 dQ^T is computed a panel at a time"),
    ("overlap    off", "early_dv on", "early_dv on", "early_dv", "early_dv on: at head_dim 256 dV^T is the first wgmma issued after P and dS are in SMEM already; leave it off"),
    ("overlap    off", "dq_writer on", "dq_writer on", "dq_writer", "dq_writer on: at head_dim 256 dQ is added from registers, with no staging for a writer warp to reduce-add; leave it off"),
    ("overlap    off", "dv_before_meeting on", "dv_before_meeting on", "dv_before_meeting", "dv_before_meeting on: at head_dim 256 dV^T reads every key's P from SMEM, so it cannot be issued before the warpgroups meet; it is the first wgmma issued after the meeting already; leave it off"),
    ("dQ:  rf -red.add-> gmem", "dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem", "dQ:  rf -st.shared", "dQ", "dQ must go rf -red.add-> gmem in the backward (each consumer thread adds its fp32 share into the accumulator (red.global.add.v4.f32): at head_dim 256 its staging does not fit in SMEM beside K, V, Q, dO, P and dS)"),
    ("dS:  rf -stmatrix->", "dS:  rf -st.shared->", "dS:  rf -st.shared", "st.shared", "'st.shared' does not move dS rf -> smem in the backward; 'stmatrix' does (dS: rf -stmatrix-> smem[cta] -wgmma-> rf)"),
    ("P:   rf -stmatrix-> smem[cta]", "P:   rf -stmatrix-> smem[warpgroup]", "P:   rf", "warpgroup", "P lives in smem[cta] in the backward: at head_dim 256 each consumer warpgroup computes P for its B_c / 2 keys and both read all of it"),
    ("stages     2                        # Q ring", "stages     3                        # Q ring", "stages     3", "3", "the backward's SMEM plan needs 255048 bytes at head_dim 256 (K 40960, V 40960, Q 98304, dO 32768, P 20480, dS 20480, dQ 0, LSE 768, D 256, mbarriers 72), over sm_90a's 232448; use fewer stages"),
]  # fmt: skip


@pytest.mark.parametrize(
    "old, new, line_part, token, message", LOCATED_256, ids=[c[4][:40] for c in LOCATED_256]
)
def test_each_head_dim_256_refusal_is_located(old, new, line_part, token, message):
    assert_error(hdim256_text(old, new), line_part, token, message)


def test_p_stays_in_registers_below_head_dim_256():
    text = variant(
        "    dS:  rf -st.shared",
        "    P:   rf -stmatrix-> smem[cta] -wgmma-> rf\n    dS:  rf -st.shared",
    )
    assert_error(text, "P:   rf -stmatrix", "P", "P stays in registers below head_dim 256")


def test_explain_shows_the_head_dim_256_block():
    data = explain_data(compile_file(HDIM256.relative_to(ROOT)))["backward"]
    producer, consumers = data["roles"]
    assert (consumers["keys_each"], consumers["head_dim_each"]) == (40, 128)
    (streamed,) = [k for k in producer["loads"] if k.startswith("per m-block")]
    assert "dO and D through one of 1" in streamed
    assert any(
        step.startswith("dQ^T = K^T dS^T by head_dim panels") for step in consumers["per_m_block"]
    )
    syncs = [s["sync"] for s in data["syncs"]]
    assert any(s.startswith("mbarrier.arrive do_empty[dO ring slot i % do_stages]") for s in syncs)
    text = explain_text(compile_file(HDIM256.relative_to(ROOT)))
    assert "each computes S and dP for 40 of the n-block's 80 keys" in text
    assert re.search(r"^  P +180224 +20480  ", text, re.M)
