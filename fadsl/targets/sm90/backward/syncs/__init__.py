"""The backward main kernel's sync pass: every mbarrier, named barrier, fence, wgmma group and
bulk group of the plan, placed from the hazards of its schedule.

The schedule is the plan's steps with no sync (schedule.py: ``schedule``): per role, in program
order and tagged with their phase (before the m-block loop, each m-block, after it), the
TMA and bulk loads, wgmmas, st.shared, ld.shared-based compute, the bulk reduce-add and the
st.global of dK and dV, with the SMEM operands (buffer, ring slot or dS^T buffer, part)
and registers each reads and writes, which threads run it and which proxy (its kind).
``insert_syncs`` derives the syncs from them, one module per mechanism, each with the
hazards it orders in its docstring:

- mbarrier: the setup, the loads' full barriers (expect_tx with their bytes) and the ring's
  empty barriers (ring parity, the producer's flipped); with `scheduler persistent` K and
  V's empty barrier per tile; with `late_v on` V's own barrier, waited in the loop's first
  pass and after the loop;
- wgmma: wgmma.fence, commit groups, wgmma.wait_group from the commit order;
- named: the proxy fence and the barrier between st.shared and an async-proxy reader (the
  dS^T meeting, the staging before the reduce-add);
- bulk: the reduce-add's bulk groups (the staging's WAR, the exit), dK's and dV's TMA
  stores (their read before the exit) and the deterministic ordered add;
- writer: with ``dq_writer`` the hand-over of the staging between the consumer and its
  writer warp (a full and an empty named barrier), the writer's bulk waits, ``__syncwarp``
  and ordered add;
- handover: with ``dq_lag`` the hand-over of each dS^T buffer from the warpgroups that
  write it to the lagged dQ that reads it a step later (a full and an empty mbarrier per
  buffer, in place of the meeting), and the wait on the last buffer's empty barrier before
  K, which every warpgroup's last dQ reads, is written after the loop;
- state: the consumer program being built, which they share.

Every consumer warpgroup runs the same program; the pass builds it once, for warpgroup wg,
and walks the loop until the state at its head is the same from before the loop and from
the end of an m-block (the registers ordinary code touched, the bulk group in flight), so
that hazards across the back edge (a register of the previous m-block, a staging an m-block
ago) are placed as in m-block 1. Before each step the mechanisms place their syncs in this
order: the wgmma commit and wait and the slot's release they allow (registers first, so the
slot goes back to the producer as early as it can), the full barrier's wait, the staging's
WAR, the proxy fence (the writers', before the barrier that hands the bytes over), the
wgmma.fence (the warpgroup's own, issued before it blocks at a meeting), the meeting
barrier, the ordered add's acquire: the header's order. The ordered add's release owed from
the previous m-block goes before the m-block's first wgmma wait (bulk.py).

Its result is the plan (protocol.py: ``protocol(p) = insert_syncs(build_schedule(p))``), which
verify.py proves; tests/test_backward_syncs.py checks that it equals a plan written by hand
from the header (tests/backward_hand_plan.py) in every configuration, every field but
``why``. Each placed sync's ``why`` names the hazard it orders (`fadsl explain` prints it).
"""

from __future__ import annotations

from ..program import Guard, Item, Kind, LoopPhase, Protocol, WarpRole
from . import bulk, handover, mbarrier, named, wgmma, writer
from .state import Consumer, join, loop_entry_equal, names

__all__ = ["insert_syncs", "without_syncs"]


def without_syncs(plan: Protocol) -> Protocol:
    """The plan's schedule: its steps with their operands, every sync removed."""
    roles = {role: tuple(x for x in plan.role(role) if not x.is_sync) for role in WarpRole}
    return Protocol(
        plan.params,
        roles[WarpRole.SETUP],
        roles[WarpRole.PRODUCER],
        roles[WarpRole.CONSUMER],
        plan.layout,
        roles[WarpRole.WRITER],
    )


def insert_syncs(schedule: Protocol, *, economical: bool = False) -> Protocol:
    """The plan with every sync placed. ``economical``: leave out the syncs whose hazard
    another mechanism's sync already orders, which the header keeps (a wgmma group ended
    at every sync, the staging's wait_group.read in deterministic mode)."""
    assert not any(x.is_sync for role in WarpRole for x in schedule.role(role)), "syncs given"
    assert not schedule.setup, "the setup holds syncs only"
    return Protocol(
        schedule.params,
        mbarrier.setup(schedule, handover.inits(schedule)),
        mbarrier.producer(schedule),
        _consumer(schedule, economical),
        schedule.layout,
        writer.program(schedule),
    )


