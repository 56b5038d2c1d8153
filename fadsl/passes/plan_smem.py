"""plan_smem: liveness over the schedule, then interval colouring into regions.

Liveness is the textbook backward dataflow over the schedule's control flow:
prologue -> mainloop -> epilogue, plus the mainloop's back edge (and the edge
prologue -> epilogue when the loop may run zero times), so a buffer
read in iteration j+1 that was written in iteration j stays live across the
edge. A buffer occupies every step where it is live or written. Buffers whose
occupied steps are disjoint may share a region; the spec's ``smem_alias``
policy decides whether they do (``scoped``: only tiles of the same sharing
scope, so aliasing never widens a barrier from a warp to the CTA).
"""

from __future__ import annotations

from dataclasses import replace

from .target import PassTarget
from ..errors import Diagnostic, SpecError
from ..ir import AliasPolicy, Buffer, Kernel, Mode, Region, Step

ALIGN = 128  # bytes: keeps every region 128-byte aligned for 16-byte vectors and swizzles


def flow(kernel: Kernel) -> tuple[list[Step], list[list[int]]]:
    """The steps of a tile in program order (no setup or teardown) and each step's
    successors (back edge included)."""
    pro = [i for i in kernel.prologue if isinstance(i, Step)]
    loop = [i for i in kernel.mainloop if isinstance(i, Step)]
    epi = [i for i in kernel.epilogue if isinstance(i, Step)]
    steps = pro + loop + epi
    succ: list[list[int]] = [[i + 1] for i in range(len(steps) - 1)] + [[]]
    if loop:
        first, last = len(pro), len(pro) + len(loop) - 1
        succ[last] = [first] + ([last + 1] if epi else [])
        if kernel.loop_may_be_empty and pro and epi:
            # The loop may run zero times: the prologue's values may reach the epilogue.
            succ[first - 1].append(last + 1)
    return steps, succ


def occupancy(kernel: Kernel) -> dict[str, frozenset[int]]:
    """For each buffer, the indices of the steps (program order) at which it holds data."""
    steps, succ = flow(kernel)
    uses = [{a.buffer for a in s.accesses if a.mode is Mode.READ} for s in steps]
    defs = [{a.buffer for a in s.accesses if a.mode is Mode.WRITE} for s in steps]
    live_in: list[set[str]] = [set() for _ in steps]
    live_out: list[set[str]] = [set() for _ in steps]
    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(steps))):
            out = set().union(*(live_in[j] for j in succ[i]))
            new_in = uses[i] | (out - defs[i])
            if out != live_out[i] or new_in != live_in[i]:
                live_out[i], live_in[i], changed = out, new_in, True
    occupied: dict[str, set[int]] = {b.name: set() for b in kernel.buffers}
    for i in range(len(steps)):
        for name in live_in[i] | live_out[i] | defs[i]:
            occupied[name].add(i)
    return {name: frozenset(idx) for name, idx in occupied.items()}


def live_text(steps: list[Step], idx: frozenset[int]) -> str:
    ops = [steps[i].op.spelling for i in sorted(idx)]
    if not ops:
        return "never"
    return f"{ops[0]}..{ops[-1]}" if len(ops) > 1 else ops[0]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_smem(kernel: Kernel, target: PassTarget) -> Kernel:
    """Place every buffer; the SMEM limit is the kernel's target's."""
    limit = target.capabilities.smem_per_cta
    cfg = kernel.config
    steps, _ = flow(kernel)
    occupied = occupancy(kernel)
    policy = cfg.smem_alias
    regions: list[list[Buffer]] = []
    reasons: list[list[str]] = []
    for buf in sorted(kernel.buffers, key=lambda b: min(occupied[b.name], default=0)):
        for members, why in zip(regions, reasons):
            disjoint = all(not occupied[buf.name] & occupied[m.name] for m in members)
            same_scope = all(m.scope is buf.scope for m in members)
            if policy is AliasPolicy.OFF or not disjoint:
                continue
            if policy is AliasPolicy.SCOPED and not same_scope:
                continue
            for m in members:
                scope = f"both {buf.scope.value}-scoped" if m.scope is buf.scope else "any scope"
                why.append(
                    f"{m.name} (live {live_text(steps, occupied[m.name])}) and {buf.name} "
                    f"(live {live_text(steps, occupied[buf.name])}) are never live at once; "
                    f"{scope}"
                )
            members.append(buf)
            break
        else:
            regions.append([buf])
            reasons.append([])
    planned: dict[str, Buffer] = {}
    out_regions = []
    offset = 0
    for index, (members, why) in enumerate(zip(regions, reasons)):
        size = _align(max(m.nbytes for m in members))
        for m in members:
            planned[m.name] = replace(m, offset=offset, region=index)
        out_regions.append(Region(index, offset, size, tuple(m.name for m in members), tuple(why)))
        offset += size
    if offset > limit:
        where = cfg.loc_of("tile")
        raise SpecError(
            [
                Diagnostic(
                    where,
                    f"the SMEM plan needs {offset} bytes per CTA, over {target.name}'s "
                    f"limit of {limit} bytes; use smaller tiles or smem_alias "
                    "scoped/any",
                )
            ]
        )
    return replace(
        kernel,
        buffers=tuple(planned[b.name] for b in kernel.buffers),
        regions=tuple(out_regions),
        smem_bytes=offset,
    )
