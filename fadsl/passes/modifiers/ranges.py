"""Interval arithmetic over a modifier's values, with bounds affine in the call's sizes.

check_modifiers asks two kinds of question of an expression, and both are about ranges:
does an index stay inside its input (``kv_idx`` in ``[0, seqlen_k)``: its bounds are the
size itself), and can a function produce inf or NaN from finite inputs (``exp`` of more than
88, ``log`` of 0 or less, a division by a divisor that may be 0). A bound is therefore an
affine form ``c + sum(k_d d)`` over the sizes d (batch, heads, heads_kv, seqlen_q,
seqlen_k), or None where nothing is known. A comparison of two bounds is decided only where
it holds for every size of 1 or more; otherwise it is not proven, and the caller refuses.
Scores (``s``) and the elements of inputs are finite but unbounded. Where a number is needed
(a product of two sizes' indices, whether a value fits an i32), a form is evaluated at the
sizes a call may have, 1 up to fadsl/ir/expr.py's ``DIM_MAX`` (``extremes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...ir.expr import DIM_MAX, Blocks, Dim


@dataclass(frozen=True)
class Affine:
    """``const + sum(k d for d, k in terms)``, every size d at least 1 (a size of the call,
    or its blocks: cdiv(size, block), an unknown of its own)."""

    const: float
    terms: tuple[tuple[Dim | Blocks, int], ...] = ()

    @staticmethod
    def size(dim: Dim | Blocks, offset: float = 0) -> Affine:
        return Affine(offset, ((dim, 1),))

    @property
    def is_const(self) -> bool:
        return not self.terms

    def __add__(self, other: Affine) -> Affine:
        terms = dict(self.terms)
        for d, k in other.terms:
            terms[d] = terms.get(d, 0) + k
        kept = tuple(sorted(((d, k) for d, k in terms.items() if k), key=lambda t: t[0].value))
        return Affine(self.const + other.const, kept)

    def scaled(self, k: float) -> Affine | None:
        """``k`` times the form; None where a size would get a fractional factor."""
        if self.terms and k != int(k):
            return None
        return Affine(self.const * k, tuple((d, int(c * k)) for d, c in self.terms if c * k))

    def span(self, tops: dict = DIM_MAX) -> tuple[float, float]:
        """Its least and largest values over every size from 1 to its top (``DIM_MAX``: every
        size a call may have)."""
        lo = hi = self.const
        for d, k in self.terms:
            top = d.of(tops[d.dim]) if isinstance(d, Blocks) else tops[d]
            lo, hi = lo + min(k, k * top), hi + max(k, k * top)
        return lo, hi

    def least(self) -> float:
        """Its least value over all sizes, or -inf where a size has a negative factor."""
        if any(k < 0 for _, k in self.terms):
            return -math.inf
        return self.const + sum(k for _, k in self.terms)

    def text(self) -> str:
        """The form in the spec's syntax: "seqlen_k + 99", "-seqlen_q + 1", "3"."""
        out = ""
        for d, k in self.terms:
            term = d.value if abs(k) == 1 else f"{abs(k)} * {d.value}"
            out += ("-" if k < 0 else "") + term if not out else (" - " if k < 0 else " + ") + term
        c = self.const
        if c or not out:
            shown = str(int(abs(c))) if c == int(c) and abs(c) < 2**53 else repr(abs(c))
            out += (
                ("-" if c < 0 else "") + shown if not out else (" - " if c < 0 else " + ") + shown
            )
        return out


def at_most(a: Affine | None, b: Affine | None) -> bool:
    """Proven: a <= b for every size (None: unknown, never proven)."""
    if a is None or b is None:
        return False
    return (b + a.scaled(-1)).least() >= 0


def below(a: Affine | None, b: Affine | None) -> bool:
    """Proven: a < b for every size."""
    if a is None or b is None:
        return False
    return (b + a.scaled(-1)).least() > 0


@dataclass(frozen=True)
class Interval:
    """Every value an expression can take lies in [lo, hi]; None: unbounded on that side."""

    lo: Affine | None
    hi: Affine | None

    def text(self) -> str:
        lo = "-inf" if self.lo is None else self.lo.text()
        hi = "inf" if self.hi is None else self.hi.text()
        return f"[{lo}, {hi}]"

    @property
    def numeric(self) -> bool:
        """Both bounds are plain numbers (no size in them)."""
        return self.lo is not None and self.hi is not None and self.lo.is_const and self.hi.is_const

    def excludes_zero(self) -> bool:
        zero = Affine(0)
        return below(zero, self.lo) or below(self.hi, zero)


UNBOUNDED = Interval(None, None)


def point(value: float) -> Interval:
    return Interval(Affine(value), Affine(value))


def index_range(dim: Dim) -> Interval:
    """An index over ``dim``: 0 .. dim - 1."""
    return Interval(Affine(0), Affine.size(dim, -1))


