"""Typed expression nodes built by the passes, folded as they are built.

derive_sparsity and differentiate_score make new expressions (a tile class's condition, a
derivative); these constructors type each node and fold what is constant, so that the
results read as a person would write them (``kv_hi - q_lo <= seqlen_k - seqlen_q``, ``1``,
not ``1 * (kv_hi - q_lo) + 0 ...``). Each takes the location of the spec's expression the
new one comes from.
"""

from __future__ import annotations

from ...errors import Loc
from ...ir.expr import Binary, BinOp, FnCall, Const, Expr, ExprType, Fn, Unary, UnOp, Where

I32, F32, BOOL = ExprType.I32, ExprType.F32, ExprType.BOOL


def const(value: int | float | bool, loc: Loc) -> Const:
    if isinstance(value, bool):
        return Const(value, loc, BOOL)
    if isinstance(value, int):
        return Const(value, loc, I32)
    if value == int(value) and abs(value) < 2**31:
        # a float that is a whole number prints as one ("1.0"), never as an int
        return Const(float(value), loc, F32, repr(float(value)))
    return Const(float(value), loc, F32)


def value_of(e: Expr) -> int | float | bool | None:
    return e.value if isinstance(e, Const) else None


def _numeric(a: Expr, b: Expr) -> ExprType:
    return I32 if a.type is I32 and b.type is I32 else F32


def add(a: Expr, b: Expr, loc: Loc) -> Expr:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return const(va + vb, loc)
    if vb == 0:
        return a
    if va == 0:
        return b
    if isinstance(vb, (int, float)) and not isinstance(vb, bool) and vb < 0:
        return Binary(BinOp.SUB, a, const(-vb, loc), loc, _numeric(a, b))
    if isinstance(b, Unary) and b.op is UnOp.NEG:  # a + -x: a - x
        return Binary(BinOp.SUB, a, b.x, loc, _numeric(a, b))
    if isinstance(a, Unary) and a.op is UnOp.NEG:  # -x + b: b - x
        return Binary(BinOp.SUB, b, a.x, loc, _numeric(a, b))
    return Binary(BinOp.ADD, a, b, loc, _numeric(a, b))


def neg(a: Expr, loc: Loc) -> Expr:
    va = value_of(a)
    if va is not None:
        return const(-va, loc)
    if isinstance(a, Unary) and a.op is UnOp.NEG:
        return a.x
    return Unary(UnOp.NEG, a, loc, a.type)


def sub(a: Expr, b: Expr, loc: Loc) -> Expr:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return const(va - vb, loc)
    if vb == 0:
        return a
    if va == 0:
        return neg(b, loc)
    return Binary(BinOp.SUB, a, b, loc, _numeric(a, b))


def mul(a: Expr, b: Expr, loc: Loc) -> Expr:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return const(va * vb, loc)
    for k, x in ((va, b), (vb, a)):
        if k == 0 and k is not None:  # (x is finite: check_modifiers proved it)
            return const(0 if _numeric(a, b) is I32 else 0.0, loc)
        if k == 1:
            return x if x.type is _numeric(a, b) else Binary(BinOp.MUL, a, b, loc, F32)
        if k == -1 and x.type is _numeric(a, b):
            return neg(x, loc)
    # constant factors gather at the front: c1 * (c2 * x) -> (c1 c2) * x
    if va is not None and isinstance(b, Binary) and b.op is BinOp.MUL and value_of(b.a) is not None:
        return mul(const(va * value_of(b.a), loc), b.b, loc)
    if vb is not None and va is None:
        return mul(b, a, loc)
    return Binary(BinOp.MUL, a, b, loc, _numeric(a, b))


def div(a: Expr, b: Expr, loc: Loc) -> Expr:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb:
        return const(float(va) / vb, loc)
    if vb == 1:
        return a if a.type is F32 else Binary(BinOp.DIV, a, b, loc, F32)
    if va == 0:
        return const(0.0, loc)
    return Binary(BinOp.DIV, a, b, loc, F32)


def compare(op: BinOp, a: Expr, b: Expr, loc: Loc) -> Expr:
    va, vb = value_of(a), value_of(b)
    if va is not None and vb is not None:
        return const(_COMPARE[op](va, vb), loc)
    # integers: a <= x - 1 is a < x, a < x + 1 is a <= x (and their mirrors)
    if a.type is I32 and isinstance(b, Binary) and value_of(b.b) == 1 and b.b.type is I32:
        step = _STRICTER.get((op, b.op))
        if step is not None:
            return Binary(step, a, b.a, loc, BOOL)
    return Binary(op, a, b, loc, BOOL)


_STRICTER = {
    (BinOp.LE, BinOp.SUB): BinOp.LT,
    (BinOp.GT, BinOp.SUB): BinOp.GE,
    (BinOp.LT, BinOp.ADD): BinOp.LE,
    (BinOp.GE, BinOp.ADD): BinOp.GT,
}


_COMPARE = {
    BinOp.LT: lambda x, y: x < y,
    BinOp.LE: lambda x, y: x <= y,
    BinOp.GT: lambda x, y: x > y,
    BinOp.GE: lambda x, y: x >= y,
    BinOp.EQ: lambda x, y: x == y,
    BinOp.NE: lambda x, y: x != y,
}


def and_(a: Expr, b: Expr, loc: Loc) -> Expr:
    for x, y in ((a, b), (b, a)):
        if value_of(x) is True:
            return y
        if value_of(x) is False:
            return const(False, loc)
    return Binary(BinOp.AND, a, b, loc, BOOL)


def or_(a: Expr, b: Expr, loc: Loc) -> Expr:
    for x, y in ((a, b), (b, a)):
        if value_of(x) is False:
            return y
        if value_of(x) is True:
            return const(True, loc)
    return Binary(BinOp.OR, a, b, loc, BOOL)


_NEGATED = {
    BinOp.LT: BinOp.GE,
    BinOp.LE: BinOp.GT,
    BinOp.GT: BinOp.LE,
    BinOp.GE: BinOp.LT,
    BinOp.EQ: BinOp.NE,
    BinOp.NE: BinOp.EQ,
}


def not_(a: Expr, loc: Loc) -> Expr:
    va = value_of(a)
    if va is not None:
        return const(not va, loc)
    if isinstance(a, Unary) and a.op is UnOp.NOT:
        return a.x
    if isinstance(a, Binary) and a.op in _NEGATED and a.a.type is not BOOL:
        return Binary(_NEGATED[a.op], a.a, a.b, a.loc, BOOL)  # (exact for ints and for
        # floats that are not NaN: a check_modifiers'd expression makes none)
    return Unary(UnOp.NOT, a, loc, BOOL)


def call(fn: Fn, args: tuple[Expr, ...], kind: ExprType, loc: Loc) -> Expr:
    return FnCall(fn, args, loc, kind)


def where(c: Expr, a: Expr, b: Expr, loc: Loc) -> Expr:
    if value_of(c) is True:
        return a
    if value_of(c) is False:
        return b
    if a == b:
        return a
    kind = BOOL if a.type is BOOL else _numeric(a, b)
    return Where(c, a, b, loc, kind)
