"""Score and mask modifiers (issue 41): the expression IR of a spec's `score` and `keep`
lines and the `input` declarations they read.

Every node is a frozen dataclass that carries the location of its first token; operators
and functions are enums. The parser builds the nodes with ``type`` None and with two kinds
that exist only before ``check_modifiers`` (fadsl/passes/modifiers/check.py): ``Name``, an
identifier not yet resolved, and ``Apply``, a call of a function not yet looked up. The
check resolves them into ``Var``, ``Load``, ``FnCall`` and ``Where`` and fills in every
node's type, bottom-up; the passes after it see typed nodes only.

The printer (``text``) writes an expression back in the spec's syntax, with the fewest
parentheses that keep its meaning: `fadsl explain`, the IR's text form (and so the spec
hash) and the error messages quote expressions through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Union

from ..errors import Loc


class ExprType(Enum):
    """What an expression's value is: a 32-bit int, a 32-bit float or a truth value."""

    I32 = "i32"
    F32 = "f32"
    BOOL = "bool"


class Dim(Enum):
    """The sizes of a call, which an input's shape may name and an expression may read."""

    BATCH = "batch"
    HEADS = "heads"  # query heads
    HEADS_KV = "heads_kv"
    SEQLEN_Q = "seqlen_q"
    SEQLEN_K = "seqlen_k"


# The largest sizes a call may have; fadsl/runtime/arguments.py refuses larger ones. Sequence
# lengths stay below 2^30 (rows are indexed by 32-bit ints, and two lengths are added), batch
# and heads at most 65,535 (CUDA's grid in y and z). check_modifiers proves an expression's
# arithmetic against them (fadsl/passes/modifiers/ranges.py, ``extremes``).
SEQLEN_LIMIT = 2**30
GRID_YZ_LIMIT = 65535
DIM_MAX = {
    Dim.BATCH: GRID_YZ_LIMIT,
    Dim.HEADS: GRID_YZ_LIMIT,
    Dim.HEADS_KV: GRID_YZ_LIMIT,
    Dim.SEQLEN_Q: SEQLEN_LIMIT - 1,
    Dim.SEQLEN_K: SEQLEN_LIMIT - 1,
}


