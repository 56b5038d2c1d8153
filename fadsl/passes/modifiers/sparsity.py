"""derive_sparsity: the tile classes of a `keep` predicate, by interval arithmetic over a tile.

A pure pass, ``Modifiers -> Modifiers``: ``rule`` says, for a tile of query rows
``q_lo .. q_hi`` and keys ``kv_lo .. kv_hi`` (one q block against one kv block), when every
score is kept (FULL: no mask), when none is (EMPTY: the block is skipped) and otherwise
PARTIAL (masked by the predicate). The rule's two conditions are expressions over the tile's
bounds and what is uniform over a tile (b, h, the sizes, inputs indexed by those), which the
kernel evaluates per block.

How: a comparison of integer terms that are linear in ``q_idx`` and ``kv_idx``,
``a q_idx + c kv_idx + r  <op>  0`` (r uniform), is a constraint ``lo <= F <= hi`` on the
form ``F = a q_idx + c kv_idx``, whose least and largest values over the tile sit at its
corners: it holds everywhere iff its range over the tile lies inside [lo, hi], nowhere iff
the two do not meet. Exact for one comparison. Over `and`, FULL is exact (every conjunct
everywhere); EMPTY takes the constraints on one form together as an interval (a sliding
window's two edges bound kv_idx - q_idx from both sides: its band misses the tile iff the
interval does), and is exact when what remains are one-sided constraints whose most
satisfied corners coincide (then each one's satisfied set holds that corner). `or` is the
dual (prefix-LM: ``kv_idx <= q_idx or kv_idx < prefix[b]``, whose failing sets both hold
the corner (q_lo, kv_hi)). A comparison of anything else (a float, a product of indices,
an input indexed by q_idx) decides nothing: PARTIAL, and ``exact`` is False. Causal masks,
sliding windows and prefix-LM written as expressions are exact (tests/test_modifiers_sparsity.py
checks every class against the predicate's scores over random tiles). A predicate that
reads an input indexed by q_idx or kv_idx (document ids) is marked ``by_pass`` (and
``per_head`` where it reads h): no rule over a tile's bounds sees through it, so the target
classes its tiles per call by evaluating the predicate (sm_90a: <kernel>_keep_classes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import Loc
from ...ir.expr import (
    Binary,
    BinOp,
    Const,
    Expr,
    ExprType,
    Fn,
    Modifiers,
    TileRule,
    Unary,
    UnOp,
    Var,
    VarKind,
    reads_head,
    reads_per_token,
    text,
    tile_uniform,
)
from . import build as b

I32 = ExprType.I32


def derive_sparsity(m: Modifiers) -> Modifiers:
    if m.keep is None:
        return m
    facts = _facts(m.keep)
    exact = facts.full_exact and facts.empty_exact
    why = (
        "every comparison is linear in q_idx and kv_idx, and the classes are decided at the "
        "tile's corners"
        if exact
        else "a term is not linear in q_idx and kv_idx, or the comparisons do not meet at a "
        "corner: some FULL or EMPTY tiles are classed PARTIAL (masked, still correct)"
    )
    by_pass = reads_per_token(m.keep)
    per_head = by_pass and reads_head(m.keep)
    return replace(m, rule=TileRule(facts.full, facts.empty, exact, why, by_pass, per_head))


# --- linear forms ------------------------------------------------------------


@dataclass(frozen=True)
class Linear:
    """``q q_idx + kv kv_idx + rest``; ``rest`` a uniform i32 expression (None: 0)."""

    q: int
    kv: int
    rest: Expr | None

    def plus(self, other: Linear, sign: int, loc: Loc) -> Linear:
        """self + sign other (sign 1 or -1)."""
        rest = self.rest
        if other.rest is not None and rest is None:
            rest = other.rest if sign > 0 else b.neg(other.rest, loc)
        elif other.rest is not None:
            rest = b.add(rest, other.rest, loc) if sign > 0 else b.sub(rest, other.rest, loc)
        return Linear(self.q + sign * other.q, self.kv + sign * other.kv, rest)

    def times(self, k: int, loc: Loc) -> Linear:
        rest = None if self.rest is None else b.mul(b.const(k, loc), self.rest, loc)
        return Linear(self.q * k, self.kv * k, rest)


def _linear(e: Expr) -> Linear | None:
    """``e`` (an i32) as a linear form of the indices, or None."""
    if e.type is not I32:
        return None
    if tile_uniform(e):
        return Linear(0, 0, e)
    match e:
        case Var(kind=VarKind.Q_IDX):
            return Linear(1, 0, None)
        case Var(kind=VarKind.KV_IDX):
            return Linear(0, 1, None)
        case Unary(op=UnOp.NEG, x=x):
            found = _linear(x)
            return None if found is None else found.times(-1, e.loc)
        case Binary(op=BinOp.ADD | BinOp.SUB, a=x, b=y):
            lx, ly = _linear(x), _linear(y)
            if lx is None or ly is None:
                return None
            return lx.plus(ly, 1 if e.op is BinOp.ADD else -1, e.loc)
        case Binary(op=BinOp.MUL, a=Const(value=k), b=y) | Binary(
            op=BinOp.MUL, a=y, b=Const(value=k)
        ):
            found = _linear(y)
            return None if found is None else found.times(k, e.loc)
    return None


# --- constraints lo <= F <= hi on a form F = q q_idx + kv kv_idx ---------------------


@dataclass(frozen=True)
class Constraint:
    q: int
    kv: int  # (q, kv) != (0, 0); kv > 0, or q > 0 where kv is 0
    lo: Expr | None  # uniform i32 bounds; None: unbounded
    hi: Expr | None

    def extreme(self, largest: bool, loc: Loc) -> Expr:
        """F's largest (or least) value over the tile, at one of its corners."""
        total: Expr = b.const(0, loc)
        for k, lo, hi in (
            (self.q, VarKind.Q_LO, VarKind.Q_HI),
            (self.kv, VarKind.KV_LO, VarKind.KV_HI),
        ):
            if k:
                bound = hi if (k > 0) == largest else lo
                total = b.add(total, b.mul(b.const(k, loc), Var(bound, loc, I32), loc), loc)
        return total

    def everywhere(self, loc: Loc) -> Expr:
        low = (
            b.const(True, loc)
            if self.lo is None
            else b.compare(BinOp.GE, self.extreme(False, loc), self.lo, loc)
        )
        high = (
            b.const(True, loc)
            if self.hi is None
            else b.compare(BinOp.LE, self.extreme(True, loc), self.hi, loc)
        )
        return b.and_(low, high, loc)

    def nowhere(self, loc: Loc) -> Expr:
        below = (
            b.const(False, loc)
            if self.lo is None
            else b.compare(BinOp.LT, self.extreme(True, loc), self.lo, loc)
        )
        above = (
            b.const(False, loc)
            if self.hi is None
            else b.compare(BinOp.GT, self.extreme(False, loc), self.hi, loc)
        )
        found = b.or_(below, above, loc)
        if self.lo is not None and self.hi is not None and self.lo != self.hi:
            # an empty interval holds nowhere: a window whose edges cross (or a causal
            # mask's diagonal past a window's far edge)
            found = b.or_(found, _above(self.lo, self.hi, loc), loc)
        return found

    def satisfied_corner(self) -> tuple[int, int] | None:
        """The corner where a one-sided constraint is most satisfied, as (q side, kv side):
        +1 the high bound, -1 the low one, 0 either; None for a two-sided one."""
        if (self.lo is None) == (self.hi is None):
            return None
        sign = 1 if self.lo is not None else -1  # F large satisfies F >= lo
        return (sign * _sign(self.q), sign * _sign(self.kv))


