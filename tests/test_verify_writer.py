"""The dQ writer's own rules in the backward's proof (verify_writer.py, `dq_writer on`), each
shown to refuse the plan it is there for: the lane-0 rule (a named barrier of the warp after
lane 0's items needs a ``__syncwarp`` between, across the m-block loop's back edge too) and
the exit rule (lane 0's adds completed, not only read, before the warp exits); and the
named barriers' thread counts (160: a consumer warpgroup and its writer warp), which the
async model checks itself (each generation's arrivals against the count each side names).
tests/test_verify_backward.py drops, shrinks and flips every sync of the writer's
configurations; here the mutations that name the writer's syncs one by one."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from fadsl.passes.asyncmodel.prove import check
from fadsl.targets.sm90.backward.program import (
    WARP_THREADS,
    WARPGROUP_THREADS,
    WRITER_BAR_THREADS,
    Item,
    Kind,
    LoopPhase,
    Named,
    Protocol,
    WarpRole,
    Who,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import (
    build_program,
    check_protocol,
    m_counts,
    parameter_space,
)
from fadsl.targets.sm90.backward.verify_writer import exit_problems, lane0_problems

WRITERS = tuple(p for p in parameter_space() if p.dq_writer)
DETERMINISTIC = tuple(p for p in WRITERS if p.deterministic)


def _writer(proto: Protocol, items: list[Item]) -> Protocol:
    return proto.with_role(WarpRole.WRITER, tuple(items))


def _syncwarps(items: tuple[Item, ...]) -> list[int]:
    return [n for n, x in enumerate(items) if x.kind is Kind.SYNCWARP]


@pytest.mark.parametrize("params", DETERMINISTIC, ids=lambda p: p.describe())
def test_the_release_is_followed_by_a_syncwarp(params):
    """Deterministic: lane 0's release is the m-block's last item of lane 0, and a
    ``__syncwarp`` of the warp follows it, before the next m-block's bar.sync."""
    items = protocol(params).writer
    release = next(n for n, x in enumerate(items) if x.kind is Kind.SEM_RELEASE)
    assert items[release + 1].kind is Kind.SYNCWARP and items[release + 1].who is Who.WRITER
    assert not any(x.who is Who.WRITER_LANE0 for x in items[release + 1 :])


@pytest.mark.parametrize("params", DETERMINISTIC, ids=lambda p: p.describe())
def test_no_syncwarp_after_the_release_is_refused(params):
    """Without it the next m-block's bar.sync follows lane 0's divergent release: the proof
    refuses the plan (from 2 m-blocks on: the hazard is across the loop's back edge)."""
    proto = protocol(params)
    items = list(proto.writer)
    del items[_syncwarps(proto.writer)[-1]]
    found = check_protocol(_writer(proto, items))
    assert found and all("no __syncwarp" in p for p in found), found
    assert any(
        "bar.sync kBarDqFull + wg (m-block 1) follows lane 0's st.release.gpu (m-block 0)" in p
        for p in found
    ), found


@pytest.mark.parametrize("params", WRITERS, ids=lambda p: p.describe())
def test_every_named_barrier_after_lane_0_needs_a_syncwarp(params):
    """Each ``__syncwarp`` of the writer, dropped alone, is refused by the lane-0 rule; so is
    a lane-0 item moved after one of them (the read's wait after the warp's __syncwarp)."""
    proto = protocol(params)
    for n in _syncwarps(proto.writer):
        items = list(proto.writer)
        del items[n]
        assert lane0_problems(tuple(items)), (n, items)
        assert check_protocol(_writer(proto, items)), n
    items = list(proto.writer)
    read = next(n for n, x in enumerate(items) if x.kind is Kind.BULK_WAIT_READ)
    items[read], items[read + 1] = items[read + 1], items[read]
    assert items[read].kind is Kind.SYNCWARP
    found = lane0_problems(tuple(items))
    assert any("bar.arrive kBarDqEmpty + wg (m-block 0)" in p for p in found), found


def test_a_lane_0_item_before_a_bar_sync_is_refused():
    """The rule names bar.sync as well as bar.arrive, within an m-block too: a lane-0 item
    just before the full barrier's bar.sync (a wait moved to the m-block's start)."""
    params = WRITERS[0]
    proto = protocol(params)
    items = list(proto.writer)
    read = next(n for n, x in enumerate(items) if x.kind is Kind.BULK_WAIT_READ)
    moved = items.pop(read)
    items.insert(0, replace(moved, pending=1))
    found = lane0_problems(tuple(items))
    assert any(p.startswith("writer: bar.sync kBarDqFull + wg (m-block 0)") for p in found), found


