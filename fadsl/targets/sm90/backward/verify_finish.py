"""Proves a `fused_convert on` hand-over plan (finish.py's ``finish_plan``) against the PTX memory
model: every contributing CTA's dQ red.adds happen before, in causality order, the loads of the
warp that converts the m-block, and those loads read where the adds were performed.

Why the conditions checked here suffice. A red.add is a relaxed atomic at GPU scope, performed
in L2. (1) Each consumer thread's fence.acq_rel.gpu after its last add, then bar.sync of every
consumer thread, puts every add of the CTA before the count in causality order (bar.sync
synchronizes its participants and orders their memory accesses; the per-thread fence makes each
add performed at GPU scope before the thread arrives, so the argument does not rest on a CTA-
scope barrier carrying cumulativity by itself). (2) The count is a release at GPU scope (its own
sem, or a fence.acq_rel.gpu after the meeting): release is cumulative, so it publishes all that
precedes it in causality order, the other threads' adds included. A fence before the meeting
does not: it would precede the other threads' arrivals. (3) The counts of one counter form a
chain of atomic read-modify-writes, so the count that completes it observes every earlier
contributor's release; being an acquire (its sem, or a fence.acq_rel.gpu after it by the
counting thread before the hand-over) it synchronizes with each of them, and every add precedes
the counting thread's later operations. (4) bar.warp.sync orders memory among the warp's lanes,
so the other lanes' loads come after the counting lane's acquire; a lane that did not itself
acquire may still hit a stale L1 line (L1 is not coherent with other SMs' writes), hence
ld.global.cg (L2). (5) No add after the fence (it would be in no count), no load or store
before the count, each CTA counts an m-block once, and every step is present.
"""

from __future__ import annotations

from .finish import WARPGROUP_THREADS, Cache, Executor, FinishCall, Sem, FinishStep

EVERY = Executor.EVERY_CONSUMER_THREAD
WARP = Executor.EVERY_LANE_OF_THE_WARP
RELEASES = (Sem.RELEASE, Sem.ACQ_REL)
ACQUIRES = (Sem.ACQUIRE, Sem.ACQ_REL)


def finish_problems(plan: tuple[FinishCall, ...], consumers: int) -> list[str]:
    """What keeps ``plan`` (one CTA's calls, in order) from being proven; [] if nothing."""
    threads = consumers * WARPGROUP_THREADS

    def at(step: FinishStep) -> list[int]:
        return [i for i, c in enumerate(plan) if c.step is step]

    def first(
        step: FinishStep, lo: int, hi: int, who: tuple[Executor, ...] = tuple(Executor)
    ) -> int:
        """The first ``step`` by one of ``who`` strictly between lo and hi (a bar.sync: of
        every consumer thread); -1 if none."""
        for i in range(lo + 1, hi):
            c = plan[i]
            if (
                c.step is step
                and c.who in who
                and (step is not FinishStep.BAR_SYNC or c.threads == threads)
            ):
                return i
        return -1

    required = (FinishStep.RED_ADD, FinishStep.COUNT, FinishStep.LOAD_SUMS, FinishStep.STORE_DQ)
    problems = [f"missing step: no {s.name} ({s.value}) in the plan" for s in required if not at(s)]
    if problems:
        return problems
    reds, counts, loads, stores = map(at, required)
    end, final = len(plan), counts[-1]
    if len(counts) > 1:
        problems.append(f"{len(counts)} counts: a CTA must count each m-block once")
    for k in counts:
        if plan[k].who is not Executor.ONE_THREAD_PER_M_BLOCK:
            problems.append(f"count by {plan[k].who.value}: a CTA must count each m-block once")

    # (h) no add after the fence that follows the adds
    after_fence = first(FinishStep.FENCE_ACQ_REL_GPU, reds[0], end, (EVERY,))
    for r in reds:
        if after_fence != -1 and r > after_fence:
            problems.append(
                f"RED_ADD after the fence (call {r}): an add after fence.acq_rel.gpu is in no "
                "count, the converting CTA may read the sums without it"
            )

    # (a) fence by every consumer thread, (b) then the meeting, (c) then the counts
    last_red = max((r for r in reds if r < counts[0]), default=-1)
    fence = first(FinishStep.FENCE_ACQ_REL_GPU, last_red, counts[0], (EVERY,))
    meeting = first(FinishStep.BAR_SYNC, fence if fence != -1 else last_red, end, (EVERY,))
    late = meeting == -1 and fence != -1  # a meeting before the fence is none after it
    if late:
        meeting = first(FinishStep.BAR_SYNC, last_red, end, (EVERY,))
    if fence == -1 or (late and meeting != -1):
        problems.append(
            "no GPU-scope fence (fence.acq_rel.gpu) by every consumer thread between its last "
            "RED_ADD and the meeting: a thread's adds are not performed before the count"
        )
    if meeting == -1:
        short = sorted(
            {c.threads for c in plan if c.step is FinishStep.BAR_SYNC and c.threads < threads}
        )
        problems.append(
            f"no bar.sync of every consumer thread ({threads} threads) between the fences and "
            "the count: the count may run before another thread's fence"
            + (f" (a bar.sync over {short} threads is not all of them)" if short else "")
        )
    for k in counts:
        if meeting != -1 and k < meeting:
            problems.append(
                f"count (call {k}) before the fences and the meeting (bar.sync, call {meeting}):"
                " the other threads' adds are not ordered before it"
            )

    # (f) the hand-over from the counting lane to the lanes that load
    first_load = min(loads)
    loaders = {plan[i].who for i in loads}
    handover = -1
    if loaders & {WARP, EVERY}:
        need, who = (
            (FinishStep.BAR_SYNC, (EVERY,))
            if EVERY in loaders
            else (FinishStep.SYNCWARP, (WARP, EVERY))
        )
        handover = first(need, final, first_load, who)
        if handover == -1:
            problems.append(
                f"no {need.value} between the count and the loads by the other lanes: only the "
                "counting lane acquired, the others may read the sums before the last CTA's adds"
            )

    # (d) release, (e) acquire
    for k in counts:
        sem = plan[k].sem
        if (
            sem not in RELEASES
            and first(FinishStep.FENCE_ACQ_REL_GPU, max(meeting, last_red), k) == -1
        ):
            problems.append(
                f"count without release (sem {sem.value if sem else None}) and no fence after "
                "the meeting: the CTA's adds are not published to the CTA that completes the m-block"
            )
        stop = handover if handover != -1 and handover > k else first_load
        if sem not in ACQUIRES and first(FinishStep.FENCE_ACQ_REL_GPU, k, stop) == -1:
            problems.append(
                f"count without acquire (sem {sem.value if sem else None}) and no acquire fence "
                "after it: the other CTAs' adds are not ordered before the loads"
            )

    # (g) through L2, (i) after the count
    for i in loads:
        if plan[i].cache is not Cache.L2:
            problems.append(
                f"load of the sums (call {i}) through L1 (cache {plan[i].cache}): L1 is not "
                "coherent with other SMs' adds; use ld.global.cg"
            )
    for i in sorted(loads + stores):
        if i < final:
            problems.append(
                f"{plan[i].step.name} (call {i}) before the count: the m-block is not known "
                "complete, its sums may lack other CTAs' adds"
            )
    return problems
