"""insert_syncs (sm_90a): the mbarrier pipeline, wgmma groups, named barriers and fences.

Derived from the schedule's steps (role, ring item, SMEM accesses, async kind) and the
consumer ops' register uses (schedule.REGISTERS); each sync records the hazards it orders.
The kernel is a loop over tiles (q block, head, batch); each role runs the IR's prologue,
mainloop and epilogue once per non-empty tile, ring items counting on across tiles (a tile
with no K/V block touches no SMEM and no barrier).

One module per mechanism, each with the hazards it orders in its docstring:

- mbarrier: the TMA loads' full and empty mbarriers (their inits in the setup, the
  producer's waits and arrive.expect_tx, the consumers' waits and arrivals), K/V's per
  ring slot and Q's per tile;
- wgmma: wgmma.fence, a commit group per wgmma, wgmma.wait_group before the
  registers an in-flight group uses;
- pingpong: the consumer warpgroups' turns on the tensor cores (named barriers);
- store: O's stmatrix and TMA store (named barriers, the proxy fence, bulk waits
  and, where O lies over the dead rings, its free barrier);
- transpose (8-bit kernels): raw V's barriers and the producer warps' side of Vt's
  (the consumers wait on and release Vt as any ring, through mbarrier);
- state: the consumer program being built, which they share.

This pass walks the phases and calls them in order; ``role_of`` (state) names the
program a step or sync belongs to, for emit and the report.
"""

from __future__ import annotations

from dataclasses import replace

from .... import targets
from ....ir import Item, Kernel, Mode, Phase, Step
from ..caps import TMA_STORE, WGMMA
from .mbarrier import (
    init_barriers,
    init_fences,
    producer,
    release,
    release_tile,
    ring_reads,
    wait_full,
)
from .pingpong import close_turns, open_turn, take_turn
from ..schedule import ring_buffers
from .store import (
    after_store,
    before_smem,
    freed_by_stores,
    in_own_bytes,
    init_free_barriers,
    reused_by_next_tile,
    wait_last_store,
)
from .state import Consumers, role_of
from .transpose import around_transposes, init_transpose_barriers
from .wgmma import issue_wgmma, track_register_writes, wait_groups

__all__ = ["insert_syncs", "role_of"]  # role_of (state): emit and report ask here


def insert_syncs(kernel: Kernel, target: targets.Target) -> Kernel:
    hw = kernel.config.ext
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

    setup: list[Item] = [
        *init_barriers(kernel, rings),
        *init_transpose_barriers(kernel),
        *init_free_barriers(kernel, freed),
    ]
    if setup:
        setup += init_fences(kernel)

    c = Consumers(kernel, readers, rings, freed, reused=reused_by_next_tile(kernel))
    consumer_items: dict[Phase, list[Item]] = {}
    for phase, items in (*kernel.phases(), (Phase.TEARDOWN, ())):
        if phase is Phase.TEARDOWN and hw.pingpong:
            close_turns(c, phase)
        waited: set = set()
        c.ring_reads, c.released = ring_reads(c, items), {}
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
            # First the registers (a wait ends the turn and frees the ring slots its
            # groups read); a wgmma then waits for its operands' load, then its turn.
            wait_groups(c, step, phase)
            if step.async_kind == WGMMA:
                wait_full(c, step, phase, waited)
                take_turn(c, phase)
                issue_wgmma(c, step, phase)
                continue
            before_smem(c, step, phase)
            c.out.append(step)
            release(c, step, phase)
            track_register_writes(c, step)
            if step.async_kind == TMA_STORE:
                after_store(c, step, phase)
        if phase is Phase.SETUP and hw.pingpong:
            open_turn(c, phase)
        consumer_items[phase], c.out = c.out, []

    new = {Phase.TEARDOWN: tuple(consumer_items[Phase.TEARDOWN])}
    for phase, items in kernel.phases():
        head = setup if phase is Phase.SETUP else []
        programs = producer(kernel, items, phase, readers, rings, freed)
        programs = around_transposes(kernel, programs, phase, freed) + consumer_items[phase]
        new[phase] = tuple(head + programs)
    return replace(
        kernel,
        setup=new[Phase.SETUP],
        prologue=new[Phase.PROLOGUE],
        mainloop=new[Phase.MAINLOOP],
        epilogue=new[Phase.EPILOGUE],
        teardown=new[Phase.TEARDOWN],
    )
