"""Lowering, part two: the tensors' paths through the memory hierarchy and the mainloop order.

A mixin of the lowerer in fadsl.lower: it reports through ``self.error`` and
``self.missing`` and records did-you-mean targets in ``self.suggested``.
"""

from __future__ import annotations

from .errors import DiagnosticSink, Loc, closest, one_of, suggest
from .ir import Hop, Instr, Level, RegLoad, Role, Scope, Tensor
from .syntax import KernelDecl, LoopStep, PathDecl, Word

# The hop each (from, to) pair allows, and the reserved sm_90 instructions.
HOP_INSTRS: dict[tuple[Level, Level], tuple[Instr, ...]] = {
    (Level.GMEM, Level.SMEM): (Instr.CP_ASYNC,),
    (Level.SMEM, Level.RF): (Instr.LDMATRIX, Instr.LDMATRIX_TRANS),
    (Level.RF, Level.SMEM): (Instr.ST_SHARED,),
    (Level.SMEM, Level.GMEM): (Instr.ST_GLOBAL,),
}
RESERVED_INSTRS = (Instr.TMA, Instr.WGMMA)

# Mainloop steps as written in a spec, and the schedule op each one is. 'K(next) -> smem'
# loads the next block's K during this iteration (the prologue loads the first block).
LOOP_STEPS = {
    "K -> smem": "k_g2s",
    "K(next) -> smem": "k_g2s_next",
    "K -> rf": "k_s2r",
    "S = Q @ K^T": "qk",
    "softmax": "softmax",
    "V -> smem": "v_g2s",
    "V(next) -> smem": "v_g2s_next",
    "V -> rf": "v_s2r",
    "O += P @ V": "pv",
}
DEFAULT_ORDER = ("k_g2s", "k_s2r", "qk", "softmax", "v_g2s", "v_s2r", "pv")
OP_TEXT = {op: text for text, op in LOOP_STEPS.items()}


