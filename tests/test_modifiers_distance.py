"""split_distance_term (fadsl/passes/modifiers/distance.py) and the sm_90a kernels' use of it
(DistanceTable, fadsl/sm90_modifiers.cuh): which scores are classed as ``s + f(q_idx -
kv_idx)``, that ``f`` at (d, 0) is the score's term at every (q_idx, kv_idx) of distance d,
and a model of the table's windows and shuffles that every score of a warp reads its own
distance's value, in the forward's S layout and the backward's S^T layout, at every tile the
targets take."""

from __future__ import annotations

import math
import random

import pytest

from fadsl.ir.expr import text
from modifier_eval import evaluate
from test_modifiers_front import modifiers

T5 = (
    "s + bias[h, clamp(where(q_idx - kv_idx < 16, q_idx - kv_idx, 16 + floor(log(max(q_idx"
    " - kv_idx, 16) / 16.0) / log(8.0) * 16.0)), 0, 31)]"
)
INPUTS = (
    "input bias : f32[heads, 32]\n  input rel : f32[heads, 401]\n  input slopes : f32[heads]\n"
    "  input irel : i32[heads, 401]"
)
BY_DISTANCE = {
    "t5": T5,
    "table_both_signs": "s + rel[h, clamp(q_idx - kv_idx + 200, 0, 400)]",
    "term_first": "rel[h, clamp(kv_idx - q_idx + 200, 0, 400)] + s",
    "log_distance": "s + slopes[h] * log(1.0 + abs(q_idx - kv_idx))",
    "exp_by_batch": "s - exp(-abs(kv_idx - q_idx) / 64.0) * (b + 1)",
    "int table added": "s + irel[h, clamp(q_idx - kv_idx + 200, 0, 400)]",
}
NOT_BY_DISTANCE = {
    "alibi (cheap)": "s + slopes[h] * (kv_idx - q_idx)",
    "scaled score": "2.0 * s + rel[h, clamp(q_idx - kv_idx + 200, 0, 400)]",
    "reads s in the term": "s + log(1.0 + abs(s)) * slopes[h]",
    "a row alone": "s + log(1.0 + q_idx)",
    "a key alone": "s + rel[h, clamp(kv_idx, 0, 400)]",
    "a sum, not a distance": "s + log(1.0 + q_idx + kv_idx)",
    "uniform term": "s + log(1.0 + slopes[h] * slopes[h])",
    "softcap": "30 * tanh(s / 30)",
    "an int subtracted (its negation would be the int's)": "s - irel[h, clamp(q_idx - kv_idx + 200, 0, 400)]",
    "dear only per tile": "s + tanh(slopes[h]) * (kv_idx - q_idx)",
}


def checked(score: str):
    return modifiers(f"{INPUTS}\n  score {score}", check_inputs=False)


@pytest.mark.parametrize("score", BY_DISTANCE.values(), ids=BY_DISTANCE.keys())
def test_a_dear_term_of_the_distance_alone_is_split_off(score):
    m = checked(score)
    assert m.distance_term is not None
    assert "s" not in text(m.distance_term).replace("abs", "").split()


@pytest.mark.parametrize("score", NOT_BY_DISTANCE.values(), ids=NOT_BY_DISTANCE.keys())
def test_other_scores_are_left_whole(score):
    assert checked(score).distance_term is None


@pytest.mark.parametrize("score", BY_DISTANCE.values(), ids=BY_DISTANCE.keys())
def test_the_term_at_the_distance_and_0_is_the_scores_term(score):
    """s + f(q_idx, kv_idx) == s + f(q_idx - kv_idx, 0) for every pair (what the kernels
    evaluate: the term with q_idx the distance and kv_idx 0)."""
    m = checked(score)
    rng = random.Random(41)
    tables = {
        "bias": [[rng.uniform(-2, 2) for _ in range(32)] for _ in range(4)],
        "rel": [[rng.uniform(-2, 2) for _ in range(401)] for _ in range(4)],
        "slopes": [[rng.uniform(-1, 1)] for _ in range(4)],
        "irel": [[rng.randint(-9, 9) for _ in range(401)] for _ in range(4)],
    }
    inputs = {
        "bias": lambda h, i: tables["bias"][h][i],
        "rel": lambda h, i: tables["rel"][h][i],
        "slopes": lambda h: tables["slopes"][h][0],
        "irel": lambda h, i: tables["irel"][h][i],
    }
    for _ in range(400):
        sq, sk = rng.randint(1, 3000), rng.randint(1, 3000)
        q, kv = rng.randrange(sq), rng.randrange(sk)
        env = {"s": rng.uniform(-20, 20), "b": rng.randrange(3), "h": rng.randrange(4)}
        env.update(seqlen_q=sq, seqlen_k=sk, batch=3, heads=4, heads_kv=2)
        whole = evaluate(m.score, {**env, "q_idx": q, "kv_idx": kv}, inputs)
        term = evaluate(m.distance_term, {**env, "q_idx": q - kv, "kv_idx": 0}, inputs)
        assert whole == env["s"] + term or math.isclose(whole, env["s"] + term, rel_tol=1e-15)


