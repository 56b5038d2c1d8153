"""A typed modifier expression (fadsl.ir.expr) as a C++ expression for a kernel's template.

Target-neutral: the names a kernel gives the variables and the sizes, and where an input's
pointer is, come from the caller (sm_90a: fadsl/targets/sm90/modifiers.py); the functions
the expression calls are fadsl/modifiers.cuh's (emit/sm90/include/fadsl/, target-neutral),
so that every target computes them alike:

- ints and floats as C++'s int and float, an int converted where a float meets it
  (``static_cast<float>``), ``/`` an IEEE division, ``//`` and ``%`` Python's (rounding
  down, the divisor's sign: ``floordiv``, ``floormod``);
- ``exp``, ``log``, ``log2`` the accurate libdevice functions; ``tanh`` the softcap's
  ``1 - 2 / (2^(2x log2 e) + 1)`` (one ex2, one rcp: an absolute error about 2^-21, where
  tanh.approx.f32's relative 2^-11 would move a score of 30 by 0.015); ``floor`` to an int
  (``__float2int_rd``, saturating);
- an input's element by ``__ldg`` at its row-major offset (the runtime passes contiguous
  tensors of fewer than 2^31 elements, so the offset is an int).

Constants keep the spec's spelling (``30``, ``0.5f``): C++ rounds a decimal float literal
to the same fp32 as the spec means. A constant a pass made is written exactly, in hex.
"""

from __future__ import annotations

import struct
from typing import Callable, Mapping, Sequence

from ..ir.expr import (
    Binary,
    BinOp,
    Blocks,
    FnCall,
    Const,
    Dim,
    Expr,
    ExprType,
    Fn,
    InputDecl,
    Load,
    Unary,
    UnOp,
    Var,
    VarKind,
    Where,
)

I32, F32, BOOL = ExprType.I32, ExprType.F32, ExprType.BOOL
NAMESPACE = "fadsl::modifiers::"

# C++'s binding strength, tightest first (lower binds tighter), as C++ parses it.
_CPP_PRECEDENCE = {
    BinOp.MUL: 5,
    BinOp.DIV: 5,
    BinOp.ADD: 6,
    BinOp.SUB: 6,
    BinOp.LT: 9,
    BinOp.LE: 9,
    BinOp.GT: 9,
    BinOp.GE: 9,
    BinOp.EQ: 10,
    BinOp.NE: 10,
    BinOp.AND: 14,
    BinOp.OR: 15,
}
_CPP_OPS = {BinOp.AND: "&&", BinOp.OR: "||"}
_UNARY, _CALL, _TERNARY = 3, 0, 16
_FLOAT_FNS = {
    Fn.ABS: "fabsf",
    Fn.MIN: "fminf",
    Fn.MAX: "fmaxf",
    Fn.EXP: "expf",
    Fn.LOG: "logf",
    Fn.LOG2: "log2f",
    Fn.TANH: NAMESPACE + "tanh",
}
_INT_FNS = {Fn.ABS: NAMESPACE + "iabs", Fn.MIN: NAMESPACE + "imin", Fn.MAX: NAMESPACE + "imax"}
_CPP_TYPES = {F32: "float", I32: "int"}


