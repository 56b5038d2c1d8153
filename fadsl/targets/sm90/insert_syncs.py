"""insert_syncs (sm_90a): the mbarrier pipeline, wgmma groups, named barriers and fences.

Derived from the schedule's steps (role, ring item, SMEM accesses, async kind) and the
consumer ops' register uses (schedule.REGISTERS); each sync records the hazards it orders:

- the kernel is a loop over tiles (q block, head, batch); each role runs the IR's
  prologue, mainloop and epilogue once per non-empty tile, ring items counting on across
  tiles (a tile with no K/V block touches no SMEM and no barrier);
- wgmma results and operands in registers (RAW/WAR within a warpgroup): each wgmma is
  preceded by wgmma.fence and followed by its own commit group; before a step that
  touches registers an in-flight group writes (or reads), wgmma.wait_group N keeps the
  N newer groups in flight. With ``overlap off`` every GEMM is waited for at once.

The mbarrier pipeline (the TMA loads' full and empty barriers, their inits) is
mbarrier_syncs'; the ping-pong turns are pingpong_syncs'; the O store's syncs (named
barriers, the proxy fence, bulk waits, the free barrier of O over the dead rings) are
store_syncs'.
"""

from __future__ import annotations

from dataclasses import replace

from ... import targets
from ...ir import (
    HazardKind,
    Item,
    Kernel,
    Mode,
    Phase,
    Step,
    Sync,
    Threads,
)
from .caps import (
    TMA_STORE,
    WGMMA,
    WGMMA_COMMIT,
    WGMMA_FENCE,
    WGMMA_WAIT,
)
from .mbarrier_syncs import (
    init_barriers,
    init_fences,
    producer,
    release,
    release_tile,
    wait_full,
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
    wait_last_store,
)
from .sync_state import (
    Consumers,
    Group,
    hazard,
    role_of,
)


class _Consumers(Consumers):
    """The consumer program being built: its syncs (moving, one mechanism at a time, to a
    module of their own)."""

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
            release(self, group.step, phase)


def insert_syncs(kernel: Kernel, target: targets.Target) -> Kernel:
    hw = kernel.config.hopper
    assert hw is not None and kernel.smem_bytes is not None, "run plan_smem first"
    readers: dict[str, list[Step]] = {}
    for s in kernel.steps():
        if role_of(s.who) != "consumers":
            continue
        for a in s.accesses:
            if a.mode is Mode.READ:
                readers.setdefault(a.buffer, []).append(s)
    rings = ring_buffers(kernel)

    freed = freed_by_stores(kernel)
    setup: list[Item] = [*init_barriers(kernel, rings), *init_free_barriers(kernel, freed)]
    if setup:
        setup += init_fences(kernel)

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
            release_tile(c, phase)
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
                wait_full(c, step, phase, waited)
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
        programs = producer(kernel, items, phase, readers, rings, freed) + consumer_items[phase]
        new[phase] = tuple(head + programs)
    return replace(
        kernel,
        setup=new[Phase.SETUP],
        prologue=new[Phase.PROLOGUE],
        mainloop=new[Phase.MAINLOOP],
        epilogue=new[Phase.EPILOGUE],
        teardown=new[Phase.TEARDOWN],
    )
