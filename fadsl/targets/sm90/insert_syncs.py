"""insert_syncs (sm_90a): the mbarrier pipeline, wgmma groups, named barriers and fences.

Derived from the schedule's steps (role, ring item, SMEM accesses, async kind) and the
consumer ops' register uses (schedule.REGISTERS); each sync records the hazards it orders:

- the kernel is a loop over tiles (q block, head, batch); each role runs the IR's
  prologue, mainloop and epilogue once per non-empty tile, ring items counting on across
  tiles (a tile with no K/V block touches no SMEM and no barrier);
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
- wgmma results and operands in registers (RAW/WAR within a warpgroup): each wgmma is
  preceded by wgmma.fence and followed by its own commit group; before a step that
  touches registers an in-flight group writes (or reads), wgmma.wait_group N keeps the
  N newer groups in flight. With ``overlap off`` every GEMM is waited for at once;
- mbarrier init by thread 0, fence.mbarrier_init, __syncthreads before any use (setup).

The ping-pong turns are pingpong_syncs'; the O store's syncs (named barriers, the proxy
fence, bulk waits, the free barrier of O over the dead rings) are store_syncs'.
"""

from __future__ import annotations

from dataclasses import replace

from ... import targets
from ...ir import (
    Buffer,
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
from .caps import (
    FENCE_MBAR_INIT,
    MBAR_ARRIVE,
    MBAR_EXPECT_TX,
    MBAR_INIT,
    MBAR_WAIT,
    SYNCTHREADS,
    TMA_LOAD,
    TMA_STORE,
    WGMMA,
    WGMMA_COMMIT,
    WGMMA_FENCE,
    WGMMA_WAIT,
)
from .pingpong_syncs import close_turns, hand_over, open_turn, take_turn
from .schedule import REGISTERS, ring_buffers
from .store_syncs import (
    after_store,
    before_smem,
    freed_by_stores,
    in_own_bytes,
    init_free_barriers,
    reused_by_next_tile,
    wait_free,
    wait_last_store,
)
from .sync_state import (
    TO_CONSUMERS,
    TO_NEXT_TILE,
    TO_PRODUCER,
    Consumers,
    Group,
    first_load,
    hazard,
    role_of,
    tma_loaded,
    unique_ops,
    writes_to,
)


class _Consumers(Consumers):
    """The consumer program being built: its syncs (moving, one mechanism at a time, to a
    module of their own)."""

    def wait_full(self, step: Step, phase: Phase, waited: set) -> None:
        """The consumers' mbarrier wait before the first read of a TMA-loaded item."""
        for access in step.accesses:
            buf = self.kernel.buffer(access.buffer)
            ring = buf.name in self.rings
            key = (buf.name, step.lag if ring else None)
            if access.mode is not Mode.READ or key in waited or buf.name in self.q_waited:
                continue
            waited.add(key)
            if not ring:
                self.q_waited.add(buf.name)
            self.sync(
                MBAR_WAIT,
                phase,
                [
                    hazard(
                        HazardKind.RAW,
                        first_load(self.kernel, buf.name).op,
                        step.op,
                        buf.name,
                        async_write=True,
                        across=TO_CONSUMERS,
                    )
                ],
                barrier=f"{buf.name.lower()}_full",
                lag=step.lag if ring else None,
                parity=Parity.PHASE if ring else Parity.TILE,
                slots=_tile_slots(buf, self.rings),
            )

    def wait_groups(self, step: Step | None, phase: Phase, force: bool = False) -> None:
        """wgmma.wait_group N before ``step`` if it touches registers an in-flight group uses."""
        reads, writes = REGISTERS.get(step.op, (frozenset(), frozenset())) if step else ((), ())
        newest = -1
        served = []
        for index, group in enumerate(self.in_flight):
            raw = group.writes & (set(reads) | set(writes))
            war = group.reads & set(writes)
            for reg in sorted(raw):
                served.append(
                    hazard(HazardKind.RAW, group.step.op, step.op, f"{reg} (rf)", async_write=True)
                )
            for reg in sorted(war - raw):
                served.append(hazard(HazardKind.WAR, group.step.op, step.op, f"{reg} (rf)"))
            if raw or war or force:
                newest = index
        if newest < 0:
            return
        hand_over(self, phase)
        retired, self.in_flight = self.in_flight[: newest + 1], self.in_flight[newest + 1 :]
        note = "" if served else "overlap off: one GEMM in flight at a time"
        self.out.append(
            Sync(
                WGMMA_WAIT,
                phase,
                tuple(served),
                self.kernel.config.loc,
                groups=len(self.in_flight),
                who=Threads.CONSUMERS,
                note=note,
            )
        )
        for group in retired:
            self.release(group.step, phase)

    def release(self, step: Step, phase: Phase) -> None:
        """Empty-barrier arrivals for the ring slots a retired wgmma group has read."""
        for access in step.accesses:
            buf = self.kernel.buffer(access.buffer)
            if buf.name not in self.rings:
                continue  # Q is released once per tile (release_tile), O by its store
            self.sync(
                MBAR_ARRIVE,
                phase,
                [
                    hazard(
                        HazardKind.WAR,
                        step.op,
                        first_load(self.kernel, buf.name).op,
                        buf.name,
                        back=True,
                        across=TO_PRODUCER,
                    )
                ],
                who=Threads.CONSUMER_WARP_LANE0,
                barrier=f"{buf.name.lower()}_empty",
                lag=step.lag,
            )

    def release_tile(self, phase: Phase, once: list[str]) -> None:
        """Entering the epilogue, no S = Q K^T is in flight: the tile's Q is dead, and
        lane 0 of each consumer warp arrives on its empty barrier for the next tile's load."""
        for name in once:
            in_flight = [a.buffer for g in self.in_flight for a in g.step.accesses]
            assert name not in in_flight, f"{name} still read by a wgmma in flight"
            load = first_load(self.kernel, name)
            self.sync(
                MBAR_ARRIVE,
                phase,
                [
                    hazard(HazardKind.WAR, r.op, load.op, name, across=TO_NEXT_TILE)
                    for r in unique_ops(self.readers.get(name, []))
                ],
                who=Threads.CONSUMER_WARP_LANE0,
                barrier=f"{name.lower()}_empty",
                slots=_tile_slots(self.kernel.buffer(name), self.rings),
            )


def insert_syncs(kernel: Kernel, target: targets.Target) -> Kernel:
    hw = kernel.config.hopper
    assert hw is not None and kernel.smem_bytes is not None, "run plan_smem first"
    steps = kernel.steps()
    consumer_steps = [s for s in steps if role_of(s.who) == "consumers"]
    readers: dict[str, list[Step]] = {}
    for s in consumer_steps:
        for a in s.accesses:
            if a.mode is Mode.READ:
                readers.setdefault(a.buffer, []).append(s)
    loc = kernel.config.loc
    rings = ring_buffers(kernel)

    # --- setup: a full and an empty mbarrier per TMA-loaded tile or ring slot ----------
    setup: list[Item] = []
    init_note = "mbarrier.init before any arrive, wait or complete_tx"
    for buf in kernel.buffers:
        if not any(writes_to(s, buf.name, TMA_LOAD) for s in steps):
            continue
        ring = buf.name in rings
        tile_slots = _tile_slots(buf, rings)
        setup.append(
            Sync(
                MBAR_INIT,
                Phase.SETUP,
                (),
                loc,
                who=Threads.THREAD0,
                barrier=f"{buf.name.lower()}_full",
                count=1,
                slots=tile_slots,
                note=init_note + " (one arrival: the producer's arrive.expect_tx)",
            )
        )
        setup.append(
            Sync(
                MBAR_INIT,
                Phase.SETUP,
                (),
                loc,
                who=Threads.THREAD0,
                barrier=f"{buf.name.lower()}_empty",
                count=4 * hw.consumers,
                slots=tile_slots,
                note=init_note
                + (" (one arrival per consumer warp" + ("" if ring else ", once per tile") + ")"),
            )
        )
    loaded = tma_loaded(kernel)
    freed = freed_by_stores(kernel)
    setup += init_free_barriers(kernel, freed)
    if setup:
        setup.append(
            Sync(
                FENCE_MBAR_INIT,
                Phase.SETUP,
                (),
                loc,
                who=Threads.THREAD0,
                note="mbarrier.init visible to the async proxy (TMA complete_tx)",
            )
        )
        setup.append(
            Sync(
                SYNCTHREADS,
                Phase.SETUP,
                (),
                loc,
                note="mbarrier.init (thread 0) before every other thread's arrive or wait",
            )
        )

    # --- producer: arm the full barrier; wait for the slot's previous round to be read ---
    def producer(items: tuple[Item, ...], phase: Phase) -> list[Item]:
        out: list[Item] = []
        for step in items:
            if not isinstance(step, Step) or role_of(step.who) != "producer":
                continue
            if step.async_kind == TMA_LOAD:
                (access,) = step.accesses
                buf = kernel.buffer(access.buffer)
                name = buf.name.lower()
                lag = step.lag if buf.name in rings else None
                raws = [
                    hazard(
                        HazardKind.RAW,
                        step.op,
                        r.op,
                        buf.name,
                        async_write=True,
                        across=TO_CONSUMERS,
                    )
                    for r in unique_ops(readers.get(buf.name, []))
                ]
                # The slot's (or, for Q, the tile's) previous use: always waited for, as
                # the ring goes on from the previous tile (a fresh barrier passes at once).
                ring = buf.name in rings
                wars = [
                    hazard(
                        HazardKind.WAR,
                        r.op,
                        step.op,
                        buf.name,
                        back=ring,
                        across=TO_PRODUCER if ring else TO_NEXT_TILE,
                    )
                    for r in unique_ops(readers.get(buf.name, []))
                ]
                out.append(
                    Sync(
                        MBAR_WAIT,
                        phase,
                        tuple(wars),
                        loc,
                        who=Threads.PRODUCER_THREAD,
                        barrier=f"{name}_empty",
                        lag=lag,
                        parity=Parity.PHASE_FLIP if ring else Parity.TILE_FLIP,
                        slots=_tile_slots(buf, rings),
                    )
                )
                out.extend(wait_free(kernel, step, phase, buf.name, freed))
                out.append(
                    Sync(
                        MBAR_EXPECT_TX,
                        phase,
                        tuple(raws),
                        loc,
                        who=Threads.PRODUCER_THREAD,
                        barrier=f"{name}_full",
                        lag=lag,
                        tx=buf.tile_bytes,
                        slots=_tile_slots(buf, rings),
                    )
                )
            out.append(step)
        return out

    # --- consumers -----------------------------------------------------------------
    c = _Consumers(kernel, readers, rings, freed, reused=reused_by_next_tile(kernel))
    consumer_items: dict[Phase, list[Item]] = {}
    for phase, items in (*kernel.phases(), (Phase.TEARDOWN, ())):
        if phase is Phase.TEARDOWN and hw.pingpong:
            close_turns(c, phase)
        waited: set = set()
        # A phase is entered from more than one place (the loop from the prologue and from
        # its own end): assume registers were written before it.
        c.registers_written = True
        if phase is Phase.EPILOGUE:
            c.release_tile(phase, [b.name for b in loaded if b.name not in rings])
        if phase is Phase.EPILOGUE and hw.pingpong:
            # O in its own bytes: the previous tile's store, waited for before the tile's
            # last turn
            c.carried = in_own_bytes(c)
        if phase is Phase.TEARDOWN:
            wait_last_store(c, phase)
        for step in items:
            if not isinstance(step, Step) or role_of(step.who) != "consumers":
                continue
            if step.async_kind == WGMMA:
                c.wait_groups(step, phase)
                c.wait_full(step, phase, waited)
                take_turn(c, phase)
                if c.registers_written:
                    c.sync(
                        WGMMA_FENCE,
                        phase,
                        note="registers written by ordinary code (O rescaled, P converted) before wgmma reads them",
                    )
                    c.registers_written = False
                c.out.append(step)
                c.sync(WGMMA_COMMIT, phase, note=f"closes {step.op.spelling}'s wgmma group")
                reads, writes = REGISTERS[step.op]
                c.in_flight.append(Group(step, reads, writes))
                if not hw.overlap:
                    c.wait_groups(None, phase, force=True)
            else:
                c.wait_groups(step, phase)
                before_smem(c, step, phase)
                c.out.append(step)
                c.registers_written |= bool(REGISTERS.get(step.op, ((), ()))[1])
                if step.async_kind == TMA_STORE:
                    after_store(c, step, phase)
        if phase is Phase.SETUP and hw.pingpong:
            open_turn(c, phase)
        consumer_items[phase], c.out = c.out, []

    new = {Phase.TEARDOWN: tuple(consumer_items[Phase.TEARDOWN])}
    for phase, items in kernel.phases():
        head = setup if phase is Phase.SETUP else []
        new[phase] = tuple(head + producer(items, phase) + consumer_items[phase])
    return replace(
        kernel,
        setup=new[Phase.SETUP],
        prologue=new[Phase.PROLOGUE],
        mainloop=new[Phase.MAINLOOP],
        epilogue=new[Phase.EPILOGUE],
        teardown=new[Phase.TEARDOWN],
    )


def _tile_slots(buf: Buffer, rings: frozenset[str]) -> int:
    """The slots of the ring of tiles a buffer's per-tile barriers make (Q's: q_slots);
    1 for a K/V ring's buffer, whose barriers are indexed by block item instead."""
    return 1 if buf.name in rings else buf.slots