class CudaExpr:
    """Renders expressions for one kernel: ``names`` the C++ of each variable it reads,
    ``sizes`` of each size, ``pointer(i)`` the C++ of input i's base pointer; ``replaced``:
    subexpressions the kernel has computed already (a tile's uniform loads), by their C++."""

    def __init__(
        self,
        names: Mapping[VarKind, str],
        sizes: Mapping[Dim, str],
        inputs: Sequence[InputDecl],
        pointer: Callable[[int], str],
        replaced: Mapping[str, str] | None = None,
    ) -> None:
        self.names, self.sizes, self.inputs, self.pointer = names, sizes, inputs, pointer
        self.replaced = dict(replaced or {})

    def render(self, e: Expr, want: ExprType | None = None) -> str:
        """``e`` as C++, converted to ``want`` (a float from an int) where given."""
        code, _ = self._expr(e)
        return self._converted(e, code, want)

    @staticmethod
    def _converted(e: Expr, code: str, want: ExprType | None) -> str:
        if want is F32 and e.type is I32:  # an int constant as the float it is: -1 -> -1.f
            if isinstance(e, Const) or (isinstance(e, Unary) and isinstance(e.x, Const)):
                return code + ".f"
            return f"static_cast<float>({code})"
        return code

    # each returns (code, its C++ precedence)
    def _expr(self, e: Expr) -> tuple[str, int]:
        if self.replaced:
            found = self.replaced.get(
                CudaExpr(self.names, self.sizes, self.inputs, self.pointer).render(e)
            )
            if found is not None:
                return found, _CALL
        match e:
            case Const():
                code = self._const(e)
                return code, _UNARY if code.startswith("-") else _CALL
            case Var(kind=kind):
                if kind.dim is not None:
                    return self.sizes[kind.dim], _CALL
                return self.names[kind], _CALL
            case Load():
                return self._load(e), _CALL
            # (a unary operand of a unary operator in parentheses too: "- -x" is not "--x")
            case Unary(op=UnOp.NOT, x=x):
                return "!" + self._operand(x, _UNARY - 1, None), _UNARY
            case Unary(op=UnOp.NEG, x=x):
                return "-" + self._operand(x, _UNARY - 1, None), _UNARY
            case Binary():
                return self._binary(e)
            case Where(cond=c, a=a, b=b):
                want = e.type
                cond = self._operand(c, _TERNARY - 1, None)
                return (
                    f"{cond} ? {self._operand(a, _TERNARY, want)} : {self._operand(b, _TERNARY, want)}",
                    _TERNARY,
                )
            case FnCall():
                return self._call(e), _CALL
        raise AssertionError(f"not a checked expression: {e!r}")

    def _operand(self, e: Expr, limit: int, want: ExprType | None, right: bool = False) -> str:
        """``e`` as an operand of an operator of strength ``limit``: in parentheses where
        it binds looser (or as loose, on the right: every binary operator here associates
        to the left), converted to ``want``."""
        code, p = self._expr(e)
        if want is F32 and e.type is I32:
            return self._converted(e, code, want)
        return f"({code})" if p > limit or (right and p == limit) else code

    def _binary(self, e: Binary) -> tuple[str, int]:
        op = e.op
        if op is BinOp.FLOORDIV or op is BinOp.MOD:
            fn = "floordiv" if op is BinOp.FLOORDIV else "floormod"
            return f"{NAMESPACE}{fn}({self.render(e.a)}, {self.render(e.b)})", _CALL
        p = _CPP_PRECEDENCE[op]
        if op.is_comparison:  # both sides as the wider of the two
            want = F32 if F32 in (e.a.type, e.b.type) else None
        elif op.is_logical:
            want = None
        else:
            want = F32 if e.type is F32 else None
        left = self._operand(e.a, p, want)
        right = self._operand(e.b, p, want, right=True)
        return f"{left} {_CPP_OPS.get(op, op.value)} {right}", p

    def _call(self, e: FnCall) -> str:
        fn, args = e.fn, e.args
        if fn is Fn.FLOOR:
            (x,) = args
            return self.render(x) if x.type is I32 else f"__float2int_rd({self.render(x)})"
        if fn is Fn.CLAMP:
            x, lo, hi = args
            inner = FnCall(Fn.MAX, (x, lo), e.loc, e.type)
            return self._call(FnCall(Fn.MIN, (inner, hi), e.loc, e.type))
        table = _INT_FNS if e.type is I32 else _FLOAT_FNS
        want = None if e.type is I32 else F32
        return f"{table[fn]}({', '.join(self.render(a, want) for a in args)})"

    def _load(self, e: Load) -> str:
        index = next(i for i, d in enumerate(self.inputs) if d.name == e.input)
        cpp = _CPP_TYPES[self.inputs[index].dtype]
        return f"{NAMESPACE}load<{cpp}>({self.pointer(index)}, {self.offset(e)})"

    def offset(self, e: Load) -> str:
        """The row-major element offset of a read, ``input[i, j, ...]``, as C++."""
        decl = next(d for d in self.inputs if d.name == e.input)
        offset = self.render(e.indices[0])
        for x, dim in zip(e.indices[1:], decl.dims[1:]):
            offset = f"({offset}) * {self.size(dim)} + {self._operand(x, 6, None, right=True)}"
        return offset

    def size(self, dim: Dim | Blocks | int) -> str:
        if isinstance(dim, Blocks):  # (cdiv: a size and a block are positive)
            return f"(({self.sizes[dim.dim]} + {dim.block - 1}) / {dim.block})"
        return self.sizes[dim] if isinstance(dim, Dim) else str(dim)

    def _const(self, c: Const) -> str:
        if c.type is BOOL:
            return "true" if c.value else "false"
        if c.type is I32:
            return str(c.value)
        if c.text:  # the spec's float literal ("0.5", "1e-3", "30."): C++ reads it alike
            return c.text + "f"
        rounded = struct.unpack("<f", struct.pack("<f", float(c.value)))[0]
        return float(rounded).hex() + "f"
