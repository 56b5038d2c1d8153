"""check_modifiers: a spec's `score` and `keep` expressions resolved, typed and proven safe.

A pure pass, ``Modifiers -> Modifiers``: the names the parser left unresolved become
variables, sizes and input loads, the function calls their ``Fn``, and every node gets its
type (i32, f32 or bool), bottom-up, as Python would give it (an int and a float make a
float, ``/`` always a float, ``//`` and ``%`` take ints). Every problem is reported at its
token, all at once, as a SpecError:

- a name that is not ``s``, ``b``, ``h``, ``q_idx``, ``kv_idx``, a size (``batch``,
  ``heads``, ``heads_kv``, ``seqlen_q``, ``seqlen_k``) or a declared input; a function that
  does not exist or has the wrong number of arguments;
- ``s`` in `keep` (a mask of the scores' own values has no tile classes), or in an index
  (the address of a load would depend on the scores: data-dependent control);
- an index that is not an i32, a wrong number of indices, or an index that may fall outside
  its dimension (fadsl/passes/modifiers/ranges.py proves it from the declared ranges:
  ``q_idx`` in [0, seqlen_q), ...), so that no load of the kernel reads past an input;
- a function that can make inf or NaN of finite values, unless its argument is clamped:
  ``exp`` of more than 88 (fp32's largest exponent), ``log`` and ``log2`` of 0 or less, a
  division (``/``, ``//``, ``%``) by a divisor that may be 0 (docs/numerics.md says why:
  the softmax's rescale modes need every score finite or -inf);
- integer arithmetic (``+``, ``-``, ``*``) that may leave the i32 range, or float arithmetic
  (and ``/``) that may pass fp32's largest number, in some call the runtime accepts
  (sequence lengths below 2^30, batch and heads at most 65,535: fadsl/ir/expr.py's DIM_MAX;
  C++'s int arithmetic would wrap silently), at every length or past a bound that the call
  enforces (``longest``). Values read from inputs are unbounded and pass: their scale is the
  caller's, as in torch;
- a `score` that is not a number, a `keep` that is not a truth value, an operator given
  the wrong types, a constant outside i32 or fp32, an input no expression reads.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ...errors import Diagnostic, Loc, SpecError, suggest
from ...ir.expr import (
    DIM_MAX,
    SPEC_VARS,
    WHERE,
    Apply,
    Binary,
    BinOp,
    Blocks,
    FnCall,
    Const,
    Dim,
    Expr,
    ExprType,
    Fn,
    Load,
    Modifiers,
    Name,
    UnOp,
    Unary,
    Var,
    VarKind,
    Where,
    reads_score,
    text,
    walk,
)
from . import ranges as rg

I32, F32, BOOL = ExprType.I32, ExprType.F32, ExprType.BOOL
INT_MAX = 2**31 - 1
# an index over each size, for the hint of an index into its blocks
_INDEX_OF = {
    Dim.BATCH: "b",
    Dim.HEADS: "h",
    Dim.HEADS_KV: "h",
    Dim.SEQLEN_Q: "q_idx",
    Dim.SEQLEN_K: "kv_idx",
}
FLOAT_MAX = 3.4028234663852886e38
EXP_LIMIT = 88.0  # exp(88) ~ 1.65e38 < fp32's largest 3.4e38; exp(89) overflows
_VAR_RANGES = {
    VarKind.BATCH: rg.index_range(Dim.BATCH),
    VarKind.HEAD: rg.index_range(Dim.HEADS),
    VarKind.Q_IDX: rg.index_range(Dim.SEQLEN_Q),
    VarKind.KV_IDX: rg.index_range(Dim.SEQLEN_K),
}
_ARITHMETIC = {BinOp.ADD, BinOp.SUB, BinOp.MUL}


def check_modifiers(m: Modifiers) -> Modifiers:
    """The modifiers resolved and typed, or a SpecError with every problem. Arithmetic that
    stays in range only for shorter sequences than the runtime's limit is admitted with
    ``longest``: the longest sequence length at which every value fits, which the runtime
    enforces (fadsl/runtime/arguments.py, check_longest)."""
    checked = _Checker(m, DIM_MAX).run()
    if not checked.diagnostics:
        return checked.result()
    if len(checked.overflows) < len(checked.diagnostics):  # other problems too: all of them
        raise SpecError(checked.diagnostics)
    shortest = _Checker(m, _tops(1)).run()
    if shortest.diagnostics:  # out of range at every length
        raise SpecError(shortest.diagnostics)
    # bisection: a value's range only grows with the sequence lengths
    passing, failing = shortest, checked
    lo, hi = 1, DIM_MAX[Dim.SEQLEN_Q]  # lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = _Checker(m, _tops(mid)).run()
        if found.diagnostics:
            hi, failing = mid, found
        else:
            lo, passing = mid, found
    if not failing.overflows:  # (a range that shrank with the sizes: not expected)
        raise SpecError(failing.diagnostics)
    what, loc = failing.overflows[0]
    return replace(passing.result(), longest=lo, longest_why=f"'{what}' (line {loc.line})")


def _tops(seqlen: int) -> dict:
    """The largest sizes with sequences of at most ``seqlen``."""
    return {**DIM_MAX, Dim.SEQLEN_Q: seqlen, Dim.SEQLEN_K: seqlen}


class _Checker:
    def __init__(self, m: Modifiers, tops: dict) -> None:
        self.m = m
        self.tops = tops  # the largest sizes the ranges are taken over
        self.diagnostics: list[Diagnostic] = []
        self.overflows: list[tuple[str, Loc]] = []  # the values found out of range
        self.overflowed: set[int] = set()  # their nodes (id), whose enclosing ones keep quiet
        self.line = ""
        self.score = self.keep = None

    def run(self) -> _Checker:
        m = self.m
        if m.score is not None:
            self.score = self.top(m.score, "score")
        if m.keep is not None:
            self.keep = self.top(m.keep, "keep")
        self.unused_inputs([e for e in (m.score, m.keep) if e is not None])
        return self

    def result(self) -> Modifiers:
        return replace(self.m, score=self.score, keep=self.keep)

    def error(self, loc: Loc, message: str) -> None:
        self.diagnostics.append(Diagnostic(loc, message))

    def top(self, e: Expr, line: str) -> Expr:
        self.line = line
        typed, _ = self.expr(e)
        if typed.type is None:
            return typed
        if line == "score" and typed.type is BOOL:
            self.error(e.loc, f"'score' must be a number, but '{text(e)}' is a truth value")
        if line == "keep" and typed.type is not BOOL:
            self.error(
                e.loc,
                f"'keep' must be a truth value (a comparison, 'and', 'or', 'not'), but "
                f"'{text(e)}' is a number ({typed.type.value})",
            )
        return typed

    def unused_inputs(self, exprs: list[Expr]) -> None:
        read = {n.input for e in exprs for n in walk(e) if isinstance(n, Load)}
        # (an input named without its brackets is reported as such, not as unread)
        read |= {n.text if isinstance(n, Name) else n.name for e in exprs for n in walk(e)
                 if isinstance(n, (Name, Apply))}  # fmt: skip
        for decl in self.m.inputs:
            if decl.name not in read:
                self.error(
                    decl.loc,
                    f"input '{decl.name}' is declared but neither 'score' nor 'keep' reads it "
                    "(every input is an argument the call must pass)",
                )

    # --- one node: (the typed node, the range of its values) -------------------------
    def expr(self, e: Expr) -> tuple[Expr, rg.Interval]:
        match e:
            case Const():
                return self.const(e)
            case Name():
                return self.name(e)
            case Load():
                return self.load(e)
            case Apply():
                return self.apply(e)
            case Unary():
                return self.unary(e)
            case Binary():
                return self.binary(e)
            case _:
                raise AssertionError(f"the parser does not make {type(e).__name__}")

    def const(self, e: Const) -> tuple[Expr, rg.Interval]:
        if isinstance(e.value, float):
            if not math.isfinite(e.value) or abs(e.value) > FLOAT_MAX:
                self.error(e.loc, f"{e.text} is too large for an f32 (at most about 3.4e38)")
                return e, rg.UNBOUNDED
            return replace(e, type=F32), rg.point(e.value)
        if e.value > INT_MAX:
            self.error(
                e.loc,
                f"{e.text} is too large for an i32 (at most {INT_MAX}); write a float, "
                f"{e.text}.0, for a large value",
            )
            return e, rg.UNBOUNDED
        return replace(e, type=I32), rg.point(e.value)

    def name(self, e: Name) -> tuple[Expr, rg.Interval]:
        kind = SPEC_VARS.get(e.text)
        if kind is VarKind.SCORE:
            if self.line == "keep":
                self.error(
                    e.loc,
                    "'keep' cannot read the score 's': a mask decided by the scores' values is "
                    "data-dependent sparsity, which has no tile classes; 'keep' reads b, h, "
                    "q_idx, kv_idx, the sizes and the inputs",
                )
                return e, rg.UNBOUNDED
            return Var(kind, e.loc, F32), rg.UNBOUNDED
        if kind is not None:
            dim = kind.dim
            found = rg.Interval(rg.Affine.size(dim), rg.Affine.size(dim)) if dim else None
            return Var(kind, e.loc, I32), found or _VAR_RANGES[kind]
        decl = self.m.input(e.text)
        if decl is not None:
            dims = ", ".join(["..."] * len(decl.dims))
            self.error(
                e.loc,
                f"input '{e.text}' is a tensor: read one element, {e.text}[{dims}] "
                f"({len(decl.dims)} {'index' if len(decl.dims) == 1 else 'indices'})",
            )
            return e, rg.UNBOUNDED
        if e.text in {f.value for f in Fn} or e.text == WHERE:
            self.error(e.loc, f"'{e.text}' is a function: call it, {e.text}(...)")
            return e, rg.UNBOUNDED
        known = [*SPEC_VARS, *(i.name for i in self.m.inputs)]
        known = [k for k in known if k != "s" or self.line == "score"]
        self.error(
            e.loc,
            f"unknown name '{e.text}'{suggest(e.text, known)}; an expression reads "
            + ("s, " if self.line == "score" else "")
            + "b, h, q_idx, kv_idx, the sizes (batch, heads, heads_kv, seqlen_q, seqlen_k) and "
            "the declared inputs",
        )
        return e, rg.UNBOUNDED

    def load(self, e: Load) -> tuple[Expr, rg.Interval]:
        decl = self.m.input(e.input)
        typed = [self.expr(x) for x in e.indices]
        indices = tuple(x for x, _ in typed)
        if decl is None:
            what = (
                f"'{e.input}' is not an input: only inputs take indices"
                if e.input in SPEC_VARS
                else f"unknown input '{e.input}'"
                + suggest(e.input, [i.name for i in self.m.inputs])
                + "; declare it: input NAME : f32[DIMS]"
            )
            self.error(e.loc, what)
            return replace(e, indices=indices), rg.UNBOUNDED
        if len(e.indices) != len(decl.dims):
            self.error(
                e.loc,
                f"input '{decl.name}' has {len(decl.dims)} "
                f"{'dimension' if len(decl.dims) == 1 else 'dimensions'} ({decl.text()}), "
                f"but is read with {len(e.indices)} {'index' if len(e.indices) == 1 else 'indices'}",
            )
            return replace(e, indices=indices), rg.UNBOUNDED
        for axis, ((x, found), dim) in enumerate(zip(typed, decl.dims)):
            self.index(decl.name, axis, e.indices[axis], x, found, dim)
        return Load(e.input, indices, e.loc, decl.dtype), rg.UNBOUNDED

    def index(self, name: str, axis: int, raw: Expr, x: Expr, found, dim) -> None:
        if x.type is None:
            return
        where = f"index {axis + 1} of '{name}'"
        if reads_score(x):
            self.error(
                raw.loc,
                f"{where} reads the score 's': the address of a load would depend on the "
                "scores (data-dependent control), which the kernel does not do",
            )
        elif x.type is not I32:
            kind = "a float" if x.type is F32 else "a truth value"
            self.error(
                raw.loc,
                f"{where} is {kind} ('{text(raw)}'); an index is an i32: floor(...) rounds "
                "a float down",
            )
        else:
            size = rg.Affine(dim) if isinstance(dim, int) else rg.Affine.size(dim)
            if not (rg.at_most(rg.Affine(0), found.lo) and rg.below(found.hi, size)):
                bound = str(dim) if isinstance(dim, int) else dim.value
                last = rg.Affine(-1) + size
                fix = f"clamp it, clamp({text(raw)}, 0, {last.text()})"
                if isinstance(dim, Blocks):  # (cdiv has no spelling in an expression)
                    fix = (
                        f"index it by an index over {dim.dim.value} floor-divided by "
                        f"{dim.block}, e.g. {_INDEX_OF[dim.dim]} // {dim.block}"
                    )
                self.error(
                    raw.loc,
                    f"{where} may fall outside [0, {bound}): '{text(raw)}' ranges over "
                    f"{found.text()}; {fix}",
                )

    def apply(self, e: Apply) -> tuple[Expr, rg.Interval]:
        typed = [self.expr(x) for x in e.args]
        args = tuple(x for x, _ in typed)
        found = [r for _, r in typed]
        if e.name == WHERE:
            return self.where(e, args, found)
        fn = next((f for f in Fn if f.value == e.name), None)
        if fn is None:
            names = [f.value for f in Fn] + [WHERE]
            hint = (
                f"; '{e.name}' is an input: index it with brackets, {e.name}[...]"
                if self.m.input(e.name)
                else suggest(e.name, names)
            )
            self.error(
                e.loc,
                f"unknown function '{e.name}'{hint}; the functions are " + ", ".join(names),
            )
            return Apply(e.name, args, e.loc), rg.UNBOUNDED
        if len(args) != fn.arity:
            self.error(
                e.loc,
                f"{fn.value}() takes {fn.arity} argument{'s' * (fn.arity > 1)}, got {len(args)}",
            )
            return FnCall(fn, args, e.loc), rg.UNBOUNDED
        if any(a.type is None for a in args):
            return FnCall(fn, args, e.loc), rg.UNBOUNDED
        for a, raw in zip(args, e.args):
            if a.type is BOOL:
                self.error(
                    raw.loc, f"{fn.value}() takes numbers, but '{text(raw)}' is a truth value"
                )
                return FnCall(fn, args, e.loc), rg.UNBOUNDED
        return self.function(fn, e, args, found)

    def function(self, fn: Fn, e: Apply, args, found) -> tuple[Expr, rg.Interval]:
        x = found[0]
        numeric = I32 if all(a.type is I32 for a in args) else F32
        call = FnCall(fn, args, e.loc)
        match fn:
            case Fn.ABS:  # (abs of -2^31 is no i32)
                return replace(call, type=numeric), self.fits(e, numeric, rg.absolute(x, self.tops))
            case Fn.MIN:
                return replace(call, type=numeric), rg.minimum(x, found[1], self.tops)
            case Fn.MAX:
                return replace(call, type=numeric), rg.maximum(x, found[1], self.tops)
            case Fn.CLAMP:
                return replace(call, type=numeric), rg.minimum(
                    rg.maximum(x, found[1], self.tops), found[2], self.tops
                )
            case Fn.EXP:
                if not rg.at_most(x.hi, rg.Affine(EXP_LIMIT)):
                    self.error(
                        e.args[0].loc,
                        f"exp() of '{text(e.args[0])}' may overflow to inf: its argument ranges "
                        f"over {x.text()}, and exp of more than {EXP_LIMIT:g} is past fp32's "
                        f"largest number; bound it, e.g. exp(min({text(e.args[0])}, 80))",
                    )
                found = rg.monotone(x, math.exp, self.tops)
                return replace(call, type=F32), rg.Interval(found.lo or rg.Affine(0), found.hi)
            case Fn.LOG | Fn.LOG2:
                if not rg.below(rg.Affine(0), x.lo):
                    self.error(
                        e.args[0].loc,
                        f"{fn.value}() of '{text(e.args[0])}' may be -inf or NaN: its argument "
                        f"ranges over {x.text()}, which is not above 0; bound it, e.g. "
                        f"{fn.value}(max({text(e.args[0])}, 1e-6))",
                    )
                    return replace(call, type=F32), rg.UNBOUNDED
                f = math.log if fn is Fn.LOG else math.log2
                return replace(call, type=F32), rg.monotone(x, f, self.tops)
            case Fn.TANH:
                found = rg.monotone(x, math.tanh, self.tops)
                return replace(call, type=F32), rg.Interval(
                    found.lo or rg.Affine(-1), found.hi or rg.Affine(1)
                )
            case Fn.FLOOR:
                # the conversion to an int saturates past the i32 range: a wrong value, so refused
                return replace(call, type=I32), self.fits(
                    e, I32, rg.monotone(x, math.floor, self.tops)
                )
        raise AssertionError(fn)

    def where(self, e: Apply, args, found) -> tuple[Expr, rg.Interval]:
        if len(args) != 3:
            self.error(
                e.loc, f"where() takes 3 arguments (a condition and two values), got {len(args)}"
            )
            return Apply(e.name, args, e.loc), rg.UNBOUNDED
        cond, a, b = args
        node = Where(cond, a, b, e.loc)
        if any(x.type is None for x in args):
            return node, rg.UNBOUNDED
        if cond.type is not BOOL:
            self.error(
                e.args[0].loc,
                f"where()'s condition must be a truth value, but '{text(e.args[0])}' is a number",
            )
            return node, rg.UNBOUNDED
        if (a.type is BOOL) != (b.type is BOOL):
            self.error(e.loc, "where()'s two values must both be numbers or both truth values")
            return node, rg.UNBOUNDED
        kind = BOOL if a.type is BOOL else I32 if a.type is b.type is I32 else F32
        return replace(node, type=kind), rg.union(found[1], found[2], self.tops)

    def unary(self, e: Unary) -> tuple[Expr, rg.Interval]:
        x, found = self.expr(e.x)
        node = Unary(e.op, x, e.loc)
        if x.type is None:
            return node, rg.UNBOUNDED
        if e.op is UnOp.NOT:
            if x.type is not BOOL:
                self.error(e.loc, f"'not' takes a truth value, but '{text(e.x)}' is a number")
                return node, rg.UNBOUNDED
            return replace(node, type=BOOL), rg.UNBOUNDED
        if x.type is BOOL:
            self.error(e.loc, f"'-' takes a number, but '{text(e.x)}' is a truth value")
            return node, rg.UNBOUNDED
        return replace(node, type=x.type), self.fits(e, x.type, rg.neg(found))

    def binary(self, e: Binary) -> tuple[Expr, rg.Interval]:
        (a, ra), (b, rb) = self.expr(e.a), self.expr(e.b)
        node = Binary(e.op, a, b, e.loc)
        if a.type is None or b.type is None:
            return node, rg.UNBOUNDED
        op = e.op
        if op.is_logical:
            for x, raw in ((a, e.a), (b, e.b)):
                if x.type is not BOOL:
                    self.error(
                        raw.loc, f"'{op.value}' takes truth values, but '{text(raw)}' is a number"
                    )
                    return node, rg.UNBOUNDED
            return replace(node, type=BOOL), rg.UNBOUNDED
        if op.is_comparison:
            if (a.type is BOOL) != (b.type is BOOL) or (
                a.type is BOOL and op not in (BinOp.EQ, BinOp.NE)
            ):
                self.error(
                    e.loc,
                    f"'{op.value}' compares two numbers (or, '==' and '!=', two truth values)",
                )
                return node, rg.UNBOUNDED
            return replace(node, type=BOOL), rg.UNBOUNDED
        for x, raw in ((a, e.a), (b, e.b)):
            if x.type is BOOL:
                self.error(
                    raw.loc, f"'{op.value}' takes numbers, but '{text(raw)}' is a truth value"
                )
                return node, rg.UNBOUNDED
        numeric = I32 if a.type is b.type is I32 else F32
        if op is BinOp.MUL and text(e.a) == text(e.b):  # one value squared: not negative
            return replace(node, type=numeric), self.fits(e, numeric, rg.square(ra, self.tops))
        if op in _ARITHMETIC:
            found = (
                rg.mul(ra, rb, self.tops)
                if op is BinOp.MUL
                else (rg.add if op is BinOp.ADD else rg.sub)(ra, rb)
            )
            return replace(node, type=numeric), self.fits(e, numeric, found)
        if op is not BinOp.DIV and numeric is not I32:
            self.error(
                e.loc,
                f"'{op.value}' takes integers, but '{text(e)}' has a float operand; floor(...) "
                "rounds a float down",
            )
            return node, rg.UNBOUNDED
        if not rb.excludes_zero():
            self.error(
                e.b.loc,
                f"the divisor '{text(e.b)}' may be 0 (it ranges over {rb.text()}), which "
                + ("makes inf or NaN" if op is BinOp.DIV else "has no integer result")
                + f"; use a divisor that cannot be, e.g. max({text(e.b)}, 1)",
            )
            return replace(node, type=F32 if op is BinOp.DIV else I32), rg.UNBOUNDED
        if op is BinOp.DIV:
            return replace(node, type=F32), self.fits(e, F32, rg.div(ra, rb, self.tops))
        if op is BinOp.MOD:
            return replace(node, type=I32), rg.mod(ra, rb, self.tops)
        # (-2^31 // -1 is no i32)
        return replace(node, type=I32), self.fits(e, I32, rg.floordiv(ra, rb, self.tops))

    def fits(self, e: Expr, kind: ExprType, found: rg.Interval) -> rg.Interval:
        """``found``, the range of ``e``'s value, with an error at ``e`` where it does not
        fit ``kind`` (an i32, or a finite f32) up to the checker's sizes, unless a value
        inside ``e`` has one already (the enclosing values' errors would repeat it)."""
        lo, hi = rg.extremes(found, self.tops)  # -inf / inf where an input's element makes it
        known = [v for v in (lo, hi) if math.isfinite(v)]
        if kind is I32:
            if all(-(INT_MAX + 1) <= v <= INT_MAX for v in known):
                return found
            why = (
                "and an int wraps silently; compute it in f32 (1.0 * ...) or bound its "
                "operands with min()"
            )
            what = "overflow an i32"
        else:
            if all(abs(v) <= FLOAT_MAX for v in known):
                return found
            why, what = "past fp32's largest number (about 3.4e38)", "overflow to inf"
        inner = [n for n in walk(e) if n is not e]
        self.overflowed.add(id(e))
        if any(id(n) in self.overflowed for n in inner):
            return found
        sized = any(isinstance(n, Name) for n in inner)  # b, h, q_idx, kv_idx or a size
        where = f" with {_limits(self.tops)}" if sized else ""
        self.overflows.append((text(e), e.loc))
        self.error(e.loc, f"'{text(e)}' may {what}: it reaches {_reach(lo, hi)}{where}, {why}")
        return found


def _limits(tops: dict) -> str:
    """The sizes a range was taken over, as a message says them."""
    seqlen = tops[Dim.SEQLEN_Q]
    shown = "2^30 - 1" if seqlen == DIM_MAX[Dim.SEQLEN_Q] else f"{seqlen}"
    return f"sequence lengths up to {shown} and batch and heads up to {tops[Dim.BATCH]}"


def _reach(lo: float, hi: float) -> str:
    """The value of largest magnitude of [lo, hi] that is a number, as the message shows it."""
    v = max((x for x in (lo, hi) if math.isfinite(x)), key=abs)
    return f"{v:.4g}" if abs(v) >= 1e6 else f"{v:g}"