@dataclass(frozen=True)
class Blocks:
    """An input's dimension of ``cdiv(dim, block)`` entries, one per block of ``block``
    indices along ``dim`` (a block mask's q and kv blocks: FlexAttention's BlockMask as
    fadsl.block_table makes it), read at ``q_idx // block``."""

    dim: Dim
    block: int

    @property
    def value(self) -> str:
        return f"cdiv({self.dim.value}, {self.block})"

    def of(self, size: int) -> int:
        """The entries for ``dim`` of ``size``."""
        return -(-size // self.block)


def dim_size(d: "Dim | Blocks | int", sizes: dict) -> int:
    """An input dimension's extent given the call's ``sizes`` (by Dim)."""
    if isinstance(d, Dim):
        return sizes[d]
    return d.of(sizes[d.dim]) if isinstance(d, Blocks) else d


class VarKind(Enum):
    """The names an expression may read besides its inputs (FlexAttention's score_mod
    arguments: score, b, h, q_idx, kv_idx), the call's sizes, and a tile's bounds, which
    only derive_sparsity's rules read (a spec cannot name them)."""

    SCORE = "s"  # the scaled score q.k softmax_scale, in natural units; `score` only
    BATCH = "b"
    HEAD = "h"  # the query head
    Q_IDX = "q_idx"
    KV_IDX = "kv_idx"
    # the sizes, as values
    BATCHES = "batch"
    HEADS = "heads"
    HEADS_KV = "heads_kv"
    SEQLEN_Q = "seqlen_q"
    SEQLEN_K = "seqlen_k"
    # a (q block, kv block) tile's first and last query row and key (derive_sparsity)
    Q_LO = "q_lo"
    Q_HI = "q_hi"
    KV_LO = "kv_lo"
    KV_HI = "kv_hi"

    @property
    def dim(self) -> Dim | None:
        """The size this name reads, if it is one."""
        return _SIZE_DIMS.get(self)


_SIZE_DIMS = {
    VarKind.BATCHES: Dim.BATCH,
    VarKind.HEADS: Dim.HEADS,
    VarKind.HEADS_KV: Dim.HEADS_KV,
    VarKind.SEQLEN_Q: Dim.SEQLEN_Q,
    VarKind.SEQLEN_K: Dim.SEQLEN_K,
}
# The names a spec's expression may use, by spelling (the tile bounds are not among them).
SPEC_VARS = {
    k.value: k
    for k in VarKind
    if k not in (VarKind.Q_LO, VarKind.Q_HI, VarKind.KV_LO, VarKind.KV_HI)
}
# The index names that vary inside a tile (the rest are the same for all of a tile's scores).
TILE_VARYING = frozenset({VarKind.SCORE, VarKind.Q_IDX, VarKind.KV_IDX})


class UnOp(Enum):
    NEG = "-"
    NOT = "not"


class BinOp(Enum):
    ADD = "+"
    SUB = "-"
    MUL = "*"
    DIV = "/"  # true division: a float
    FLOORDIV = "//"  # integers, rounding down (Python's)
    MOD = "%"  # integers, the sign of the divisor (Python's)
    LT = "<"
    LE = "<="
    GT = ">"
    GE = ">="
    EQ = "=="
    NE = "!="
    AND = "and"
    OR = "or"

    @property
    def is_comparison(self) -> bool:
        return self in _COMPARISONS

    @property
    def is_logical(self) -> bool:
        return self in (BinOp.AND, BinOp.OR)


_COMPARISONS = frozenset({BinOp.LT, BinOp.LE, BinOp.GT, BinOp.GE, BinOp.EQ, BinOp.NE})


class Fn(Enum):
    """The functions an expression may call, with their arity."""

    ABS = "abs"
    MIN = "min"
    MAX = "max"
    CLAMP = "clamp"  # clamp(x, lo, hi) = min(max(x, lo), hi)
    EXP = "exp"
    LOG = "log"
    LOG2 = "log2"
    TANH = "tanh"
    FLOOR = "floor"  # to an i32, rounding down

    @property
    def arity(self) -> int:
        return {Fn.MIN: 2, Fn.MAX: 2, Fn.CLAMP: 3}.get(self, 1)


WHERE = "where"  # where(c, a, b): a where c holds, else b (its own node, Where)


# --- nodes -----------------------------------------------------------------


@dataclass(frozen=True)
class Const:
    value: int | float | bool
    loc: Loc
    type: ExprType | None = None
    text: str = ""  # as the spec wrote it ("30", "0.5"); "" for a constant a pass made


@dataclass(frozen=True)
class Name:
    """An identifier before check_modifiers resolves it (a variable, a size or an input)."""

    text: str
    loc: Loc
    type: ExprType | None = None


@dataclass(frozen=True)
class Var:
    kind: VarKind
    loc: Loc
    type: ExprType | None = None


@dataclass(frozen=True)
class Load:
    """``input[i, j, ...]``: one element of a declared input."""

    input: str
    indices: tuple["Expr", ...]
    loc: Loc
    type: ExprType | None = None


@dataclass(frozen=True)
class Unary:
    op: UnOp
    x: "Expr"
    loc: Loc
    type: ExprType | None = None


@dataclass(frozen=True)
class Binary:
    op: BinOp
    a: "Expr"
    b: "Expr"
    loc: Loc
    type: ExprType | None = None


@dataclass(frozen=True)
class Where:
    cond: "Expr"
    a: "Expr"
    b: "Expr"
    loc: Loc
    type: ExprType | None = None


@dataclass(frozen=True)
class Apply:
    """``name(args)`` before check_modifiers looks the function up."""

    name: str
    args: tuple["Expr", ...]
    loc: Loc
    type: ExprType | None = None


@dataclass(frozen=True)
class FnCall:
    fn: Fn
    args: tuple["Expr", ...]
    loc: Loc
    type: ExprType | None = None


Expr = Union[Const, Name, Var, Load, Unary, Binary, Where, Apply, FnCall]


def children(e: Expr) -> tuple[Expr, ...]:
    match e:
        case Load(indices=xs) | Apply(args=xs) | FnCall(args=xs):
            return xs
        case Unary(x=x):
            return (x,)
        case Binary(a=a, b=b):
            return (a, b)
        case Where(cond=c, a=a, b=b):
            return (c, a, b)
        case _:
            return ()


def walk(e: Expr):
    """Every node of ``e``, parents before their children."""
    yield e
    for child in children(e):
        yield from walk(child)


def var_kinds(e: Expr) -> frozenset[VarKind]:
    return frozenset(n.kind for n in walk(e) if isinstance(n, Var))


def reads_score(e: Expr) -> bool:
    return VarKind.SCORE in var_kinds(e)


def reads_per_token(e: Expr) -> bool:
    """Whether ``e`` reads an input at an index that varies inside a tile (``t[b, q_idx]``)."""
    return any(isinstance(n, Load) and not all(map(tile_uniform, n.indices)) for n in walk(e))


def reads_head(e: Expr) -> bool:
    """Whether ``e`` reads the head: ``h`` itself (in an index or not)."""
    return VarKind.HEAD in var_kinds(e)


def tile_uniform(e: Expr) -> bool:
    """Whether ``e`` has one value for all of a tile's scores: it reads no score, query row
    or key (inputs indexed by the batch and head only are uniform too)."""
    return not (var_kinds(e) & TILE_VARYING)


# --- declarations ------------------------------------------------------------


@dataclass(frozen=True)
class InputDecl:
    """``input NAME : DTYPE[DIMS]``: a read-only tensor the call passes by name, contiguous,
    each dimension a size of the call, its blocks (``cdiv(seqlen_q, 128)``) or a constant."""

    name: str
    dtype: ExprType  # i32 or f32
    dims: tuple[Dim | Blocks | int, ...]
    loc: Loc

    def text(self) -> str:
        dims = ", ".join(str(d) if isinstance(d, int) else d.value for d in self.dims)
        return f"{self.name} : {self.dtype.value}[{dims}]"


@dataclass(frozen=True)
class TileRule:
    """derive_sparsity's result: a tile is FULL where ``full`` holds, EMPTY where ``empty``
    holds, PARTIAL otherwise. Both read only what is uniform over a tile: its bounds (Q_LO ..
    KV_HI), the batch, the head, the sizes and inputs indexed by those. ``exact``: FULL and
    EMPTY are decided exactly (never PARTIAL where every or no score is kept), with ``why``.
    ``by_pass``: the predicate reads an input indexed by ``q_idx`` or ``kv_idx`` (document
    ids), which no rule over a tile's bounds can see through: each call classes the tiles by
    evaluating the predicate at every score first (a pass before the kernel), per head where
    it reads ``h`` (``per_head``), and the kernel takes those classes beside the rule's."""

    full: Expr
    empty: Expr
    exact: bool
    why: str
    by_pass: bool = False
    per_head: bool = False


@dataclass(frozen=True)
class InputGrad:
    """One read of a float input by ``score``, ``input[indices]``, and the score's
    derivative by it (differentiate_inputs): the backward adds dS' x ``derivative`` into the
    input's gradient at ``indices``, dS' being the gradient of the modified score.
    ``derivative`` is None where there is none (``why``, at ``loc``: the token)."""

    input: str
    indices: tuple["Expr", ...]
    derivative: "Expr | None"
    loc: Loc
    why: str = ""

    def index_text(self) -> str:
        return ", ".join(text(x) for x in self.indices)


@dataclass(frozen=True)
class Modifiers:
    """A spec's modifiers. ``score``: the new score as an expression of ``s`` (natural
    units), or None; ``keep``: the predicate a score is kept by, or None. ``rule`` (for
    ``keep``) and ``derivative`` (d score / d s, for ``score``) are filled in by the passes;
    ``not_differentiable`` says why there is no derivative; ``input_grads`` (differentiate_inputs):
    the score's derivative by each read of a float input. ``learn``: the inputs whose
    gradients a backward kernel computes (the runtime's variant for inputs that require
    grad; empty in a compiled spec, and not part of its text form)."""

    inputs: tuple[InputDecl, ...] = ()
    score: Expr | None = None
    keep: Expr | None = None
    score_loc: Loc | None = None  # the `score` keyword
    keep_loc: Loc | None = None
    rule: TileRule | None = None
    derivative: Expr | None = None
    not_differentiable: str = ""
    not_differentiable_loc: Loc | None = None  # the token with no derivative (floor)
    input_grads: tuple[InputGrad, ...] = ()
    learn: tuple[str, ...] = ()
    # split_distance_term: f where score is s + f(b, h, q_idx - kv_idx), f dear to evaluate
    distance_term: Expr | None = None
    # check_modifiers: the longest sequence length at which every value of the expressions
    # stays in range (None: up to the runtime's own limit, SEQLEN_LIMIT), and the value that
    # leaves it beyond ("'3 * q_idx' (line 12)"); the runtime refuses longer calls
    longest: int | None = None
    longest_why: str = ""

    def input(self, name: str) -> InputDecl | None:
        return next((i for i in self.inputs if i.name == name), None)

    def lines(self) -> list[str]:
        """The IR's text form: one line per declaration (fadsl.ir.printer)."""
        out = [f"input {i.text()}" for i in self.inputs]
        if self.score is not None:
            out.append(f"score {text(self.score)}")
        if self.keep is not None:
            out.append(f"keep {text(self.keep)}")
        return out


# --- the printer -------------------------------------------------------------

# Binding strength, loosest first, as the grammar parses them.
_PRECEDENCE = {
    BinOp.OR: 1,
    BinOp.AND: 2,
    **{op: 4 for op in _COMPARISONS},
    BinOp.ADD: 5,
    BinOp.SUB: 5,
    BinOp.MUL: 6,
    BinOp.DIV: 6,
    BinOp.FLOORDIV: 6,
    BinOp.MOD: 6,
}
_NOT, _NEG, _ATOM = 3, 7, 8


def _precedence(e: Expr) -> int:
    match e:
        case Binary(op=op):
            return _PRECEDENCE[op]
        case Unary(op=UnOp.NOT):
            return _NOT
        case Unary(op=UnOp.NEG):
            return _NEG
        case Const(value=v) if not isinstance(v, bool) and v < 0:
            return _NEG
        case _:
            return _ATOM


def _const_text(c: Const) -> str:
    if c.text:
        return c.text
    if isinstance(c.value, bool):
        return "1 == 1" if c.value else "1 == 0"  # (the spec has no boolean literals)
    if isinstance(c.value, float):
        return repr(c.value)
    return str(c.value)


def text(e: Expr) -> str:
    """``e`` in the spec's syntax."""
    match e:
        case Const():
            return _const_text(e)
        case Name(text=t):
            return t
        case Var(kind=k):
            return k.value
        case Load(input=name, indices=xs):
            return f"{name}[{', '.join(text(x) for x in xs)}]"
        case Apply(name=name, args=xs):
            return f"{name}({', '.join(text(x) for x in xs)})"
        case FnCall(fn=fn, args=xs):
            return f"{fn.value}({', '.join(text(x) for x in xs)})"
        case Where(cond=c, a=a, b=b):
            return f"{WHERE}({text(c)}, {text(a)}, {text(b)})"
        case Unary(op=UnOp.NOT, x=x):
            return f"not {_side(x, _NOT, False)}"
        case Unary(op=UnOp.NEG, x=x):
            return f"-{_side(x, _NEG, False)}"
        case Binary(op=op, a=a, b=b):
            p = _PRECEDENCE[op]
            # comparisons do not chain: both sides need parentheses at the same strength
            left = _side(a, p, op.is_comparison)
            return f"{left} {op.value} {_side(b, p, True)}"
        case _:
            raise AssertionError(f"unknown expression {e!r}")


def _side(e: Expr, parent: int, strict: bool) -> str:
    """An operand's text, in parentheses where it binds looser than its parent (or as
    loose, on the right of a left-associative operator)."""
    p = _precedence(e)
    inner = text(e)
    return f"({inner})" if p < parent or (strict and p == parent) else inner
