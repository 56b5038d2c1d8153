"""The backward's hand-over of a double-buffered SMEM tile between the consumer warpgroups by
mbarriers (`dq_lag on`: dS^T, from its writers to the lagged dQ).

A tile that every consumer warpgroup writes by its own part with st.shared (generic proxy)
and that an async-proxy reader takes every warpgroup's part of (a wgmma reading all of
dS^T) is met at a named barrier where the reader runs in the writers' m-block (named.py).
Where the reader runs a step behind (``Guard.LAGGED``: dQ(i - 1) issued in m-block i, the
last after the loop), there is no program point at which the warpgroups meet: each has
moved on to its next m-block, and may be a whole m-block ahead of the other. The tile is
double-buffered (``Index.ALTERNATE``: buffer i % 2), so the pass hands each buffer over by
a pair of mbarriers of its own, each counting every consumer thread:

- RAW, the writers' parts before the reader: after its write each thread fences the async
  proxy (fence.proxy.async.shared::cta: its generic writes before the async reader) and
  arrives on full(buf); the reader waits on full(buf) with the parity of the buffer's use,
  (i / 2) & 1 of the m-block i it acts for, before its wgmma (and, as the ring's full
  barrier, before the wgmma.fence);
- WAR, the reader's read before the buffer is written again two m-blocks later: once the
  wgmma.wait_group that retires the reader's group has run, each reader thread arrives on
  empty(buf); each writer waits on empty(buf) before its write, from the running index 2 on
  (``Guard.REUSED``: the buffer's first use has no earlier reader), with the parity of the
  previous use, (i / 2 - 1) & 1.

The fence and the arrival follow the write or, where wgmmas that do not read the tile are
issued right after it (`dq_lag on`'s dV(i) after the dS^T store), that run and its commit:
the fence waits for the thread's stores to land, and the run gives the tensor cores work
meanwhile (FlashAttention-3's and -4's order; on an H200 the fence and the arrival before
dV were 8 % of the lagged consumer's stall samples, 2026-12-01: docs/backward.md, "Loads
ahead of the wgmmas"). The due syncs go before the next step that is not such a wgmma.

Each barrier completes a phase per use of its buffer, so each wait names one phase: the
writers cannot arrive on full(buf) for use k + 1 before empty(buf) completed use k, which
needs full(buf)'s use k complete; the readers cannot arrive on empty(buf) for use k + 1
before full(buf) completed use k + 1. The writes handed over here are no longer the
meeting's (named.py) nor the proxy fence's before the reader: they leave those lists.
"""

from __future__ import annotations

from ..program import (
    CodeSite,
    Guard,
    Index,
    Item,
    Kind,
    LoopPhase,
    Mbar,
    Operand,
    Protocol,
    StagedTile,
    WaitParity,
    Who,
)
from .state import ASYNC_PROXY, Consumer, names, reaches_other_warpgroups, same_bytes, sync

__all__ = [
    "inits",
    "before_write",
    "after_write",
    "place_due",
    "wait_full",
    "release_if_retired",
]

# the tiles handed over this way, with their (full, empty) mbarriers
BARRIERS = {StagedTile.DS: (Mbar.DS_FULL, Mbar.DS_EMPTY)}


def _lagged_reader(x: Item) -> bool:
    return x.kind in ASYNC_PROXY and x.guard is Guard.LAGGED


def _handed(schedule: Protocol) -> dict[StagedTile, tuple[list[Item], list[Item]]]:
    """Per tile handed over: its writers (generic writes of a double buffer) and its lagged
    async readers that take other warpgroups' parts of it."""
    found: dict[StagedTile, tuple[list[Item], list[Item]]] = {}
    for w in schedule.consumer:
        if w.kind in ASYNC_PROXY:
            continue
        for op in w.writes:
            if op.index is not Index.ALTERNATE:
                continue
            readers = [
                r
                for r in schedule.consumer
                if _lagged_reader(r)
                and any(same_bytes(op, x) and reaches_other_warpgroups(x) for x in r.reads)
            ]
            if readers:
                assert op.buffer in BARRIERS, f"{op.buffer.value}: no barriers to hand it over"
                writers, known = found.setdefault(op.buffer, ([], []))
                writers.append(w)
                known += [r for r in readers if r not in known]
    return found


