"""differentiate_score: d score / d s, symbolically, for the backward (issue 41's step 4:
dS is multiplied by it) and for `fadsl explain`.

A pure pass, ``Modifiers -> Modifiers``: ``derivative`` is the expression's derivative by
the score ``s``, folded as it is built (fadsl/passes/modifiers/build.py), so that ALiBi's
``s + slopes[h] * (kv_idx - q_idx)`` gives ``1.0`` and softcap's ``30 * tanh(s / 30)`` gives
``1.0 - tanh(s / 30) * tanh(s / 30)`` (the factor the built-in softcap's backward takes,
docs/numerics.md). Where the score goes through ``floor`` the derivative is 0 almost
everywhere and undefined at the steps: ``not_differentiable`` says so, and a backward of
such a score is to be refused (the forward is fine). A where() differentiates each branch
(its condition picks one); min, max and clamp the argument they pick; abs by its sign.

At kinks and ties the derivative is torch autograd's, so that the backward agrees with a
reference written in torch: abs has 0 at 0 (``sgn``); min and max (``torch.minimum``,
``torch.maximum``) give each argument half at a tie; clamp passes x's at both bounds
(``lo <= x <= hi``, as ``torch.clamp``), a bound's where x is past it; where() the branch its
condition picks.

``derivative(e, wrt)`` differentiates by one read of an input instead (``Wrt``: every read of
that input at an index of the same text), for differentiate_inputs (input_grads.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...ir.expr import Binary, BinOp, FnCall, Const, Expr, ExprType, Fn, Load, Modifiers
from ...ir.expr import Unary, UnOp, Var, VarKind, Where, reads_score, text, walk
from . import build as b

F32 = ExprType.F32


@dataclass(frozen=True)
class Wrt:
    """What a derivative is by: the score ``s`` (``input`` empty), or one read of an input,
    ``input[index]`` (every read of that input at an index of the same text is the same
    variable; reads at other indices are other variables, held constant)."""

    input: str = ""
    index: str = ""  # the indices' text, "h" or "h, kv_idx - q_idx"

    @property
    def what(self) -> str:
        return f"input '{self.input}'" if self.input else "the score"

    def matches(self, e: Expr) -> bool:
        if not self.input:
            return isinstance(e, Var) and e.kind is VarKind.SCORE
        return isinstance(e, Load) and e.input == self.input and index_text(e) == self.index

    def occurs(self, e: Expr) -> bool:
        if not self.input:
            return reads_score(e)
        return any(isinstance(n, Load) and n.input == self.input for n in walk(e))


def index_text(e: Load) -> str:
    return ", ".join(text(x) for x in e.indices)


SCORE = Wrt()


class NotDifferentiable(Exception):
    """The score goes through a function with no useful derivative (the message says which;
    ``loc``: that function's token)."""

    def __init__(self, message: str, loc=None) -> None:
        super().__init__(message)
        self.loc = loc


def differentiate_score(m: Modifiers) -> Modifiers:
    if m.score is None:
        return m
    try:
        return replace(m, derivative=derivative(m.score))
    except NotDifferentiable as err:
        return replace(
            m, derivative=None, not_differentiable=str(err), not_differentiable_loc=err.loc
        )


def derivative(e: Expr, wrt: Wrt = SCORE) -> Expr:
    """d e / d s of a typed expression (a float), or d e / d ``wrt``'s read."""
    return _derivative(e, wrt)


def _derivative(e: Expr, wrt: Wrt) -> Expr:
    loc = e.loc
    if not wrt.occurs(e):
        return b.const(0.0, loc)
    if wrt.matches(e):
        return b.const(1.0, loc)

    def derivative(x: Expr) -> Expr:  # (the recursion, by the same variable)
        return _derivative(x, wrt)

    match e:
        case Unary(op=UnOp.NEG, x=x):
            return b.neg(derivative(x), loc)
        case Binary(op=BinOp.ADD, a=x, b=y):
            return b.add(derivative(x), derivative(y), loc)
        case Binary(op=BinOp.SUB, a=x, b=y):
            return b.sub(derivative(x), derivative(y), loc)
        case Binary(op=BinOp.MUL, a=x, b=y):
            return b.add(b.mul(derivative(x), y, loc), b.mul(x, derivative(y), loc), loc)
        case Binary(op=BinOp.DIV, a=x, b=y) if not wrt.occurs(y):
            return b.div(derivative(x), y, loc)
        case Binary(op=BinOp.DIV, a=x, b=y):
            top = b.sub(b.mul(derivative(x), y, loc), b.mul(x, derivative(y), loc), loc)
            return b.div(top, b.mul(y, y, loc), loc)
        case Where(cond=c, a=x, b=y):
            return b.where(c, derivative(x), derivative(y), loc)
        case FnCall(fn=Fn.ABS, args=(x,)):
            # torch's: sgn(x) x', so 0 at x = 0
            zero = b.const(0, loc)
            negative = b.where(b.compare(BinOp.LT, x, zero, loc), b.neg(derivative(x), loc),
                               b.const(0.0, loc), loc)  # fmt: skip
            return b.where(b.compare(BinOp.GT, x, zero, loc), derivative(x), negative, loc)
        case FnCall(fn=Fn.MIN | Fn.MAX, args=(x, y)):
            # torch.minimum / maximum's: the picked argument's, half of each at a tie
            dx, dy = derivative(x), derivative(y)
            op = BinOp.LT if e.fn is Fn.MIN else BinOp.GT
            tie = b.where(b.compare(BinOp.EQ, x, y, loc),
                          b.mul(b.add(dx, dy, loc), b.const(0.5, loc), loc), dy, loc)  # fmt: skip
            return b.where(b.compare(op, x, y, loc), dx, tie, loc)
        case FnCall(fn=Fn.CLAMP, args=(x, lo, hi)):
            inside = b.and_(b.compare(BinOp.GE, x, lo, loc), b.compare(BinOp.LE, x, hi, loc), loc)
            below = b.compare(BinOp.LT, x, lo, loc)
            outside = b.where(below, derivative(lo), derivative(hi), loc)
            return b.where(inside, derivative(x), outside, loc)
        case FnCall(fn=Fn.EXP, args=(x,)):
            return b.mul(e, derivative(x), loc)
        case FnCall(fn=Fn.LOG, args=(x,)):
            return b.div(derivative(x), x, loc)
        case FnCall(fn=Fn.LOG2, args=(x,)):
            return b.div(derivative(x), b.mul(x, b.const(math.log(2.0), loc), loc), loc)
        case FnCall(fn=Fn.TANH, args=(x,)):
            square = b.sub(b.const(1.0, loc), b.mul(e, e, loc), loc)
            return b.mul(square, derivative(x), loc)
        case FnCall(fn=Fn.FLOOR):
            raise NotDifferentiable(
                f"'{text(e)}' rounds {wrt.what} down: its derivative is 0 almost everywhere "
                "and undefined at each step",
                e.loc,
            )
        case Load(indices=xs) if not any(wrt.occurs(x) for x in xs):
            return b.const(0.0, loc)  # the input at another index: another variable
        case Load():  # a read whose index reads the variable (through floor)
            raise NotDifferentiable(
                f"'{text(e)}' reads {wrt.what} in its index, which has no derivative", e.loc
            )
    raise NotDifferentiable(f"'{text(e)}' has no derivative rule", e.loc)
