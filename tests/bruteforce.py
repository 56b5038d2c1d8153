"""A brute-force SMEM race detector for fadsl schedules, independent of verify.

It simulates the CTA instead of scanning pairs of accesses. The CTA is W warps of
two lanes each (two lanes are enough to show that lanes of one warp exchange
data); every lane runs the trace prologue + n iterations + epilogue as a
sequential program, with a vector clock. An access of warp w is made by both of
its lanes over the warp's bytes. ``__syncthreads()`` joins the clocks of all
lanes, ``__syncwarp()`` those of one warp's lanes; program order orders only a
lane's own accesses. A cp.async write is in flight from its issue until the
lane's ``cp.async.wait_group N`` retires its group (all but the N newest
groups); it then counts as performed at the wait. Two conflicting accesses
(overlapping bytes, at least one write) race unless the earlier happens before
the later; any access to the bytes of an in-flight write races. Accesses of one
warp within one step are the step's own business and never race.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fadsl.ir import Kernel, Mode, Partition, Step
from fadsl.targets.sm80 import caps as sm80

LANES = 2


@dataclass(frozen=True)
class _Rec:
    lane: int  # global lane id: warp * LANES + lane
    clock: int
    pos: int  # trace position of the step
    warp: int
    lo: int
    hi: int
    write: bool
    what: str


def _bytes(kernel: Kernel, buffer: str, part: Partition, warp: int) -> tuple[int, int]:
    buf = kernel.buffer(buffer)
    if part is Partition.WHOLE:
        return buf.offset, buf.offset + buf.nbytes
    per_row = buf.cols * buf.elem_bytes
    first = warp * buf.rows // kernel.config.warps
    last = (warp + 1) * buf.rows // kernel.config.warps
    return buf.offset + first * per_row, buf.offset + last * per_row


def _simulate(kernel: Kernel, n: int) -> list[str]:
    warps = kernel.config.warps
    lanes = warps * LANES
    clocks = [[int(i == j) for j in range(lanes)] for i in range(lanes)]
    done: list[_Rec] = []  # performed accesses
    groups: list[list[list[_Rec]]] = [[] for _ in range(lanes)]  # per lane: committed groups
    found: list[str] = []

    def join(members: list[int]) -> None:
        top = [max(clocks[m][k] for m in members) for k in range(lanes)]
        for m in members:
            clocks[m] = top[:]
            clocks[m][m] += 1

    items = list(kernel.prologue)
    where = ["prologue" for _ in kernel.prologue]
    for it in range(n):
        items += kernel.mainloop
        where += [f"mainloop #{it}" for _ in kernel.mainloop]
    items += kernel.epilogue
    where += ["epilogue" for _ in kernel.epilogue]

    for pos, item in enumerate(items):
        if not isinstance(item, Step):
            if item.kind is sm80.SYNCTHREADS:
                join(list(range(lanes)))
            elif item.kind is sm80.SYNCWARP:
                for w in range(warps):
                    join([w * LANES + k for k in range(LANES)])
            else:
                for lane in range(lanes):
                    retire = max(0, len(groups[lane]) - item.groups)
                    for group in groups[lane][:retire]:
                        done.extend(replace(r, clock=clocks[lane][lane]) for r in group)
                    groups[lane] = groups[lane][retire:]
                    clocks[lane][lane] += 1
            continue
        for lane in range(lanes):
            warp = lane // LANES
            mine: list[_Rec] = []
            for acc in item.accesses:
                lo, hi = _bytes(kernel, acc.buffer, acc.partition, warp)
                write = acc.mode is Mode.WRITE
                what = f"{item.op.spelling} [{where[pos]}] {acc.mode.value}s {acc.buffer} as warp {warp}"
                rec = _Rec(lane, clocks[lane][lane], pos, warp, lo, hi, write, what)
                in_flight = [r for g in groups for grp in g for r in grp]
                for r, flying in [(r, False) for r in done] + [(r, True) for r in in_flight]:
                    if not (r.write or write) or r.hi <= lo or hi <= r.lo:
                        continue
                    if r.pos == pos and r.warp == warp:
                        continue
                    if flying or r.clock > clocks[lane][r.lane]:
                        state = "in flight " if flying else ""
                        found.append(f"{r.what} ({state}lane {r.lane}) races {what} (lane {lane})")
                (mine if item.is_async and write else done).append(rec)
            if item.is_async:
                groups[lane].append(mine)
            clocks[lane][lane] += 1
    return found


def races(kernel: Kernel, max_iterations: int = 3) -> list[str]:
    """Every race in the traces with 1 (0 if the loop may be empty) .. max_iterations
    mainloop iterations."""
    first = 0 if kernel.loop_may_be_empty else 1
    return [race for n in range(first, max_iterations + 1) for race in _simulate(kernel, n)]