def _buffers(schedule: Protocol, operands: tuple[Operand, ...]) -> list[StagedTile]:
    handed = _handed(schedule)
    return list(dict.fromkeys(op.buffer for op in operands if op.buffer in handed))


def inits(schedule: Protocol) -> tuple[Item, ...]:
    """Thread 0's inits: full and empty per buffer, each counting every consumer thread."""
    count = schedule.params.consumer_threads
    init = dict(who=Who.THREAD0, source=CodeSite.KERNEL, phase=LoopPhase.BEFORE)
    init |= dict(slot=Index.ALTERNATE, count=count)
    out = []
    for tile, (writers, readers) in _handed(schedule).items():
        full, empty = BARRIERS[tile]
        why = f"every consumer thread's part of {tile.value} stored and fenced ({names(writers)})"
        out.append(Item(Kind.MBAR_INIT, mbar=full, why=why, **init))
        why = f"every consumer thread's {names(readers)} of the buffer retired"
        out.append(Item(Kind.MBAR_INIT, mbar=empty, why=why, **init))
    return tuple(out)


def before_write(c: Consumer, schedule: Protocol, step: Item, phase: LoopPhase) -> None:
    """WAR: the previous use's readers (every warpgroup's, two m-blocks ago) retired before
    the writer writes the buffer again; after the loop, the last m-block's lagged readers
    in every warpgroup retired before a write of other bytes they read (K, by dK's
    staging: the last buffer's empty barrier completes once every consumer thread's last
    dQ retired, and that dQ read K with it)."""
    if step.kind in ASYNC_PROXY:
        return
    handed = _handed(schedule)
    for tile, (_, readers) in handed.items() if phase is LoopPhase.AFTER else ():
        late = [r for r in readers if r.phase is LoopPhase.AFTER and _takes_beside(r, tile, step)]
        if late:  # (the last m-block's readers: the buffer's use of that m-block)
            why = (
                f"WAR: every warpgroup's {names(late)} (it reads them too) retired before "
                f"{step.name} writes them"
            )
            _wait_empty(c, tile, phase, why, Guard.LAGGED, WaitParity.ALTERNATE)
    for tile in _buffers(schedule, step.writes):
        readers = names(handed[tile][1])
        why = (
            f"WAR: every warpgroup's {readers} of the buffer's previous use (i - 2) retired "
            f"before {step.name} writes it"
        )
        _wait_empty(c, tile, phase, why, Guard.REUSED, WaitParity.ALTERNATE_PREVIOUS)


def _takes_beside(reader: Item, tile: StagedTile, step: Item) -> bool:
    """Whether ``reader`` of the handed-over ``tile`` also reads, beside it, bytes that
    ``step`` writes, other warpgroups' rows of them included (dQ reads K with dS^T)."""
    return any(
        same_bytes(w, x) and reaches_other_warpgroups(x)
        for w in step.writes
        for x in reader.reads
        if x.buffer is not tile
    )


def _wait_empty(
    c: Consumer, tile: StagedTile, phase: LoopPhase, why: str, guard: Guard, parity: WaitParity
) -> None:
    """The warpgroup's wait on ``tile``'s empty barrier (its buffer i % 2) for ``parity``."""
    empty = dict(mbar=BARRIERS[tile][1], slot=Index.ALTERNATE, guard=guard, parity=parity)
    c.place(sync(Kind.MBAR_WAIT, Who.WARPGROUP, c.home, phase, why, **empty))


