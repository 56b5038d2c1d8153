"""verify: an independent proof that the schedule's syncs order every SMEM hazard.

It shares no logic with insert_barriers or plan_smem, only data: the IR and the
target's sync model, whose kinds it reads by their fields (the warps a barrier
meets, the async writes a wait completes and its rule). The schedule is unrolled
into the traces prologue + n mainloop iterations + epilogue for n = 1 and 2, and
n = 0 when ``kernel.loop_may_be_empty`` (a pair of accesses two back edges apart
has a window that contains the window of the same pair one edge apart, so longer
traces add nothing). Every access becomes one byte interval per warp (SLICE: warp
w's rows of the buffer; WHOLE: the whole buffer), and every pair of accesses, the
earlier one at trace position i and the later at j, that overlap for warps
(wa, wb) with at least one a write must be ordered by a sync in (i, j):

- a barrier orders warps wa and wb when one group of its scope holds both: a CTA
  barrier (``__syncthreads()``) any pair, a warp barrier (``__syncwarp()``) only
  wa == wb (lanes of one warp exchange data, so one warp still needs a warp barrier);
- an asynchronous write (a write of a step with an ``async_kind``, which commits one
  group of that kind) is complete only after a wait for that kind: under the rule
  ``NEWEST_PENDING`` (``cp.async.wait_group N``) one at a point where at least N
  groups of the kind were committed after its own (PTX: the N most recent groups may
  stay pending); the barrier must follow that wait.

Two warps whose accesses in one step conflict cannot be ordered by any sync.
"""

from __future__ import annotations

from dataclasses import dataclass

from .target import PassTarget
from ..ir import Access, Buffer, HazardKind, Item, Kernel, Mode, Partition, Step, Sync
from ..ir.syncmodel import SyncModel, WaitRule, narrowest, same_group


@dataclass(frozen=True)
class Failure:
    """One unordered hazard: ``earlier`` and ``later`` read 'op (phase[, iteration i])'."""

    kind: HazardKind
    earlier: str
    later: str
    buffers: tuple[str, str]  # the earlier access's buffer, the later access's
    lo: int  # the overlapping bytes [lo, hi)
    hi: int
    warps: tuple[int, int]  # the warp of the earlier access, of the later
    missing: str

    def __str__(self) -> str:
        a, b = self.buffers
        bufs = a if a == b else f"{a}/{b} (aliased)"
        wa, wb = self.warps
        who = f"warp {wa}" if wa == wb else f"warp {wa} then warp {wb}"
        return (
            f"{self.kind.value} on {bufs}, bytes [{self.lo}, {self.hi}), {who}: "
            f"{self.earlier} -> {self.later}: missing {self.missing}"
        )


class VerifyError(Exception):
    """The schedule's syncs leave SMEM hazards unordered; ``failures`` lists them."""

    def __init__(self, failures: tuple[Failure, ...]) -> None:
        self.failures = tuple(failures)
        lines = "\n".join(f"  {f}" for f in self.failures)
        super().__init__(f"{len(self.failures)} unordered SMEM hazard(s):\n{lines}")


@dataclass(frozen=True)
class _Event:
    pos: int  # position in the trace
    step: Step
    iteration: int | None  # None outside the mainloop
    access: Access

    def where(self) -> str:
        it = "" if self.iteration is None else f", iteration {self.iteration}"
        return f"{self.step.op.spelling} ({self.step.phase.value}{it})"

    @property
    def async_write(self) -> bool:
        return self.step.async_kind is not None and self.access.mode is Mode.WRITE


def _trace(kernel: Kernel, n: int) -> list[tuple[Item, int | None]]:
    loop = [(item, it) for it in range(n) for item in kernel.mainloop]
    return (
        [(item, None) for item in kernel.prologue]
        + loop
        + [(item, None) for item in kernel.epilogue]
    )


def _span(buf: Buffer, part: Partition, warp: int, warps: int) -> tuple[int, int]:
    """The bytes [lo, hi) that ``warp`` touches in ``buf``."""
    assert buf.offset is not None
    if part is Partition.WHOLE:
        return buf.offset, buf.offset + buf.nbytes
    row = buf.nbytes // buf.rows
    return (
        buf.offset + warp * buf.rows // warps * row,
        buf.offset + (warp + 1) * buf.rows // warps * row,
    )


