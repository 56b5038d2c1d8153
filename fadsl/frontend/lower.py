"""Lower the AST to a validated configuration, the tensors' paths and the mainloop order.

Every problem becomes a located diagnostic; independent problems are collected
and reported together. The work is split by what it checks: the settings
(lower_settings), the paths (lower_paths), the mainloop order (lower_order), the
backward block (frontend/backward.py, then ``Target.validate_backward``) and, once all
are known, the target's own checks (``Target.validate``). The target's
schedule builder turns the result into the IR.
"""

from __future__ import annotations

from .. import targets
from dataclasses import replace

from .backward import read_backward
from .modifiers import read_modifiers
from ..spec.checks import Checks, and_list
from ..errors import DiagnosticSink, quoted
from ..ir import AliasPolicy, Config, Lowered, Mask, Role, Swizzle, Tensor
from .order import read_order
from .paths import read_paths
from .settings import REQUIRED_KEYS, read_settings
from ..spec.syntax import KernelDecl

# The name prefixes every CUDA symbol and file the kernel becomes ("NAME_bf16_kernel",
# "NAME_bf16.cu", cache entries that add a hash): it must stay a short C++ identifier.
MAX_NAME = 64


def lower(decl: KernelDecl, sink: DiagnosticSink, partial: bool = False) -> Lowered | None:
    """Validate a parsed spec; on success return its config, tensors and mainloop order."""
    c = Checks(decl, sink, partial)
    _kernel_name(c)
    read_settings(c)
    # A missing or wrong target line is reported already; its paths are still checked, by
    # the rules of the target the spec's other keys point to, so that their mistakes are
    # reported too, and no key is asked for on a guess.
    known = "target" in c.values
    target = targets.get(c.values["target"]) if known else _likely_target(c)
    if known:
        _report_foreign_dtypes(c, target)
    tensors = read_paths(c, target)
    required = (*REQUIRED_KEYS, *(target.required_keys if known else ()))
    _report_foreign_keys(c, target)
    _report_missing(c, [k for k in required if k not in c.key_locs], c.missing_tensors)
    order = read_order(c, tensors)
    config = _config(c, target, tensors, required)
    # The block is checked whatever the kernel's own lines say, so that its mistakes are
    # reported with theirs; the target's checks of it need a valid target line.
    backward = read_backward(c, target if known else None)
    modifiers = read_modifiers(c)
    if sink.diagnostics or config is None or len(tensors) != len(Role):
        return None
    if modifiers is not None:
        config = replace(config, modifiers=modifiers)
    assert backward is not None or not decl.backwards, "a refused block reports why"
    return Lowered(config, tuple(tensors[r] for r in Role), order, backward)


def _likely_target(c: Checks) -> targets.Target:
    """With no valid target line: the target whose own required keys the spec sets
    ('warpgroups': sm_90a), else the fallback."""
    for name in targets.names():
        target = targets.get(name)
        if target.required_keys and all(k in c.key_locs for k in target.required_keys):
            return target
    return targets.get(targets.FALLBACK)


def _kernel_name(c: Checks) -> None:
    name = c.decl.name
    if len(name.text) > MAX_NAME:
        c.error(
            name.loc,
            f"the kernel name is {len(name.text)} characters long; at most {MAX_NAME} "
            "(it names the CUDA symbols and the files the kernel compiles to)",
        )
    elif name.text.startswith("__") or (name.text[:1] == "_" and name.text[1:2].isupper()):
        c.error(
            name.loc,
            f"kernel name '{name.text}' is reserved in C++ (names that begin with '__' or "
            "'_' and a capital letter); it prefixes the kernel's CUDA symbols",
        )


def _report_missing(c: Checks, keys: list[str], tensors: list[str]) -> None:
    """One message for everything the kernel lacks (a misspelling aside)."""
    keys = [k for k in keys if k not in c.suggested]
    tensors = [t for t in tensors if t not in c.suggested]
    parts = []
    if keys:
        parts.append(("key " if len(keys) == 1 else "keys ") + and_list(f"'{k}'" for k in keys))
    if tensors:
        parts.append(("the path of " if len(tensors) == 1 else "the paths of ") + and_list(tensors))
    if parts:
        name = quoted(c.decl.name.text)
        c.missing(c.decl.loc, f"kernel '{name}' is missing {' and '.join(parts)}")


def _report_foreign_keys(c: Checks, target: targets.Target) -> None:
    """A key that another target takes (sm_80's 'warps' in an sm_90a spec) is refused."""
    if "target" not in c.values:
        return  # the target line is wrong or missing, and reported: no second guess
    own = {*REQUIRED_KEYS, *target.required_keys, *target.keys}
    for setting in c.decl.settings:
        key = setting.key.text
        if key in c.key_locs and key not in own and c.key_locs[key] == setting.key.loc:
            others = [t for t in targets.names() if key in _keys_of(targets.get(t))]
            c.error(
                setting.key.loc,
                f"'{key}' is not a setting of target {target.name}"
                + (f" (it is {and_list(others)}'s)" if others else "")
                + (f"; {target.key_hints[key]}" if key in target.key_hints else ""),
            )
            c.values.pop(key, None)


def _report_foreign_dtypes(c: Checks, target: targets.Target) -> None:
    """A dtype the target does not take (e4m3 on sm_80) is refused at its word, saying
    which targets take it; the dtype line then counts as not set."""
    offered = target.capabilities.dtypes
    listed = {d.value: d for d in c.values.get("dtype", ())}
    for setting in c.decl.settings:
        if setting.key.text != "dtype" or c.key_locs.get("dtype") != setting.key.loc:
            continue
        for value in setting.values:
            dtype = listed.get(getattr(value, "text", None))
            if dtype is None or dtype in offered:
                continue
            owners = [t for t in targets.names() if dtype in targets.get(t).capabilities.dtypes]
            why = " (FP8 wgmma)" if dtype.is_8bit else ""
            c.error(
                value.loc,
                f"dtype {dtype.value} needs target {and_list(owners)}{why}; {target.name} "
                f"takes {and_list([d.value for d in offered])}",
            )
            c.values.pop("dtype", None)


def _keys_of(target: targets.Target) -> set[str]:
    return {*target.required_keys, *target.keys}


def _config(
    c: Checks, target: targets.Target, tensors: dict[Role, Tensor], required: tuple[str, ...]
) -> Config | None:
    v = c.values
    if any(key not in v for key in required):
        return None
    if not target.validate(c, tensors):
        return None
    if target.configure is not None:
        return target.configure(c)
    swizzle = v.get("swizzle")
    return Config(
        name=c.decl.name.text,
        target=v["target"],
        dtypes=v["dtype"],
        head_dim=v["head_dim"],
        block_r=v["tile"]["B_r"],
        block_c=v["tile"]["B_c"],
        warps=v["warps"],
        mask=v.get("mask", Mask.NONE),
        swizzle=swizzle if isinstance(swizzle, Swizzle) else None,
        smem_alias=v.get("smem_alias", AliasPolicy.SCOPED),
        allow_spills=v.get("spills", False),
        window=v.get("window"),  # a target without windows refuses them in its validate
        loc=c.decl.loc,
        key_locs=tuple(sorted(c.key_locs.items())),
    )