def _add(a: Affine | None, b: Affine | None) -> Affine | None:
    return None if a is None or b is None else a + b


def add(x: Interval, y: Interval) -> Interval:
    return Interval(_add(x.lo, y.lo), _add(x.hi, y.hi))


def neg(x: Interval) -> Interval:
    return Interval(
        None if x.hi is None else x.hi.scaled(-1), None if x.lo is None else x.lo.scaled(-1)
    )


def sub(x: Interval, y: Interval) -> Interval:
    return add(x, neg(y))


def _scale(x: Interval, k: float) -> Interval:
    lo = None if x.lo is None else x.lo.scaled(k)
    hi = None if x.hi is None else x.hi.scaled(k)
    return Interval(lo, hi) if k >= 0 else Interval(hi, lo)


def _scalable(x: Interval, k: float) -> bool:
    """``k`` times each known bound of ``x`` is an affine form (a size keeps a whole factor):
    else the product is boxed (q_idx * 1.5 reaches 1.5 x 2^30; unbounded here, it passed the
    i32 check under a floor, 2026-12-06)."""
    return all(b is None or b.scaled(k) is not None for b in (x.lo, x.hi))


def _products(x: Interval, y: Interval, op) -> Interval:
    """Numeric bounds: the extremes of ``op`` over the corners (inf where unbounded)."""
    xs = (-math.inf if x.lo is None else x.lo.const, math.inf if x.hi is None else x.hi.const)
    ys = (-math.inf if y.lo is None else y.lo.const, math.inf if y.hi is None else y.hi.const)
    values = []
    for a in xs:
        for b in ys:
            v = op(a, b)
            values.append(0.0 if math.isnan(v) else v)  # 0 x inf: the corner adds nothing
    lo, hi = min(values), max(values)
    return Interval(None if lo == -math.inf else Affine(lo), None if hi == math.inf else Affine(hi))


def _numeric_or_unbounded(x: Interval) -> bool:
    return all(b is None or b.is_const for b in (x.lo, x.hi))


def extremes(x: Interval, tops: dict = DIM_MAX) -> tuple[float, float]:
    """The least and largest values ``x`` takes with every size from 1 to its top (-inf /
    inf: unbounded there)."""
    lo = -math.inf if x.lo is None else x.lo.span(tops)[0]
    hi = math.inf if x.hi is None else x.hi.span(tops)[1]
    return lo, hi


def boxed(x: Interval, tops: dict = DIM_MAX) -> Interval:
    """``x`` with numbers for bounds: its extremes up to ``tops`` (unbounded ends stay)."""
    lo, hi = extremes(x, tops)
    return Interval(None if lo == -math.inf else Affine(lo), None if hi == math.inf else Affine(hi))


def mul(x: Interval, y: Interval, tops: dict = DIM_MAX) -> Interval:
    for a, b in ((x, y), (y, x)):
        if a.numeric and a.lo == a.hi and _scalable(b, a.lo.const):
            return _scale(b, a.lo.const)
    # a product of two sizes' values is no affine form: its corners up to the sizes' tops
    return _products(boxed(x, tops), boxed(y, tops), lambda a, b: a * b)


def square(x: Interval, tops: dict = DIM_MAX) -> Interval:
    """x * x of one value: never negative."""
    found = boxed(absolute(x, tops), tops)
    if found.numeric:
        return Interval(Affine(found.lo.const**2), Affine(found.hi.const**2))
    return Interval(Affine(0), None)


def div(x: Interval, y: Interval, tops: dict = DIM_MAX) -> Interval:
    """x / y where y excludes 0 (the caller checks, so y's extremes keep its sign)."""
    if y.numeric and y.lo == y.hi and not _numeric_or_unbounded(x) and _scalable(x, 1 / y.lo.const):
        return _scale(x, 1 / y.lo.const)  # (a number's quotient by a/b: 237 * (1 / 237) < 1)
    return _quotients(x, y, tops, lambda a, b: a / b)


def _quotients(x: Interval, y: Interval, tops: dict, op) -> Interval:
    """``op`` (a quotient) over the corners of x's and y's bounds, sizes' affine bounds boxed
    to their extremes up to the tops; unbounded where y is (anything near 0 divides)."""
    x = x if _numeric_or_unbounded(x) else boxed(x, tops)
    y = y if y.numeric else boxed(y, tops)
    return _products(x, y, op) if y.numeric else UNBOUNDED


