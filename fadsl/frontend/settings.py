"""Lowering, part one: the settings (``key value`` lines), each checked on its own.

What a setting means in combination with the others and with the target (tile
shapes the MMA allows, register and SMEM budgets) is checked later, by the target
(fadsl/targets/<t>/validate.py). A knob the grammar accepts but the compiler
cannot yet honour is refused here ("not supported yet"), never silently ignored.
"""

from __future__ import annotations

from typing import Callable

from .. import targets
from ..errors import closest, one_of, quoted, suggest
from ..ir import AliasPolicy, Dtype, Mask, Swizzle, Window
from ..spec.checks import Checks, clip, show
from ..spec.readers import count, number, single, word_choice
from ..spec.syntax import Assign, Call, Number, Setting, Word

HEAD_DIMS = (64, 96, 128, 256)
MAX_TILE = 256
MAX_WARPS = 16

# Every target needs these; a target adds its own (Target.required_keys: sm_80 'warps',
# sm_90a 'warpgroups') and says which optional ones it takes (Target.keys).
REQUIRED_KEYS = ("target", "dtype", "head_dim", "tile")
SPILLS = {"refuse": False, "allow": True}  # `spills allow`: compile a kernel that spills
BACKWARD_ONLY_KEYS = ("deterministic",)  # set in the backward block, hinted at the top level


def read_settings(c: Checks) -> None:
    handlers = kernel_settings()
    for setting in c.decl.settings:
        key = setting.key.text
        if key not in handlers:
            hint = suggest(key, handlers)
            c.suggested.add(closest(key, handlers) or "")
            if key in ("Q", "K", "V", "O"):
                hint = f" (a path needs a colon: '{key}: gmem -cp.async-> ...')"
            if key in BACKWARD_ONLY_KEYS:
                hint = " (a setting of the backward block: put it inside 'backward { ... }')"
            c.error(setting.key.loc, f"unknown key '{quoted(key)}'{hint}")
            continue
        if key in c.key_locs:
            first = c.key_locs[key]
            c.error(setting.key.loc, f"duplicate key '{key}' (first set at line {first.line})")
            continue
        c.key_locs[key] = setting.key.loc
        value = handlers[key](c, setting)
        if value is not None:
            c.values[key] = value


def kernel_settings() -> dict[str, Callable[[Checks, Setting], object]]:
    """Each key a kernel's top level may set, with the function that reads its value: the
    keys every target shares, then each target's own (``Target.settings``; which of them a
    spec's target takes is the lowering's to check, ``Target.keys``)."""
    return {
        "target": target,
        "dtype": dtype,
        "head_dim": head_dim,
        "tile": tile,
        "warps": warps,
        "mask": mask,
        "swizzle": swizzle,
        "smem_alias": smem_alias,
        "stages": stages,
        "spills": spills,
        **targets.settings_readers(),
    }


def target(c: Checks, setting: Setting) -> str | None:
    spellings = (*targets.names(), *targets.RESERVED)
    name = word_choice(c, setting, {spelling: spelling for spelling in spellings})
    if name in targets.RESERVED:
        c.error(setting.values[0].loc, targets.RESERVED[name])
        return None
    return name


def dtype(c: Checks, setting: Setting) -> tuple[Dtype, ...] | None:
    dtypes: list[Dtype] = []
    names = {d.value: d for d in Dtype}
    for value in setting.values:
        if not isinstance(value, Word):
            c.error(value.loc, f"dtype expects {one_of(names)}, not {show(value)}")
            continue
        if value.text not in names:
            hint = suggest(value.text, names)
            if value.text.lower().startswith(("fp8", "float8", "e4m3", "e5m2")):
                hint = f" (the 8-bit floats are 'e4m3' and 'e5m2', on target {_fp8_targets()})"
            c.error(
                value.loc, f"unknown dtype '{quoted(value.text)}'; expected {one_of(names)}{hint}"
            )
            continue
        if names[value.text] in dtypes:
            c.error(value.loc, f"dtype '{value.text}' is listed twice")
            continue
        if dtypes and names[value.text].is_8bit != dtypes[0].is_8bit:
            c.error(value.loc, _mixed_widths(dtypes[0], names[value.text]))
            continue
        dtypes.append(names[value.text])
    return tuple(dtypes) if dtypes and len(dtypes) == len(setting.values) else None


