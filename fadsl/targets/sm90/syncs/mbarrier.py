"""insert_syncs' mbarrier pipeline (sm_90a): the TMA loads' full and empty barriers.

- a TMA load by the producer, read by the consumers (RAW across roles): the producer
  arms the buffer's full mbarrier (arrive.expect_tx with the tile's bytes) before the
  load; the consumers wait on it with the parity of the item's round (K/V) or of the
  tile (Q) before the first step that reads the item;
- a ring slot read by a consumer wgmma and refilled by the producer a round later (WAR
  across roles, across the back edge and across tiles): once a wgmma wait has retired
  the reading group, lane 0 of each consumer warp arrives on the slot's empty barrier
  (count = consumer warps); the producer waits on it with the flipped parity before
  every load, the first tile's included (the ring goes on from the previous tile);
- Q, read by every S = Q K^T of a tile and reloaded for a later tile (WAR across roles
  and tiles): when the consumers enter the epilogue (no S in flight), lane 0 of each
  warp arrives on Q's empty barrier; the producer waits on it with the flipped parity
  before loading the next Q into that slot. Q is a ring of ``q_slots`` tiles (its
  barriers too, ``Sync.slots``): with 2 the next tile's Q loads while this one runs;
- mbarrier init by thread 0, fence.mbarrier_init, __syncthreads before any use (setup).
"""

from __future__ import annotations

from ....ir import (
    Buffer,
    Hazard,
    HazardKind,
    Item,
    Kernel,
    Mode,
    Parity,
    Phase,
    Step,
    Sync,
    Threads,
)
from ....ir.syncmodel import SyncKind
from ..caps import FENCE_MBAR_INIT, MBAR_ARRIVE, MBAR_EXPECT_TX, MBAR_WAIT, SYNCTHREADS, TMA_LOAD
from .store import wait_free
from .state import (
    TO_CONSUMERS,
    TO_NEXT_TILE,
    TO_PRODUCER,
    Consumers,
    before_refill,
    first_load,
    hazard,
    init_barrier,
    role_of,
    tma_loaded,
    transposed_from,
    unique_ops,
)


def init_barriers(kernel: Kernel, rings: frozenset[str]) -> list[Sync]:
    """A full and an empty mbarrier per TMA-loaded tile or ring slot."""
    inits = []
    for buf in tma_loaded(kernel):
        if buf.name in transposed_from(kernel):
            continue  # raw V, read by the producer warps: syncs/transpose.py
        ring = buf.name in rings
        slots = _tile_slots(buf, rings)
        name = buf.name.lower()
        why = "one arrival: the producer's arrive.expect_tx"
        inits.append(init_barrier(kernel, f"{name}_full", 1, why, slots))
        why = "one arrival per consumer warp" + ("" if ring else ", once per tile")
        inits.append(
            init_barrier(kernel, f"{name}_empty", 4 * kernel.config.ext.consumers, why, slots)
        )
    return inits


def init_fences(kernel: Kernel) -> list[Sync]:
    """After the inits: visible to the async proxy, and to every thread before its first use."""
    loc = kernel.config.loc
    return [
        Sync(
            FENCE_MBAR_INIT,
            Phase.SETUP,
            (),
            loc,
            who=Threads.THREAD0,
            note="mbarrier.init visible to the async proxy (TMA complete_tx)",
        ),
        Sync(
            SYNCTHREADS,
            Phase.SETUP,
            (),
            loc,
            note="mbarrier.init (thread 0) before every other thread's arrive or wait",
        ),
    ]


def producer(
    kernel: Kernel,
    items: tuple[Item, ...],
    phase: Phase,
    readers: dict[str, list[Step]],
    rings: frozenset[str],
    freed: dict[str, list[str]],
) -> list[Item]:
    """The producer's program: before each TMA load, wait for the slot's previous round to
    be read (and for a TMA store over its bytes), then arm the full barrier."""
    out: list[Item] = []
    raw = transposed_from(kernel)  # loads whose barriers syncs/transpose.py places
    for step in items:
        if not isinstance(step, Step) or role_of(step.who) != "producer":
            continue
        if step.async_kind == TMA_LOAD and step.accesses[0].buffer not in raw:
            out += _around_load(kernel, step, phase, readers, rings, freed)
        out.append(step)
    return out


