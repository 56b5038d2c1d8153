"""The backward's named barriers and proxy fences for SMEM that consumer threads write with
st.shared (generic proxy) and an async-proxy reader (a wgmma, the bulk reduce-add) reads.

- fence.proxy.async.shared::cta by the writing threads, after their writes and before the
  barrier that hands them over (a fence after the barrier would order nothing for the
  reader);
- bar.sync of every thread whose writes the reader takes: a reader of bytes the other
  consumer warpgroups wrote too (dQ = dS K split by head_dim panels reads all B_c rows of
  dS^T) meets every consumer thread at kBarDS; one that reads only its own warpgroup's
  (dQ split by keys, the leader's reduce-add of the warpgroup's staging) meets the
  warpgroup's 128 threads at its own barrier. A warpgroup-wide wgmma needs it too: its
  128 threads wrote different rows. The barrier goes in the reader's function, unless the
  reader is the leader alone (a bar.sync there would wait for threads that never come):
  then in the writer's.

The WAR of dS^T's next writes against another warpgroup's dQ read is the schedule's
(two buffers, i % 2): warpgroup w's dQ of m-block i is retired before it meets at m-block
i + 1, before any warpgroup writes buffer i % 2 again at i + 2 (tests/test_verify_backward.py
test_one_ds_buffer: where one buffer is enough).
"""

from __future__ import annotations

from ..program import WARPGROUP_THREADS, Item, Kind, Named, Operand, LoopPhase, Who
from .state import ASYNC_PROXY, Consumer, names, reaches_other_warpgroups, same_bytes, sync, words


def record_writes(c: Consumer, step: Item) -> None:
    """A generic SMEM write: to fence and to meet before an async-proxy reader."""
    if step.kind in ASYNC_PROXY:
        return
    for op in step.writes:
        for pending in (c.unfenced, c.unmet_in_warpgroup, c.unmet_in_consumers):
            pending.append((step, op))


def _read_by(step: Item, writes: list[tuple[Item, Operand]]) -> list[tuple[Item, Operand]]:
    if step.kind not in ASYNC_PROXY:
        return []
    return [(w, op) for w, op in writes if any(same_bytes(op, r) for r in step.reads)]


def _reaches_others(step: Item, written: list[tuple[Item, Operand]]) -> bool:
    return any(
        reaches_other_warpgroups(r) for r in step.reads for _, op in written if same_bytes(op, r)
    )


def fence_writes(c: Consumer, step: Item, phase: LoopPhase) -> list[tuple[Item, Operand]]:
    """fence.proxy.async before async-proxy ``step`` reads bytes written with st.shared since
    the last fence; returns the writes fenced (their barrier must follow the fence)."""
    written = _read_by(step, c.unfenced)
    if not written:
        return []
    writers = [w for w, _ in written]
    why = (
        f"RAW: {names(writers)}'s st.shared (generic proxy) before {step.name} reads it "
        "(async proxy)"
    )
    fence = sync(Kind.FENCE_PROXY_ASYNC_SMEM, writers[-1].who, writers[-1].source, phase, why)
    c.place(fence)
    c.unfenced.clear()  # the fence orders every earlier generic access of the thread
    return written


def meet(c: Consumer, step: Item, phase: LoopPhase, fenced: list[tuple[Item, Operand]]) -> None:
    """bar.sync of the writers and ``step``'s threads before it reads what they wrote."""
    others = _reaches_others(step, _read_by(step, c.unmet_in_consumers) + fenced)
    unmet = c.unmet_in_consumers if others else c.unmet_in_warpgroup
    written = list(dict.fromkeys(_read_by(step, unmet) + fenced))
    if not written:
        return
    writers = [w for w, _ in written]
    if all(w.who is step.who is Who.LEADER for w in writers):
        return  # one thread: program order
    buffers = words(op.buffer.value for _, op in written)
    if others:
        named, threads = Named.DS, WARPGROUP_THREADS * c.params.consumers
        whose = f"every consumer warpgroup's rows of {buffers}"
    else:
        named, threads = Named.DQ, WARPGROUP_THREADS
        whose = f"every thread's part of the warpgroup's {buffers}"
    why = f"RAW: {whose} written ({names(writers)}) before {step.name} reads them"
    source = step.source if step.who is Who.WARPGROUP else writers[-1].source
    c.place(
        sync(Kind.NAMED_BAR_SYNC, Who.WARPGROUP, source, phase, why, named=named, threads=threads)
    )
