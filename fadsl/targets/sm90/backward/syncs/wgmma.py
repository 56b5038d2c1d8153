"""The backward's wgmma syncs: wgmma.fence, commit groups and wgmma.wait_group.

- wgmma.fence (PTX: before the warpgroup's first wgmma, and between an ordinary access of a
  register and a wgmma that reads or accumulates into it): one per run of wgmmas (those
  issued with no ordinary step between them), before the run's first, where any wgmma of
  the run uses a register that ordinary code accessed since the last fence. Across the
  back edge the registers of the previous m-block count (S^T, dP^T, P^T, dS^T, dQ);
- commit groups: a wait retires groups oldest first, so a group ends between two wgmmas
  where ordinary code needs the earlier one's result before the later one's (S^T before
  dP^T, dQ before dV and dK); and, as the header does, where the warpgroup turns to
  anything else (a barrier, a fence, ordinary code). ``economical`` keeps a group open
  across syncs: bwd_consumer's dV, dK and dQ then share one; never across wgmmas of
  different guards (`dq_lag on`'s dQ(i - 1), from m-block 1 on, after dV(i)): the commit
  closing a group runs under its wgmmas' guard;
- wgmma.wait_group N before an ordinary step that reads or writes a register an in-flight
  group writes (RAW, WAW), writes one it reads (WAR: an RS operand), or writes SMEM it
  reads: N is the number of groups committed after the newest such group. A wait also
  retires the groups that read a ring slot (mbarrier.release follows it), and at the end
  of an m-block every group is retired: none crosses the back edge.
"""

from __future__ import annotations

from ..program import Guard, Item, Kind, LoopPhase, Reg, Who
from .state import Consumer, WgmmaGroup, guard_of, names, registers, same_bytes, sync, words


def hazards(reads, writes, smem_reads, step: Item) -> list[str]:
    """The hazards between in-flight wgmma accesses and ordinary ``step`` (empty: none)."""
    found = []
    for reg in sorted(writes & registers(step), key=lambda r: r.value):
        found.append(f"{'RAW' if reg in step.reg_reads else 'WAW'} on {reg.value}")
    for reg in sorted((reads - writes) & frozenset(step.reg_writes), key=lambda r: r.value):
        found.append(f"WAR on {reg.value}")
    for op in step.writes:
        if any(same_bytes(op, read) for read in smem_reads):
            found.append(f"WAR on {op.buffer.value}")
    return found


def _group_hazards(group: WgmmaGroup, step: Item) -> list[str]:
    return hazards(group.reads(), group.writes(), group.smem_reads(), step)


def needed_at(steps: list[Item], k: int) -> int:
    """Where ordinary code first needs wgmma steps[k] retired: the position of the first
    later step of the phase with a hazard on it, else the phase's end."""
    wgmma = steps[k]
    reads, writes = frozenset(wgmma.reg_reads), frozenset(wgmma.reg_writes)
    for j in range(k + 1, len(steps)):
        if steps[j].kind is not Kind.WGMMA and hazards(reads, writes, wgmma.reads, steps[j]):
            return j
    return len(steps)


def must_close(c: Consumer, steps: list[Item], k: int, synced_before: bool) -> str:
    """Why the open group ends before wgmma steps[k] ('' where it goes on)."""
    if not c.open_group.wgmmas:
        return ""
    open_need = min(needed_at(steps, j) for j, _ in c.open_group.wgmmas)
    if open_need < needed_at(steps, k):
        return f"{steps[open_need].name} needs it before {steps[k].name}'s result"
    if synced_before and not c.economical:
        return "the warpgroup syncs before its next wgmma"
    if guard_of(c.open_group.steps()) is not steps[k].guard:  # (its commit runs under one)
        return f"{steps[k].name} runs under another guard ({steps[k].guard.value})"
    return ""


def commit(c: Consumer, phase: LoopPhase, reason: str, at: int | None = None) -> None:
    """wgmma.commit_group closing the open group (inserted at ``at``, before syncs placed
    ahead of the next wgmma)."""
    if not c.open_group.wgmmas:
        return
    group, c.open_group = c.open_group, WgmmaGroup()
    last = group.wgmmas[-1][1]
    why = f"closes the group of {names(group.steps())}: {reason}"
    guard = guard_of(group.steps())
    item = sync(Kind.WGMMA_COMMIT, Who.WARPGROUP, last.source, phase, why, guard=guard)
    c.out.insert(len(c.out) if at is None else at, item)
    c.in_flight.append(group)


