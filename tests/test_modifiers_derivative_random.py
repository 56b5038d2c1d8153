"""The score's derivative (fadsl/passes/modifiers/derivative.py) against central finite
differences for random score expressions (hypothesis), not only the written ones of
test_modifiers_front.py: sums, products, quotients by constants, tanh, bounded exp, logs of
positive values, abs, min, max, clamp and where over s, the indices and constants. A wrong
derivative is a wrong dS, so wrong gradients with no error anywhere."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fadsl.errors import SpecError
from modifier_eval import evaluate
from test_modifiers_front import modifiers
from test_modifiers_index_proofs import forms

LEAVES = st.one_of(
    st.just("s"),
    st.sampled_from(["q_idx", "kv_idx", "h"]),
    st.sampled_from(["0.5", "-1.25", "3.0", "2", "0.125"]),
)


def combine(children):
    return forms(
        children,
        "({0} + {1})",
        "({0} - {1})",
        "({0} * {1})",
        "({0} / 4.0)",
        "tanh({0})",
        "exp(min({0}, 6.0))",
        "log(1.0 + abs({0}))",
        "abs({0})",
        "min({0}, {1})",
        "max({0}, {1})",
        "clamp({0}, -2.0, 5.0)",
        "where({0} > 0.3, {1}, {2})",
    )


SCORES = st.recursive(LEAVES, combine, max_leaves=5)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    score=SCORES,
    s=st.floats(-4.0, 4.0, allow_nan=False),
    q_idx=st.integers(0, 9),
    kv_idx=st.integers(0, 9),
    h=st.integers(0, 3),
)
def test_the_derivative_of_a_random_score_matches_finite_differences(score, s, q_idx, kv_idx, h):
    try:
        m = modifiers(f"score {score}")
    except SpecError:
        return  # refused (a value that may overflow, ...): nothing to hold
    assume(m.derivative is not None)
    # off the round numbers where min, max, abs, clamp and where meet a tie (their
    # derivative there is torch's convention, test_modifiers_backward.py checks it)
    s += 0.001234567
    env = {"s": s, "b": 0, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
    step = 1e-6
    up = evaluate(m.score, {**env, "s": s + step})
    down = evaluate(m.score, {**env, "s": s - step})
    mid = evaluate(m.score, env)
    # a kink or a jump within a step of s (abs, min, max, clamp, where): no derivative to
    # compare with there; the two one-sided slopes tell
    left, right = (mid - down) / step, (up - mid) / step
    assume(math.isclose(left, right, rel_tol=1e-3, abs_tol=1e-3))
    want = (up - down) / (2 * step)
    got = evaluate(m.derivative, env)
    assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), (score, env, got, want)