def test_explain_names_the_term():
    from fadsl.tools.report import modifiers_data, modifiers_text

    data = modifiers_data(checked(BY_DISTANCE["table_both_signs"]))
    assert data["score"]["distance_term"] == "rel[h, clamp(q_idx - kv_idx + 200, 0, 400)]"
    assert any("once a distance" in line for line in modifiers_text(data))
    assert (
        modifiers_data(checked(NOT_BY_DISTANCE["alibi (cheap)"]))["score"]["distance_term"] is None
    )


# --- the table's windows (DistanceTable), modelled lane by lane ---------------------------

SPREAD_LO = -7  # DistanceTable::kSpreadLo


def table_reads(lo: int, hi: int, base: int, spreads, offsets):
    """For each lane and offset o, the distance DistanceTable<lo, hi> hands it: window k =
    (o - lo) / 16 of source lane (o - lo) % 16 + spread - kSpreadLo, whose value is f at
    base + lo + kSpreadLo + 16 k + that lane; and the windows' count."""
    windows = (hi - lo) // 16 + 1
    found = {}
    for lane, spread in enumerate(spreads):
        for o in offsets:
            k = (o - lo) // 16
            src = (o - lo) % 16 + spread - SPREAD_LO
            assert 0 <= k < windows and 0 <= src < 32, (lane, o, k, src)
            found[lane, o] = base + lo + SPREAD_LO + 16 * k + src
    return found, windows


@pytest.mark.parametrize("block_n", [16, 64, 112, 128, 176, 256])
def test_the_forwards_scores_read_their_own_distance(block_n):
    """S's layout (wgmma m64nN): lane l of warp w holds rows 16 w + l / 4 (+ 8 r) and keys
    8 j + 2 (l % 4) + e of the block; apply_score's base is row0 - col0 - spread."""
    for first_row, first_key in [(0, 0), (64 + 16 * 3, 128 * 7), (4096, 0), (0, 4096)]:
        spreads = [lane // 4 - 2 * (lane % 4) for lane in range(32)]
        assert min(spreads) >= SPREAD_LO and max(spreads) <= SPREAD_LO + 14
        offsets = [8 * r - 8 * j - e for r in (0, 1) for j in range(block_n // 8) for e in (0, 1)]
        assert min(offsets) == 7 - block_n and max(offsets) == 8  # the template's <7 - B_c, 8>
        base = first_row - first_key
        found, windows = table_reads(7 - block_n, 8, base, spreads, offsets)
        assert windows == block_n // 16 + 1
        for lane in range(32):
            for r in (0, 1):
                for j in range(block_n // 8):
                    for e in (0, 1):
                        q = first_row + lane // 4 + 8 * r
                        kv = first_key + 8 * j + 2 * (lane % 4) + e
                        assert found[lane, 8 * r - 8 * j - e] == q - kv


@pytest.mark.parametrize("block_m", [64, 80, 128])
def test_the_backwards_scores_read_their_own_distance(block_m):
    """S^T's layout: lane l holds key rows key0 = 16 w + l / 4 (+ 8 r) and query columns
    8 j + 2 (l % 4) + e of the m-block; bwd_score's base is q0 - key0 + l / 4."""
    for q0, first_key in [(0, 0), (80 * 5, 128 * 2 + 16), (0, 4096 + 48), (8000, 0)]:
        spreads = [2 * (lane % 4) - lane // 4 for lane in range(32)]
        assert min(spreads) >= SPREAD_LO and max(spreads) <= SPREAD_LO + 14
        offsets = [8 * j + e - 8 * r for j in range(block_m // 8) for e in (0, 1) for r in (0, 1)]
        assert min(offsets) == -8 and max(offsets) == block_m - 7  # the template's <-8, B_r - 7>
        for lane in range(32):
            key0 = first_key + lane // 4
            found, _ = table_reads(-8, block_m - 7, q0 - key0 + lane // 4, spreads, offsets)
            for j in range(block_m // 8):
                for e in (0, 1):
                    for r in (0, 1):
                        q = q0 + 8 * j + 2 * (lane % 4) + e
                        assert found[lane, 8 * j + e - 8 * r] == q - (key0 + 8 * r)
