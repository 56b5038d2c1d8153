"""Lowering, part two: each tensor's path through the memory hierarchy.

Levels, sharing scopes and register loads are checked here; which instruction
each hop may use comes from the target's capabilities, and the shape a path must
have from the target's ``validate_path``.
"""

from __future__ import annotations

from .. import targets
from ..spec.checks import Checks, and_list
from ..errors import Loc, closest, one_of, quoted, suggest
from ..ir import GradRole, Hop, Instr, Level, RegLoad, Role, Scope, Tensor
from ..spec.syntax import PathDecl, Word
from ..targets import Target

# Every path has two hops (three for sm_90a's 8-bit V, transposed in SMEM); a longer one is
# refused as a whole, not hop by hop.
MAX_HOPS = 4


def read_paths(c: Checks, target: Target) -> dict[Role, Tensor]:
    tensors: dict[Role, Tensor] = {}
    seen: dict[str, Loc] = {}
    for path in c.decl.paths:
        name = path.tensor.text
        if name not in Role.__members__:
            c.suggested.add(closest(name, Role.__members__) or "")
            hint = suggest(name, Role.__members__)
            # (P too is a backward block's tensor, at head_dim 256 only: a forward's P is the
            # softmax's, which never leaves registers, so no hint for it)
            if name in {g.value for g in GradRole if g is not GradRole.P}:
                hint = f" ({name}'s path goes inside the 'backward {{ ... }}' block)"
            c.error(
                path.tensor.loc,
                f"unknown tensor '{quoted(name)}'; a kernel moves Q, K, V and O{hint}",
            )
            continue
        if name in seen:
            c.error(
                path.tensor.loc,
                f"tensor '{name}' has two paths (first at line {seen[name].line})",
            )
            continue
        seen[name] = path.tensor.loc
        tensor = _path(c, target, Role[name], path)
        if tensor is not None:
            tensors[tensor.role] = tensor
    c.missing_tensors = [r.value for r in Role if r.value not in seen]
    return tensors


def _path(c: Checks, target: Target, role: Role, path: PathDecl) -> Tensor | None:
    if len(path.hops) > MAX_HOPS:
        shape = "rf -> smem -> gmem" if role is Role.O else "gmem -> smem -> rf"
        three = ""
        if role is Role.V and (Level.SMEM, Level.SMEM) in target.capabilities.hop_instrs:
            three = ", or three for 8-bit V (gmem -> smem -transpose-> smem -> rf)"
        c.error(
            path.hops[MAX_HOPS].loc,
            f"{role.value}'s path has {len(path.hops)} hops; a path has two ({shape}){three}",
        )
        return None
    ok = True
    levels: list[Level] = []
    scope: Scope | None = None
    reg_load = RegLoad.TILE
    for ref in path.levels:
        if ref.name.text not in {lv.value for lv in Level}:
            names = [lv.value for lv in Level]
            c.error(
                ref.name.loc,
                f"unknown memory level '{quoted(ref.name.text)}'; expected {one_of(names)}"
                + suggest(ref.name.text, names),
            )
            ok = False
            continue
        level = Level(ref.name.text)
        levels.append(level)
        if level is Level.RF and ref.scope is not None:
            loaded = _reg_load(c, role, ref.scope)
            ok = ok and loaded is not None
            reg_load = loaded or reg_load
            continue
        if level is not Level.SMEM:
            if ref.scope is not None:
                c.error(ref.scope.loc, f"only smem takes a sharing scope, not {level.value}")
                ok = False
            continue
        offered = target.capabilities.scopes
        if ref.scope is None:
            listed = " or ".join(f"smem[{s.value}]" for s in offered)
            c.error(ref.loc, f"smem needs a sharing scope: {listed}")
            ok = False
            continue
        names = [s.value for s in Scope]
        if ref.scope.text not in names:
            c.error(
                ref.scope.loc,
                f"unknown scope '{quoted(ref.scope.text)}'; expected "
                + " or ".join(f"'{s.value}'" for s in offered)
                + suggest(ref.scope.text, names),
            )
            ok = False
        elif Scope(ref.scope.text) not in offered:
            owners = [
                t
                for t in targets.names()
                if Scope(ref.scope.text) in targets.get(t).capabilities.scopes
            ]
            c.error(
                ref.scope.loc,
                f"scope '{ref.scope.text}' is not one of target {target.name}'s"
                + (f" (it is {and_list(owners)}'s)" if owners else ""),
            )
            ok = False
        elif scope is not None and Scope(ref.scope.text) is not scope:
            c.error(
                ref.scope.loc,
                f"both smem levels of {role.value}'s path hold its tiles in one scope: "
                f"smem[{scope.value}], as the first",
            )
            ok = False
        else:
            scope = Scope(ref.scope.text)
    if not ok:
        return None
    hops: list[Hop] = []
    for (src, dst), ref in zip(zip(levels, levels[1:]), path.hops):
        hop = _hop(c, target, src, dst, ref.instr)
        if hop is None:
            ok = False
        else:
            hops.append(hop)
    if not ok:
        return None
    if not target.validate_path(c, role, path, levels, hops):
        return None
    assert scope is not None
    return Tensor(role, tuple(hops), scope, path.loc, reg_load)


