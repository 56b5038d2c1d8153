"""The backward's mbarriers: the producer's loads, their full barriers and the ring's empty
ones.

- a load by the producer read by the consumers (RAW across roles): the loads that name one
  barrier complete on it, so the producer arms it once (arrive.expect_tx with the bytes of
  all of them) before the first; the consumers wait on it before their first read of any
  of them. K and V, loaded once before the loop, are waited for once before the loop with
  parity 0 and the loads' guard (a CTA with no m-block loads nothing: an unguarded wait
  would hang); a ring slot's (Q, dO, LSE, D) each m-block, parity (i / stages) & 1 (at
  head_dim 256 the dO ring's (dO, D) on barriers of its own, parity (i / do_stages) & 1);
- a ring slot refilled a round later (WAR across roles and the back edge): once the
  m-block's last read of the slot is done (an ordinary read once issued, a wgmma's once a
  wait retired its group; at the latest at the m-block's end, where the consumers wait for
  those groups), every consumer thread arrives on the slot's empty barrier: the slot is
  also read by ordinary code of every thread (LSE, D), each of which orders its own reads
  before its own arrival. The producer waits on it with the flipped parity before arming
  the slot, which a fresh barrier passes in the first round;
- a load issued once in the loop's first pass (`late_v on`: V, after m-block 0's slot;
  ``Guard.FIRST``) read by the consumers in the loop: each warpgroup waits on its barrier
  with parity 0 before its first read, in its own first pass of the loop (``Guard.FIRST``:
  m-block 1 where `peel_dead on` peeled m-block 0, whose products read nothing); with
  `peel_dead on` once more right after the loop, for a CTA with work: a peeled warpgroup
  of a one-m-block tile never runs the loop, and it may write the buffer after it (dV
  staged over V) and must not end with the load in flight (the SMEM goes to the next CTA).
  The phase completes once, so that wait returns at once wherever the first ran; without
  the peel every warpgroup of a CTA with work runs the loop's first pass, so none is
  placed;
- `scheduler persistent` (``Params.persistent``: the program runs once per tile, the
  m-block index running on): what is loaded once per tile (K and V) is loaded again for the
  next tile once every consumer thread has read it (WAR across roles and tiles): after the
  m-block loop, where every wgmma group is retired, each consumer thread arrives on
  kv_empty, which the producer waits on before arming kv_full, with the flipped parity of
  the tile's round t (a fresh barrier passes it for t = 0); the consumers wait on kv_full
  with parity t & 1, t counting the CTA's tiles with an m-block (those without load and
  wait nothing);
- the setup: thread 0 initialises each barrier (a ring's per slot: full with one arrival,
  the producer's expect_tx; empty with one per consumer thread), then fence.mbarrier_init
  (the inits visible to the async proxy's complete_tx), then __syncthreads before any use.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..program import (
    RING_PARITY,
    WARPGROUP_THREADS,
    Guard,
    Index,
    Item,
    Kind,
    Mbar,
    Operand,
    WaitParity,
    Part,
    LoopPhase,
    Protocol,
    CodeSite,
    Who,
)
from . import wgmma
from .state import LOADS, Consumer, names, sync, words

# a ring's full barrier -> its empty barrier (the consumers' release of the slot)
EMPTY_OF = {Mbar.Q_FULL: Mbar.Q_EMPTY, Mbar.DO_FULL: Mbar.DO_EMPTY}
# `scheduler persistent`: what is loaded once a tile (K and V) freed for the next tile's loads
KV_EMPTY = Mbar.KV_EMPTY


@dataclass(frozen=True)
class Transaction:
    """The loads that complete on one full barrier, in one phase of the producer."""

    full: Mbar
    slot: Index  # a ring's (Index.RING, RING_DO): a barrier per slot, refilled each m-block
    phase: LoopPhase
    loads: tuple[Item, ...]

    @property
    def ring(self) -> bool:
        return self.slot in RING_PARITY

    def buffers(self) -> str:
        return words(op.buffer.value for x in self.loads for op in x.writes)

    def loaded(self, read: Operand) -> bool:
        return any(op.buffer is read.buffer for x in self.loads for op in x.writes)


def transactions(schedule: Protocol) -> list[Transaction]:
    """The producer's transactions in program order."""
    found: dict[Mbar, Transaction] = {}
    for x in schedule.producer:
        if x.kind in LOADS:
            assert x.mbar is not None, f"{x.name}: a load completes on an mbarrier"
            old = found.get(x.mbar)
            loads = (old.loads if old else ()) + (x,)
            found[x.mbar] = Transaction(x.mbar, x.slot, x.phase, loads)
    return list(found.values())


def load_bytes(schedule: Protocol, operand: Operand) -> int:
    """The bytes one load writes: a slot of the buffer, or one of its 64-column panels."""
    _, slot_bytes = schedule.buffers().base(operand.buffer)
    if operand.part is Part.PANEL:
        return slot_bytes // schedule.params.panels
    assert operand.part is Part.WHOLE, operand
    return slot_bytes