def _fp8_targets() -> str:
    owners = [t for t in targets.names() if Dtype.E4M3 in targets.get(t).capabilities.dtypes]
    return " or ".join(owners)


def _mixed_widths(first: Dtype, other: Dtype) -> str:
    # FP8 wgmma (k32) and 16-bit wgmma (k16) make different kernels, tiles and budgets
    width = {True: "8-bit", False: "16-bit"}
    return (
        f"dtype '{other.value}' is {width[other.is_8bit]} and '{first.value}' "
        f"{width[first.is_8bit]}: a kernel's dtypes are all 8-bit (e4m3, e5m2) or all 16-bit "
        "(bf16, fp16); write a spec for each"
    )


def head_dim(c: Checks, setting: Setting) -> int | None:
    value = single(c, setting)
    if value is None:
        return None
    supported = "64, 96, 128 or 256"
    if not isinstance(value, Number):
        c.error(value.loc, f"head_dim must be a number, not {show(value)}")
        return None
    if value.value not in HEAD_DIMS:
        c.error(value.loc, f"head_dim {clip(value.text)} is not supported; expected {supported}")
        return None
    c.key_locs["head_dim"] = value.loc  # budget errors point at the number
    return value.value


def tile(c: Checks, setting: Setting) -> dict[str, int] | None:
    sizes: dict[str, int] = {}
    for value in setting.values:
        if not isinstance(value, Assign):
            c.error(value.loc, f"'tile' expects 'B_r = N, B_c = N', not {show(value)}")
            continue
        name = value.name.text
        if name not in ("B_r", "B_c"):
            hint = suggest(name, ("B_r", "B_c"))
            c.error(
                value.name.loc,
                f"unknown tile size '{quoted(name)}'; expected 'B_r' or 'B_c'{hint}",
            )
            continue
        if name in sizes:
            c.error(value.name.loc, f"tile size '{name}' is given twice")
            continue
        size = number(c, value.value, name, 16, MAX_TILE)
        if size is not None and size % 16:
            c.error(value.value.loc, f"{name} = {size} is not a multiple of 16 (the mma tile)")
            size = None
        if size is not None:
            sizes[name] = size
            c.key_locs[name] = value.value.loc
    if all(isinstance(v, Assign) for v in setting.values):
        for name in ("B_r", "B_c"):
            if not any(v.name.text == name for v in setting.values):
                c.error(setting.key.loc, f"'tile' is missing '{name} = N'")
    return sizes if len(sizes) == 2 else None


def warps(c: Checks, setting: Setting) -> int | None:
    value = single(c, setting)
    if value is None:
        return None
    warps = number(c, value, "warps", 1, MAX_WARPS)
    if warps is not None and warps & (warps - 1):
        c.error(value.loc, f"warps = {warps} is not a power of two; use 1, 2, 4, 8 or 16")
        return None
    return warps


def mask(c: Checks, setting: Setting) -> Mask | None:
    """`mask none` or `causal`, or a sliding window (sm_90a): `mask window(LEFT, RIGHT)`, or
    `mask causal, window(LEFT)` (the causal mask puts the right side at 0). A window goes to
    c.values['window'] (Window), its call's place to c.key_locs['window']."""
    masks = {m.value: m for m in Mask}
    if not any(isinstance(value, Call) for value in setting.values):
        return word_choice(c, setting, masks)  # the plain masks' messages, as before windows
    causal: Word | None = None
    call: Call | None = None
    ok = True
    for value in setting.values:
        if isinstance(value, Call) and value.name.text == "window" and call is None:
            call = value
        elif isinstance(value, Word) and value.text == "causal" and causal is None:
            causal = value
        else:
            c.error(value.loc, _not_a_window_part(value))
            ok = False
    if call is None or not ok:
        return None
    window = _window(c, call, causal is not None)
    if window is None:
        return None
    c.values["window"] = window
    c.key_locs["window"] = call.loc
    return Mask.CAUSAL if causal is not None else Mask.NONE