def _offset(e: Expr) -> tuple[str, int]:
    """``e`` as (the text of its part that is not a constant, the constant it adds)."""
    if isinstance(e, Const) and isinstance(e.value, int):
        return "", e.value
    if isinstance(e, Binary) and e.op in (BinOp.ADD, BinOp.SUB) and isinstance(e.b, Const):
        base, k = _offset(e.a)
        return base, k + (e.b.value if e.op is BinOp.ADD else -e.b.value)
    return text(e), 0


def _above(lo: Expr, hi: Expr, loc: Loc) -> Expr:
    """lo > hi, decided here where the two differ by a constant (a window's edges)."""
    (base_lo, k_lo), (base_hi, k_hi) = _offset(lo), _offset(hi)
    if base_lo == base_hi:
        return b.const(k_lo > k_hi, loc)
    return b.compare(BinOp.GT, lo, hi, loc)


def _sign(k: int) -> int:
    return (k > 0) - (k < 0)


def _constraint(e: Expr) -> Constraint | None:
    """A comparison of linear forms (not '!='), as a constraint; None otherwise."""
    if not (isinstance(e, Binary) and e.op.is_comparison and e.op is not BinOp.NE):
        return None
    lx, ly = _linear(e.a), _linear(e.b)
    if lx is None or ly is None:
        return None
    diff = lx.plus(ly, -1, e.loc)  # a - b = F + rest  <op>  0
    if diff.q == diff.kv == 0:
        return None  # uniform: decided per tile as it stands
    loc = e.loc
    rest = b.const(0, loc) if diff.rest is None else diff.rest
    bound = b.neg(rest, loc)  # F <op> -rest
    lo = hi = None
    match e.op:
        case BinOp.LE:
            hi = bound
        case BinOp.LT:
            hi = b.sub(bound, b.const(1, loc), loc)
        case BinOp.GE:
            lo = bound
        case BinOp.GT:
            lo = b.add(bound, b.const(1, loc), loc)
        case BinOp.EQ:
            lo = hi = bound
    if diff.kv < 0 or (diff.kv == 0 and diff.q < 0):  # kv_idx's factor positive, as people write
        lo, hi = (None if hi is None else b.neg(hi, loc)), (None if lo is None else b.neg(lo, loc))
        return Constraint(-diff.q, -diff.kv, lo, hi)
    return Constraint(diff.q, diff.kv, lo, hi)


