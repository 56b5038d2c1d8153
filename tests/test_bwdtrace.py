"""The backward's m-block timeline (fadsl/sm90_bwd_trace.cuh, fadsl/tools/bwdtrace.py) without
a GPU: the budget of a synthetic timeline, and the traced build compiles (NVRTC) while the
plain build's source carries no mark."""

from __future__ import annotations

import pytest

import fadsl
from fadsl import targets
from fadsl.tools import bwdtrace

LAYOUT = bwdtrace.BackwardTraceLayout(ctas=2, roles=3, steps=4, marks=10, all_ctas=4, cta_marks=5)


def _timeline():
    """CTA 0's consumers run 3 m-blocks each: mark j of m-block s at 1000 s + 10 j (+ 5 for
    warpgroup 1), so each phase takes 10 ns, an m-block 90 and the gap 910; the producer
    waits 7 ns and issues in 3. CTAs 0 and 2 run on SM 5, CTA 1 on SM 6; CTA 3 is not stamped."""
    steps = [0] * (LAYOUT.ctas * LAYOUT.roles * LAYOUT.steps * LAYOUT.marks)
    for wg in range(2):
        for s in range(3):
            base = ((0 * LAYOUT.roles + wg) * LAYOUT.steps + s) * LAYOUT.marks
            for j in range(10):
                steps[base + j] = 1000 * (s + 1) + 10 * j + 5 * wg
    for s in range(3):
        base = ((0 * LAYOUT.roles + 2) * LAYOUT.steps + s) * LAYOUT.marks
        steps[base : base + 3] = [1000 * (s + 1), 1000 * (s + 1) + 7, 1000 * (s + 1) + 10]
    ctas = [0] * (LAYOUT.all_ctas * LAYOUT.cta_marks)
    ctas[0:5] = [5, 100, 300, 3300, 3700]
    ctas[5:10] = [6, 100, 300, 3300, 3700]
    ctas[10:15] = [5, 4300, 4500, 7500, 7900]
    return steps, ctas


def test_the_budget_of_a_timeline():
    found = bwdtrace.budget(*_timeline(), LAYOUT, consumers=2)
    assert found.m_blocks == 6
    assert set(found.consumer.values()) == {10}
    assert set(found.consumer_mean.values()) == set(found.consumer_p90.values()) == {10}
    assert found.m_block == 90 and found.m_block_gap == 910
    assert found.producer == {"wait for a free slot": 7, "loads issued": 3}
    assert found.ctas == 3
    assert found.cta == {"start to K, V landed": 200, "m-blocks": 3000, "dK, dV stored": 400}
    assert found.cta_gap == 600  # SM 5: CTA 2 starts 600 ns after CTA 0's stores
    text = bwdtrace.report(found)
    assert "6 consumer m-blocks; an m-block takes 0.09 us" in text
    assert "gap to the SM next CTA" in text


def test_a_stall_of_some_m_blocks_moves_the_mean_and_the_tail_not_the_median():
    """Warpgroup 1's third m-block waits 1 us longer to add dQ (marks 8 and 9 later): the
    median of "dQ added" stays 10 ns, its mean is (5 x 10 + 1010) / 6, its p90 1010."""
    steps, ctas = _timeline()
    base = ((0 * LAYOUT.roles + 1) * LAYOUT.steps + 2) * LAYOUT.marks
    steps[base + 8] += 1000
    steps[base + 9] += 1000
    found = bwdtrace.budget(steps, ctas, LAYOUT, consumers=2)
    assert found.consumer["dQ added"] == 10
    assert found.consumer_mean["dQ added"] == pytest.approx((5 * 10 + 1010) / 6)
    assert found.consumer_p90["dQ added"] == 1010
    assert "dQ added" in bwdtrace.report(found)


def test_no_complete_m_block_is_no_budget():
    steps, ctas = _timeline()
    for i in range(0, len(steps), LAYOUT.marks):
        steps[i + 4] = 0
    assert bwdtrace.budget(steps, ctas, LAYOUT, consumers=2) is None


def test_the_layout_is_the_headers():
    layout = bwdtrace.BackwardTraceLayout.of_target(targets.get("sm_90a"))
    assert layout.roles == 3 and layout.marks == 10 and layout.cta_marks == 5


def test_the_traced_backward_builds_and_the_plain_one_has_no_mark():
    try:
        from fadsl.build import cache
        from fadsl.build.nvrtc import compiler_id

        compiler_id()
    except Exception:
        pytest.skip("needs NVRTC (cuda-bindings)")
    kern = fadsl.load("examples/fa3_hopper.fa", verbose=False)
    backward = kern._backward_kernels()
    dtype = kern.config.dtypes[0]
    assert "FADSL_BWD_TRACE" not in backward.source(dtype)
    traced = cache.development_build(backward.request(dtype, "sm_90a"), {"FADSL_BWD_TRACE": 1})
    assert b"fadsl_bwd_trace" in traced.cubin and b"fadsl_bwd_ctas" in traced.cubin
