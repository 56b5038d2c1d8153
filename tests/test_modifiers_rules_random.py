"""derive_sparsity's tile rule is sound for random keep predicates, not only the written ones
of test_modifiers_sparsity.py: FULL only where every score of a tile is kept (a FULL tile
runs unmasked: a wrong one keeps scores the spec masks), EMPTY only where none is (an EMPTY
tile is skipped). Predicates are comparisons of random integer expressions
(test_modifiers_index_proofs.EXPRS) under and, or, not; tiles as test_modifiers_sparsity
draws them, each score evaluated with Python's exact integers."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fadsl.errors import SpecError
from test_modifiers_index_proofs import EXPRS
from test_modifiers_sparsity import check_rule, random_tiles, rule_of

COMPARISONS = ["<", "<=", ">", ">=", "==", "!="]
SIDES = st.sampled_from(["q_idx", "kv_idx", "seqlen_q", "seqlen_k", "h", "b"])
# linear comparisons, the ones the rule decides exactly (a * kv_idx OP c * q_idx + d + ...)
LINEAR = st.tuples(
    st.integers(-3, 3),
    st.sampled_from(COMPARISONS),
    st.integers(-3, 3),
    st.integers(-40, 40),
    SIDES,
).map(lambda t: f"{t[0]} * kv_idx {t[1]} {t[2]} * q_idx + {t[3]} - {t[4]}")
ATOMS = st.one_of(
    LINEAR,
    st.tuples(EXPRS, st.sampled_from(COMPARISONS), EXPRS).map(lambda t: " ".join(t)),
)


def predicates(children):
    two = st.tuples(children, children)
    return st.one_of(
        two.map(lambda t: f"({t[0]} and {t[1]})"),
        two.map(lambda t: f"({t[0]} or {t[1]})"),
        children.map(lambda a: f"(not {a})"),
    )


KEEPS = st.recursive(ATOMS, predicates, max_leaves=3)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(keep=KEEPS, seed=st.integers(0, 2**32 - 1))
def test_a_random_keep_gets_a_sound_rule(keep, seed):
    try:
        m, rule = rule_of(keep)
    except SpecError:
        return  # refused (a divisor that may be 0, a value out of range): nothing to hold
    check_rule(m, rule, random_tiles(random.Random(seed), 25), exact=False)