# --- facts about a predicate over a tile ---------------------------------------------


@dataclass(frozen=True)
class Facts:
    full: Expr  # holds: every score of the tile is kept
    empty: Expr  # holds: none is
    full_exact: bool  # full holds whenever every score is kept
    empty_exact: bool


def _facts(p: Expr) -> Facts:
    loc = p.loc
    if tile_uniform(p):
        return Facts(p, b.not_(p, loc), True, True)
    match p:
        case Unary(op=UnOp.NOT, x=x):
            inner = _facts(x)
            return Facts(inner.empty, inner.full, inner.empty_exact, inner.full_exact)
        case Binary(op=BinOp.AND):
            parts = _flatten(p, BinOp.AND)
            each = [_facts(x) for x in parts]
            full = each[0].full
            for f in each[1:]:
                full = b.and_(full, f.full, loc)
            empty, empty_exact = _nowhere_all(parts, loc)
            return Facts(full, empty, all(f.full_exact for f in each), empty_exact)
        case Binary(op=BinOp.OR):
            parts = _flatten(p, BinOp.OR)
            each = [_facts(x) for x in parts]
            empty = each[0].empty
            for f in each[1:]:
                empty = b.and_(empty, f.empty, loc)
            # kept everywhere iff no score fails every disjunct: "nowhere" of their negations
            negations = [b.not_(x, loc) for x in parts]
            full, full_exact = _nowhere_all(negations, loc)
            return Facts(full, empty, full_exact, all(f.empty_exact for f in each))
    found = _constraint(p)
    if found is not None:
        return Facts(found.everywhere(loc), found.nowhere(loc), True, True)
    if isinstance(p, Binary) and p.op is BinOp.NE:
        return _facts(Unary(UnOp.NOT, Binary(BinOp.EQ, p.a, p.b, loc, p.type), loc, p.type))
    # not linear in the indices: decided by the scores alone
    return Facts(b.const(False, loc), b.const(False, loc), False, False)


def _flatten(p: Expr, op: BinOp) -> list[Expr]:
    if isinstance(p, Binary) and p.op is op:
        return _flatten(p.a, op) + _flatten(p.b, op)
    return [p]


def _nowhere_all(parts: list[Expr], loc: Loc) -> tuple[Expr, bool]:
    """When the conjunction of ``parts`` holds at no score of the tile, and whether that is
    exact: the constraints on one form intersected, the rest each on its own."""
    groups: dict[tuple[int, int], list[Constraint]] = {}
    others: list[Expr] = []
    for x in parts:
        c = _constraint(x)
        if c is None:
            others.append(x)
        else:
            groups.setdefault((c.q, c.kv), []).append(c)
    merged = [_intersect(cs, loc) for cs in groups.values()]
    empty: Expr = b.const(False, loc)
    exact = True
    corners: list[tuple[int, int] | None] = []
    for c in merged:
        empty = b.or_(empty, c.nowhere(loc), loc)
        corners.append(c.satisfied_corner())
    for x in others:
        f = _facts(x)
        empty = b.or_(empty, f.empty, loc)
        exact = exact and f.empty_exact
        if not tile_uniform(x):
            corners.append(None)  # (a nested formula: no single corner)
    if len(corners) > 1:
        exact = exact and _one_corner(corners)
    return empty, exact


def _intersect(cs: list[Constraint], loc: Loc) -> Constraint:
    lo = hi = None
    for c in cs:
        if c.lo is not None:
            lo = c.lo if lo is None else b.call(Fn.MAX, (lo, c.lo), I32, loc)
        if c.hi is not None:
            hi = c.hi if hi is None else b.call(Fn.MIN, (hi, c.hi), I32, loc)
    return Constraint(cs[0].q, cs[0].kv, lo, hi)


def _one_corner(corners: list[tuple[int, int] | None]) -> bool:
    """Whether one corner of the tile is the most satisfied of every constraint."""
    if any(c is None for c in corners):
        return False
    for axis in (0, 1):
        sides = {c[axis] for c in corners} - {0}
        if len(sides) > 1:
            return False
    return True