class PathChecks:
    """Paths and mainloop order; mixed into the lowerer."""

    decl: KernelDecl
    sink: DiagnosticSink
    suggested: set[str]
    key_locs: dict[str, Loc]
    missing_tensors: list[str]

    # --- paths --------------------------------------------------------------------

    def paths(self) -> dict[Role, Tensor]:
        tensors: dict[Role, Tensor] = {}
        seen: dict[str, Loc] = {}
        for path in self.decl.paths:
            name = path.tensor.text
            if name not in Role.__members__:
                self.suggested.add(closest(name, Role.__members__) or "")
                self.error(
                    path.tensor.loc,
                    f"unknown tensor '{name}'; a kernel moves Q, K, V and O"
                    + suggest(name, Role.__members__),
                )
                continue
            if name in seen:
                self.error(
                    path.tensor.loc,
                    f"tensor '{name}' has two paths (first at line {seen[name].line})",
                )
                continue
            seen[name] = path.tensor.loc
            tensor = self.path(Role[name], path)
            if tensor is not None:
                tensors[tensor.role] = tensor
        self.missing_tensors = [r.value for r in Role if r.value not in seen]
        return tensors

    def path(self, role: Role, path: PathDecl) -> Tensor | None:
        ok = True
        levels: list[Level] = []
        scope: Scope | None = None
        reg_load = RegLoad.TILE
        for ref in path.levels:
            if ref.name.text not in {lv.value for lv in Level}:
                names = [lv.value for lv in Level]
                self.error(
                    ref.name.loc,
                    f"unknown memory level '{ref.name.text}'; expected {one_of(names)}"
                    + suggest(ref.name.text, names),
                )
                ok = False
                continue
            level = Level(ref.name.text)
            levels.append(level)
            if level is Level.RF and ref.scope is not None:
                loaded = self.reg_load(role, ref.scope)
                ok = ok and loaded is not None
                reg_load = loaded or reg_load
                continue
            if level is not Level.SMEM:
                if ref.scope is not None:
                    self.error(ref.scope.loc, f"only smem takes a sharing scope, not {level.value}")
                    ok = False
                continue
            if ref.scope is None:
                self.error(ref.loc, "smem needs a sharing scope: smem[warp] or smem[cta]")
                ok = False
                continue
            names = [s.value for s in Scope]
            if ref.scope.text not in names:
                self.error(
                    ref.scope.loc,
                    f"unknown scope '{ref.scope.text}'; expected 'warp' or 'cta'"
                    + suggest(ref.scope.text, names),
                )
                ok = False
            elif ref.scope.text == Scope.WARPGROUP.value:
                self.error(ref.scope.loc, "scope 'warpgroup' is not supported yet (sm_90 path)")
                ok = False
            else:
                scope = Scope(ref.scope.text)
        if not ok:
            return None
        hops: list[Hop] = []
        for (src, dst), ref in zip(zip(levels, levels[1:]), path.hops):
            hop = self.hop(src, dst, ref.instr)
            if hop is None:
                ok = False
            else:
                hops.append(hop)
        if not ok:
            return None
        if not self.path_shape(role, path, levels, hops, scope):
            return None
        assert scope is not None
        return Tensor(role, tuple(hops), scope, path.loc, reg_load)

    def reg_load(self, role: Role, word: Word) -> RegLoad | None:
        """The bracket of an input's ``rf`` level: how its tile is loaded into registers."""
        if role is Role.O:
            self.error(
                word.loc,
                "O is accumulated in registers by the mma; its rf level takes no bracket",
            )
            return None
        names = [r.value for r in RegLoad]
        if word.text in [s.value for s in Scope]:
            self.error(
                word.loc,
                f"rf takes no sharing scope ('{word.text}'): registers belong to one thread; "
                "its bracket says how the tile is loaded, 'tile' or 'frag'",
            )
            return None
        if word.text not in names:
            self.error(
                word.loc,
                f"unknown register load '{word.text}'; expected 'tile' (the whole tile, by its "
                "own mainloop step) or 'frag' (one k16 slice at a time, inside the mma)"
                + suggest(word.text, names),
            )
            return None
        return RegLoad(word.text)

    def hop(self, src: Level, dst: Level, word: Word) -> Hop | None:
        names = [i.value for i in Instr]
        if word.text not in names:
            self.error(word.loc, f"unknown instruction '{word.text}'" + suggest(word.text, names))
            return None
        instr = Instr(word.text)
        if instr in RESERVED_INSTRS:
            self.error(word.loc, f"instruction '{instr.value}' is not supported yet (sm_90 path)")
            return None
        if src is dst:
            self.error(
                word.loc, f"a hop must change level, but this one goes {src.value} -> {dst.value}"
            )
            return None
        allowed = HOP_INSTRS.get((src, dst))
        if allowed is None:
            self.error(
                word.loc,
                f"there is no direct {src.value} -> {dst.value} hop; stage the tile through smem",
            )
            return None
        if instr not in allowed:
            self.error(
                word.loc,
                f"'{instr.value}' cannot copy {src.value} -> {dst.value}; "
                f"{one_of(i.value for i in allowed)} does",
            )
            return None
        return Hop(src, dst, instr, word.loc)

    def path_shape(self, role, path, levels, hops, scope) -> bool:
        where = path.tensor.loc
        if role is Role.O:
            if levels[0] is not Level.RF:
                self.error(
                    path.levels[0].name.loc,
                    "O is the output: its path starts in registers (rf), where the mma "
                    f"accumulates it, not in {levels[0].value}",
                )
                return False
            if levels != [Level.RF, Level.SMEM, Level.GMEM]:
                self.error(where, "O must go rf -st.shared-> smem[...] -st.global-> gmem")
                return False
        else:
            if levels[0] is not Level.GMEM:
                self.error(
                    path.levels[0].name.loc,
                    f"{role.value} is an input: its path starts in gmem, not {levels[0].value}",
                )
                return False
            if Level.RF not in levels:
                self.error(
                    path.levels[-1].name.loc,
                    f"{role.value} never reaches registers (rf), where the mma reads its operands",
                )
                return False
            if levels[-1] is not Level.RF:
                self.error(
                    path.levels[-1].name.loc,
                    f"{role.value}'s path must end in rf: {role.value} must go "
                    "gmem -cp.async-> smem[...] -ldmatrix-> rf",
                )
                return False
            if levels != [Level.GMEM, Level.SMEM, Level.RF]:
                self.error(where, f"{role.value} must go gmem -cp.async-> smem[...] -ldmatrix-> rf")
                return False
            want = Instr.LDMATRIX_TRANS if role is Role.V else Instr.LDMATRIX
            load = hops[1]
            if load.instr is not want:
                why = {
                    Role.Q: "Q is the A operand of S = Q @ K^T, read row-major",
                    Role.K: "K is the B operand of S = Q @ K^T; row-major K is K^T column-major",
                    Role.V: "V is the B operand of O += P @ V and must be transposed on load",
                }[role]
                self.error(load.loc, f"{role.value} must be loaded with '{want.value}': {why}")
                return False
        return True

    # --- mainloop order -------------------------------------------------------------

    def order(self, tensors: dict[Role, Tensor]) -> tuple[tuple[str, Loc], ...]:
        frag = {role for role, t in tensors.items() if t.reg_load is RegLoad.FRAG}
        default = tuple(op for op in DEFAULT_ORDER if op not in _fused_loads(frag))
        loops = self.decl.mainloops
        if not loops:
            return tuple((op, self.decl.loc) for op in default)
        for extra in loops[1:]:
            self.error(extra.loc, f"duplicate mainloop (first at line {loops[0].loc.line})")
        loop = loops[0]
        placed: dict[str, LoopStep] = {}
        for step in loop.steps:
            op = self.loop_op(step, tensors, frag)
            if op is None:
                continue
            twin = _twin_load(op)
            if op in placed:
                self.error(
                    step.loc,
                    f"'{step.text()}' appears twice in the mainloop (first at line "
                    f"{placed[op].loc.line})",
                )
                continue
            if twin in placed:
                self.error(
                    step.loc,
                    f"'{step.text()}' loads the same tile as '{placed[twin].text()}' (line "
                    f"{placed[twin].loc.line}); an iteration loads either its own block or, "
                    "ahead, the next one",
                )
                continue
            placed[op] = step
        absent = [op for op in default if not {op, _twin_load(op)} & (set(placed) | self.suggested)]
        if absent:
            self.missing(
                loop.loc, f"the mainloop is missing {_and(repr(OP_TEXT[op]) for op in absent)}"
            )
        position = {op: i for i, op in enumerate(placed)}
        for earlier, later, why in _dependencies(frag):
            if earlier in position and later in position and position[later] < position[earlier]:
                self.error(
                    placed[later].loc,
                    f"'{OP_TEXT[later]}' must come after '{OP_TEXT[earlier]}': {why}",
                )
        return tuple((op, step.loc) for op, step in placed.items())

    def loop_op(self, step: LoopStep, tensors: dict[Role, Tensor], frag: set[Role]) -> str | None:
        text = step.text()
        first = step.words[0]
        if text in LOOP_STEPS:
            op = LOOP_STEPS[text]
            role = Role(first.text) if first.text in ("K", "V") else None
            if role in frag and op == f"{first.text.lower()}_s2r":
                self.error(
                    step.loc,
                    f"'{text}' is not a step of its own here: {role.value}'s path ends in "
                    f"rf[frag] (line {tensors[role].loc.line}), so "
                    f"'{OP_TEXT[_fused_reader(role)]}' loads it one k16 slice at a time; "
                    "drop this line",
                )
                return None
            return op
        if step.form == "move_next" and step.words[1].text != "next":
            if first.text in ("K", "V"):
                self.suggested.add(f"{first.text.lower()}_g2s_next")
            self.error(
                step.words[1].loc,
                f"unknown block '{step.words[1].text}' in '{text}'; only "
                f"'{first.text}(next) -> smem' (the next block's tile, loaded ahead) exists",
            )
        elif step.form in ("move", "move_next") and first.text in ("Q", "O"):
            self.error(
                step.loc,
                f"{first.text} moves once, in the {'prologue' if first.text == 'Q' else 'epilogue'};"
                " the mainloop moves only K and V",
            )
        elif step.form == "move" and first.text in ("K", "V"):
            self.error(
                step.words[1].loc,
                f"in the mainloop {first.text} moves to 'smem' and then to 'rf', "
                f"not to '{step.words[1].text}'",
            )
        elif step.form == "move_next" and first.text in ("K", "V"):
            self.error(
                step.words[2].loc,
                f"'{first.text}(next)' is loaded ahead into 'smem', not '{step.words[2].text}'",
            )
        elif closest(text, LOOP_STEPS):
            self.suggested.add(LOOP_STEPS[closest(text, LOOP_STEPS)])
            self.error(step.loc, f"unknown mainloop step '{text}'" + suggest(text, LOOP_STEPS))
        else:
            self.error(
                step.loc,
                f"unknown mainloop step '{text}'; expected one of: "
                + ", ".join(f"'{s}'" for s in LOOP_STEPS),
            )
        return None