def _consumer(schedule: Protocol, economical: bool) -> tuple[Item, ...]:
    steps = {phase: [x for x in schedule.consumer if x.phase is phase] for phase in LoopPhase}
    assert steps[LoopPhase.BEFORE], "the consumer's prologue names its function"
    c = Consumer(schedule.params, steps[LoopPhase.BEFORE][0].source, economical)
    for k in range(len(steps[LoopPhase.BEFORE])):
        _place_step(c, schedule, steps[LoopPhase.BEFORE], k, LoopPhase.BEFORE)
    wgmma.commit(c, LoopPhase.BEFORE, "the prologue's end")
    mbarrier.wait_loaded_before_loop(c, schedule)

    before_loop = entry = c.snapshot()
    for _ in range(4):  # the state at the loop's head: a join of two entries, at a fixpoint
        body = _m_block(entry, schedule, steps[LoopPhase.LOOP])
        joined = join(before_loop, body)
        if loop_entry_equal(joined, entry):
            break
        entry = joined
    else:
        raise AssertionError("the loop's entry state does not settle")

    c = body
    mbarrier.wait_once_after_loop(c, schedule)  # (`late_v on`: V)
    after = steps[LoopPhase.AFTER]
    # the last m-block's lagged steps (dq_lag's last dQ) end the m-blocks' work, then the
    # tile's: K and V freed (every wgmma reading them retired), the exit's bulk wait; with
    # `dv_out_first on` dV's staging and TMA store go first, under the last dQ
    first = next((k for k, x in enumerate(after) if x.guard is Guard.LAGGED), 0)
    end = first + len([x for x in after if x.guard is Guard.LAGGED])
    assert all(x.guard is Guard.LAGGED for x in after[first:end]), "the lagged steps together"
    for k in range(end):
        _place_step(c, schedule, after, k, LoopPhase.AFTER)
    if end > first:
        wgmma.commit(c, LoopPhase.AFTER, "the last m-block's end")
        wgmma.drain(c, LoopPhase.AFTER)
        handover.release_if_retired(c, schedule, LoopPhase.AFTER)
    # (a persistent CTA frees K and V here, under any TMA store still reading V: none, since
    # dK and dV by TMA run one tile per CTA, Params' assert)
    mbarrier.release_tile(c, schedule)
    bulk.wait_at_exit(c, with_stores=False)  # (a TMA store in flight reads on until the exit's)
    for k in range(end, len(after)):
        _place_step(c, schedule, after, k, LoopPhase.AFTER)
    bulk.wait_at_exit(c)  # (the epilogue's TMA stores, if any)
    wgmma.commit(c, LoopPhase.AFTER, "the program's end")
    wgmma.drain(c, LoopPhase.AFTER)
    assert not c.handover_due, "a hand-over's fence and arrival never placed"
    return tuple(c.out)


def _m_block(entry: Consumer, schedule: Protocol, steps: list[Item]) -> Consumer:
    c = entry.snapshot()
    mbarrier.start_m_block(c, schedule, steps)
    bulk.start_m_block(c)
    for k in range(len(steps)):
        _place_step(c, schedule, steps, k, LoopPhase.LOOP)
    wgmma.commit(c, LoopPhase.LOOP, "the m-block's end")
    handover.place_due(c, schedule, steps, None, LoopPhase.LOOP)
    mbarrier.release_at_end(c, schedule, steps, LoopPhase.LOOP)
    wgmma.drain(c, LoopPhase.LOOP)
    handover.release_if_retired(c, schedule, LoopPhase.LOOP)
    return c


def _place_step(c: Consumer, schedule: Protocol, steps: list[Item], k: int, phase: LoopPhase):
    step = steps[k]
    if step.kind is Kind.WGMMA:
        # whether the open group ends here depends on the syncs the wgmma needs first; the
        # commit then goes ahead of them (no mechanism before a wgmma counts groups)
        mark = len(c.out)
        _syncs_before(c, schedule, steps, k, phase)
        reason = wgmma.must_close(c, steps, k, synced_before=len(c.out) > mark)
        if reason:
            wgmma.commit(c, phase, reason, at=mark)
        wgmma.issue(c, k, step)
        return
    wgmma.commit(c, phase, f"the warpgroup turns to {step.name}")
    handover.place_due(c, schedule, steps, k, phase)
    if wgmma.waits_before(c, step):  # the owed release runs under the groups in flight
        bulk.release_due(c, phase, f"while {names(g.steps()[0] for g in c.in_flight)} run")
    wgmma.wait_before(c, step, phase)
    mbarrier.release_if_done(c, schedule, steps, phase)
    handover.release_if_retired(c, schedule, phase)
    _syncs_before(c, schedule, steps, k, phase)
    c.place(step)
    wgmma.track(c, step)
    named.record_writes(c, step)
    bulk.after_add(c, step, phase)
    writer.after_write(c, schedule, step, phase)
    handover.after_write(c, schedule, step, phase)
    if phase is LoopPhase.LOOP:
        mbarrier.read_done(c, k)
        mbarrier.release_if_done(c, schedule, steps, phase)


def _syncs_before(c: Consumer, schedule: Protocol, steps: list[Item], k: int, phase: LoopPhase):
    step = steps[k]
    mark = len(c.out)
    if phase is LoopPhase.LOOP:
        mbarrier.wait_full(c, schedule, step, phase)
        mbarrier.wait_once_in_loop(c, schedule, step, phase)
    handover.wait_full(c, schedule, step, phase)
    bulk.before_write(c, step, phase)
    writer.before_write(c, schedule, step, phase)
    handover.before_write(c, schedule, step, phase)
    if step.kind is Kind.WGMMA:  # (an ordinary step's went before its waits)
        handover.place_due(c, schedule, steps, k, phase, at=mark, blocked=len(c.out) > mark)
    fenced = named.fence_writes(c, step, phase)
    if step.kind is Kind.WGMMA:
        wgmma.fence(c, steps, k, phase)
    met = len(c.out)
    named.meet(c, step, phase, fenced)
    # (a hand-over's arrival held back over a meeting could close a cycle: none in any plan)
    assert not (c.handover_due and len(c.out) > met), "a meeting while an arrival is held back"
    bulk.before_add(c, step, phase)
