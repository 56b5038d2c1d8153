"""The checker's proofs hold: for random integer expressions used as an input's index,
whatever check_modifiers accepts stays inside the input's dimension, never divides by zero,
and keeps every integer value inside the i32 range, for every size a call may have (up to
``Modifiers.longest``) and every index. The reference is Python's exact integers
(tests/modifier_eval.py, Python's // and % as the kernel's floordiv and floormod): a load the
proof lets through that reads outside its input would be an out-of-bounds read on the GPU.
Likewise for values with floats and floors in them (a score): every int the kernel computes
fits an i32 (a floor's conversion included), every float stays below fp32's largest."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fadsl.errors import SpecError
from fadsl.ir.expr import (
    DIM_MAX,
    Binary,
    Dim,
    ExprType,
    FnCall,
    Load,
    Unary,
    dim_size,
    text,
    walk,
)
from fadsl.pipeline import front_end
from modifier_eval import evaluate
from test_modifiers_front import spec

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
LEAVES = ["q_idx", "kv_idx", "b", "h", "seqlen_q", "seqlen_k", "batch", "heads", "heads_kv"]
DIMS = ["seqlen_k", "seqlen_q", "heads", "batch", "64", "cdiv(seqlen_q, 128)"]


def forms(children, *templates: str):
    """One of ``templates``, each a format string whose fields ({0}, {1}, ...) are filled with
    ``children``'s expressions (a constant field: ``{c}``, a small integer)."""

    def filled(template: str):
        arity = len(set(re.findall(r"\{(\d)\}", template)))
        parts = st.tuples(st.tuples(*[children] * arity), st.integers(-3, 300))
        return parts.map(lambda t: template.format(*t[0], c=t[1]))

    return st.one_of(*(filled(t) for t in templates))


def combine(children):
    return forms(
        children,
        "({0} + {1})",
        "({0} - {1})",
        "({0} * {1})",
        "({0} // {c})",
        "({0} % {c})",
        "({0} // {1})",
        "min({0}, {1})",
        "max({0}, {1})",
        "abs({0})",
        "(-{0})",
        "clamp({0}, {1}, {2})",
        "where({0} < {1}, {2}, {3})",
    )


EXPRS = st.recursive(
    st.one_of(st.sampled_from(LEAVES), st.integers(-3, 300).map(str)), combine, max_leaves=6
)
# wrappers a spec writes to keep an index in range, and near misses of them
WRAPS = [
    "{e}",
    "clamp({e}, 0, {last})",
    "min({e}, {last})",
    "max({e}, 0)",
    "min(max({e}, 0), {last})",
    "abs({e}) % 64",
    "{e} // 128",
    "max({e}, 0) // 128",
]


def checked_index(expr: str, dim: str):
    """(the checked modifiers, the typed load) of ``t[expr]`` with ``t : f32[dim]`` (``{last}``
    in ``expr``: the dimension's last index), or None where the checker refuses it."""
    last = f"{dim} - 1" if not dim.isdigit() else str(int(dim) - 1)
    lines = f"input t : f32[{dim}]\n  score s + t[{expr.replace('{last}', last)}]"
    try:
        m = front_end(spec(lines), "mods.fa").config.modifiers
    except SpecError:
        return None
    load = next(n for n in walk(m.score) if isinstance(n, Load))
    return m, load


def sizes_strategy(longest: int | None):
    top = DIM_MAX[Dim.SEQLEN_Q] if longest is None else longest
    seqlen = st.one_of(st.integers(1, min(300, top)), st.integers(1, top), st.just(top))
    grid = st.one_of(st.integers(1, 20), st.just(DIM_MAX[Dim.BATCH]))
    return st.fixed_dictionaries(
        {
            Dim.SEQLEN_Q: seqlen,
            Dim.SEQLEN_K: seqlen,
            Dim.BATCH: grid,
            Dim.HEADS: grid,
            Dim.HEADS_KV: grid,
        }
    )


