"""The backward's sync pass (fadsl/targets/sm90/backward/syncs): from the schedule (schedule.py:
the steps with no sync) it places the kernel's plan (protocol.py: ``protocol``), which
verify.py proves and which equals the plan written by hand from the header
(tests/backward_hand_plan.py, an oracle only), sync for sync and field for field but
``why``, in every configuration of verify.parameter_space; ``economical`` leaves out exactly the syncs the proof
finds redundant (tests/backward_cases.py UNNEEDED). The pass is a pure function of
the schedule, and taking an access out of a step moves or removes the syncs that ordered
it."""

from __future__ import annotations

import difflib
from dataclasses import replace

import pytest

from backward_hand_plan import hand_protocol
from fadsl.targets.sm90.backward.program import (
    StagedTile,
    Item,
    Kind,
    Mbar,
    Named,
    Params,
    LoopPhase,
    Protocol,
    WarpRole,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import check_protocol, parameter_space
from fadsl.targets.sm90.backward.peel import peel_dead_first
from fadsl.targets.sm90.backward.schedule import build_schedule
from fadsl.targets.sm90.backward.syncs import insert_syncs, without_syncs
from backward_cases import DV_GROUP, UNNEEDED

PARAMS = parameter_space()


def label(items: tuple[Item, ...], n: int) -> str:
    """'kind (phase) after <the last named step before it>' (test_verify_backward's)."""
    previous = next((x.name for x in reversed(items[:n]) if x.name), "the start")
    return f"{items[n].kind.value} ({items[n].phase.value}) after {previous}"


def compared(x: Item):
    """A sync's every field but ``why``; a step by its name (its accesses may be edited)."""
    return replace(x, why="") if x.is_sync else (x.kind, x.name, x.phase)


def left_out(hand: Protocol, placed: Protocol) -> set[str]:
    """The hand plan's syncs the placed plan leaves out, labelled; asserts that it adds,
    changes or moves none."""
    found = set()
    for role in WarpRole:
        ours = [compared(x) for x in placed.role(role)]
        theirs = [compared(x) for x in hand.role(role)]
        matcher = difflib.SequenceMatcher(a=theirs, b=ours, autojunk=False)
        for op, lo, hi, _, _ in matcher.get_opcodes():
            assert op in ("equal", "delete"), (role, op, theirs[lo:hi])
            if op == "delete":
                assert all(hand.role(role)[n].is_sync for n in range(lo, hi)), theirs[lo:hi]
                found |= {f"{role.value}: {label(hand.role(role), n)}" for n in range(lo, hi)}
    return found


# The placed plan's differences from the hand plan: none, in every configuration.
DIFFERENCES: dict[Params, set[str]] = {}


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.describe())
def test_the_placed_plan_is_the_hand_plan_and_is_proven(params):
    placed = insert_syncs(build_schedule(params))
    # the kernel's plan is the placed one (`peel_dead on`: with the peeled m-block added;
    # tests/test_backward_peel_dead.py holds that to the header's hand-over)
    assert protocol(params) == peel_dead_first(placed)
    assert check_protocol(protocol(params)) == ()
    assert left_out(hand_protocol(params), placed) == DIFFERENCES.get(params, set())
    assert without_syncs(placed) == build_schedule(params)  # the steps untouched, in order
    assert without_syncs(hand_protocol(params)) == build_schedule(params)


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.describe())
def test_every_placed_sync_says_what_it_orders(params):
    """Each placed sync's ``why`` names its hazard (`fadsl explain` prints it)."""
    for role in WarpRole:
        for x in protocol(params).role(role):
            assert not x.is_sync or x.why, (role, x)


def test_the_schedule_has_no_sync():
    for params in PARAMS:
        steps = build_schedule(params)
        assert not steps.setup
        assert not any(x.is_sync for role in WarpRole for x in steps.role(role))
        for role in WarpRole:  # a step is known by its name (``edited``)
            names = [x.name for x in steps.role(role)]
            assert all(names) and len(set(names)) == len(names), names


# economical: a wgmma group open across syncs (bwd_consumer's dK and dQ share one; with
# dv_before_meeting, dV and dQ, issued with only the dS^T fence and the meeting between
# them: DV_GROUP), and the ordered add's wait_group 0 retiring the staging's read
# (deterministic mode)
STAGING = {
    "consumer: cp.async.bulk.wait_group.read (each m-block) after {last}",
    "consumer: bar.sync (each m-block) after {last}",
    "consumer: cp.async.bulk.wait_group (after the m-block loop) after dQ reduce-add",
}
ECONOMICAL_LEAVES_OUT = {
    (False, False): {"consumer: wgmma.commit_group (each m-block) after dK += dS^T Q"},
    (False, True): set(),
}
ECONOMICAL_LEAVES_OUT[True, False] = ECONOMICAL_LEAVES_OUT[False, False] | {
    s.format(last="dQ = dS K") for s in STAGING
}
ECONOMICAL_LEAVES_OUT[True, True] = {s.format(last="dK += dS^T Q") for s in STAGING}


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.describe())
def test_the_economical_plan_is_proven_and_cheaper(params):
    placed = insert_syncs(build_schedule(params), economical=True)
    assert check_protocol(peel_dead_first(placed)) == ()
    # (head_dim 256's split consumer: every sync is needed, none left out)
    expected = (
        set()
        if params.split
        else ECONOMICAL_LEAVES_OUT[params.deterministic and not params.dq_writer, params.overlap]
    )
    extra = {DV_GROUP} if params.dv_before_meeting else set()  # (a new set: not |=)
    assert left_out(hand_protocol(params), placed) == expected | extra


