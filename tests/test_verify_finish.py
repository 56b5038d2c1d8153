"""verify_finish.finish_problems: finish.py's plan proven for 2 and 3 consumer warpgroups, and
each hazard of the cross-CTA hand-over, made by one mutation of the plan, refused with its own
message (each test asserts the hazard's words, so that another check firing does not pass it).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fadsl.targets.sm90.backward.finish import (
    Cache,
    Executor,
    FinishCall,
    Sem,
    FinishStep,
    finish_plan,
)
from fadsl.targets.sm90.backward.verify_finish import finish_problems

Plan = tuple[FinishCall, ...]


def index(plan: Plan, step: FinishStep) -> int:
    return next(i for i, c in enumerate(plan) if c.step is step)


def without(plan: Plan, step: FinishStep) -> Plan:
    return tuple(c for c in plan if c.step is not step)


def changed(plan: Plan, step: FinishStep, **fields: object) -> Plan:
    return tuple(replace(c, **fields) if c.step is step else c for c in plan)  # type: ignore[arg-type]


def moved(plan: Plan, step: FinishStep, before: FinishStep) -> Plan:
    """``plan`` with its ``step`` call moved just before its ``before`` call."""
    call = plan[index(plan, step)]
    rest = [c for c in plan if c is not call]
    at = next(i for i, c in enumerate(rest) if c.step is before)
    return tuple(rest[:at] + [call] + rest[at:])


def inserted(plan: Plan, call: FinishCall, after: FinishStep) -> Plan:
    at = index(plan, after) + 1
    return plan[:at] + (call,) + plan[at:]


def refused(plan: Plan, words: str, consumers: int = 2) -> list[str]:
    problems = finish_problems(plan, consumers)
    assert any(words in p for p in problems), problems
    return problems


@pytest.mark.parametrize("consumers", [1, 2, 3])
def test_the_plan_is_proven(consumers: int) -> None:
    assert finish_problems(finish_plan(consumers), consumers) == []


def test_the_plan_has_every_step_once() -> None:
    assert sorted(c.step.name for c in finish_plan(2)) == sorted(s.name for s in FinishStep)


def test_no_fence_is_refused() -> None:
    plan = without(finish_plan(2), FinishStep.FENCE_ACQ_REL_GPU)
    refused(plan, "no GPU-scope fence")


def test_a_fence_by_one_thread_is_refused() -> None:
    plan = changed(
        finish_plan(2), FinishStep.FENCE_ACQ_REL_GPU, who=Executor.ONE_THREAD_PER_M_BLOCK
    )
    refused(plan, "no GPU-scope fence")


def test_a_fence_after_the_meeting_is_refused() -> None:
    plan = moved(finish_plan(2), FinishStep.FENCE_ACQ_REL_GPU, before=FinishStep.COUNT)
    refused(plan, "no GPU-scope fence")


def test_no_meeting_is_refused() -> None:
    plan = without(finish_plan(2), FinishStep.BAR_SYNC)
    refused(plan, "no bar.sync of every consumer thread (256 threads)")


def test_a_meeting_of_one_warpgroup_is_refused() -> None:
    plan = changed(finish_plan(2), FinishStep.BAR_SYNC, threads=128)
    problems = refused(plan, "no bar.sync of every consumer thread (256 threads)")
    assert any("bar.sync over [128] threads" in p for p in problems)


def test_a_meeting_of_two_warpgroups_is_short_of_three() -> None:
    plan = finish_plan(2)  # 256 threads
    refused(plan, "no bar.sync of every consumer thread (384 threads)", consumers=3)


def test_the_count_before_the_meeting_is_refused() -> None:
    plan = moved(finish_plan(2), FinishStep.COUNT, before=FinishStep.BAR_SYNC)
    problems = refused(plan, "before the fences and the meeting")
    assert not any("no bar.sync" in p for p in problems)


def test_the_count_before_the_fence_is_refused() -> None:
    plan = moved(finish_plan(2), FinishStep.COUNT, before=FinishStep.FENCE_ACQ_REL_GPU)
    refused(plan, "before the fences and the meeting")


@pytest.mark.parametrize("sem", [Sem.RELAXED, Sem.ACQUIRE, None])
def test_a_count_without_release_is_refused(sem: Sem | None) -> None:
    plan = changed(finish_plan(2), FinishStep.COUNT, sem=sem)
    refused(plan, "count without release")


@pytest.mark.parametrize("sem", [Sem.RELAXED, Sem.RELEASE, None])
def test_a_count_without_acquire_is_refused(sem: Sem | None) -> None:
    plan = changed(finish_plan(2), FinishStep.COUNT, sem=sem)
    refused(plan, "count without acquire")


def test_a_release_count_is_not_refused_for_want_of_release() -> None:
    problems = finish_problems(changed(finish_plan(2), FinishStep.COUNT, sem=Sem.RELEASE), 2)
    assert problems and not any("without release" in p for p in problems)


def test_a_relaxed_count_between_fences_is_proven() -> None:
    """fence after the meeting (release pattern) and after the count (acquire pattern)."""
    fence = FinishCall(FinishStep.FENCE_ACQ_REL_GPU, Executor.ONE_THREAD_PER_M_BLOCK)
    plan = changed(finish_plan(2), FinishStep.COUNT, sem=Sem.RELAXED)
    plan = inserted(inserted(plan, fence, after=FinishStep.COUNT), fence, after=FinishStep.BAR_SYNC)
    assert finish_problems(plan, 2) == []


def test_an_acquire_fence_after_the_hand_over_is_refused() -> None:
    """the other lanes passed the syncwarp before the counting lane's fence."""
    fence = FinishCall(FinishStep.FENCE_ACQ_REL_GPU, Executor.EVERY_LANE_OF_THE_WARP)
    plan = inserted(
        changed(finish_plan(2), FinishStep.COUNT, sem=Sem.RELEASE), fence, FinishStep.SYNCWARP
    )
    refused(plan, "count without acquire")