def _reg_load(c: Checks, role: Role, word: Word) -> RegLoad | None:
    """The bracket of an input's ``rf`` level: how its tile is loaded into registers."""
    if role is Role.O:
        c.error(
            word.loc,
            "O is accumulated in registers by the mma; its rf level takes no bracket",
        )
        return None
    names = [r.value for r in RegLoad]
    if word.text in [s.value for s in Scope]:
        c.error(
            word.loc,
            f"rf takes no sharing scope ('{word.text}'): registers belong to one thread; "
            "its bracket says how the tile is loaded, 'tile' or 'frag'",
        )
        return None
    if word.text not in names:
        c.error(
            word.loc,
            f"unknown register load '{quoted(word.text)}'; expected 'tile' (the whole tile, by its "
            "own mainloop step) or 'frag' (one k16 slice at a time, inside the mma)"
            + suggest(word.text, names),
        )
        return None
    return RegLoad(word.text)


def _hop(c: Checks, target: Target, src: Level, dst: Level, word: Word) -> Hop | None:
    names = [i.value for i in Instr]
    if word.text not in names:
        c.error(word.loc, f"unknown instruction '{quoted(word.text)}'" + suggest(word.text, names))
        return None
    instr = Instr(word.text)
    caps = target.capabilities
    allowed = caps.hop_instrs.get((src, dst))
    if allowed is None and src is dst:
        c.error(
            word.loc,
            f"a hop must change level, but this one goes {src.value} -> {dst.value}"
            + _same_level_owners(instr, target, src),
        )
        return None
    if allowed is None:
        c.error(
            word.loc,
            f"there is no direct {src.value} -> {dst.value} hop; stage the tile through smem",
        )
        return None
    if instr not in allowed:
        c.error(
            word.loc,
            _foreign(instr, target, src, dst, allowed)
            or f"'{instr.value}' cannot copy {src.value} -> {dst.value}; "
            f"{one_of(i.value for i in allowed)} does",
        )
        return None
    return Hop(src, dst, instr, word.loc)


def _foreign(instr: Instr, target: Target, src: Level, dst: Level, allowed) -> str:
    """For an instruction only other targets offer, say whose it is and what this one uses."""
    owners = [
        name
        for name in targets.names()
        if name != target.name
        and any(instr in usable for usable in targets.get(name).capabilities.hop_instrs.values())
    ]
    if not owners:
        return ""
    return (
        f"'{instr.value}' is an instruction of target {and_list(owners)}; {target.name} "
        f"copies {src.value} -> {dst.value} with {one_of(i.value for i in allowed)}"
    )


def _same_level_owners(instr: Instr, target: Target, level: Level) -> str:
    """For a level-to-level hop only other targets offer (sm_90a's smem -transpose-> smem),
    whose it is."""
    owners = [
        name
        for name in targets.names()
        if name != target.name
        and instr in targets.get(name).capabilities.hop_instrs.get((level, level), ())
    ]
    if not owners:
        return ""
    return f" ('{instr.value}' is target {and_list(owners)}'s {level.value} -> {level.value} hop)"
