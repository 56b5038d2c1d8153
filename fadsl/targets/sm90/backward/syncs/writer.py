"""The dQ writer's syncs (`dq_writer on`, research/backward-dq-writer.md): consumer w stages
its dQ share with st.shared and writer w (warp 1 + w of the producer warpgroup) reduce-adds
that staging into global memory from its lane 0, through the async proxy. The two are
different warps, so each hand-over is a named barrier of the consumer's 128 threads and the
writer's 32 (bar.arrive by the side that hands over, bar.sync by the side that waits):

- RAW, the staging written before the writer's add reads it: the consumer's
  fence.proxy.async.shared::cta after its stores (generic writes, async-proxy reader), then
  bar.arrive kBarDqFull + w; the writer's bar.sync on it before the add;
- WAR, the add's read before the next m-block's stores: the writer's lane 0 commits its bulk
  group and waits for its read (cp.async.bulk.wait_group.read 0), ``__syncwarp`` so that
  the other lanes' arrivals follow lane 0's wait, then bar.arrive kBarDqEmpty + w, except
  in the last m-block (no store follows it: ``Guard.BEFORE_LAST``); the consumer's bar.sync
  on it before its stores from m-block 1 on (``Guard.AFTER_FIRST``; with ``dq_lag`` the
  staging of m-block i - 1 runs in m-block i, so from m-block 2 on and after a loop of two
  or more, ``Guard.LAGGED_AFTER_FIRST``, and its fence and arrival where it runs,
  ``Guard.LAGGED``);
- ``deterministic on``: the ordered add's semaphore moves with the add: lane 0 spins on its
  ticket (ld.acquire.gpu) and fences the async proxy before the add; after the hand-back it
  waits for the add to be performed (wait_group 0), fences again and releases the next
  ticket (st.release.gpu), before it waits on anything (the next m-block's full barrier):
  the release is never deferred, so nothing in the consumer waits on a ticket. A
  ``__syncwarp`` then reconverges the warp before that full barrier's bar.sync, which is
  .aligned (every lane executes it together; verify_writer.py's lane-0 rule).

The consumer has no bulk group then (bulk.py finds no add in its program). The writer's exit:
lane 0's wait_group 0 after the loop, so that its last add is performed, not only read,
before the warp exits (as the consumer's own exit wait without a writer, bulk.py); with
``deterministic on`` every m-block's release has waited so already, and there is none.
"""

from __future__ import annotations

from ..program import (
    WRITER_BAR_THREADS,
    Guard,
    Item,
    Kind,
    LoopPhase,
    Named,
    Protocol,
    Who,
)
from .state import Consumer, names, same_bytes, sync

__all__ = ["program", "before_write", "after_write"]


def _readers(schedule: Protocol, step: Item) -> list[Item]:
    """The writer's steps that read bytes ``step`` writes (the hand-over)."""
    return [
        x for x in schedule.writer if any(same_bytes(w, r) for w in step.writes for r in x.reads)
    ]


def _writers(schedule: Protocol, step: Item) -> list[Item]:
    """The consumer's steps that write bytes the writer's ``step`` reads."""
    return [
        x for x in schedule.consumer if any(same_bytes(w, r) for w in x.writes for r in step.reads)
    ]


def before_write(c: Consumer, schedule: Protocol, step: Item, phase: LoopPhase) -> None:
    """The consumer's wait for its writer to hand the bytes back (WAR), from m-block 1 on."""
    readers = _readers(schedule, step)
    if not readers:
        return
    why = f"WAR: the writer's {names(readers)} (an m-block ago) read the bytes {step.name} writes"
    # (a lagged staging acts for the m-block before: its first is m-block 0's, in m-block 1)
    first = Guard.LAGGED_AFTER_FIRST if step.guard is Guard.LAGGED else Guard.AFTER_FIRST
    empty = dict(named=Named.DQ_EMPTY, threads=WRITER_BAR_THREADS, guard=first)
    c.place(sync(Kind.NAMED_BAR_SYNC, Who.WARPGROUP, step.source, phase, why, **empty))