def _waited(wait: Sync, commits: int) -> bool:
    """Whether ``wait``, with ``commits`` groups of its kind committed after the write's
    own, completes that write."""
    match wait.kind.rule:
        case WaitRule.NEWEST_PENDING:
            return commits >= wait.groups
        case _:
            raise AssertionError(f"verify: no rule for {wait.kind.name}")


def _missing(
    model: SyncModel,
    trace: list[tuple[Item, int | None]],
    a: _Event,
    b: _Event,
    warps: tuple[int, int],
):
    """None if a sync in the trace orders a before b for the warp pair, else what is missing."""
    if a.pos == b.pos:
        return "a barrier inside one step (two warps conflict within it: split the step)"
    needed = model.barrier_for(narrowest(*warps))
    barrier = f"{needed.what} ({needed.name})"
    start = a.pos
    kind = a.step.async_kind
    if a.async_write:
        commits = 0
        for p in range(a.pos + 1, b.pos):
            item = trace[p][0]
            if isinstance(item, Step) and item.async_kind == kind:
                commits += 1
            elif isinstance(item, Sync) and item.kind.completes == kind and _waited(item, commits):
                start = p
                break
        else:
            wait = model.wait_for(kind)
            return (
                f"{wait.what} before the barrier: {wait.name} {commits} (or lower) "
                f"after the {kind.name}, then {barrier}"
            )
    for p in range(start + 1, b.pos):
        item = trace[p][0]
        if (
            isinstance(item, Sync)
            and item.kind.scope is not None
            and same_group(item.kind.scope, *warps)
        ):
            return None
    return barrier + (f" after the {kind.name} wait" if start != a.pos else "")


def _kind(a: Access, b: Access) -> HazardKind:
    if a.mode is Mode.WRITE:
        return HazardKind.WAW if b.mode is Mode.WRITE else HazardKind.RAW
    return HazardKind.WAR


def _check(kernel: Kernel, model: SyncModel, n: int) -> list[tuple[tuple, Failure]]:
    warps = kernel.config.warps
    trace = _trace(kernel, n)
    events = [
        _Event(pos, item, it, acc)
        for pos, (item, it) in enumerate(trace)
        if isinstance(item, Step)
        for acc in item.accesses
    ]
    spans = {
        (e.pos, e.access, w): _span(kernel.buffer(e.access.buffer), e.access.partition, w, warps)
        for e in events
        for w in range(warps)
    }
    found = []
    for x, a in enumerate(events):
        for y in range(x, len(events)):
            b = events[y]
            if Mode.WRITE not in (a.access.mode, b.access.mode):
                continue
            for wa in range(warps):
                for wb in range(warps):
                    if a.pos == b.pos and wa == wb:
                        continue  # one warp inside one step: the step's own code orders it
                    (alo, ahi), (blo, bhi) = spans[a.pos, a.access, wa], spans[b.pos, b.access, wb]
                    lo, hi = max(alo, blo), min(ahi, bhi)
                    if lo >= hi:
                        continue
                    missing = _missing(model, trace, a, b, (wa, wb))
                    if missing is None:
                        continue
                    bufs = (a.access.buffer, b.access.buffer)
                    edge = a.iteration is not None and b.iteration not in (None, a.iteration)
                    key = (a.step.op, a.step.phase, b.step.op, b.step.phase, edge, bufs, missing)
                    fail = Failure(
                        _kind(a.access, b.access), a.where(), b.where(), bufs, lo, hi, (wa, wb),
                        missing,
                    )  # fmt: skip
                    found.append((key, fail))
    return found


def verify(kernel: Kernel, target: PassTarget) -> Kernel:
    """Return ``kernel`` if its syncs order every SMEM hazard of the kernel's target's sync
    model, else raise VerifyError."""
    model = target.sync_model
    for buf in kernel.buffers:
        if buf.offset is None:
            raise ValueError(f"buffer {buf.name} has no offset: run plan_smem before verify")
    failures: dict[tuple, Failure] = {}
    for n in (0, 1, 2) if kernel.loop_may_be_empty else (1, 2):
        for key, fail in _check(kernel, model, n):
            failures.setdefault(key, fail)
    if failures:
        raise VerifyError(tuple(failures.values()))
    return kernel