def setup(schedule: Protocol, more: tuple[Item, ...] = ()) -> tuple[Item, ...]:
    """Thread 0's inits of the loads' barriers, then ``more`` (another mechanism's: the
    hand-over's), then the fence and __syncthreads."""
    init = dict(who=Who.THREAD0, source=CodeSite.KERNEL, phase=LoopPhase.BEFORE)
    out = []
    for t in transactions(schedule):
        why = f"one arrival: the producer's arrive.expect_tx for {t.buffers()}"
        out.append(Item(Kind.MBAR_INIT, mbar=t.full, slot=t.slot, count=1, why=why, **init))
        if not t.ring and schedule.params.persistent:
            count = WARPGROUP_THREADS * schedule.params.consumers
            why = f"every consumer thread frees the tile's {t.buffers()} once per tile"
            out.append(Item(Kind.MBAR_INIT, mbar=KV_EMPTY, count=count, why=why, **init))
        if t.ring:
            count = WARPGROUP_THREADS * schedule.params.consumers
            why = f"every consumer thread releases the slot's {t.buffers()} once per m-block"
            empty = EMPTY_OF[t.full]
            out.append(Item(Kind.MBAR_INIT, mbar=empty, slot=t.slot, count=count, why=why, **init))
    out += more
    if out:
        why = "the inits visible to the async proxy (TMA's complete_tx)"
        out.append(Item(Kind.FENCE_MBAR_INIT, why=why, **init))
        why = "thread 0's inits before any other thread's arrive or wait"
        out.append(sync(Kind.SYNCTHREADS, Who.CTA, CodeSite.KERNEL, LoopPhase.BEFORE, why))
    return tuple(out)


def producer(schedule: Protocol) -> tuple[Item, ...]:
    """The producer's program: before a transaction's first load, wait for the slot's
    previous round to be read (a ring), then arm the full barrier with all its bytes."""
    out = []
    armed = set()
    by_barrier = {t.full: t for t in transactions(schedule)}
    for x in schedule.producer:
        t = by_barrier.get(x.mbar) if x.kind in LOADS else None
        if t is not None and t.full not in armed:
            armed.add(t.full)
            arm = dict(who=x.who, source=x.source, phase=x.phase, guard=x.guard, slot=t.slot)
            if t.ring:
                why = (
                    f"WAR: every consumer's reads of the slot's {t.buffers()} (a round "
                    "ago) done before they are reloaded"
                )
                empty, flip = EMPTY_OF[t.full], RING_PARITY[t.slot][1]
                out.append(Item(Kind.MBAR_WAIT, mbar=empty, parity=flip, why=why, **arm))
            elif schedule.params.persistent:
                why = (
                    f"WAR: every consumer's reads of the previous tile's {t.buffers()} "
                    "retired before they are reloaded"
                )
                flip = WaitParity.TILE_FLIP
                out.append(Item(Kind.MBAR_WAIT, mbar=KV_EMPTY, parity=flip, why=why, **arm))
            tx = sum(load_bytes(schedule, op) for load in t.loads for op in load.writes)
            why = f"{t.buffers()}'s bytes complete {t.full.value}"
            out.append(Item(Kind.MBAR_ARRIVE_EXPECT_TX, mbar=t.full, tx=tx, why=why, **arm))
        out.append(x)
    return tuple(out)


def wait_loaded_before_loop(c: Consumer, schedule: Protocol) -> None:
    """At the end of the consumers' prologue: wait once for what was loaded once."""
    for t in transactions(schedule):
        read = any(
            t.loaded(op) for x in schedule.consumer if x.phase is LoopPhase.LOOP for op in x.reads
        )
        if t.phase is LoopPhase.BEFORE and read:
            (guard,) = {x.guard for x in t.loads}
            why = f"RAW: {t.buffers()} landed (loaded once: phase 0)"
            parity = WaitParity.ZERO
            if schedule.params.persistent:
                why = (
                    f"RAW: the tile's {t.buffers()} landed (loaded once a tile: its round's phase)"
                )
                parity = WaitParity.TILE
            once = dict(guard=guard, mbar=t.full, parity=parity)
            c.place(sync(Kind.MBAR_WAIT, Who.WARPGROUP, c.home, LoopPhase.BEFORE, why, **once))


def _issued_in_loop_once(schedule: Protocol) -> list[Transaction]:
    """The transactions the producer issues in the loop's first pass only (`late_v on`)."""
    found = []
    for t in transactions(schedule):
        if t.phase is LoopPhase.LOOP and not t.ring:
            (guard,) = {x.guard for x in t.loads}
            assert guard is Guard.FIRST, f"{t.buffers()}: once in the loop, in its first pass"
            found.append(t)
    return found


def wait_once_in_loop(c: Consumer, schedule: Protocol, step: Item, phase: LoopPhase) -> None:
    """Before the loop's first read of what the producer loads in its first pass: wait, in
    the warpgroup's first pass of the loop."""
    for t in _issued_in_loop_once(schedule):
        if t.full in c.waited or not any(map(t.loaded, step.reads)):
            continue
        c.waited.add(t.full)
        why = (
            f"RAW: {t.buffers()} landed before {step.name} first reads them (loaded once: phase 0)"
        )
        once = dict(guard=Guard.FIRST, mbar=t.full, parity=WaitParity.ZERO)
        c.place(sync(Kind.MBAR_WAIT, Who.WARPGROUP, c.home, phase, why, **once))


