"""split_distance_term: a score of the form ``s + f`` where ``f`` reads the query row and the
key only through their distance ``q_idx - kv_idx`` (a relative position bias: T5's buckets),
and is dear to evaluate (a transcendental, or a read of an input at an index that varies
inside a tile).

A pure pass, ``Modifiers -> Modifiers``: ``distance_term`` is that ``f`` (``-f`` for ``s - f``; None where the score
is not of that form, or ``f`` is cheap: ALiBi's ``slopes[h] * (kv_idx - q_idx)`` is one
multiply a score, cheaper than any table). A B_r x B_c tile meets B_r + B_c - 1 distances
where it meets B_r B_c scores, so a target may evaluate ``f`` once a distance and hand each
score its value (sm_90a: fadsl/sm90_modifiers.cuh, ``DistanceTable``), and the score stays
``s + f`` bit for bit but for the rounding of ``S softmax_scale + f`` (one fused multiply-add
or two roundings, as the compiler contracts it: the same freedom the direct form has).

Why the substitution is exact: where every ``q_idx`` and ``kv_idx`` of ``f`` sits in a
``q_idx - kv_idx`` or ``kv_idx - q_idx`` node, ``f`` at (q_idx, kv_idx) equals ``f`` at
(q_idx - kv_idx, 0): each such node has the same 32-bit integer value in both (the distance,
or its negation), and nothing else in ``f`` reads either index. A target renders ``f`` with
``q_idx`` as the distance and ``kv_idx`` as 0. The distance of a real score lies in
``[-(seqlen_k - 1), seqlen_q - 1]``, where check_modifiers proved ``f``'s indices in bounds;
a target evaluates ``f`` only there (a padding row's or key's distance is clamped into it).
"""

from __future__ import annotations

from dataclasses import replace

from ...ir.expr import Binary, BinOp, Expr, ExprType, Fn, FnCall, Load, Modifiers, Unary, UnOp
from ...ir.expr import Var, VarKind, children, reads_score, tile_uniform

# The functions whose evaluation costs more than a table's read (a MUFU op each, and more).
_DEAR_FNS = frozenset({Fn.EXP, Fn.LOG, Fn.LOG2, Fn.TANH})
_INDICES = (VarKind.Q_IDX, VarKind.KV_IDX)


def split_distance_term(m: Modifiers) -> Modifiers:
    if m.score is None:
        return m
    return replace(m, distance_term=distance_term(m.score))


def distance_term(score: Expr) -> Expr | None:
    """``f`` where ``score`` is ``s + f`` or ``f + s`` (``-f`` where it is ``s - f``, f a float), ``f`` reads no score, reads the
    indices only as their distance, and is dear (see the module's docstring); else None."""
    match score:
        case Binary(op=BinOp.ADD, a=Var(kind=VarKind.SCORE), b=f):
            term = f
        case Binary(op=BinOp.ADD, a=f, b=Var(kind=VarKind.SCORE)):
            term = f
        case Binary(op=BinOp.SUB, a=Var(kind=VarKind.SCORE), b=f) if f.type is ExprType.F32:
            term = Unary(UnOp.NEG, f, f.loc, f.type)  # s - f = s + (-f) exactly (a float's sign)
        case _:
            return None
    if reads_score(f) or tile_uniform(f) or not _by_distance_only(f):
        return None
    return term if _dear(f) else None


def _is_distance(e: Expr) -> bool:
    """``q_idx - kv_idx`` or ``kv_idx - q_idx``."""
    match e:
        case Binary(op=BinOp.SUB, a=Var(kind=x), b=Var(kind=y)):
            return {x, y} == set(_INDICES)
    return False


def _by_distance_only(e: Expr) -> bool:
    """Whether every q_idx and kv_idx of ``e`` is an operand of a distance node."""
    if _is_distance(e):
        return True
    if isinstance(e, Var):
        return e.kind not in _INDICES
    return all(_by_distance_only(child) for child in children(e))


def _dear(f: Expr) -> bool:
    """Whether ``f`` evaluates a transcendental or reads an input per score: parts the same
    for all of a tile's scores are not counted (the kernels load them once per tile)."""
    if tile_uniform(f):
        return False
    if isinstance(f, FnCall) and f.fn in _DEAR_FNS:
        return True
    if isinstance(f, Load):
        return True  # (not tile-uniform: an index varies inside the tile)
    return any(_dear(child) for child in children(f))
