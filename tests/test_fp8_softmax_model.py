"""The FP8 online softmax (tests/fp8_softmax_model.py; research/fp8-forward.md §3.5, §4, §6
test 3) against a float64 softmax: every threshold the FP8 kernel adds (the 0.8 slack,
e4m3's 448, its smallest normal and its flush) and both sides of it, in every block, with
hypothesis sequences on top; the bound checked is §4's: each key's weight within a relative
2^-4 while P is normal, and absolutely 2^-18 of the row's largest weight below. Each
choice of the design removed (the offset, its place in the move, the slack) fails."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8_softmax_model as model
from fp8_softmax_model import DESIGN, Numerics, attend, attend_pieces, problems, scale_log2
from softmax_cases import random_case
from softmax_model import Mode

SCALE = math.log(2)  # c' = 1 with unit descales: scores are log2 units
C = scale_log2(SCALE)
BLOCKS = (64, 128, 192, 256)
MODES = (Mode.EVERY, Mode.LAZY)
# a key this far (log2 units) below the reference R = m c' - 8 has P = 2^-gap
NORMAL_GAP = 14.0  # P = 2^-6, e4m3's smallest normal
FLUSH_GAP = 18.0  # P = 2^-10: rounds to 0 (ties to even), above it to 2^-9
OFFSETS = (-0.0625, -(2.0**-10), 0.0, 2.0**-10, 0.0625)


def check(result, scores, scale=SCALE, v_descale=1.0, numerics=DESIGN) -> list[str]:
    """§4's bound, and the invariants: P <= 2^(8 + slack) < 448, never clamped; l >= 2^8
    (less the rounding of the row max's scaled score) for every row that saw a key."""
    found = problems(result, scores, scale, v_descale)
    if result.trace.p_max > 2.0 ** (numerics.offset + numerics.slack) * (1 + 2.0**-20):
        found.append(f"P reached {result.trace.p_max}")
    if result.trace.clamped:
        found.append("a finite P clamped to 448")
    seen = (scores > -math.inf).any(dim=-1)
    # the row max's own P is 2^8 up to the rounding of its scaled score m c' (the exponent's
    # argument s c' - m c' is off by up to half an ulp of m c', |m c'| 2^-24): slack for it
    finite = scores.masked_fill(scores == -math.inf, 0.0).double()
    magnitude = finite.abs().amax(dim=-1) * scale * math.log2(math.e)
    slack = 2.0**-16 + magnitude * 2.0**-23
    low = seen & ~(result.l.double() >= 2.0**numerics.offset * (1 - slack))
    if low.any():
        found.append(f"l below 2^8: {result.l[low].min().item()}")
    return found


def edge_warp(block_n, n_blocks, jump, visit, rows=(5,), below=None) -> torch.Tensor:
    """One warp at score 0 but ``rows``' key 3 of the ``visit``-th visited block, ``jump``
    above; ``below``: also keys 8.. of that block that far below the row's reference."""
    scores = torch.zeros(1, 16, n_blocks * block_n)
    b = n_blocks - 1 - visit
    for r in rows:
        scores[0, r, b * block_n + 3] = jump
        if below is not None:
            top = max(jump, 0.0)
            scores[0, r, b * block_n + 8 : b * block_n + 40] = top - 8.0 - below
    return scores


def edge_batch(block_n: int, n_blocks: int = 3) -> torch.Tensor:
    warps = []
    for offset in OFFSETS:
        for visit in range(n_blocks):
            for rows in ((5,), (2, 10)):
                for edge in (model.RESCALE_SLACK, 2 * model.RESCALE_SLACK, 8.0):
                    warps.append(edge_warp(block_n, n_blocks, edge + offset, visit, rows))
                for gap in (NORMAL_GAP, FLUSH_GAP):
                    warps.append(edge_warp(block_n, n_blocks, 0.5, visit, rows, gap + offset))
    return torch.cat(warps)


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("block_n", BLOCKS)
def test_every_threshold_on_both_sides(block_n, mode):
    scores = edge_batch(block_n)
    assert check(attend(scores, block_n, C, mode), scores) == []


def test_the_slack_keeps_up_to_0_8_and_moves_past_it():
    """A jump of 0.8 keeps the reference (its key's P is 2^8.8 = 445.7, e4m3's 448 after
    rounding, not clamped); 0.8 + 2^-10 moves it (P back to 2^8)."""
    for jump, p_max in ((0.8, 2.0**8.8), (0.8 + 2.0**-10, 2.0**8)):
        scores = edge_warp(64, 2, jump, 1)
        result = attend(scores, 64, C, Mode.LAZY)
        assert result.trace.p_max == pytest.approx(p_max, rel=2.0**-20), jump
        assert check(result, scores) == []


def test_e4m3_rounding_at_its_thresholds():
    """P < 2^-10 (and 2^-10 itself, ties to even) flushes, just above rounds to 2^-9; normal
    P from 2^-6 keeps a relative 2^-4; 448 is the largest, inf clamps to it, NaN stays."""
    p = torch.tensor([2.0**-10 * 0.99, 2.0**-10, 2.0**-10 * 1.01, 2.0**-6, 2.0**-6 * 1.06])
    assert model.to_e4m3(p).tolist() == [0.0, 0.0, 2.0**-9, 2.0**-6, 2.0**-6 * 1.0]
    big = torch.tensor([445.72, 448.0, 470.0, math.inf, -math.inf, math.nan])
    out = model.to_e4m3(big)
    assert out[:5].tolist() == [448.0, 448.0, 448.0, 448.0, -448.0] and out[5].isnan()
    x = torch.logspace(-6, 8.8, 5000, base=2.0)
    assert ((model.to_e4m3(x) - x).abs() <= x * 2.0**-4).all()
    assert model.to_e4m3(torch.tensor([0.0])).to(torch.float8_e4m3fn).view(torch.uint8) == 0


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_a_diffuse_row_keeps_its_mass_with_the_offset(mode):
    """One key at 0, 4,159 at -12: with the offset their P is 2^-4 (normal); without it
    (FA3's paper's P in [0, 1]) 2^-12, flushed: half the row's mass lost."""
    scores = torch.full((1, 16, 4096 + 64), -12.0)
    scores[0, :, 4100] = 0.0
    assert check(attend(scores, 64, C, mode), scores) == []
    without = Numerics(offset=0.0)
    found = check(attend(scores, 64, C, mode, numerics=without), scores, numerics=without)
    assert found and "weight" in found[0], found


def test_the_16_bit_slack_clamps_p():
    """Slack 8 (the 16-bit kernel's): a jump of 4 keeps the reference, P = 2^12 clamps to 448."""
    scores = edge_warp(128, 3, 4.0, 1)
    old = Numerics(slack=8.0)
    result = attend(scores, 128, C, Mode.LAZY, numerics=old)
    assert result.trace.clamped
    assert any("weight" in p for p in problems(result, scores, SCALE))


def test_a_move_needs_the_offset_in_the_old_reference():
    """The 16-bit factor 2^(m c' - R) is 2^8 too large with R = m c' - 8."""
    scores = edge_warp(64, 3, 3.0, 1)
    wrong = Numerics(offset_in_move=False)
    found = check(attend(scores, 64, C, Mode.EVERY, numerics=wrong), scores)
    assert found and "weight" in found[0], found


@pytest.mark.parametrize(
    "q_descale, k_descale",
    [
        (0.0, 1.0),
        (-1.0, 1.0),
        (1.0, math.inf),
        (math.nan, 1.0),
        (2.0**-70, 2.0**-70),  # c' underflows to a subnormal... or 0
        (2.0**70, 2.0**70),  # c' overflows to inf
        (1.0, -0.0),
    ],
)
def test_a_bad_scale_poisons_every_row(q_descale, k_descale):
    c = scale_log2(SCALE, q_descale, k_descale)
    assert not model.good_scale(c)
    result = attend(edge_warp(64, 2, 1.0, 0), 64, c)
    assert result.weights.isnan().all() and result.lse.isnan().all()


def test_the_scale_threshold_is_the_smallest_normal():
    tiny = 2.0**-126
    assert model.good_scale(tiny) and not model.good_scale(tiny / 2)
    assert not model.good_scale(math.inf) and model.good_scale(torch.finfo(torch.float32).max)
    c = scale_log2(SCALE, 2.0**-60, 2.0**-60)  # small, but normal: the rows are fine
    scores = torch.zeros(1, 16, 128)
    scores[0, 3, 7] = 2.0**120
    assert check(attend(scores, 64, c), scores, scale=SCALE * 2.0**-120) == []


def test_descales_fold_into_the_scale():
    """qd and kd multiply the scores' scale; vd the weights (one rounding)."""
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(2, 16, 256, generator=gen) * 30
    qd, kd, vd = 0.37, 2.5, 0.013
    c = scale_log2(SCALE, qd, kd)
    result = attend(scores, 128, c, Mode.LAZY, v_descale=vd)
    assert check(result, scores, scale=SCALE * qd * kd, v_descale=vd) == []


def test_nan_and_inf_scores_poison_only_their_row():
    """A NaN byte of Q or K gives a NaN score: its row is NaN (fmaxf does not pick it; its P
    is NaN), the others are bit for bit as without it; e5m2's +inf likewise; -inf (a
    mask) gives P exactly 0."""
    gen = torch.Generator().manual_seed(5)
    clean = torch.randn(1, 16, 128, generator=gen) * 4
    for mode in MODES:
        base = attend(clean, 64, C, mode)
        for bad in (math.nan, math.inf):
            scores = clean.clone()
            scores[0, 6, 70] = bad
            result = attend(scores, 64, C, mode)
            assert result.weights[0, 6].isnan().all() and result.lse[0, 6].isnan()
            others = [r for r in range(16) if r != 6]
            assert torch.equal(result.weights[0, others], base.weights[0, others])
            assert torch.equal(result.lse[0, others], base.lse[0, others])
        masked = clean.clone()
        masked[0, 9, 64:] = -math.inf
        result = attend(masked, 64, C, mode)
        assert (result.weights[0, 9, 64:] == 0).all()
        assert check(result, masked) == []


def test_a_row_that_sees_no_key_gives_zero_and_minus_infinity():
    scores = torch.zeros(1, 16, 128)
    scores[0, 3] = -math.inf
    for mode in MODES:
        result = attend(scores, 64, C, mode)
        assert (result.weights[0, 3] == 0).all() and result.lse[0, 3] == -math.inf
        assert check(result, scores) == []


def fp8_warps(rng: random.Random, block_n: int, n_blocks: int, warps: int) -> torch.Tensor:
    """tests/softmax_cases.py's adversarial warps, with the FP8 thresholds added: a key that
    jumps by the slack (or twice it) +- a little, and keys near the normal and flush gaps."""
    scores, _ = random_case(rng, block_n, n_blocks, warps)
    for w in range(warps):
        for _ in range(rng.randint(0, 3)):
            row, block = rng.randrange(16), rng.randrange(n_blocks)
            keys = slice(block * block_n, (block + 1) * block_n)
            top = scores[w, row, keys].amax()
            if top == -math.inf:
                continue
            offset = rng.choice(OFFSETS)
            if rng.random() < 0.5:
                jump = rng.choice((model.RESCALE_SLACK, 2 * model.RESCALE_SLACK))
                scores[w, row, keys][rng.randrange(block_n)] = top + jump + offset
            else:
                gap = rng.choice((NORMAL_GAP, FLUSH_GAP))
                lo = block * block_n + rng.randrange(block_n)
                scores[w, row, lo : lo + 8] = top - 8.0 - gap + offset
    return scores


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rng=st.randoms(use_true_random=False),
    block_n=st.sampled_from(BLOCKS),
    n_blocks=st.integers(1, 5),
    mode=st.sampled_from(MODES),
    softmax_scale=st.sampled_from([SCALE, 128**-0.5, 0.125]),
    descales=st.sampled_from([(1.0, 1.0), (0.25, 3.0), (2.0**-7, 2.0**5)]),
)
def test_random_adversarial_sequences(rng, block_n, n_blocks, mode, softmax_scale, descales):
    scores = fp8_warps(rng, block_n, n_blocks, warps=3)
    qd, kd = descales
    c = scale_log2(softmax_scale, qd, kd)
    result = attend(scores, block_n, c, mode)
    assert check(result, scores, scale=softmax_scale * qd * kd) == []


