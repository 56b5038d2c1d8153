"""derive_sparsity (fadsl/passes/modifiers/sparsity.py): a keep predicate's tile rule against
the predicate's own values over every score of random tiles. Sound always (FULL only where
every score is kept, EMPTY only where none is); exact where the rule says so (causal masks,
sliding windows and prefix-LM written as expressions: FULL and EMPTY wherever they hold)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from fadsl.ir.expr import text
from fadsl.passes.modifiers.sparsity import derive_sparsity
from modifier_eval import evaluate
from test_modifiers_front import modifiers

CAUSAL = "kv_idx <= q_idx + seqlen_k - seqlen_q"
WINDOW = "kv_idx >= q_idx + seqlen_k - seqlen_q - 37 and kv_idx <= q_idx + seqlen_k - seqlen_q + 5"
PREFIX_LM = "kv_idx <= q_idx + seqlen_k - seqlen_q or kv_idx < prefix[b]"
EXACT = {
    "causal": CAUSAL,
    "causal_top_left": "q_idx >= kv_idx",
    "window": WINDOW,
    "window_causal_written_twice": f"{CAUSAL} and kv_idx > q_idx - 20 and kv_idx <= q_idx + 9",
    "prefix_lm": PREFIX_LM,
    "prefix_lm_negated_twice": f"not (not ({PREFIX_LM}))",
    "per_head": f"h < 2 or {CAUSAL}",
    "not_causal": "not (kv_idx > q_idx + 3)",
    "equal": "kv_idx == q_idx",
    "not_equal": "kv_idx != q_idx",
    "scaled": "2 * kv_idx <= 3 * q_idx - seqlen_q // 4",
    "empty_window": "kv_idx >= q_idx + 5 and kv_idx <= q_idx + 2",
}
SOUND_ONLY = {
    "product": "(q_idx * kv_idx) % 3 == 0",
    "block_diagonal": "q_idx // 64 == kv_idx // 64",
    "two_forms_and": "kv_idx <= q_idx and kv_idx >= 2 * q_idx - 50",
    "two_forms_or": "kv_idx <= q_idx - 40 or kv_idx >= 2 * q_idx + 30",
    "input_by_row": "kv_idx <= table[q_idx]",
}
INPUTS = "input prefix : i32[batch]\n  input table : i32[seqlen_q]"


def rule_of(keep: str):
    m = modifiers(f"{INPUTS}\n  keep {keep}", check_inputs=False)
    return m, m.rule


def random_tiles(rng: random.Random, count: int):
    for _ in range(count):
        sq, sk = rng.randint(1, 120), rng.randint(1, 120)
        q_lo = rng.randrange(sq)
        q_hi = min(sq - 1, q_lo + rng.choice((0, 1, 5, 17, 40)))
        kv_lo = rng.randrange(sk)
        kv_hi = min(sk - 1, kv_lo + rng.choice((0, 1, 6, 23, 50)))
        env = {"seqlen_q": sq, "seqlen_k": sk, "b": rng.randrange(3), "h": rng.randrange(4)}
        env.update(q_lo=q_lo, q_hi=q_hi, kv_lo=kv_lo, kv_hi=kv_hi, batch=3, heads=4, heads_kv=2)
        prefix = [rng.randint(0, sk + 5) for _ in range(3)]
        table = [rng.randint(-3, sk + 3) for _ in range(sq)]
        yield env, {"prefix": lambda b, p=prefix: p[b], "table": lambda i, t=table: t[i]}


def classes(m, env, inputs):
    """(every score kept, no score kept) over the tile, by brute force."""
    kept = [
        evaluate(m.keep, {**env, "q_idx": i, "kv_idx": j}, inputs)
        for i in range(env["q_lo"], env["q_hi"] + 1)
        for j in range(env["kv_lo"], env["kv_hi"] + 1)
    ]
    return all(kept), not any(kept)


def check_rule(m, rule, tiles, exact: bool) -> None:
    for env, inputs in tiles:
        everywhere, nowhere = classes(m, env, inputs)
        full, empty = evaluate(rule.full, env, inputs), evaluate(rule.empty, env, inputs)
        where = f"{env}: full {text(rule.full)}, empty {text(rule.empty)}"
        assert not full or everywhere, f"FULL where a score is masked at {where}"
        assert not empty or nowhere, f"EMPTY where a score is kept at {where}"
        if exact:
            assert full == everywhere, f"FULL missed at {where}"
            assert empty == nowhere, f"EMPTY missed at {where}"


@pytest.mark.parametrize("name", EXACT)
def test_the_rule_is_exact_for_linear_masks(name):
    m, rule = rule_of(EXACT[name])
    assert rule.exact, rule.why
    check_rule(m, rule, random_tiles(random.Random(name), 400), exact=True)


@pytest.mark.parametrize("name", SOUND_ONLY)
def test_the_rule_is_sound_where_it_cannot_decide(name):
    m, rule = rule_of(SOUND_ONLY[name])
    assert not rule.exact
    check_rule(m, rule, random_tiles(random.Random(name), 300), exact=False)


def test_the_causal_rule_reads_as_one_comparison_per_class():
    _, rule = rule_of(CAUSAL)
    assert text(rule.full) == "kv_hi - q_lo <= seqlen_k - seqlen_q"
    assert text(rule.empty) == "kv_lo - q_hi > seqlen_k - seqlen_q"
    _, rule = rule_of(PREFIX_LM)
    assert text(rule.full) == "kv_hi - q_lo <= seqlen_k - seqlen_q or kv_hi < prefix[b]"
    assert text(rule.empty) == "kv_lo - q_hi > seqlen_k - seqlen_q and kv_lo >= prefix[b]"


def test_a_window_misses_a_tile_only_where_its_band_does():
    """The two edges of a window taken apart would say EMPTY never (each edge alone holds
    somewhere in a tile the band misses): the rule intersects them."""
    m, rule = rule_of(WINDOW)
    env = {"seqlen_q": 256, "seqlen_k": 256, "q_lo": 128, "q_hi": 191, "kv_lo": 0, "kv_hi": 63}
    assert evaluate(rule.empty, env) and classes(m, env, {}) == (False, True)


def test_the_checker_catches_a_wrong_rule():
    """The brute force is what the rules are held to: a rule that claims too much fails."""
    m, rule = rule_of(CAUSAL)
    swapped = replace(rule, full=rule.empty, empty=rule.full)
    with pytest.raises(
        AssertionError, match="(FULL where a score is masked|EMPTY where a score is kept)"
    ):
        check_rule(m, swapped, random_tiles(random.Random(1), 200), exact=False)
    weak = replace(rule, full=rule_of("1 == 0 and " + CAUSAL)[1].full)
    with pytest.raises(AssertionError, match="FULL missed"):
        check_rule(m, weak, random_tiles(random.Random(2), 200), exact=True)


def test_a_spec_without_keep_has_no_rule():
    m = modifiers("score s * 2")
    assert m.rule is None and derive_sparsity(m) is m