def wait_once_after_loop(c: Consumer, schedule: Protocol) -> None:
    """Right after the loop, for a CTA with work, where a warpgroup's loop may have no pass
    (`peel_dead on`): the same wait again (that warpgroup never waited, and the epilogue may
    write those bytes, or the CTA end)."""
    if not schedule.params.peel_dead:
        return
    for t in _issued_in_loop_once(schedule):
        why = (
            f"RAW and WAW: {t.buffers()} landed before the epilogue (a peeled warpgroup's "
            "loop may not run) writes them or the CTA ends"
        )
        once = dict(guard=Guard.HAS_WORK, mbar=t.full, parity=WaitParity.ZERO)
        c.place(sync(Kind.MBAR_WAIT, Who.WARPGROUP, c.home, LoopPhase.AFTER, why, **once))


def release_tile(c: Consumer, schedule: Protocol) -> None:
    """`scheduler persistent`, after the m-block loop: every wgmma that read what was loaded
    once a tile (K, V) is retired (no group crosses an m-block's end), so every consumer
    thread frees it for the next tile's loads, with the loads' guard."""
    if not schedule.params.persistent:
        return
    assert not c.in_flight, "a wgmma group crosses the m-block loop's end"
    for t in transactions(schedule):
        if t.phase is LoopPhase.BEFORE:
            (guard,) = {x.guard for x in t.loads}
            why = f"WAR: the tile's {t.buffers()} read (every wgmma retired): the next tile's may load"
            tile = dict(guard=guard, mbar=KV_EMPTY)
            c.place(sync(Kind.MBAR_ARRIVE, Who.WARPGROUP, c.home, LoopPhase.AFTER, why, **tile))


def _slot_readers(schedule: Protocol, steps: list[Item]) -> dict[Mbar, tuple[str, Index, set[int]]]:
    """Per ring's empty barrier: its slot's buffers, the ring's index and the m-block's steps
    that read them."""
    found = {}
    for t in transactions(schedule):
        if t.ring:
            readers = {k for k, x in enumerate(steps) if any(map(t.loaded, x.reads))}
            found[EMPTY_OF[t.full]] = (t.buffers(), t.slot, readers)
    return found


def start_m_block(c: Consumer, schedule: Protocol, steps: list[Item]) -> None:
    """The m-block's readers of each ring slot, none released nor waited for yet."""
    c.waited, c.released = set(), set()
    c.ring_readers = {e: set(r) for e, (_, _, r) in _slot_readers(schedule, steps).items()}


def wait_full(c: Consumer, schedule: Protocol, step: Item, phase: LoopPhase) -> None:
    """Before the m-block's first read of a slot's loads: wait for them to land."""
    for t in transactions(schedule):
        if not t.ring or t.full in c.waited or not any(map(t.loaded, step.reads)):
            continue
        c.waited.add(t.full)
        why = f"RAW: the slot's {t.buffers()} landed before {step.name} reads them"
        ring = dict(mbar=t.full, slot=t.slot, parity=RING_PARITY[t.slot][0])
        c.place(sync(Kind.MBAR_WAIT, Who.WARPGROUP, c.home, phase, why, **ring))


def read_done(c: Consumer, k: int) -> None:
    """Ordinary step k's reads are done once it is placed."""
    for readers in c.ring_readers.values():
        readers.discard(k)


def release_if_done(c: Consumer, schedule: Protocol, steps: list[Item], phase: LoopPhase) -> None:
    """Arrive on a slot's empty barrier as soon as the m-block's reads of it are done."""
    for empty, (buffers, index, readers) in _slot_readers(schedule, steps).items():
        if c.ring_readers.get(empty) or empty in c.released or phase is not LoopPhase.LOOP:
            continue
        c.released.add(empty)
        retired = names(steps[k] for k in sorted(readers) if steps[k].kind is Kind.WGMMA)
        why = f"WAR: the slot's {buffers} are free (read; {retired or 'no wgmma'} retired)"
        ring = dict(mbar=empty, slot=index)
        c.place(sync(Kind.MBAR_ARRIVE, Who.WARPGROUP, c.home, phase, why, **ring))


def release_at_end(c: Consumer, schedule: Protocol, steps: list[Item], phase: LoopPhase) -> None:
    """At the m-block's end: retire the groups that still read a slot, then release it (an
    arrival per thread and m-block: it cannot wait for the next m-block)."""
    for empty, readers in c.ring_readers.items():
        if readers and empty not in c.released:
            slot_reads = names(steps[k] for k in sorted(readers))
            why = f"WAR: {slot_reads} retired before the m-block releases the slot they read"
            wgmma.wait_for(c, set(readers), phase, why)
    release_if_done(c, schedule, steps, phase)