def floordiv(x: Interval, y: Interval, tops: dict = DIM_MAX) -> Interval:
    if y.numeric and y.lo.const == y.hi.const and y.lo.const == int(y.lo.const) > 0:
        found = _index_blocks(x, int(y.lo.const))
        if found is not None:
            return found
    # a size's affine bounds: their extremes up to the tops (q_idx // -1 reaches -(2^30 - 2);
    # unbounded here, `abs(q_idx // -1) * q_idx` passed the i32 check, found by
    # tests/test_modifiers_index_proofs.py's hypothesis search, 2026-12-06)
    # exact on integers (a float quotient's floor may be off by one past 2^53)
    return _quotients(x, y, tops, lambda a, b: a // b if math.isfinite(a) else a / b)


def _index_blocks(x: Interval, block: int) -> Interval | None:
    """``x // block`` for an index ``x`` in [c, size - 1] (c >= 0, a constant): in [c // block,
    cdiv(size, block) - 1], since floor((size - 1) / block) = cdiv(size, block) - 1 for every
    size of 1 or more (the block that holds a size's last index is its last); None for any
    other x."""
    lo, hi = x.lo, x.hi
    if lo is None or hi is None or not lo.is_const or lo.const < 0 or lo.const != int(lo.const):
        return None
    if hi.const != -1 or len(hi.terms) != 1 or hi.terms[0][1] != 1:
        return None
    size = hi.terms[0][0]
    if not isinstance(size, Dim):
        return None
    return Interval(Affine(lo.const // block), Affine.size(Blocks(size, block), -1))


def mod(x: Interval, y: Interval, tops: dict = DIM_MAX) -> Interval:
    """Python's %: the sign of the divisor, below it in magnitude."""
    y = y if y.numeric else boxed(y, tops)
    if y.numeric and y.lo.const > 0:
        return Interval(Affine(0), Affine(y.hi.const - 1))
    if y.numeric and y.hi.const < 0:
        return Interval(Affine(y.lo.const + 1), Affine(0))
    return UNBOUNDED


def lowest(a: Affine | None, b: Affine | None) -> Affine | None:
    """The smaller of two bounds where one is proven smaller for every size, else None
    (the lower bound of min(u, v) from u's and v's, or the tighter of two upper bounds)."""
    if at_most(a, b):
        return a
    if at_most(b, a):
        return b
    return None


def highest(a: Affine | None, b: Affine | None) -> Affine | None:
    """The larger of two bounds where one is proven larger, else None."""
    if at_most(a, b):
        return b
    if at_most(b, a):
        return a
    return None


def either(a: Affine | None, b: Affine | None) -> Affine | None:
    """One of two bounds, both valid: a number where one is, else the first known."""
    for bound in (a, b):
        if bound is not None and bound.is_const:
            return bound
    return a if a is not None else b


def _outer(a: Affine | None, b: Affine | None, tops: dict, upper: bool) -> Affine | None:
    """The looser of two bounds (the larger of two upper ones, the smaller of two lower
    ones): the one proven so, else their extreme value up to ``tops`` (None where either
    is unbounded)."""
    found = highest(a, b) if upper else lowest(a, b)
    if found is not None or a is None or b is None:
        return found
    pick, side = (max, 1) if upper else (min, 0)
    return Affine(pick(a.span(tops)[side], b.span(tops)[side]))


def minimum(x: Interval, y: Interval, tops: dict = DIM_MAX) -> Interval:
    # min(u, v) is at most u and at most v: the tighter upper bound where one is proven
    # tighter, else either known one (a number first, then v's: clamp(x, lo, hi)'s hi, which
    # a spec writes to fit the dimension it indexes)
    return Interval(_outer(x.lo, y.lo, tops, False), lowest(x.hi, y.hi) or either(y.hi, x.hi))


def maximum(x: Interval, y: Interval, tops: dict = DIM_MAX) -> Interval:
    return Interval(highest(x.lo, y.lo) or either(y.lo, x.lo), _outer(x.hi, y.hi, tops, True))


def union(x: Interval, y: Interval, tops: dict = DIM_MAX) -> Interval:
    return Interval(_outer(x.lo, y.lo, tops, False), _outer(x.hi, y.hi, tops, True))


def absolute(x: Interval, tops: dict = DIM_MAX) -> Interval:
    zero = Affine(0)
    if at_most(zero, x.lo):
        return x
    if at_most(x.hi, zero):
        return neg(x)
    found = boxed(x, tops)  # of unknown sign: its largest magnitude up to the tops
    if found.numeric:
        return Interval(zero, Affine(max(-found.lo.const, found.hi.const)))
    return Interval(zero, None)


def monotone(x: Interval, f, tops: dict = DIM_MAX) -> Interval:
    """An increasing function (exp, log, floor, tanh) of ``x``'s extremes up to the tops;
    unbounded ends, and values past a float's range (exp of 1000), stay unbounded (the
    caller knows the function's own range and refuses what overflows)."""

    def bound(v: float) -> Affine | None:
        try:
            found = f(v)
        except OverflowError:
            return None
        return Affine(found) if math.isfinite(found) else None

    lo, hi = extremes(x, tops)
    return Interval(None if lo == -math.inf else bound(lo), None if hi == math.inf else bound(hi))
