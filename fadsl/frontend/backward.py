"""Lowering, the backward block: its settings and paths read on their own, then the target's
checks (``Target.validate_backward``), which fill in the defaults and build the IR's
``Backward``.

The block reuses the kernel's line syntax and, for its keys, the kernel's readers (a
`tile` line means B_r and B_c, a `stages` line a count ...), each with its own ``Checks`` so
that the block's values and locations never mix with the kernel's. What this module checks
holds for any target: the keys and tensors the block knows, each once; levels, scopes and
instructions that exist. Which path each tensor takes, and what the first kernel supports,
is the target's.
"""

from __future__ import annotations

from typing import Callable

from .. import targets
from ..errors import one_of, quoted, suggest
from ..ir import (
    Backward,
    BackwardTensor,
    GradRole,
    Hop,
    Instr,
    Level,
    Role,
    Scope,
)
from ..spec.checks import BackwardBlock, Checks, and_list
from ..spec.readers import count, on_off, word_choice
from .settings import kernel_settings
from ..spec.syntax import BackwardDecl, PathDecl, Setting, Word

# The block's keys, each read as the kernel's key of that name is; `deterministic on|off`
# orders dQ's accumulation by n-block (bitwise-stable gradients); `overlap on|off` stages dQ
# while dV and dK run; `early_dv on|off` issues dV as soon as P is packed, before dS;
# `dv_before_meeting on|off` issues it after the dS^T store, before the meeting; `dq_lag
# on|off` issues dQ one m-block behind, after dV, so that the consumers never meet; with it,
# `dq_first on|off` issues that dQ before dV, so that its adds run under dV and dK;
# `longest_first on|off` launches every head's first n-block (the causal mask's longest)
# before any head's second; `dq_writer on|off` hands each consumer's staged dQ to a writer
# warp of the producer warpgroup for its bulk reduce-add; `scheduler persistent|grid` runs
# about one CTA per SM over the tiles (the next tile's K and V under this one's epilogue) or
# one CTA per tile (the default); `fused_convert on|off` converts dQ in the main kernel, by
# the CTA whose adds complete each m-block, instead of a convert_dq kernel after it;
# `prefetch_kv on|off` fetches into the L2, with each CTA's last loads, the K and V of the
# CTA launched a wave after it; `dv_out_first on|off` stages and stores dV (by TMA) before
# the last m-block's dQ rather than after it; `peel_dead on|off` lets a consumer warpgroup
# whose keys are all masked in its tile's first m-block skip that m-block's products;
# `late_v on|off` loads V after the first m-block's Q and dO (S^T's first wgmma waits for K
# alone); `dq_chains N` (1 to 4, with `deterministic on` and `dq_writer on`) splits each
# m-block's ordered dQ adds into N chains of tickets summed by the conversion.
KERNEL_KEYS = ("tile", "warpgroups", "registers", "stages")
ON_OFF_KEYS = ("deterministic", "overlap", "early_dv", "dv_before_meeting", "longest_first")
ON_OFF_KEYS += ("dq_writer", "dq_lag", "dq_first", "fused_convert", "prefetch_kv")
ON_OFF_KEYS += ("dv_out_first", "peel_dead", "late_v")


def backward_settings() -> dict[str, Callable[[Checks, Setting], object]]:
    """Each key the block may set, with its reader (the kernel's, a target's for the warp
    specialisation's keys)."""
    kernel = kernel_settings()
    keys = {**{key: kernel[key] for key in KERNEL_KEYS}, **{key: on_off for key in ON_OFF_KEYS}}
    return keys | {"scheduler": _scheduler, "dq_chains": _dq_chains}


def _scheduler(c: Checks, setting: Setting) -> bool | None:
    """The backward's `scheduler persistent` (True) or `grid` (False, the default)."""
    return word_choice(c, setting, {"persistent": True, "grid": False})


# `dq_chains N`: at most 4 chains (each an m-block's accumulator more, in the workspace and
# in the conversion's reads)
MAX_DQ_CHAINS = 4


def _dq_chains(c: Checks, setting: Setting) -> int | None:
    """The backward's `dq_chains N`: chains of dQ tickets per (m-block, share)."""
    return count(c, setting, 1, MAX_DQ_CHAINS)


# The tensors the block may give a path: the forward's inputs and the backward's own.
BACKWARD_TENSORS: dict[str, Role | GradRole] = {
    **{role.value: role for role in (Role.Q, Role.K, Role.V)},
    **{role.value: role for role in GradRole},
}
# A longer path is refused as a whole, not hop by hop (every path has one or two hops).
MAX_HOPS = 4


def read_backward(c: Checks, target: targets.Target | None) -> Backward | None:
    """The spec's backward block, checked by ``target`` (None: the spec's target line is
    missing or wrong, reported already, and only the block's own mistakes are reported).
    None without a block, or when it has errors (each reported through ``c``)."""
    blocks = c.decl.backwards
    if not blocks:
        return None
    for extra in blocks[1:]:
        c.error(
            extra.loc,
            f"a kernel has one backward block (the first is at line {blocks[0].loc.line})",
        )
    block = _read_block(c, blocks[0], target)
    if target is None:
        return None
    if target.validate_backward is None:
        able = [n for n in targets.names() if targets.get(n).validate_backward is not None]
        c.error(
            block.loc,
            f"{target.name} has no backward pass yet; the backward block needs "
            + (f"target {' or '.join(able)}" if able else "a target that has one"),
        )
        return None
    return target.validate_backward(c, block)