SPLITS = (2, 3)
V_DESCALES = (1.0, 0.375, 2.0**-9)


@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_split_pieces_merge_to_the_whole_tile(splits, mode):
    """`splits auto`: 8-bit pieces written as fp8_piece_partial writes them and merged by
    the combine at scale 1 meet the bound the whole tile meets, at every threshold of the
    edge batch, with descales and v_descale != 1; their LSE is the whole tile's within
    its rounding. A piece of fully masked keys (m -inf) and a row that sees no key merge
    to the whole tile's 0 and -inf."""
    block_n, n_blocks = 64, 3
    scores = edge_batch(block_n, n_blocks)
    scores[0, 7, :] = -math.inf  # a row that sees no key
    scores[1, 4, : 2 * block_n] = -math.inf  # a row the first pieces never see
    for qd, kd, vd in (
        (1.0, 1.0, 1.0),
        (0.25, 3.0, V_DESCALES[1]),
        (2.0**-7, 2.0**5, V_DESCALES[2]),
    ):
        c = scale_log2(SCALE, qd, kd)
        merged = attend_pieces(scores, block_n, c, splits, mode, v_descale=vd)
        whole = attend(scores, block_n, c, mode, v_descale=vd)
        assert problems(merged, scores, SCALE * qd * kd, vd) == []
        assert merged.lse[0, 7] == -math.inf and (merged.weights[0, 7] == 0).all()
        ok = whole.lse > -math.inf
        assert torch.equal(ok, merged.lse > -math.inf)
        assert ((merged.lse - whole.lse)[ok].abs() <= 2.0**-18 * (whole.lse[ok].abs() + 1)).all()