def after_write(c: Consumer, schedule: Protocol, step: Item, phase: LoopPhase) -> None:
    """The consumer's hand-over to its writer (RAW): its writes fenced for the async proxy,
    then its arrival on the full barrier."""
    readers = _readers(schedule, step)
    if not readers:
        return
    why = (
        f"RAW: {step.name}'s st.shared (generic proxy) before the writer's {names(readers)} "
        "reads it (async proxy)"
    )
    at = dict(guard=step.guard)  # (a lagged staging's hand-over runs where it does)
    c.place(sync(Kind.FENCE_PROXY_ASYNC_SMEM, Who.WARPGROUP, step.source, phase, why, **at))
    c.unfenced = [(w, op) for w, op in c.unfenced if w is not step]
    why = f"RAW: every thread's part of {step.name} written and fenced, handed to the writer"
    full = dict(named=Named.DQ_FULL, threads=WRITER_BAR_THREADS, **at)
    c.place(sync(Kind.NAMED_BAR_ARRIVE, Who.WARPGROUP, step.source, phase, why, **full))


def program(schedule: Protocol) -> tuple[Item, ...]:
    """The writer warp's program: its steps (lane 0's bulk reduce-adds) with the syncs of
    the module docstring."""
    p = schedule.params
    out: list[Item] = []
    for step in schedule.writer:
        assert step.kind is Kind.BULK_REDUCE_ADD and step.who is Who.WRITER_LANE0, step
        at = dict(source=step.source, phase=step.phase)
        warp = dict(who=Who.WRITER, **at)
        lane0 = dict(who=Who.WRITER_LANE0, **at)
        staged = names(_writers(schedule, step))
        full = dict(named=Named.DQ_FULL, threads=WRITER_BAR_THREADS)
        why = f"RAW: the consumer's {staged} written and fenced before {step.name} reads it"
        out.append(Item(Kind.NAMED_BAR_SYNC, why=why, **warp, **full))
        if p.deterministic:
            why = "WAW on dQ's accumulator: the lower tickets' reduce-adds before this one"
            out.append(Item(Kind.SEM_ACQUIRE, why=why, **lane0))
            why = "the acquire (generic) before the adds (async proxy)"
            out.append(Item(Kind.FENCE_PROXY_ASYNC_GLOBAL, why=why, **lane0))
        out.append(step)
        why = f"closes {step.name}'s bulk group: the waits below name it"
        out.append(Item(Kind.BULK_COMMIT, why=why, **lane0))
        why = f"WAR: {step.name} read the staging before the consumer's next {staged}"
        out.append(Item(Kind.BULK_WAIT_READ, why=why, pending=0, **lane0))
        why = "lane 0's wait before the other lanes' arrivals: the warp hands the staging back"
        out.append(Item(Kind.SYNCWARP, why=why, **warp))
        why = f"WAR: the staging read, the consumer's next {staged} may write it"
        empty = dict(named=Named.DQ_EMPTY, threads=WRITER_BAR_THREADS, guard=Guard.BEFORE_LAST)
        out.append(Item(Kind.NAMED_BAR_ARRIVE, why=why, **warp, **empty))
        if p.deterministic:
            why = f"{step.name}'s adds performed (not only their SMEM read) before the release"
            out.append(Item(Kind.BULK_WAIT, why=why, pending=0, **lane0))
            why = "the adds (async proxy) before the release (generic)"
            out.append(Item(Kind.FENCE_PROXY_ASYNC_GLOBAL, why=why, **lane0))
            why = "WAW on dQ's accumulator: the next ticket may add"
            out.append(Item(Kind.SEM_RELEASE, why=why, **lane0))
            why = "lane 0's release before the warp's next bar.sync, which it runs converged"
            out.append(Item(Kind.SYNCWARP, why=why, **warp))
    if out and not any(x.kind is Kind.BULK_WAIT for x in out):  # (deterministic: the release's)
        adds = names(list(schedule.writer))
        why = f"the last {adds} performed (not only its read) before the warp exits"
        after = dict(source=schedule.writer[-1].source, phase=LoopPhase.AFTER)
        out.append(Item(Kind.BULK_WAIT, Who.WRITER_LANE0, why=why, pending=0, **after))
    return tuple(out)