WINDOW_FORMS = "'window(LEFT, RIGHT)' or 'causal, window(LEFT)'"
WINDOW_SIDES = ("LEFT", "RIGHT")
MAX_WINDOW = 1 << 24  # keys on a side; a window past every sequence bounds nothing


def _not_a_window_part(value: Word | Number | Call | Assign) -> str:
    """Why a value of a `mask` line that has a window call is not part of the mask."""
    if isinstance(value, Call) and value.name.text == "window":
        return "'mask' takes one window"
    if isinstance(value, Word) and value.text == "causal":
        return "'causal' is given twice"
    if isinstance(value, Word) and value.text == "none":
        return "'none' and a window contradict: a window alone is 'mask window(LEFT, RIGHT)'"
    if isinstance(value, Call):
        hint = suggest(value.name.text, ("window",))
        return f"unknown mask '{quoted(value.name.text)}(...)'; expected {WINDOW_FORMS}{hint}"
    if isinstance(value, Word):
        hint = suggest(value.text, ("causal",))
        return f"unknown mask '{quoted(value.text)}'; expected {WINDOW_FORMS}{hint}"
    return f"'mask' expects {WINDOW_FORMS}, not {show(value)}"


def _window(c: Checks, call: Call, causal: bool) -> Window | None:
    """The sizes of `window(LEFT, RIGHT)` (without the causal mask) or `window(LEFT)` (with
    it: right 0), each a number of keys in [0, MAX_WINDOW]."""
    args = call.args
    if causal and len(args) != 1:
        c.error(
            args[1].loc if len(args) > 1 else call.loc,
            "with 'causal' the window takes LEFT only, 'window(LEFT)': the causal mask puts "
            "its right side at 0 (a right side of its own: 'mask window(LEFT, RIGHT)')",
        )
        return None
    if not causal and len(args) == 1:
        c.error(
            call.loc,
            "window(LEFT) bounds the left side only with the causal mask: 'mask causal, "
            "window(LEFT)'; without it give both sides, 'mask window(LEFT, RIGHT)'",
        )
        return None
    if not causal and len(args) != 2:
        c.error(
            call.loc,
            "window(LEFT, RIGHT) takes 2 numbers (keys left and right of the diagonal), "
            f"got {len(args)}",
        )
        return None
    sizes = [
        number(c, arg, f"window {side}", 0, MAX_WINDOW) for arg, side in zip(args, WINDOW_SIDES)
    ]
    if None in sizes:
        return None
    return Window(sizes[0], 0 if causal else sizes[1])


def swizzle(c: Checks, setting: Setting) -> Swizzle | None | str:
    """`swizzle none`, `xor(B, M, S)`, or a word a target names (``Target.swizzle_words``:
    sm_90a's `128B`, the swizzle TMA writes and wgmma reads)."""
    value = single(c, setting)
    if value is None:
        return None
    words = targets.swizzle_words()
    if isinstance(value, Word) and value.text in ("none", *words):
        c.key_locs["swizzle_value"] = value.loc
        return value.text
    if not isinstance(value, Call) or value.name.text != "xor":
        spelled = "".join(f" or '{w}'" for w in words)
        c.error(value.loc, f"swizzle expects 'none', 'xor(B, M, S)'{spelled}, not {show(value)}")
        return None
    if len(value.args) != 3:
        c.error(value.loc, f"xor(B, M, S) takes 3 numbers, got {len(value.args)}")
        return None
    nums = [number(c, arg, f"xor(B, M, S): {name}", 0, 16) for arg, name in zip(value.args, "BMS")]
    if None in nums:
        return None
    return Swizzle(nums[0], nums[1], nums[2], value.loc)


def spills(c: Checks, setting: Setting) -> bool | None:
    return word_choice(c, setting, SPILLS)


def smem_alias(c: Checks, setting: Setting) -> AliasPolicy | None:
    return word_choice(c, setting, {p.value: p for p in AliasPolicy})


def stages(c: Checks, setting: Setting) -> int | None:
    return count(c, setting, 1, 8)