def after_write(c: Consumer, schedule: Protocol, step: Item, phase: LoopPhase) -> None:
    """A write of a handed-over tile: its fence and arrival are due (``place_due``)."""
    if step.kind not in ASYNC_PROXY and _buffers(schedule, step.writes):
        c.handover_due.append(step)


def place_due(
    c: Consumer,
    schedule: Protocol,
    steps: list[Item],
    k: int | None,
    phase: LoopPhase,
    at: int | None = None,
    blocked: bool = False,
) -> None:
    """Each due writer's part fenced for the async proxy (RAW), then its arrival on full:
    before steps[k] (``None``: the m-block's end), at ``at`` in the program where steps[k]
    is a wgmma (ahead of the syncs placed for it, its waits among them: an arrival never
    comes after a wait, which might wait for the other warpgroup to get past its own).
    Held back where steps[k] is a wgmma that reads no tile a due write handed over and
    needs no wait or barrier (not ``blocked``): the run of wgmmas after the write."""
    if not c.handover_due:
        return
    if k is not None and steps[k].kind is Kind.WGMMA and not blocked:
        tiles = {t for w in c.handover_due for t in _buffers(schedule, w.writes)}
        if not any(op.buffer in tiles for op in steps[k].reads):
            return  # a wgmma of the run after the write: it goes first
    handed = _handed(schedule)
    due, c.handover_due = c.handover_due, []
    syncs = []
    for step in due:
        for tile in _buffers(schedule, step.writes):
            readers = names(handed[tile][1])
            why = (
                f"RAW: {step.name}'s st.shared (generic proxy) before every warpgroup's "
                f"{readers} reads it (async proxy) a step later"
            )
            syncs.append(sync(Kind.FENCE_PROXY_ASYNC_SMEM, Who.WARPGROUP, c.home, phase, why))
            why = f"RAW: this thread's part of {tile.value} stored and fenced, for {readers}"
            full = dict(mbar=BARRIERS[tile][0], slot=Index.ALTERNATE)
            syncs.append(sync(Kind.MBAR_ARRIVE, Who.WARPGROUP, c.home, phase, why, **full))
            for pending in (c.unmet_in_warpgroup, c.unmet_in_consumers):  # handed, not met
                pending[:] = [(w, op) for w, op in pending if op.buffer is not tile]
    c.unfenced.clear()  # the fence orders every earlier generic access of the thread
    at = len(c.out) if at is None else at
    c.out[at:at] = syncs  # (neither a named barrier: nothing for Consumer.place to publish)


def wait_full(c: Consumer, schedule: Protocol, step: Item, phase: LoopPhase) -> None:
    """Before a lagged reader: every writer's part of its m-block's buffer stored."""
    if not _lagged_reader(step):
        return
    for tile in _buffers(schedule, step.reads):
        writers = names(_handed(schedule)[tile][0])
        why = f"RAW: every warpgroup's part of {tile.value} ({writers}) stored and fenced"
        full = dict(mbar=BARRIERS[tile][0], slot=Index.ALTERNATE, parity=WaitParity.ALTERNATE)
        c.place(sync(Kind.MBAR_WAIT, Who.WARPGROUP, c.home, phase, why, guard=step.guard, **full))
        c.handed_reading.append(step)


def release_if_retired(c: Consumer, schedule: Protocol, phase: LoopPhase) -> None:
    """After a wgmma wait: each lagged reader whose group it retired frees its buffer."""
    running = [x for g in c.in_flight for x in g.steps()] + c.open_group.steps()
    for step in [x for x in c.handed_reading if x not in running]:
        c.handed_reading.remove(step)
        for tile in _buffers(schedule, step.reads):
            why = f"WAR: this thread's {step.name} of the buffer retired: it may be written again"
            empty = dict(mbar=BARRIERS[tile][1], slot=Index.ALTERNATE, guard=step.guard)
            c.place(sync(Kind.MBAR_ARRIVE, Who.WARPGROUP, c.home, phase, why, **empty))