@pytest.mark.parametrize("params", WRITERS, ids=lambda p: p.describe())
def test_the_writer_waits_for_its_last_add_before_it_exits(params):
    """Without `deterministic`, lane 0's wait_group 0 (not .read) after the loop; with it,
    none: each m-block's release waited for its add so already (the exit rule holds)."""
    items = protocol(params).writer
    after = [x for x in items if x.phase is not LoopPhase.LOOP]
    if params.deterministic:
        assert after == [] and exit_problems(items) == []
        return
    (wait,) = after
    assert (wait.kind, wait.who, wait.pending) == (Kind.BULK_WAIT, Who.WRITER_LANE0, 0)
    assert wait is items[-1]


@pytest.mark.parametrize("params", [p for p in WRITERS if not p.deterministic][:8])
def test_no_exit_wait_is_refused_by_the_exit_rule_alone(params):
    """Dropped, or only for the read (wait_group.read 0), the exit wait leaves the last add
    in flight: the exit rule refuses the plan, which the async model alone would accept (its
    events are SMEM's, and the read was waited for in the loop)."""
    proto = protocol(params)
    *loop, wait = proto.writer
    for mutant in (loop, loop + [replace(wait, kind=Kind.BULK_WAIT_READ)]):
        plan = _writer(proto, mutant)
        found = check_protocol(plan)
        assert found and all("1 bulk group(s) not completed" in p for p in found), found
        assert all(check(build_program(plan, m)) == () for m in m_counts(params))


BARRIERS = (Kind.NAMED_BAR_SYNC, Kind.NAMED_BAR_ARRIVE)
# a count without the writer warp, with a warp more, with a warp of the consumer less, the
# writer's alone
COUNTS = (WARPGROUP_THREADS, WRITER_BAR_THREADS + WARP_THREADS, WARPGROUP_THREADS - WARP_THREADS)
COUNTS += (WARP_THREADS,)


def _recount(proto: Protocol, threads: int, role: WarpRole, n: int) -> Protocol:
    """The plan with item n of ``role`` (a named barrier) counting ``threads``."""
    items = proto.role(role)
    return proto.with_role(role, items[:n] + (replace(items[n], threads=threads),) + items[n + 1 :])


def _writer_barriers(proto: Protocol) -> list[tuple[WarpRole, int, Item]]:
    return [
        (role, n, x)
        for role in (WarpRole.CONSUMER, WarpRole.WRITER)
        for n, x in enumerate(proto.role(role))
        if x.kind in BARRIERS and x.named in (Named.DQ_FULL, Named.DQ_EMPTY)
    ]


@pytest.mark.parametrize("params", WRITERS, ids=lambda p: p.describe())
def test_each_side_of_a_writer_barrier_counts_160(params):
    """The four sides of the pair (the consumer's bar.arrive on full and bar.sync on empty,
    the writer's bar.sync on full and bar.arrive on empty) each count 160; any other count
    on one side, arrive or sync, is refused: a mismatch with the other side, or more
    threads arriving than the barrier counts. (With `dq_lag on` the consumer's two sides
    come twice: in the loop for the m-block before, and after it for the last.)"""
    proto = protocol(params)
    sides = _writer_barriers(proto)
    kinds = {(role, x.kind, x.named) for role, _, x in sides}
    assert len(kinds) == 4 and len(sides) == (6 if params.dq_lag else 4)
    assert {x.threads for _, _, x in sides} == {WRITER_BAR_THREADS} == {160}
    for role, n, x in sides:
        for threads in COUNTS:
            found = check_protocol(_recount(proto, threads, role, n))
            assert found, (role, x.kind, x.named, threads)
            assert all(re.search(r"named barrier \d+|never returns", p) for p in found), found


# (a tenth, from the writers with dS stored by st.shared: the sample taken before the stmatrix
# store's configurations joined; with 1 consumer some refusals read "arrives twice")
SAMPLED = tuple(p for p in WRITERS if not p.ds_stmatrix)


@pytest.mark.parametrize("params", SAMPLED[:: len(SAMPLED) // 10], ids=lambda p: p.describe())
@pytest.mark.parametrize("named", (Named.DQ_FULL, Named.DQ_EMPTY), ids=lambda n: n.name)
def test_both_sides_of_a_writer_barrier_miscounted_are_refused(params, named):
    """Both sides of one barrier changed alike, so that they agree: 128 (the writer warp
    left out) lets the consumer's warpgroup complete a generation alone, and the writer's
    32 threads then overflow one, wait forever or (`dq_lag on`, whose last staging comes after
    the loop) arrive in a generation that never completes, and with one consumer its
    warpgroup may arrive twice in one; 192 never completes (a hang)."""
    proto = protocol(params)
    alone = r"named barrier \d+|never returns"  # (its generations, however they go wrong)
    for threads, sign in ((WARPGROUP_THREADS, alone), (COUNTS[1], "never returns")):
        plan = proto
        for role in (WarpRole.CONSUMER, WarpRole.WRITER):
            items = plan.role(role)
            recounted = tuple(
                replace(x, threads=threads) if x.kind in BARRIERS and x.named is named else x
                for x in items
            )
            assert recounted != items
            plan = plan.with_role(role, recounted)
        found = check_protocol(plan)
        assert found and all(re.search(sign, p) for p in found), (threads, found)
