"""A Python evaluator of checked modifier expressions (fadsl.ir.expr), for the CPU tests of
the passes: a tile rule against the predicate's own scores, a derivative against finite
differences. Ints are Python ints (Python's // and %, as the kernel's floordiv/floormod),
floats Python floats; ``inputs`` maps an input's name to a function of its indices."""

from __future__ import annotations

import math

from fadsl.ir.expr import Binary, BinOp, FnCall, Const, Fn, Load, Unary, UnOp, Var, Where

_BINARY = {
    BinOp.ADD: lambda a, b: a + b,
    BinOp.SUB: lambda a, b: a - b,
    BinOp.MUL: lambda a, b: a * b,
    BinOp.DIV: lambda a, b: a / b,
    BinOp.FLOORDIV: lambda a, b: a // b,
    BinOp.MOD: lambda a, b: a % b,
    BinOp.LT: lambda a, b: a < b,
    BinOp.LE: lambda a, b: a <= b,
    BinOp.GT: lambda a, b: a > b,
    BinOp.GE: lambda a, b: a >= b,
    BinOp.EQ: lambda a, b: a == b,
    BinOp.NE: lambda a, b: a != b,
}
_CALLS = {
    Fn.ABS: abs,
    Fn.MIN: min,
    Fn.MAX: max,
    Fn.CLAMP: lambda x, lo, hi: min(max(x, lo), hi),
    Fn.EXP: math.exp,
    Fn.LOG: math.log,
    Fn.LOG2: math.log2,
    Fn.TANH: math.tanh,
    Fn.FLOOR: math.floor,
}


def evaluate(e, env: dict, inputs: dict | None = None):
    """``e``'s value where the variables have ``env``'s values (keyed by their spelling:
    "s", "q_idx", "q_lo", "seqlen_k", ...)."""
    inputs = inputs or {}
    match e:
        case Const(value=v):
            return v
        case Var(kind=k):
            return env[k.value]
        case Load(input=name, indices=xs):
            return inputs[name](*(evaluate(x, env, inputs) for x in xs))
        case Unary(op=UnOp.NEG, x=x):
            return -evaluate(x, env, inputs)
        case Unary(op=UnOp.NOT, x=x):
            return not evaluate(x, env, inputs)
        case Binary(op=BinOp.AND, a=a, b=b):
            return evaluate(a, env, inputs) and evaluate(b, env, inputs)
        case Binary(op=BinOp.OR, a=a, b=b):
            return evaluate(a, env, inputs) or evaluate(b, env, inputs)
        case Binary(op=op, a=a, b=b):
            return _BINARY[op](evaluate(a, env, inputs), evaluate(b, env, inputs))
        case Where(cond=c, a=a, b=b):
            return evaluate(a if evaluate(c, env, inputs) else b, env, inputs)
        case FnCall(fn=fn, args=xs):
            return _CALLS[fn](*(evaluate(x, env, inputs) for x in xs))
    raise AssertionError(f"not a checked expression: {e!r}")