def test_the_16_bit_pieces_units_fail_with_descales():
    """The units fp8_piece_partial replaces are the ones a combine of 8-bit pieces cannot
    read: raw maxima merged at the 16-bit scale (softmax_scale log2 e, no descales) and O
    without v_descale miss the bound once the descales are not 1."""
    block_n = 64
    scores = edge_batch(block_n, 3)
    qd, kd, vd = 0.25, 3.0, 0.375
    c = scale_log2(SCALE, qd, kd)
    legacy = attend_pieces(
        scores, block_n, c, 2, v_descale=vd, combine_scale=scale_log2(SCALE), scaled=False
    )
    assert problems(legacy, scores, SCALE * qd * kd, vd) != []
    # the raw maxima at scale 1 alone (O v-descaled) miss it too: the offset and c' matter
    raw = attend_pieces(scores * 4, block_n, c, 2, v_descale=1.0, scaled=False)
    assert problems(raw, scores * 4, SCALE * qd * kd) != []


@pytest.mark.parametrize("q_descale", (0.0, math.inf, math.nan))
def test_a_bad_scale_poisons_every_merged_row(q_descale):
    c = scale_log2(SCALE, q_descale, 1.0)
    merged = attend_pieces(edge_batch(64, 3), 64, c, 3)
    assert merged.weights.isnan().all() and merged.lse.isnan().all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rng=st.randoms(use_true_random=False),
    block_n=st.sampled_from(BLOCKS),
    n_blocks=st.integers(2, 5),
    splits=st.integers(2, 5),
    mode=st.sampled_from(MODES),
    descales=st.sampled_from([(1.0, 1.0, 1.0), (0.25, 3.0, 0.375), (2.0**-7, 2.0**5, 4.0)]),
)
def test_random_split_pieces(rng, block_n, n_blocks, splits, mode, descales):
    """Pieces of 0 blocks (splits > n_blocks) are empty partials (m -inf, l 0)."""
    scores = fp8_warps(rng, block_n, n_blocks, warps=3)
    qd, kd, vd = descales
    c = scale_log2(SCALE, qd, kd)
    merged = attend_pieces(scores, block_n, c, splits, mode, v_descale=vd)
    assert problems(merged, scores, SCALE * qd * kd, vd) == []
