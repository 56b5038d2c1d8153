"""A spec's `input`, `score` and `keep` lines (issue 41) read into ``fadsl.ir.expr.Modifiers``
and taken through the modifier passes (fadsl/passes/modifiers), their errors reported with
the spec's others.

Here: the declarations themselves (an input's name, dtype and dimensions; one `score` and
one `keep` at most; inputs within the kernel's params) and, with a backward block, a score
whose derivative is not defined (differentiate_score's NotDifferentiable). What an expression may say is check_modifiers'
business; what a target supports, its validate's (sm_80: none; sm_90a:
fadsl/targets/sm90/modifiers.py).
"""

from __future__ import annotations

from ..errors import SpecError, quoted, suggest
from ..ir.expr import SPEC_VARS, WHERE, Blocks, Dim, ExprType, Fn, InputDecl, Modifiers
from ..passes.modifiers import run_modifier_passes
from ..spec.checks import Checks
from ..spec.syntax import BlocksDim, ExprLine, InputLine, Number, Word

# The inputs a kernel's params hold (sm_90a's FwdParamsSm90 keeps this many pointers).
MAX_INPUTS = 8
# The slots a keep that reads inputs per token takes for its tiles' classes (TileRule.by_pass).
CLASS_INPUTS = 2
# Dimensions of an input that are constants: at least 1, and an element count within i32.
MAX_CONSTANT_DIM = 2**20
INPUT_DTYPES = {"f32": ExprType.F32, "i32": ExprType.I32}
_RESERVED = {*SPEC_VARS, *(f.value for f in Fn), WHERE, "and", "or", "not"}


def read_modifiers(c: Checks) -> Modifiers | None:
    """The spec's modifiers, checked and through the passes; None without any (or when
    one of them is refused: reported)."""
    lines = c.decl.modifiers
    if not lines:
        return None
    before = len(c.sink)
    inputs = _inputs(c, [x for x in lines if isinstance(x, InputLine)])
    exprs: dict[str, ExprLine] = {}
    for line in (x for x in lines if isinstance(x, ExprLine)):
        word = line.keyword.text
        if word in exprs:
            c.error(
                line.loc,
                f"a second '{word}' line (the first is on line {exprs[word].loc.line}); a kernel "
                f"takes one: combine them{' with and' if word == 'keep' else ''}",
            )
            continue
        exprs[word] = line
    if "score" not in exprs and "keep" not in exprs:
        first = lines[0]
        c.error(first.loc, "inputs are read by 'score' or 'keep' lines, and the kernel has neither")
        return None
    score, keep = exprs.get("score"), exprs.get("keep")
    modifiers = Modifiers(
        inputs=inputs,
        score=score.expr if score else None,
        keep=keep.expr if keep else None,
        score_loc=score.loc if score else None,
        keep_loc=keep.loc if keep else None,
    )
    if len(inputs) < sum(isinstance(x, InputLine) for x in lines):
        return None  # (an input refused: its reads would only repeat it as unknown)
    try:
        modifiers = run_modifier_passes(modifiers)
    except SpecError as err:
        for d in err.diagnostics:
            c.error(d.loc, d.message)
        return None
    rule = modifiers.rule
    if rule is not None and rule.by_pass and len(inputs) > MAX_INPUTS - CLASS_INPUTS:
        c.error(
            modifiers.keep_loc,
            f"this keep reads inputs per token, so each call classes its tiles first, and the "
            f"classes take {CLASS_INPUTS} of the kernel's {MAX_INPUTS} input slots: declare at "
            f"most {MAX_INPUTS - CLASS_INPUTS} inputs",
        )
        return None
    _differentiable(c, modifiers)
    return modifiers if len(c.sink) == before else None


def _differentiable(c: Checks, m: Modifiers) -> None:
    """A backward block needs d score / d s (differentiate_score): where the score has none
    (it rounds the score: floor), the block is refused at the token that has no derivative."""
    if not c.decl.backwards or not m.not_differentiable:
        return
    block = c.decl.backwards[0]
    c.error(
        m.not_differentiable_loc or m.score_loc or block.loc,
        f"the backward block (line {block.loc.line}) multiplies dS by d score / d s, but "
        f"{m.not_differentiable}; write the score without it, or remove the backward block "
        "(the kernel is then forward-only)",
    )


def _inputs(c: Checks, lines: list[InputLine]) -> tuple[InputDecl, ...]:
    found: dict[str, InputDecl] = {}
    for line in lines:
        name = line.name.text
        if name in _RESERVED:
            c.error(
                line.name.loc,
                f"'{name}' is a name expressions already read (a variable, a size, a function "
                "or an operator); call the input something else",
            )
            continue
        if name in found:
            c.error(
                line.name.loc,
                f"input '{name}' is declared twice (first on line {found[name].loc.line})",
            )
            continue
        dtype = INPUT_DTYPES.get(line.dtype.text)
        if dtype is None:
            c.error(
                line.dtype.loc,
                f"unknown input dtype '{quoted(line.dtype.text)}'"
                f"{suggest(line.dtype.text, INPUT_DTYPES)}; an input is f32 (float32) or "
                "i32 (int32)",
            )
            continue
        dims = [_dim(c, d) for d in line.dims]
        if any(d is None for d in dims):
            continue
        if len(found) == MAX_INPUTS:
            c.error(
                line.loc, f"more than {MAX_INPUTS} inputs (the kernel's params hold {MAX_INPUTS})"
            )
            continue
        found[name] = InputDecl(name, dtype, tuple(dims), line.name.loc)
    return tuple(found.values())


def _dim(c: Checks, d: Word | Number | BlocksDim) -> Dim | Blocks | int | None:
    if isinstance(d, BlocksDim):
        return _blocks(c, d)
    if isinstance(d, Number):
        if not 1 <= d.value <= MAX_CONSTANT_DIM:
            c.error(
                d.loc, f"a dimension of {d.text}: a constant dimension is 1 to {MAX_CONSTANT_DIM}"
            )
            return None
        return d.value
    dim = next((x for x in Dim if x.value == d.text), None)
    if dim is None:
        names = [x.value for x in Dim]
        c.error(
            d.loc,
            f"unknown dimension '{quoted(d.text)}'{suggest(d.text, names)}; an input's "
            f"dimensions are sizes of the call ({', '.join(names)}), their blocks "
            "(cdiv(seqlen_q, 128)) or constants",
        )
    return dim


def _blocks(c: Checks, d: BlocksDim) -> Blocks | None:
    """``cdiv(SIZE, N)``: one entry per block of N indices along a size of the call."""
    if d.fn.text != "cdiv":
        c.error(
            d.fn.loc,
            f"unknown dimension function '{quoted(d.fn.text)}'{suggest(d.fn.text, ['cdiv'])}; "
            "an input's dimension may be cdiv(SIZE, N), the blocks of N along a size",
        )
        return None
    size = _dim(c, d.name)
    if size is None:
        return None
    if not 1 <= d.block.value <= MAX_CONSTANT_DIM:
        c.error(d.block.loc, f"a block of {d.block.text}: a block is 1 to {MAX_CONSTANT_DIM}")
        return None
    return Blocks(size, d.block.value)