def test_a_release_fence_before_the_meeting_is_not_a_release() -> None:
    plan = changed(finish_plan(2), FinishStep.COUNT, sem=Sem.ACQUIRE)
    assert any("count without release" in p for p in finish_problems(plan, 2))


def test_no_syncwarp_is_refused() -> None:
    plan = without(finish_plan(2), FinishStep.SYNCWARP)
    refused(plan, "no __syncwarp between the count and the loads")


def test_a_syncwarp_by_the_counting_thread_alone_is_refused() -> None:
    plan = changed(finish_plan(2), FinishStep.SYNCWARP, who=Executor.ONE_THREAD_PER_M_BLOCK)
    refused(plan, "no __syncwarp between the count and the loads")


def test_loads_by_every_consumer_thread_need_a_meeting() -> None:
    plan = changed(finish_plan(2), FinishStep.LOAD_SUMS, who=Executor.EVERY_CONSUMER_THREAD)
    refused(plan, "no bar.sync between the count and the loads")


def test_loads_by_the_counting_thread_need_no_hand_over() -> None:
    plan = changed(
        without(finish_plan(2), FinishStep.SYNCWARP),
        FinishStep.LOAD_SUMS,
        who=Executor.ONE_THREAD_PER_M_BLOCK,
    )
    assert finish_problems(plan, 2) == []


@pytest.mark.parametrize("cache", [Cache.L1, None])
def test_loads_through_l1_are_refused(cache: Cache | None) -> None:
    plan = changed(finish_plan(2), FinishStep.LOAD_SUMS, cache=cache)
    refused(plan, "through L1")


def test_an_add_after_the_fence_is_refused() -> None:
    add = FinishCall(FinishStep.RED_ADD, Executor.EVERY_CONSUMER_THREAD)
    refused(
        inserted(finish_plan(2), add, after=FinishStep.FENCE_ACQ_REL_GPU), "RED_ADD after the fence"
    )


def test_an_add_after_the_count_is_refused() -> None:
    add = FinishCall(FinishStep.RED_ADD, Executor.EVERY_CONSUMER_THREAD)
    problems = refused(
        inserted(finish_plan(2), add, after=FinishStep.COUNT), "RED_ADD after the fence"
    )
    assert len(problems) == 1


def test_a_load_before_the_count_is_refused() -> None:
    plan = moved(finish_plan(2), FinishStep.LOAD_SUMS, before=FinishStep.COUNT)
    refused(plan, "LOAD_SUMS (call 3) before the count")


def test_a_store_before_the_count_is_refused() -> None:
    plan = moved(finish_plan(2), FinishStep.STORE_DQ, before=FinishStep.COUNT)
    refused(plan, "STORE_DQ (call 3) before the count")


@pytest.mark.parametrize(
    "step", [FinishStep.COUNT, FinishStep.LOAD_SUMS, FinishStep.STORE_DQ, FinishStep.RED_ADD]
)
def test_a_missing_step_is_refused(step: FinishStep) -> None:
    refused(without(finish_plan(2), step), f"missing step: no {step.name}")


def test_counting_twice_is_refused() -> None:
    plan = finish_plan(2)
    count = plan[index(plan, FinishStep.COUNT)]
    refused(inserted(plan, count, after=FinishStep.COUNT), "2 counts")
    refused(changed(plan, FinishStep.COUNT, who=Executor.EVERY_CONSUMER_THREAD), "count by every")


def test_each_mutation_names_only_its_hazard() -> None:
    """Single-hazard mutations report exactly one problem (no check fires for another's)."""
    plan = finish_plan(2)
    for mutant in (
        without(plan, FinishStep.FENCE_ACQ_REL_GPU),
        moved(plan, FinishStep.FENCE_ACQ_REL_GPU, before=FinishStep.COUNT),
        changed(plan, FinishStep.BAR_SYNC, threads=128),
        moved(plan, FinishStep.COUNT, before=FinishStep.BAR_SYNC),
        changed(plan, FinishStep.COUNT, sem=Sem.ACQUIRE),
        changed(plan, FinishStep.COUNT, sem=Sem.RELEASE),
        without(plan, FinishStep.SYNCWARP),
        changed(plan, FinishStep.LOAD_SUMS, cache=Cache.L1),
        moved(plan, FinishStep.STORE_DQ, before=FinishStep.COUNT),
    ):
        assert len(finish_problems(mutant, 2)) == 1, finish_problems(mutant, 2)