def _read_block(c: Checks, decl: BackwardDecl, target: targets.Target | None) -> BackwardBlock:
    checks = Checks(c.decl, c.sink, c.partial)
    _read_settings(checks, decl)
    return BackwardBlock(decl, checks, _read_paths(checks, decl, target))


def _read_settings(c: Checks, decl: BackwardDecl) -> None:
    kernel_keys = kernel_settings()
    readers = backward_settings()
    for setting in decl.settings:
        key = setting.key.text
        if key not in readers:
            _unknown_key(c, setting, kernel_keys)
            continue
        if key in c.key_locs:
            c.error(
                setting.key.loc,
                f"duplicate key '{key}' in the backward block (first set at line "
                f"{c.key_locs[key].line})",
            )
            continue
        c.key_locs[key] = setting.key.loc
        value = readers[key](c, setting)
        if value is not None:
            c.values[key] = value


def _unknown_key(c: Checks, setting: Setting, kernel_keys: dict[str, object]) -> None:
    key = setting.key.text
    if key in kernel_keys:
        c.error(
            setting.key.loc,
            f"'{key}' is a setting of the kernel, not of its backward block: the backward "
            f"takes the kernel's (set it outside the block)",
        )
        return
    if key in BACKWARD_TENSORS:
        hint = f" (a path needs a colon: '{key}: {'rf' if key.startswith('d') else 'gmem'} -...')"
    else:
        hint = suggest(key, backward_settings())
    keys = and_list([f"'{k}'" for k in backward_settings()])
    c.error(
        setting.key.loc, f"unknown key '{quoted(key)}' in the backward block; it takes {keys}{hint}"
    )


def _read_paths(
    c: Checks, decl: BackwardDecl, target: targets.Target | None
) -> dict[Role | GradRole, tuple[BackwardTensor, PathDecl]]:
    paths: dict[Role | GradRole, tuple[BackwardTensor, PathDecl]] = {}
    seen: dict[str, int] = {}
    for path in decl.paths:
        name = path.tensor.text
        if name not in BACKWARD_TENSORS:
            c.error(
                path.tensor.loc,
                f"unknown tensor '{quoted(name)}' in the backward block; it moves "
                f"{and_list(list(BACKWARD_TENSORS))}" + suggest(name, BACKWARD_TENSORS),
            )
            continue
        if name in seen:
            c.error(
                path.tensor.loc,
                f"tensor '{name}' has two paths in the backward block (first at line "
                f"{seen[name]})",
            )
            continue
        seen[name] = path.tensor.loc.line
        tensor = _path(c, BACKWARD_TENSORS[name], path, target)
        if tensor is not None:
            paths[tensor.role] = (tensor, path)
    return paths


def _path(
    c: Checks, role: Role | GradRole, path: PathDecl, target: targets.Target | None
) -> BackwardTensor | None:
    if len(path.hops) > MAX_HOPS:
        c.error(
            path.hops[MAX_HOPS].loc,
            f"{role.value}'s path has {len(path.hops)} hops; a backward path has one or two",
        )
        return None
    ok = True
    levels: list[Level] = []
    scope: Scope | None = None
    offered = target.capabilities.scopes if target is not None else tuple(Scope)
    for ref in path.levels:
        names = [lv.value for lv in Level]
        if ref.name.text not in names:
            c.error(
                ref.name.loc,
                f"unknown memory level '{quoted(ref.name.text)}'; expected {one_of(names)}"
                + suggest(ref.name.text, names),
            )
            ok = False
            continue
        level = Level(ref.name.text)
        levels.append(level)
        if level is not Level.SMEM:
            if ref.scope is not None:
                c.error(
                    ref.scope.loc,
                    f"only smem takes a bracket (its sharing scope), not {level.value}",
                )
                ok = False
            continue
        if ref.scope is None:
            listed = " or ".join(f"smem[{s.value}]" for s in offered)
            c.error(ref.loc, f"smem needs a sharing scope: {listed}")
            ok = False
            continue
        if ref.scope.text not in {s.value for s in offered}:
            c.error(
                ref.scope.loc,
                f"unknown scope '{quoted(ref.scope.text)}'; expected "
                + one_of(s.value for s in offered)
                + suggest(ref.scope.text, [s.value for s in offered]),
            )
            ok = False
            continue
        scope = Scope(ref.scope.text)
    if not ok:
        return None
    hops: list[Hop] = []
    for (src, dst), ref in zip(zip(levels, levels[1:]), path.hops):
        instr = _instr(c, ref.instr)
        if instr is None:
            ok = False
        elif src is dst:
            c.error(
                ref.instr.loc,
                f"a hop must change level, but this one goes {src.value} -> {dst.value}",
            )
            ok = False
        else:
            hops.append(Hop(src, dst, instr, ref.instr.loc))
    if not ok:
        return None
    return BackwardTensor(role, tuple(hops), scope, path.loc)


def _instr(c: Checks, word: Word) -> Instr | None:
    names = [i.value for i in Instr]
    if word.text not in names:
        c.error(word.loc, f"unknown instruction '{quoted(word.text)}'" + suggest(word.text, names))
        return None
    return Instr(word.text)
