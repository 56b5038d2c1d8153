"""The deterministic backward's deferred ticket release (release_dq_ticket in
emit/sm90/include/fadsl/sm90_bwd.cuh): the leader issues and commits its ordered reduce-add
and releases the next ticket in its next m-block, under S^T and dP^T, or after the loop.
Each broken placement is refused by fadsl/targets/sm90/backward/verify.py: after the meeting
(a deadlock), without the completion wait (the adds' order lost), none at the CTA's end,
and with one stage in the overlapped order (a cycle through the ring). Where the warpgroups'
shares of dQ are disjoint each share has its own counter, so no warpgroup waits on another
of its CTA; by keys they take turns on one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fadsl.passes.asyncmodel.prove import check
from fadsl.targets.sm90.backward.program import CodeSite, Item, Kind, LoopPhase, Params, WarpRole
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import build_program, check_protocol

PANELS = Params(2, 2, 128)  # dQ by head_dim panels: a meeting of every consumer
BY_KEYS = Params(2, 2, 64)  # dQ by keys: each warpgroup's own barrier

# both consumer orders, dQ by panels, by keys, and by keys with 3 warpgroups; the overlapped
# one also with dV issued after the dS^T store, before the meeting (dv_before_meeting)
DEFERRED = [replace(p, deterministic=True) for p in (PANELS, BY_KEYS, Params(3, 2, 128))]
DEFERRED += [replace(p, overlap=True) for p in DEFERRED]
DEFERRED += [replace(p, dv_before_meeting=True) for p in DEFERRED if p.overlap]


def _owed_release(items: tuple[Item, ...], phase: LoopPhase) -> list[int]:
    return [
        n
        for n, x in enumerate(items)
        if x.source is CodeSite.RELEASE_DQ_TICKET and x.phase is phase
    ]


@pytest.mark.parametrize("params", DEFERRED, ids=lambda p: p.describe())
def test_the_release_comes_before_the_front_and_the_meeting(params):
    """The owed release (wait_group 0, fence, release) right after S^T's and dP^T's issue,
    before the m-block's first wgmma wait; so before dS^T's store, dV (with
    dv_before_meeting, issued after that store) and the barrier at dS^T."""
    items = protocol(params).consumer
    owed = _owed_release(items, LoopPhase.LOOP)
    kinds = [items[n].kind for n in owed]
    assert kinds == [Kind.BULK_WAIT, Kind.FENCE_PROXY_ASYNC_GLOBAL, Kind.SEM_RELEASE], kinds
    assert owed == list(range(owed[0], owed[0] + 3)), owed  # together
    loop = [n for n, x in enumerate(items) if x.phase is LoopPhase.LOOP]
    names = {x.name: n for n, x in enumerate(items) if x.phase is LoopPhase.LOOP and x.name}
    assert names["dP^T = V dO^T"] < owed[0]
    first_wait = next(n for n in loop if items[n].kind is Kind.WGMMA_WAIT)
    # the barrier at dS^T: every consumer's, or by keys the warpgroup's own (whose ticket
    # wait comes later still, before the reduce-add)
    at = next(n for n in loop if items[n].kind is Kind.NAMED_BAR_SYNC)
    assert owed[-1] < first_wait < names["dS^T -> smem"] < at
    if params.dv_before_meeting:
        assert names["dS^T -> smem"] < names["dV += P^T dO"] < at < names["dQ = dS K"]


@pytest.mark.parametrize("params", DEFERRED, ids=lambda p: p.describe())
def test_the_release_after_the_meeting_is_refused(params):
    """The owed release moved after the next m-block's meeting at dS^T (or, by keys, after
    the next ticket's wait): warpgroup 0 would wait there for warpgroup 1, which waits for
    warpgroup 0's release; the model finds the hang where the meeting counts both."""
    items = protocol(params).consumer
    owed = _owed_release(items, LoopPhase.LOOP)
    moved = [items[n] for n in owed]
    rest = [x for n, x in enumerate(items) if n not in owed]
    meeting = Kind.SEM_ACQUIRE if params.dq_by_keys else Kind.NAMED_BAR_SYNC
    at = next(n for n, x in enumerate(rest) if x.kind is meeting and x.phase is LoopPhase.LOOP)
    mutant = protocol(params).with_role(
        WarpRole.CONSUMER, tuple(rest[: at + 1] + moved + rest[at + 1 :])
    )
    problems = check_protocol(mutant)
    assert any("while owing a release" in p and "deadlock" in p for p in problems), problems


@pytest.mark.parametrize("params", DEFERRED, ids=lambda p: p.describe())
@pytest.mark.parametrize("phase", [LoopPhase.LOOP, LoopPhase.AFTER], ids=lambda p: p.name)
def test_the_release_without_the_completion_wait_is_refused(params, phase):
    """wait_group 0 dropped before the owed release: the next ticket could add before this
    one's adds are performed (the sum's order lost)."""
    items = protocol(params).consumer
    (wait,) = [n for n in _owed_release(items, phase) if items[n].kind is Kind.BULK_WAIT]
    problems = check_protocol(
        protocol(params).with_role(WarpRole.CONSUMER, items[:wait] + items[wait + 1 :])
    )
    assert any("wait_group 0 of the reduce-add" in p for p in problems), problems


@pytest.mark.parametrize("params", DEFERRED, ids=lambda p: p.describe())
def test_the_release_at_the_ctas_end_is_needed(params):
    items = protocol(params).consumer
    (release,) = [
        n for n in _owed_release(items, LoopPhase.AFTER) if items[n].kind is Kind.SEM_RELEASE
    ]
    mutant = protocol(params).with_role(WarpRole.CONSUMER, items[:release] + items[release + 1 :])
    problems = check_protocol(mutant)
    assert any("no release of the next ticket" in p for p in problems), problems
    if params.dq_by_keys:  # the model alone: the next warpgroup's ticket never comes
        found = check(build_program(mutant, 2))
        assert any("ticket of wg1, m-block 1" in p for p in found), found


@pytest.mark.parametrize("params", DEFERRED, ids=lambda p: p.describe())
def test_warpgroups_wait_on_each_other_only_when_they_share_dq(params):
    """By keys, warpgroup w's ticket at m-block i waits for warpgroup w - 1's release of i (a
    counter the model holds per m-block and warpgroup); with disjoint shares (panels, here)
    no warpgroup's acquire or release is an event of this CTA's model."""
    counts = dict(build_program(protocol(params), 2).mbarriers)
    tickets = sorted(name for name in counts if name.startswith("ticket"))
    if params.dq_by_keys:
        wgs = range(1, params.consumers)
        assert tickets == sorted(f"ticket of wg{w}, m-block {i}" for w in wgs for i in (0, 1))
    else:
        assert tickets == []


def test_the_deferred_release_needs_two_stages():
    """One stage, overlapped, by keys: m-block i + 1's q_full needs warpgroup 1's q_empty
    arrival of m-block i, after its ticket, which waits for warpgroup 0's release, deferred
    past that q_full wait: a cycle (BwdConfig's static_assert keeps two stages for every
    split). The default order arrives before its add: no cycle."""
    problems = check_protocol(
        protocol(replace(BY_KEYS, stages=1, deterministic=True, overlap=True))
    )
    assert any("hang" in p for p in problems), problems
    assert check_protocol(protocol(replace(BY_KEYS, stages=1, deterministic=True))) == ()