def fence(c: Consumer, steps: list[Item], k: int, phase: LoopPhase) -> None:
    """wgmma.fence before the run of wgmmas starting at steps[k], where it needs one."""
    if k > 0 and steps[k - 1].kind is Kind.WGMMA:
        return  # inside a run: its first wgmma decided
    run = []
    for step in steps[k:]:
        if step.kind is not Kind.WGMMA:
            break
        run.append(step)
    used = frozenset(r for step in run for r in registers(step))
    stale = [r for r in c.touched if r in used]
    if c.fenced and not stale:
        return
    if stale:
        by = words(name for r in stale for name in c.touched[r])
        regs = words(r.value for r in stale)
        why = f"{regs} accessed by ordinary code ({by}) before {names(run)} use them"
    else:
        why = f"the warpgroup's first wgmma ({names(run)}, m-block 0)"
    # a run under one guard (lagged dQ alone): only where it runs; a run that mixes guards
    # (dq_first's lagged dQ(i - 1), then dV(i) and dK(i)): in every m-block
    guards = {step.guard for step in run}
    guard = run[0].guard if len(guards) == 1 else Guard.ALWAYS
    c.place(sync(Kind.WGMMA_FENCE, Who.WARPGROUP, c.home, phase, why, guard=guard))
    c.touched.clear()
    c.fenced = True


def issue(c: Consumer, k: int, step: Item) -> None:
    c.place(step)
    c.open_group.wgmmas.append((k, step))


def track(c: Consumer, step: Item) -> None:
    """An ordinary step's register accesses: the next wgmma using them needs a fence."""
    for reg in sorted(registers(step), key=list(Reg).index):
        c.touched[reg] = tuple(dict.fromkeys(c.touched.get(reg, ()) + (step.name,)))


def waits_before(c: Consumer, step: Item) -> bool:
    """Whether ``wait_before`` places a wgmma.wait_group before ``step``."""
    return any(_group_hazards(g, step) for g in c.in_flight)


def wait_before(c: Consumer, step: Item, phase: LoopPhase) -> None:
    """wgmma.wait_group before ordinary ``step`` where an in-flight group has a hazard on it."""
    found = [(n, _group_hazards(g, step)) for n, g in enumerate(c.in_flight)]
    found = [(n, h) for n, h in found if h]
    if not found:
        return
    newest = found[-1][0]
    served = "; ".join(
        f"{h}: {names(c.in_flight[n].steps())} before {step.name}" for n, hs in found for h in hs
    )
    _wait(c, newest, phase, served, step.guard)


def wait_for(c: Consumer, positions: set[int], phase: LoopPhase, why: str) -> None:
    """wgmma.wait_group retiring the groups of the wgmmas at ``positions``."""
    hit = [n for n, g in enumerate(c.in_flight) if positions & {k for k, _ in g.wgmmas}]
    if hit:
        _wait(c, hit[-1], phase, why)


def drain(c: Consumer, phase: LoopPhase) -> None:
    """At the end of an m-block: no group crosses the back edge."""
    if c.in_flight:
        _wait(c, len(c.in_flight) - 1, phase, "no wgmma group crosses into the next m-block")


def _wait(c: Consumer, newest: int, phase: LoopPhase, why: str, guard=None) -> None:
    """wgmma.wait_group retiring the in-flight groups up to ``newest``; ``guard``: that of the
    step it is placed for (a lagged step's wait runs only where the step does)."""
    pending = len(c.in_flight) - newest - 1
    retired, c.in_flight = c.in_flight[: newest + 1], c.in_flight[newest + 1 :]
    if pending:
        why += f" ({names(s for g in c.in_flight for s in g.steps())} may run on)"
    more = {} if guard is None else dict(guard=guard)
    c.place(sync(Kind.WGMMA_WAIT, Who.WARPGROUP, c.home, phase, why, pending=pending, **more))
    for group in retired:
        for readers in c.ring_readers.values():
            readers.difference_update(k for k, _ in group.wgmmas)