def index_value(size: int):
    return st.one_of(st.just(0), st.just(size - 1), st.integers(0, size - 1))


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    expr=EXPRS,
    wrap=st.sampled_from(WRAPS),
    dim=st.sampled_from(DIMS),
    data=st.data(),
)
def test_an_accepted_index_stays_inside_its_input(expr, wrap, dim, data):
    found = checked_index(wrap.format(e=expr, last="{last}"), dim)
    if found is None:
        return  # refused: nothing to hold
    m, load = found
    index = load.indices[0]
    for _ in range(4):
        sizes = data.draw(sizes_strategy(m.longest))
        env = {d.value: n for d, n in sizes.items()}
        env |= {
            "q_idx": data.draw(index_value(sizes[Dim.SEQLEN_Q])),
            "kv_idx": data.draw(index_value(sizes[Dim.SEQLEN_K])),
            "b": data.draw(index_value(sizes[Dim.BATCH])),
            "h": data.draw(index_value(sizes[Dim.HEADS])),
        }
        for node in walk(index):  # every integer value the kernel computes fits an i32
            if isinstance(node, (Binary, Unary)) and node.type is ExprType.I32:
                value = evaluate(node, env)
                assert INT_MIN <= value <= INT_MAX, (text(node), env)
        value = evaluate(index, env)  # (a division by zero raises: a failure too)
        extent = dim_size(m.input("t").dims[0], sizes)
        assert 0 <= value < extent, (text(index), env, extent)


def test_a_floor_division_by_a_negative_constant_is_bounded():
    """q_idx // -1 ranges down to -(seqlen_q - 1), so its product with q_idx may overflow an
    i32 and is refused (it was taken for unbounded, which the i32 check lets through: the
    hypothesis search above found it, 2026-12-06); by a positive constant it stays taken."""
    assert checked_index("clamp(q_idx * abs(q_idx // -1), 0, {last})", "seqlen_k") is None
    assert checked_index("clamp(q_idx * abs(q_idx // -3), 0, {last})", "seqlen_k") is None
    assert checked_index("clamp(q_idx // -1 + kv_idx, 0, {last})", "seqlen_k") is not None
    assert checked_index("clamp(q_idx // 2 * 3, 0, {last})", "seqlen_k") is not None


FLOAT_MAX = 3.4028234663852886e38


def combine_floats(children):
    """combine's integer forms and forms through floats: a float factor, a quotient, a floor,
    exp and log of bounded arguments."""
    return st.one_of(
        combine(children),
        forms(
            children,
            "floor({0} * 1.5)",
            "floor({0} * 3.0)",
            "floor({0} / {1})",
            "floor({0} / 7)",
            "({0} * 1.0e30)",
            "floor({0} * 2.5e8)",
            "floor(exp(min({0}, 80)))",
            "floor(log(max({0}, 1)) * {c})",
            "floor(tanh({0}) * 1.0e10)",
        ),
    )


VALUES = st.recursive(
    st.one_of(st.sampled_from(LEAVES), st.integers(-3, 300).map(str)),
    combine_floats,
    max_leaves=5,
)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(expr=VALUES, data=st.data())
def test_an_accepted_value_fits_its_type(expr, data):
    try:
        m = front_end(spec(f"score s + 1.0 * ({expr})"), "mods.fa").config.modifiers
    except SpecError:
        return  # refused: nothing to hold
    for _ in range(4):
        sizes = data.draw(sizes_strategy(m.longest))
        env = {d.value: n for d, n in sizes.items()}
        env |= {
            "s": 0.0,
            "q_idx": data.draw(index_value(sizes[Dim.SEQLEN_Q])),
            "kv_idx": data.draw(index_value(sizes[Dim.SEQLEN_K])),
            "b": data.draw(index_value(sizes[Dim.BATCH])),
            "h": data.draw(index_value(sizes[Dim.HEADS])),
        }
        for node in walk(m.score):
            if not isinstance(node, (Binary, Unary, FnCall)) or node.type is ExprType.BOOL:
                continue
            value = evaluate(node, env)  # (a division by zero raises: a failure too)
            if node.type is ExprType.I32:
                assert INT_MIN <= value <= INT_MAX, (text(node), env, m.longest)
            else:
                assert abs(value) <= FLOAT_MAX, (text(node), env, m.longest)