def _fused_reader(role: Role) -> str:
    """The mma step that reads ``role``'s SMEM tile itself when it is loaded fragment-wise."""
    return "qk" if role in (Role.Q, Role.K) else "pv"


def _fused_loads(frag: set[Role]) -> set[str]:
    """The smem -> rf steps that fragment-wise loading folds into the mma."""
    return {f"{r.value.lower()}_s2r" for r in frag if r in (Role.K, Role.V)}


def _twin_load(op: str) -> str:
    """'k_g2s' <-> 'k_g2s_next': two ways to load the same tile; a loop uses one."""
    if op in ("k_g2s", "v_g2s"):
        return op + "_next"
    return op.removesuffix("_next") if op.endswith("_g2s_next") else ""


def _dependencies(frag: set[Role]) -> list[tuple[str, str, str]]:
    """(earlier, later, why): the order the mainloop's steps must keep."""

    def load(role: Role, mma: str) -> list[tuple[str, str, str]]:
        t = role.value
        g2s, s2r = f"{t.lower()}_g2s", f"{t.lower()}_s2r"
        wrote = f"it reads the {t} tile that '{t} -> smem' writes"
        if role in frag:
            return [(g2s, mma, wrote)]
        return [
            (g2s, s2r, wrote),
            (s2r, mma, f"it multiplies the {t} fragments that '{t} -> rf' loads"),
        ]

    def ahead(role: Role, mma: str) -> tuple[str, str, str]:
        t = role.value
        reader = mma if role in frag else f"{t.lower()}_s2r"
        why = f"it overwrites the {t} tile that '{OP_TEXT[reader]}' still reads in this iteration"
        return (reader, f"{t.lower()}_g2s_next", why)

    return [
        *load(Role.K, "qk"),
        ("qk", "softmax", "it normalises the scores S that 'S = Q @ K^T' computes"),
        ("softmax", "pv", "it multiplies the probabilities P that 'softmax' produces"),
        *load(Role.V, "pv"),
        ahead(Role.K, "qk"),
        ahead(Role.V, "pv"),
    ]


def _scope_loc(decl: KernelDecl, role: Role) -> Loc:
    for path in decl.paths:
        if path.tensor.text == role.value:
            for level in path.levels:
                if level.scope is not None:
                    return level.scope.loc
            return path.loc
    return decl.loc


def _and(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