def _around_load(
    kernel: Kernel,
    load: Step,
    phase: Phase,
    readers: dict[str, list[Step]],
    rings: frozenset[str],
    freed: dict[str, list[str]],
) -> list[Sync]:
    """The producer thread's waits before ``load`` and its arming of the full barrier."""
    (access,) = load.accesses
    buf = kernel.buffer(access.buffer)
    ring = buf.name in rings
    uses = unique_ops(readers.get(buf.name, []))
    # The slot's (or, for Q, the tile's) previous use: always waited for, as the ring goes
    # on from the previous tile (a fresh barrier passes at once).
    across = TO_PRODUCER if ring else TO_NEXT_TILE
    wars = [hazard(HazardKind.WAR, r.op, load.op, buf.name, back=ring, across=across) for r in uses]
    raws = [
        hazard(HazardKind.RAW, load.op, r.op, buf.name, async_write=True, across=TO_CONSUMERS)
        for r in uses
    ]

    def on(kind: SyncKind, serves: list[Hazard], barrier: str, **args) -> Sync:
        return Sync(
            kind,
            phase,
            tuple(serves),
            kernel.config.loc,
            who=Threads.PRODUCER_THREAD,
            barrier=f"{buf.name.lower()}_{barrier}",
            lag=load.lag if ring else None,
            slots=_tile_slots(buf, rings),
            **args,
        )

    return [
        on(MBAR_WAIT, wars, "empty", parity=Parity.PHASE_FLIP if ring else Parity.TILE_FLIP),
        *wait_free(kernel, load, phase, buf.name, freed),
        on(MBAR_EXPECT_TX, raws, "full", tx=buf.tile_bytes),
    ]


def wait_full(c: Consumers, step: Step, phase: Phase, waited: set) -> None:
    """The consumers' mbarrier wait before the first read of a TMA-loaded item."""
    for access in step.accesses:
        buf = c.kernel.buffer(access.buffer)
        ring = buf.name in c.rings
        key = (buf.name, step.lag if ring else None)
        if access.mode is not Mode.READ or key in waited or buf.name in c.q_waited:
            continue
        waited.add(key)
        if not ring:
            c.q_waited.add(buf.name)
        c.sync(
            MBAR_WAIT,
            phase,
            [
                hazard(
                    HazardKind.RAW,
                    first_load(c.kernel, buf.name).op,
                    step.op,
                    buf.name,
                    async_write=True,
                    across=TO_CONSUMERS,
                )
            ],
            barrier=f"{buf.name.lower()}_full",
            lag=step.lag if ring else None,
            parity=Parity.PHASE if ring else Parity.TILE,
            slots=_tile_slots(buf, c.rings),
        )


def ring_reads(c: Consumers, items) -> dict[tuple[str, int], list[Step]]:
    """A phase's consumer reads of each ring item (buffer, lag): its wgmma groups and any
    ordinary step (`rescale guarded` reads K again when it recomputes S)."""
    reads: dict[tuple[str, int], list[Step]] = {}
    for step in items:
        if not isinstance(step, Step) or role_of(step.who) != "consumers":
            continue
        for access in step.accesses:
            if access.mode is Mode.READ and access.buffer in c.rings:
                reads.setdefault((access.buffer, step.lag), []).append(step)
    return reads


def release(c: Consumers, step: Step, phase: Phase) -> None:
    """After a retired wgmma group or an ordinary step: the empty-barrier arrival for each
    ring slot it read, once the phase's last read of that item is done."""
    for access in step.accesses:
        buf = c.kernel.buffer(access.buffer)
        if buf.name not in c.rings or access.mode is not Mode.READ:
            continue  # Q is released once per tile (release_tile), O by its store
        key = (buf.name, step.lag)
        readers = c.ring_reads.get(key, [step])
        c.released[key] = c.released.get(key, 0) + 1
        if c.released[key] < len(readers):
            continue
        c.sync(
            MBAR_ARRIVE,
            phase,
            [
                before_refill(c.kernel, r, buf.name, back=True, across=TO_PRODUCER)
                for r in unique_ops(readers)
            ],
            who=Threads.CONSUMER_WARP_LANE0,
            barrier=f"{buf.name.lower()}_empty",
            lag=step.lag,
        )


def release_tile(c: Consumers, phase: Phase) -> None:
    """Entering the epilogue, no S = Q K^T is in flight: the tile's Q (each TMA-loaded tile
    outside the rings) is dead, and lane 0 of each consumer warp arrives on its empty
    barrier for the next tile's load."""
    for name in [b.name for b in tma_loaded(c.kernel) if b.name not in c.rings]:
        in_flight = [a.buffer for g in c.in_flight for a in g.step.accesses]
        assert name not in in_flight, f"{name} still read by a wgmma in flight"
        c.sync(
            MBAR_ARRIVE,
            phase,
            [
                before_refill(c.kernel, r, name, across=TO_NEXT_TILE)
                for r in unique_ops(c.readers.get(name, []))
            ],
            who=Threads.CONSUMER_WARP_LANE0,
            barrier=f"{name.lower()}_empty",
            slots=_tile_slots(c.kernel.buffer(name), c.rings),
        )


def _tile_slots(buf: Buffer, rings: frozenset[str]) -> int:
    """The slots of the ring of tiles a buffer's per-tile barriers make (Q's: q_slots);
    1 for a K/V ring's buffer, whose barriers are indexed by block item instead."""
    return 1 if buf.name in rings else buf.slots