def test_economical_leaves_out_what_the_proof_finds_redundant():
    """Each sync economical leaves out survives being dropped alone from the plan."""
    assert ECONOMICAL_LEAVES_OUT == UNNEEDED


def test_the_pass_is_a_pure_function():
    one, two = Params(2, 2, 128), Params(3, 3, 64, True, True)
    first = insert_syncs(build_schedule(one))
    insert_syncs(build_schedule(two))
    assert insert_syncs(build_schedule(one)) == first  # the whys too
    assert insert_syncs(build_schedule(one), economical=True) == insert_syncs(
        build_schedule(one), economical=True
    )
    with pytest.raises(AssertionError, match="syncs given"):
        insert_syncs(first)


# --- an access taken out: the syncs that ordered it go or move ---------------------------


def edited(params: Params, role: WarpRole, name: str, **fields) -> Protocol:
    """The schedule with step ``name`` of ``role`` changed."""
    sched = build_schedule(params)
    items = sched.role(role)
    (n,) = [n for n, x in enumerate(items) if x.name == name]
    return sched.with_role(role, items[:n] + (replace(items[n], **fields),) + items[n + 1 :])


def kinds(labels: set[str]) -> list[str]:
    return sorted(x.split(": ", 1)[1].split(" (")[0] for x in labels)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("head_dim", [128, 64], ids=["by panels", "by keys"])
def test_dq_not_reading_ds_needs_no_meeting(head_dim, overlap):
    """dQ's wgmma without its read of dS^T: no proxy fence and no barrier before it (and in
    bwd_consumer dK's group, no longer ended by a sync, goes on into dQ's)."""
    params = Params(2, 2, head_dim, overlap=overlap)
    dq = next(x for x in build_schedule(params).consumer if x.name == "dQ = dS K")
    reads = tuple(op for op in dq.reads if op.buffer is not StagedTile.DS)
    placed = insert_syncs(edited(params, WarpRole.CONSUMER, "dQ = dS K", reads=reads))
    assert check_protocol(placed) == ()
    gone = left_out(hand_protocol(params), placed)
    expected = ["bar.sync", "fence.proxy.async.shared::cta"]
    expected += [] if overlap else ["wgmma.commit_group"]
    assert kinds(gone) == sorted(expected), gone
    meetings = [x for x in placed.consumer if x.kind is Kind.NAMED_BAR_SYNC]
    assert all(x.named is Named.DQ for x in meetings)  # the staging's own remain


def test_p_without_registers_needs_no_wait_for_s():
    """P without its accesses of S^T: S^T's result is first needed with dP^T's, so the two
    share a group and the wait_group 1 between them goes."""
    params = Params(2, 2, 128)
    placed = insert_syncs(
        edited(params, WarpRole.CONSUMER, "P = exp2(S - LSE)", reg_reads=(), reg_writes=())
    )
    gone = left_out(hand_protocol(params), placed)
    assert kinds(gone) == ["wgmma.commit_group", "wgmma.wait_group"], gone
    assert {"consumer: wgmma.wait_group (each m-block) after dP^T = V dO^T"} < gone


def test_dv_dk_not_reading_the_slot_release_it_early():
    """dV and dK without their reads of Q and dO (overlap): the slot is free once dS has
    read D, and the release moves there from after the m-block's last wait."""
    params = Params(2, 2, 128, overlap=True)
    sched = edited(params, WarpRole.CONSUMER, "dV += P^T dO", reads=())
    items = sched.consumer
    (n,) = [n for n, x in enumerate(items) if x.name == "dK += dS^T Q"]
    sched = sched.with_role(
        WarpRole.CONSUMER, items[:n] + (replace(items[n], reads=()),) + items[n + 1 :]
    )
    consumer = insert_syncs(sched).consumer
    arrive = next(n for n, x in enumerate(consumer) if x.kind is Kind.MBAR_ARRIVE)
    assert consumer[arrive - 1].name == "dS = P (dP - D)"
    last_wait = [x for x in consumer if x.kind is Kind.WGMMA_WAIT][-1]
    assert last_wait.pending == 0 and "crosses into the next m-block" in last_wait.why


def test_a_staging_not_written_needs_no_staging_syncs():
    params = Params(2, 2, 64)
    placed = insert_syncs(edited(params, WarpRole.CONSUMER, "dQ -> staging", writes=()))
    gone = left_out(hand_protocol(params), placed)
    assert kinds(gone) == sorted(
        ["cp.async.bulk.wait_group.read", "bar.sync", "fence.proxy.async.shared::cta", "bar.sync"]
    ), gone


def test_the_expected_bytes_are_the_loads():
    """The LSE load writing nothing: q_full expects 256 bytes fewer."""
    params = Params(2, 2, 128)
    placed = insert_syncs(edited(params, WarpRole.PRODUCER, "LSE load", writes=()))
    hand = hand_protocol(params)

    def armed(plan: Protocol) -> int:
        (x,) = [
            x
            for x in plan.producer
            if x.kind is Kind.MBAR_ARRIVE_EXPECT_TX and x.mbar is Mbar.Q_FULL
        ]
        return x.tx

    assert armed(hand) - armed(placed) == 64 * 4
    assert [x.phase for x in placed.producer if x.is_sync][:1] == [LoopPhase.BEFORE]
