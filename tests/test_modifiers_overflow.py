"""Arithmetic in a modifier that leaves its type's range (an i32 past 2^31 - 1, an f32 past
3.4e38) only for long sequences: check_modifiers admits it with ``Modifiers.longest``, the
longest sequence length at which every value fits, and the runtime refuses longer calls,
naming q or k (fadsl/runtime/arguments.py, check_longest). What fails at every length is
refused where it is written (test_modifiers_errors.py)."""

from __future__ import annotations

import math

import pytest

from fadsl.errors import SpecError
from fadsl.ir.expr import DIM_MAX, SEQLEN_LIMIT, Blocks, Dim
from fadsl.passes.modifiers import ranges as rg
from fadsl.runtime.arguments import check_longest
from test_modifiers_front import modifiers

INT_MAX = 2**31 - 1


def longest_int(value_at) -> int:
    """The largest sequence length n with value_at(n) <= INT_MAX, by brute bisection over
    Python's exact integers (the reference the checker's bound is held to)."""
    lo, hi = 1, SEQLEN_LIMIT
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if value_at(mid) <= INT_MAX else (lo, mid)
    return lo


@pytest.mark.parametrize(
    "keep, value_at",
    [
        ("2 * kv_idx <= 3 * q_idx - seqlen_q // 4", lambda n: 3 * (n - 1)),
        ("q_idx * kv_idx % 7 != 3", lambda n: (n - 1) ** 2),
        ("(kv_idx - q_idx) * (kv_idx - q_idx) < 4096", lambda n: (n - 1) ** 2),
        ("q_idx + kv_idx + seqlen_k + 5 > 0", lambda n: 3 * n + 3),
        ("min(q_idx, 1000) * kv_idx > 0", lambda n: min(n - 1, 1000) * (n - 1)),
        # where's branches of no proven order: the larger of their tops bounds it
        ("q_idx * where(q_idx < kv_idx, q_idx, seqlen_k) > 0", lambda n: (n - 1) * n),
    ],
)
def test_the_longest_length_is_where_the_widest_value_still_fits(keep, value_at):
    m = modifiers(f"keep {keep}")
    want = longest_int(value_at)
    assert m.longest == want
    assert value_at(want) <= INT_MAX < value_at(want + 1)  # tight: one more overflows
    assert m.longest_why.startswith("'") and "(line 10)" in m.longest_why


@pytest.mark.parametrize(
    "keep",
    ["kv_idx <= q_idx + seqlen_k - seqlen_q", "q_idx + kv_idx >= 0", "2 * q_idx >= kv_idx"],
)
def test_what_fits_every_call_has_no_bound(keep):
    # q_idx + kv_idx and 2 * q_idx stay below 2^31 - 1 for lengths below 2^30
    assert modifiers(f"keep {keep}").longest is None


def test_float_arithmetic_gets_its_bound_too():
    m = modifiers("score s + kv_idx * 1e36")
    assert m.longest == 341  # 340 x 1e36 < 3.4028e38 < 341 x 1e36
    assert m.longest_why == "'kv_idx * 1e36' (line 10)"
    assert modifiers("score s + 1.0 * q_idx * kv_idx").longest is None  # f32 all the way
    # a quotient too: q_idx / 1e-30 passes 3.4028e38 past about 3.4e8 queries
    assert 340_000_000 < modifiers("score s + q_idx / 1e-30").longest < 341_000_000


