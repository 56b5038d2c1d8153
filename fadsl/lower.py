"""Lower the AST to the IR, validating as we go.

Every problem becomes a located diagnostic; independent problems are collected
and reported together. A knob the grammar accepts but the compiler cannot yet
honour is refused here ("not supported yet"), never silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .errors import DiagnosticSink, Loc, closest, one_of, suggest
from .ir import (
    AliasPolicy,
    Config,
    Dtype,
    Mask,
    RegLoad,
    Role,
    Scope,
    Swizzle,
    Target,
    Tensor,
)
from .lower_paths import (
    PathChecks,
    _and,
    _scope_loc,
)  # noqa: F401
from .syntax import Assign, Call, KernelDecl, Number, Setting, Word

HEAD_DIMS = (64, 96, 128, 256)
MAX_TILE = 256
MAX_WARPS = 16
REGISTERS_PER_THREAD = 255


REQUIRED_KEYS = ("target", "dtype", "head_dim", "tile", "warps")
OPTIONAL_KEYS = ("mask", "swizzle", "smem_alias", "stages")


@dataclass(frozen=True)
class Lowered:
    config: Config
    tensors: tuple[Tensor, ...]
    order: tuple[tuple[str, Loc], ...]  # mainloop ops with the location that asked for each


class _Lowerer(PathChecks):
    def __init__(self, decl: KernelDecl, sink: DiagnosticSink, partial: bool) -> None:
        self.decl = decl
        self.sink = sink
        self.partial = partial  # syntax errors removed lines: don't report missing things
        self.values: dict[str, object] = {}
        # Names a did-you-mean already pointed at: not reported again as missing.
        self.suggested: set[str] = set()
        self.key_locs: dict[str, Loc] = {}

    def error(self, loc: Loc, message: str) -> None:
        self.sink.error(loc, message)

    def missing(self, loc: Loc, message: str) -> None:
        if not self.partial:
            self.error(loc, message)

    # --- settings ---------------------------------------------------------------

    def settings(self) -> None:
        handlers: dict[str, Callable[[Setting], object]] = {
            "target": self.target,
            "dtype": self.dtype,
            "head_dim": self.head_dim,
            "tile": self.tile,
            "warps": self.warps,
            "mask": self.mask,
            "swizzle": self.swizzle,
            "smem_alias": self.smem_alias,
            "stages": self.stages,
        }
        for setting in self.decl.settings:
            key = setting.key.text
            if key not in handlers:
                hint = suggest(key, handlers)
                self.suggested.add(closest(key, handlers) or "")
                if key in ("Q", "K", "V", "O"):
                    hint = f" (a path needs a colon: '{key}: gmem -cp.async-> ...')"
                self.error(setting.key.loc, f"unknown key '{key}'{hint}")
                continue
            if key in self.key_locs:
                first = self.key_locs[key]
                self.error(
                    setting.key.loc, f"duplicate key '{key}' (first set at line {first.line})"
                )
                continue
            self.key_locs[key] = setting.key.loc
            value = handlers[key](setting)
            if value is not None:
                self.values[key] = value

    def single(self, setting: Setting) -> Word | Number | Call | Assign | None:
        if len(setting.values) != 1:
            extra = setting.values[1]
            self.error(extra.loc, f"'{setting.key.text}' takes one value")
            return None
        return setting.values[0]

    def word_choice(self, setting: Setting, choices: dict[str, object]) -> object | None:
        value = self.single(setting)
        if value is None:
            return None
        if not isinstance(value, Word):
            self.error(
                value.loc, f"'{setting.key.text}' expects {one_of(choices)}, not {_show(value)}"
            )
            return None
        if value.text not in choices:
            self.error(
                value.loc,
                f"unknown {setting.key.text} '{value.text}'; expected {one_of(choices)}"
                + suggest(value.text, choices),
            )
            return None
        return choices[value.text]

    def number(self, value: object, what: str, lo: int, hi: int) -> int | None:
        if not isinstance(value, Number):
            self.error(value.loc, f"{what} must be a number, not {_show(value)}")
            return None
        if not lo <= value.value <= hi:
            self.error(value.loc, f"{what} = {_clip(value.text)} is out of range ({lo} to {hi})")
            return None
        return value.value

    def target(self, setting: Setting) -> Target | None:
        target = self.word_choice(setting, {t.value: t for t in Target})
        if target is Target.SM90A:
            self.error(
                setting.values[0].loc,
                "target 'sm_90a' is not supported yet (reserved for the TMA/wgmma path); "
                "use 'sm_80', which runs on sm_80 to sm_90",
            )
            return None
        return target

    def dtype(self, setting: Setting) -> tuple[Dtype, ...] | None:
        dtypes: list[Dtype] = []
        names = {d.value: d for d in Dtype}
        for value in setting.values:
            if not isinstance(value, Word):
                self.error(value.loc, f"dtype expects {one_of(names)}, not {_show(value)}")
                continue
            if value.text not in names:
                hint = suggest(value.text, names)
                self.error(
                    value.loc, f"unknown dtype '{value.text}'; expected {one_of(names)}{hint}"
                )
                continue
            if names[value.text] in dtypes:
                self.error(value.loc, f"dtype '{value.text}' is listed twice")
                continue
            dtypes.append(names[value.text])
        return tuple(dtypes) if dtypes and len(dtypes) == len(setting.values) else None

    def head_dim(self, setting: Setting) -> int | None:
        value = self.single(setting)
        if value is None:
            return None
        supported = "64, 96, 128 or 256"
        if not isinstance(value, Number):
            self.error(value.loc, f"head_dim must be a number, not {_show(value)}")
            return None
        if value.value not in HEAD_DIMS:
            self.error(
                value.loc, f"head_dim {_clip(value.text)} is not supported; expected {supported}"
            )
            return None
        self.key_locs["head_dim"] = value.loc  # budget errors point at the number
        return value.value

    def tile(self, setting: Setting) -> dict[str, int] | None:
        sizes: dict[str, int] = {}
        for value in setting.values:
            if not isinstance(value, Assign):
                self.error(value.loc, f"'tile' expects 'B_r = N, B_c = N', not {_show(value)}")
                continue
            name = value.name.text
            if name not in ("B_r", "B_c"):
                hint = suggest(name, ("B_r", "B_c"))
                self.error(
                    value.name.loc, f"unknown tile size '{name}'; expected 'B_r' or 'B_c'{hint}"
                )
                continue
            if name in sizes:
                self.error(value.name.loc, f"tile size '{name}' is given twice")
                continue
            size = self.number(value.value, name, 16, MAX_TILE)
            if size is not None and size % 16:
                self.error(
                    value.value.loc, f"{name} = {size} is not a multiple of 16 (the mma tile)"
                )
                size = None
            if size is not None:
                sizes[name] = size
                self.key_locs[name] = value.value.loc
        if all(isinstance(v, Assign) for v in setting.values):
            for name in ("B_r", "B_c"):
                if not any(v.name.text == name for v in setting.values):
                    self.error(setting.key.loc, f"'tile' is missing '{name} = N'")
        return sizes if len(sizes) == 2 else None

    def warps(self, setting: Setting) -> int | None:
        value = self.single(setting)
        if value is None:
            return None
        warps = self.number(value, "warps", 1, MAX_WARPS)
        if warps is not None and warps & (warps - 1):
            self.error(value.loc, f"warps = {warps} is not a power of two; use 1, 2, 4, 8 or 16")
            return None
        return warps

    def mask(self, setting: Setting) -> Mask | None:
        return self.word_choice(setting, {m.value: m for m in Mask})

    def swizzle(self, setting: Setting) -> Swizzle | None | str:
        value = self.single(setting)
        if value is None:
            return None
        if isinstance(value, Word) and value.text == "none":
            return "none"
        if not isinstance(value, Call) or value.name.text != "xor":
            self.error(value.loc, f"swizzle expects 'none' or 'xor(B, M, S)', not {_show(value)}")
            return None
        if len(value.args) != 3:
            self.error(value.loc, f"xor(B, M, S) takes 3 numbers, got {len(value.args)}")
            return None
        nums = [
            self.number(arg, f"xor(B, M, S): {name}", 0, 16) for arg, name in zip(value.args, "BMS")
        ]
        if None in nums:
            return None
        return Swizzle(nums[0], nums[1], nums[2], value.loc)

    def smem_alias(self, setting: Setting) -> AliasPolicy | None:
        return self.word_choice(setting, {p.value: p for p in AliasPolicy})

    def stages(self, setting: Setting) -> int | None:
        value = self.single(setting)
        if value is None:
            return None
        stages = self.number(value, "stages", 1, 8)
        if stages is not None and stages > 1:
            self.error(value.loc, f"stages = {stages} is not supported yet (one K/V stage for now)")
            return None
        return stages

    def report_missing(self, keys: list[str], tensors: list[str]) -> None:
        """One message for everything the kernel lacks (a misspelling aside)."""
        keys = [k for k in keys if k not in self.suggested]
        tensors = [t for t in tensors if t not in self.suggested]
        parts = []
        if keys:
            parts.append(("key " if len(keys) == 1 else "keys ") + _and(f"'{k}'" for k in keys))
        if tensors:
            parts.append(("the path of " if len(tensors) == 1 else "the paths of ") + _and(tensors))
        if parts:
            self.missing(
                self.decl.loc, f"kernel '{self.decl.name.text}' is missing {' and '.join(parts)}"
            )

    # --- cross-field checks -----------------------------------------------------------

    def config(self, tensors: dict[Role, Tensor]) -> Config | None:
        v = self.values
        if any(key not in v for key in REQUIRED_KEYS):
            return None
        tile = v["tile"]
        block_r, block_c = tile["B_r"], tile["B_c"]
        warps, head_dim = v["warps"], v["head_dim"]
        ok = True
        if block_r % (16 * warps):
            self.error(
                self.key_locs["B_r"],
                f"B_r = {block_r} is not divisible by 16 x warps = {16 * warps}: "
                "each warp owns a whole number of 16-row mma tiles",
            )
            ok = False
        per_warp = block_c * head_dim * 2 // warps
        if block_c % warps or per_warp % 512:
            self.error(
                self.key_locs["B_c"],
                f"B_c = {block_c} with {warps} warps leaves each warp {per_warp} bytes of a K/V "
                "tile to copy, not a whole number of 512-byte warp-wide cp.async rounds",
            )
            ok = False
        rows = block_r // warps
        if ok and not self.registers_fit(tensors, rows, block_c, head_dim):
            ok = False
        swizzle = v.get("swizzle")
        if isinstance(swizzle, Swizzle) and not self.swizzle_fits(swizzle, head_dim):
            ok = False
        for role in (Role.K, Role.V):
            tensor = tensors.get(role)
            if tensor is not None and tensor.smem_scope is Scope.WARP and warps > 1:
                self.error(
                    _scope_loc(self.decl, role),
                    f"{role.value}'s SMEM tile is declared warp-scoped, but every warp reads all "
                    f"of it (each warp multiplies its query rows by all {block_c} keys): with "
                    f"{warps} warps that is a race; declare smem[cta]",
                )
                ok = False
        for role in (Role.Q, Role.O):
            tensor = tensors.get(role)
            if tensor is not None and tensor.smem_scope is Scope.CTA:
                self.error(
                    _scope_loc(self.decl, role),
                    f"{role.value} in smem[cta] (a CTA-wide copy of the whole tile) is not "
                    "supported yet; each warp moves its own rows: smem[warp]",
                )
                ok = False
        if not ok:
            return None
        return Config(
            name=self.decl.name.text,
            target=v["target"],
            dtypes=v["dtype"],
            head_dim=head_dim,
            block_r=block_r,
            block_c=block_c,
            warps=warps,
            mask=v.get("mask", Mask.NONE),
            swizzle=swizzle if isinstance(swizzle, Swizzle) else None,
            smem_alias=v.get("smem_alias", AliasPolicy.SCOPED),
            loc=self.decl.loc,
            key_locs=tuple(sorted(self.key_locs.items())),
        )

    def registers_fit(
        self, tensors: dict[Role, Tensor], rows: int, block_c: int, head_dim: int
    ) -> bool:
        """Registers per thread (4 bytes, 32 lanes) live through each mma must fit the budget.

        An estimate, deliberately simple: the larger of the two mma steps' operands and
        accumulators, plus Q's fragments for the whole loop when Q is loaded as a tile. A
        tile loaded fragment-wise costs one k16 slice. (nvcc's 0-spill check is the real guard.)
        """

        def whole(role: Role) -> bool:
            tensor = tensors.get(role)
            return tensor is None or tensor.reg_load is RegLoad.TILE

        def operand(role: Role, tile_rows: int, slice_regs: int) -> tuple[str, int]:
            if whole(role):
                return f"the whole {role.value} tile", tile_rows * head_dim // 64
            return f"a k16 slice of {role.value}", slice_regs

        o = ("O accumulators", rows * head_dim // 32)
        q = operand(Role.Q, rows, rows // 4)
        phases = {
            "S = Q @ K^T": [o, q, operand(Role.K, block_c, block_c // 4)],
            "O += P @ V": [o, ("P", rows * block_c // 64), operand(Role.V, block_c, head_dim // 4)],
        }
        if whole(Role.Q):
            phases["O += P @ V"].append(("Q fragments held through the loop", q[1]))
        step, parts = max(phases.items(), key=lambda kv: sum(n for _, n in kv[1]))
        need = sum(n for _, n in parts)
        if need <= REGISTERS_PER_THREAD:
            return True
        tiles = [r.value for r in (Role.Q, Role.K, Role.V) if whole(r)]
        hint = "use a smaller B_c or more warps"
        if tiles:
            paths = f"{tiles[0]}'s path" if len(tiles) == 1 else f"the paths of {_and(tiles)}"
            hint = f"load fragment-wise (end {paths} in rf[frag]), or " + hint
        listed = _and(f"{what} ({n})" for what, n in parts)
        self.error(
            self.key_locs["head_dim"],
            f"head_dim {head_dim} with B_c = {block_c} and {rows} query rows per warp does not "
            f"fit the {REGISTERS_PER_THREAD}-register budget per thread: during '{step}', "
            f"{listed} need {need}; {hint}",
        )
        return False

    def swizzle_fits(self, swz: Swizzle, head_dim: int) -> bool:
        """The swizzle must keep 16-byte chunks whole and stay inside one row."""
        if swz.base < 3:
            self.error(
                swz.loc,
                f"xor(B, M, S) with M = {swz.base} splits the 16-byte chunks that cp.async and "
                "ldmatrix move (M must be at least 3 for 2-byte elements)",
            )
            return False
        if swz.shift < swz.bits:
            self.error(swz.loc, f"xor(B, M, S) needs S >= B, got S = {swz.shift}, B = {swz.bits}")
            return False
        if head_dim & (head_dim - 1):
            self.error(swz.loc, f"a swizzle needs rows of a power-of-two length, not {head_dim}")
            return False
        if swz.base + swz.bits > head_dim.bit_length() - 1:
            self.error(
                swz.loc,
                f"xor({swz.bits}, {swz.base}, {swz.shift}) permutes spans of "
                f"{1 << (swz.base + swz.bits)} elements, wider than a {head_dim}-element row "
                f"(need M + B <= {head_dim.bit_length() - 1})",
            )
            return False
        return True


def _show(value: object) -> str:
    match value:
        case Word(text=text):
            return f"'{text}'"
        case Number(text=text):
            return f"the number {_clip(text)}"
        case Call(name=name):
            return f"'{name.text}(...)'"
        case Assign(name=name):
            return f"'{name.text} = ...'"
        case _:
            raise AssertionError(f"unknown value {value!r}")


def _clip(text: str) -> str:
    return text if len(text) <= 20 else text[:8] + "..." + f" ({len(text)} digits)"


def lower(decl: KernelDecl, sink: DiagnosticSink, partial: bool = False) -> Lowered | None:
    """Validate a parsed spec; on success return its config, tensors and mainloop order."""
    lowerer = _Lowerer(decl, sink, partial)
    lowerer.settings()
    tensors = lowerer.paths()
    lowerer.report_missing(
        [k for k in REQUIRED_KEYS if k not in lowerer.key_locs], lowerer.missing_tensors
    )
    order = lowerer.order(tensors)
    config = lowerer.config(tensors)
    if sink.diagnostics or config is None or len(tensors) != len(Role):
        return None
    return Lowered(config, tuple(tensors[r] for r in Role), order)
