"""Lowering, part three: the mainloop's order, as written or FlashAttention-2's default.

Each line of a ``mainloop { ... }`` block names one op (``fadsl.ops.LOOP_STEPS``);
the order must keep every dependency between them (a tile is loaded before it is
read, S before softmax, ...), and a tile loaded one block ahead must not be
overwritten before this iteration's reader is done with it.
"""

from __future__ import annotations

from ..spec.checks import Checks, and_list
from ..errors import Loc, closest, quoted, suggest
from ..ir import RegLoad, Role, Tensor
from ..ir.ops import DEFAULT_ORDER, LOOP_STEPS, Move, Op, fused_reader
from ..spec.syntax import LoopStep


def read_order(c: Checks, tensors: dict[Role, Tensor]) -> tuple[tuple[Op, Loc], ...]:
    """The mainloop's ops, each with the location that asked for it."""
    frag = {role for role, t in tensors.items() if t.reg_load is RegLoad.FRAG}
    default = tuple(op for op in DEFAULT_ORDER if op not in _fused_loads(frag))
    loops = c.decl.mainloops
    if not loops:
        return tuple((op, c.decl.loc) for op in default)
    for extra in loops[1:]:
        c.error(extra.loc, f"duplicate mainloop (first at line {loops[0].loc.line})")
    loop = loops[0]
    placed: dict[Op, LoopStep] = {}
    for step in loop.steps:
        op = _loop_op(c, step, tensors, frag)
        if op is None:
            continue
        twin = op.twin
        if op in placed:
            c.error(
                step.loc,
                f"'{step.text()}' appears twice in the mainloop (first at line "
                f"{placed[op].loc.line})",
            )
            continue
        if twin in placed:
            c.error(
                step.loc,
                f"'{step.text()}' loads the same tile as '{placed[twin].text()}' (line "
                f"{placed[twin].loc.line}); an iteration loads either its own block or, "
                "ahead, the next one",
            )
            continue
        placed[op] = step
    absent = [op for op in default if not {op, op.twin} & (set(placed) | c.suggested)]
    if absent:
        c.missing(
            loop.loc, f"the mainloop is missing {and_list(repr(op.loop_text) for op in absent)}"
        )
    position = {op: i for i, op in enumerate(placed)}
    for earlier, later, why in _dependencies(frag):
        if earlier in position and later in position and position[later] < position[earlier]:
            c.error(
                placed[later].loc,
                f"'{later.loop_text}' must come after '{earlier.loop_text}': {why}",
            )
    return tuple((op, step.loc) for op, step in placed.items())


def _loop_op(c: Checks, step: LoopStep, tensors: dict[Role, Tensor], frag: set[Role]) -> Op | None:
    text = step.text()
    first = step.words[0]
    if text in LOOP_STEPS:
        op = LOOP_STEPS[text]
        role = op.tensor
        if role in frag and op.move is Move.S2R:
            c.error(
                step.loc,
                f"'{text}' is not a step of its own here: {role.value}'s path ends in "
                f"rf[frag] (line {tensors[role].loc.line}), so "
                f"'{fused_reader(role).loop_text}' loads it one k16 slice at a time; "
                "drop this line",
            )
            return None
        return op
    if step.form == "move_next" and step.words[1].text != "next":
        if first.text in ("K", "V"):
            c.suggested.add(Op.of(Role(first.text), Move.G2S, ahead=True))
        c.error(
            step.words[1].loc,
            f"unknown block '{quoted(step.words[1].text)}' in '{quoted(text)}'; only "
            f"'{first.text}(next) -> smem' (the next block's tile, loaded ahead) exists",
        )
    elif step.form in ("move", "move_next") and first.text in ("Q", "O"):
        c.error(
            step.loc,
            f"{first.text} moves once, in the {'prologue' if first.text == 'Q' else 'epilogue'};"
            " the mainloop moves only K and V",
        )
    elif step.form == "move" and first.text in ("K", "V"):
        c.error(
            step.words[1].loc,
            f"in the mainloop {first.text} moves to 'smem' and then to 'rf', "
            f"not to '{quoted(step.words[1].text)}'",
        )
    elif step.form == "move_next" and first.text in ("K", "V"):
        c.error(
            step.words[2].loc,
            f"'{first.text}(next)' is loaded ahead into 'smem', not '{quoted(step.words[2].text)}'",
        )
    elif closest(text, LOOP_STEPS):
        c.suggested.add(LOOP_STEPS[closest(text, LOOP_STEPS)])
        c.error(step.loc, f"unknown mainloop step '{quoted(text)}'" + suggest(text, LOOP_STEPS))
    else:
        c.error(
            step.loc,
            f"unknown mainloop step '{quoted(text)}'; expected one of: "
            + ", ".join(f"'{s}'" for s in LOOP_STEPS),
        )
    return None


def _fused_loads(frag: set[Role]) -> set[Op]:
    """The smem -> rf steps that fragment-wise loading folds into the mma."""
    return {Op.of(r, Move.S2R) for r in frag if r in (Role.K, Role.V)}


def _dependencies(frag: set[Role]) -> list[tuple[Op, Op, str]]:
    """(earlier, later, why): the order the mainloop's steps must keep."""

    def load(role: Role, mma: Op) -> list[tuple[Op, Op, str]]:
        t = role.value
        g2s, s2r = Op.of(role, Move.G2S), Op.of(role, Move.S2R)
        wrote = f"it reads the {t} tile that '{t} -> smem' writes"
        if role in frag:
            return [(g2s, mma, wrote)]
        return [
            (g2s, s2r, wrote),
            (s2r, mma, f"it multiplies the {t} fragments that '{t} -> rf' loads"),
        ]

    def ahead(role: Role, mma: Op) -> tuple[Op, Op, str]:
        t = role.value
        reader = mma if role in frag else Op.of(role, Move.S2R)
        why = f"it overwrites the {t} tile that '{reader.loop_text}' still reads in this iteration"
        return (reader, Op.of(role, Move.G2S, ahead=True), why)

    return [
        *load(Role.K, Op.QK),
        (Op.QK, Op.SOFTMAX, "it normalises the scores S that 'S = Q @ K^T' computes"),
        (Op.SOFTMAX, Op.PV, "it multiplies the probabilities P that 'softmax' produces"),
        *load(Role.V, Op.PV),
        ahead(Role.K, Op.QK),
        ahead(Role.V, Op.PV),
    ]