@pytest.mark.parametrize(
    "keep, value_at",
    [
        # a float factor, a floor, a quotient or remainder by a size: each once unbounded,
        # so an i32 product of it passed (2026-12-06)
        ("floor(q_idx * 3.0) * 2 > 0", lambda n: 6 * (n - 1)),
        ("floor(q_idx / 3) * q_idx * 7 > 0", lambda n: (n - 1) // 3 * (n - 1) * 7),
        ("q_idx // max(kv_idx, 1) * q_idx * q_idx > 0", lambda n: (n - 1) ** 3),
        ("q_idx % max(kv_idx, 1) * q_idx * q_idx > 0", lambda n: (n - 2) * (n - 1) ** 2),
    ],
)
def test_a_size_through_a_float_a_floor_or_a_size_divisor_is_bounded(keep, value_at):
    m = modifiers(f"keep {keep}")
    want = longest_int(value_at)
    assert m.longest is not None and abs(m.longest - want) <= want // 1000 + 1, (m.longest, want)


def test_a_floor_past_the_i32_range_is_refused_or_bounded():
    # the float-to-int conversion saturates: floor(1e20) would be 2^31 - 1, a wrong value
    with pytest.raises(SpecError, match="may overflow an i32"):
        modifiers("score s + 1.0 * floor(1e20 * 1.0)")
    m = modifiers("score s + 1.0 * floor(q_idx * 3.0)")  # 3 x (2^30 - 1) > 2^31 - 1
    assert m.longest == longest_int(lambda n: 3 * (n - 1))
    assert modifiers("score s + 1.0 * floor(q_idx * 1.5)").longest is None  # 1.61e9 fits


@pytest.mark.parametrize("expr", ["(q_idx - 2147483647 - 1) // -1", "abs(q_idx - 2147483647 - 1)"])
def test_a_quotient_or_abs_past_the_i32_range_is_refused(expr):
    # -2^31 // -1 and abs(-2^31) are 2^31: no i32 (found by a review, 2026-12-06)
    with pytest.raises(SpecError, match="may overflow an i32"):
        modifiers(f"score s + 1.0 * ({expr})")


def test_exp_past_floats_is_a_located_error():
    # exp(1000.0)'s value bound was math.exp(1000): an OverflowError, not the spec's error
    with pytest.raises(SpecError, match="exp\\(\\) of '1000.0' may overflow"):
        modifiers("score s + exp(1000.0)")


def test_values_read_from_inputs_are_the_callers_scale():
    # an input's elements are unbounded: their sums pass (as in torch), the sizes' do not
    m = modifiers("input t : i32[seqlen_k]\n  keep t[kv_idx] * 3 == t[kv_idx] + 1")
    assert m.longest is None


class FakeTensor:
    def __init__(self, seqlen: int) -> None:
        self.shape = (1, seqlen, 16, 128)


def test_the_runtime_refuses_a_longer_call_naming_the_tensor():
    m = modifiers("keep q_idx * kv_idx % 7 != 3")
    assert m.longest == 46341
    check_longest(m, FakeTensor(46341), FakeTensor(46341), "mods")  # at the bound: accepted
    with pytest.raises(ValueError) as info:
        check_longest(m, FakeTensor(100), FakeTensor(46342), "mods")
    assert str(info.value) == (
        "k's sequence length 46342 is past 46341, the longest at which kernel 'mods''s "
        "'q_idx * kv_idx' (line 10) stays within its type's range"
    )
    with pytest.raises(ValueError, match="^q's sequence length 65536 is past 46341"):
        check_longest(m, FakeTensor(65536), FakeTensor(65536), "mods")
    check_longest(None, FakeTensor(SEQLEN_LIMIT), FakeTensor(1), "plain")  # no modifiers


def test_an_affine_form_spans_every_size_up_to_its_top():
    form = rg.Affine(-1, ((Dim.SEQLEN_Q, 3), (Dim.HEADS, -2)))  # 3 seqlen_q - 2 heads - 1
    assert form.span() == (3 - 2 * 65535 - 1, 3 * (SEQLEN_LIMIT - 1) - 2 - 1)
    blocks = rg.Affine(0, ((Blocks(Dim.SEQLEN_K, 128), 1),))
    assert blocks.span() == (1, math.ceil((SEQLEN_LIMIT - 1) / 128))
    tops = {**DIM_MAX, Dim.SEQLEN_Q: 10}
    assert form.span(tops) == (3 - 2 * 65535 - 1, 30 - 2 - 1)


def test_a_product_of_two_indices_is_bounded_by_their_corners():
    q = rg.index_range(Dim.SEQLEN_Q)
    kv_minus_q = rg.sub(rg.index_range(Dim.SEQLEN_K), q)
    top = SEQLEN_LIMIT - 2
    assert rg.extremes(rg.mul(q, q)) == (0, top * top)
    assert rg.extremes(rg.mul(kv_minus_q, q)) == (-top * top, top * top)
    assert rg.extremes(rg.square(kv_minus_q)) == (0, top * top)
    # an unbounded factor keeps the product unbounded (an input's element)
    assert rg.mul(q, rg.UNBOUNDED) == rg.UNBOUNDED


def test_explain_says_how_long_a_call_may_be(tmp_path):
    from fadsl.pipeline import compile_source
    from fadsl.tools.report import explain_text
    from test_modifiers_front import spec

    found = explain_text(compile_source(spec("keep 3 * q_idx >= 2 * kv_idx"), "mods.fa"))
    assert (
        "calls of sequences up to 715827883 only: past it '3 * q_idx' (line 10) leaves its "
        "type's range (the call refuses longer ones)" in found
    )
    plain = explain_text(compile_source(spec("keep 2 * q_idx >= kv_idx"), "mods.fa"))
    assert "calls of sequences up to" not in plain


def test_a_loaded_kernel_refuses_the_longer_call_before_anything_runs():
    import torch

    import fadsl
    from test_modifiers_front import spec

    kern = fadsl.load(spec("keep q_idx * kv_idx % 7 != 3"))
    q = torch.empty(1, 50000, 16, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="^q's sequence length 50000 is past 46341, the longest"):
        kern(q, q, q)
