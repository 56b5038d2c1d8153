"""The backward main kernel's sync plan (fadsl/targets/sm90/backward/protocol.py: the steps
of schedule.py with the syncs the sync pass placed) is proven in the async model for every
configuration the header admits, with either consumer (bwd_consumer, or bwd_consumer with
`overlap on`), and every broken variant of it is refused with the hazard named. The header
and template make the plan's calls: test_verify_backward_header.py; `dq_lag on` and the
brute-force interleaving checker: test_verify_backward_lag.py; the cases: backward_cases.py."""

from __future__ import annotations

import re
from dataclasses import replace
from math import lcm

import pytest

from fadsl.targets.sm90.backward.program import (
    StagedTile,
    Guard,
    Item,
    Kind,
    Mbar,
    Params,
    WaitParity,
    LoopPhase,
    Protocol,
    WarpRole,
    CodeSite,
    Who,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import (
    check_protocol,
    m_counts,
    parameter_space,
    prove,
)

from backward_cases import (
    single_ds_buffer,
    BY_KEYS,
    BY_QUERIES,
    MUTATED,
    OVERLAPPED,
    PANELS,
    SPLIT,
    SPLITS,
    mutants,
    survivors,
    unneeded,
)

PARAMS = parameter_space()


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.describe())
def test_the_plan_is_proven(params):
    assert check_protocol(protocol(params)) == ()
    assert prove(params).params == params


def test_the_cases_wrap_every_ring_slot_twice():
    for params in PARAMS:
        if params.dq_lag:  # every joint phase of the ring and dS^T's barriers, and 3 more
            top = lcm(2 * params.stages, 4) + 3
            assert list(m_counts(params)) == list(range(0, top + 1)) and top >= 7
            continue
        assert list(m_counts(params)) == list(range(0, 2 * params.stages + 3))
    assert {p.dq_by_keys for p in PARAMS} == {False, True}
    assert {p.dq_by_queries for p in PARAMS} == {False, True}
    assert {p.dq_transposed for p in PARAMS} == {False, True}
    assert {p.stages for p in PARAMS} == {1, 2, 3}
    # 6 shapes with B_r 64, one with B_r 128 and one with B_r 80, 3 stages, 3
    # (deterministic, dQ's adds), 4 orders, deterministic only with 2 or 3 stages; and head_dim
    # 256's B_c 80 and 64, 3 stages
    # `dq_writer on`: each staged one of the 5 shapes whose shares are disjoint (not by keys)
    # dS by stmatrix: once more each configuration with 2 stages that keeps dS^T's keys as rows
    stm = {p for p in PARAMS if p.ds_stmatrix}
    plain_two = {p for p in PARAMS if p.stages == 2 and not (p.dq_transposed or p.split)}
    assert stm and {replace(p, ds_stmatrix=False) for p in stm} == plain_two - stm
    writers = [p for p in PARAMS if p.dq_writer and not (p.ds_stmatrix or p.dq_lag)]
    assert len(writers) == 5 * 4 * (3 + 2) and not any(p.dq_by_keys for p in writers)
    # `dq_lag on`: 5 shapes (dQ not by keys), 1-3 stages, `dq_first` off and on, dK and dV
    # from registers or by TMA (dV's store after or before the last dQ), 24 of them with 2
    # stages by stmatrix; each again with the writer warps, and with 2 or 3 stages with them
    # in deterministic mode
    # `late_v on`: each 2-stage one not in deterministic mode, peeled or not (peeled: dQ by
    # red.add), once more
    late = {p for p in PARAMS if p.late_v}
    early = [p for p in PARAMS if not p.late_v]
    late_base = {
        p
        for p in early
        if p.dq_lag and p.stages == 2 and not p.deterministic and (p.dq_red or not p.peel_dead)
    }
    assert late and {replace(p, late_v=False) for p in late} == late_base
    # `peel_dead on`: each 2-stage one whose dS^T keeps the keys as rows, once more
    peeled = {p for p in early if p.peel_dead}
    two_stages = {p for p in early if p.dq_lag and p.stages == 2 and not p.dq_transposed}
    assert peeled and {replace(p, peel_dead=False) for p in peeled} == two_stages - peeled
    lag_writers = [p for p in early if p.dq_lag and p.dq_writer and not p.peel_dead]
    lag = [p for p in early if p.dq_lag and not p.dq_writer and not p.peel_dead]
    assert len(lag) == (5 * 3 + 4) * 2 * 3 and sum(p.ds_stmatrix for p in lag) == 24
    staged = dict(dq_red=True, dq_writer=False, deterministic=False)
    assert {replace(p, **staged) for p in lag_writers} == set(lag)
    deterministic = [p for p in lag_writers if p.deterministic]
    assert len(lag_writers) == len(lag) + len(deterministic)
    assert len(deterministic) == (5 * 2 + 4) * 2 * 3 and min(p.stages for p in deterministic) == 2
    assert not any(p.dq_red for p in lag_writers)
    tma = {p for p in lag if p.dkv_tma and not p.dv_out_first}
    plain = {p for p in lag if not p.dkv_tma}
    assert {replace(p, dkv_tma=False) for p in tma} == plain
    first = {p for p in lag if p.dv_out_first}
    assert {replace(p, dv_out_first=False) for p in first} == tma
    assert sum(p.dq_first for p in lag) == len(lag) // 2
    assert all(p.overlap and p.dq_red and not p.dq_by_keys for p in lag)
    others = [p for p in PARAMS if not (p.dq_writer or p.ds_stmatrix or p.dq_lag)]
    assert len(others) == 262 and sum(p.overlap for p in others) == 192
    assert sum(p.early_dv for p in others) == 64 and sum(p.block_m == 128 for p in others) == 32
    assert sum(p.dv_before_meeting for p in others) == 64
    assert sum(p.block_m == 80 for p in others) == 32 and sum(p.dq_red for p in others) == 102
    assert all(p.stages >= 2 for p in PARAMS if p.deterministic)
    split = [p for p in PARAMS if p.split]
    assert sorted((p.block_n, p.stages) for p in split) == [
        (n, s) for n in (64, 80) for s in (1, 2, 3)
    ]
    assert {p.do_stages for p in split} == {1} and all(p.dq_red for p in split)
    # the split consumer has one order: neither of the overlapped ones' dV placements
    assert not any(p.overlap or p.early_dv or p.dv_before_meeting for p in split)


# --- mutations ----------------------------------------------------------------------------


@pytest.mark.parametrize("params", MUTATED, ids=lambda p: p.describe())
def test_dropping_each_sync(params):
    proto = protocol(params)
    drops = list(mutants(proto, lambda x: () if x.is_sync else None))
    assert len(drops) == sum(x.is_sync for r in WarpRole for x in proto.role(r))
    assert set(survivors(proto, lambda x: () if x.is_sync else None)) == unneeded(params)


def _refusals(proto: Protocol, change) -> dict[str, tuple[str, ...]]:
    found = {what: check_protocol(mutant) for what, mutant in mutants(proto, change)}
    assert found, "no item was mutated"
    return found


@pytest.mark.parametrize("params", MUTATED, ids=lambda p: p.describe())
def test_flipping_each_parity(params):
    flips = {
        WaitParity.ZERO: WaitParity.ONE,  # kv_full, used once: parity 1 passes the fresh barrier
        WaitParity.RING: WaitParity.RING_FLIP,
        WaitParity.RING_FLIP: WaitParity.RING,
        WaitParity.RING_DO: WaitParity.RING_DO_FLIP,
        WaitParity.RING_DO_FLIP: WaitParity.RING_DO,
        WaitParity.ALTERNATE: WaitParity.ALTERNATE_PREVIOUS,  # dq_lag: ((i / 2) & 1) ^ 1
        WaitParity.ALTERNATE_PREVIOUS: WaitParity.ALTERNATE,
    }

    def flip(x: Item):
        return None if x.parity is None else (replace(x, parity=flips[x.parity]),)

    found = _refusals(protocol(params), flip)
    # kv_full, q_full, q_empty (do_full, do_empty; dq_lag: ds_empty, ds_full and the last's)
    assert len(found) == 3 + 2 * params.split + 3 * params.dq_lag
    assert all(found.values()), [w for w, p in found.items() if not p]


@pytest.mark.parametrize("params", MUTATED, ids=lambda p: p.describe())
def test_shrinking_each_count(params):
    def shrink(x: Item):
        if x.kind is Kind.MBAR_INIT and x.count > 1:
            return (replace(x, count=x.count - 1),)
        if x.kind is Kind.NAMED_BAR_SYNC:
            return (replace(x, threads=x.threads - 32),)  # a warp fewer
        if x.tx:
            return (replace(x, tx=x.tx - 16),)
        return None

    found = _refusals(protocol(params), shrink)
    assert all(found.values()), [w for w, p in found.items() if not p]
    q_empty = next(p for w, p in found.items() if w.startswith("setup: mbarrier.init"))
    # (the setup's inits share a label: the last one's refusal, do_empty's at head_dim 256,
    # ds_empty's with dq_lag)
    empty = "do_empty" if params.split else "ds_empty" if params.dq_lag else "q_empty"
    assert any("arrival(s) where phase" in p and empty in p for p in q_empty), q_empty


@pytest.mark.parametrize("params", MUTATED, ids=lambda p: p.describe())
def test_waiting_for_one_group_fewer(params):
    waits = (Kind.WGMMA_WAIT, Kind.BULK_WAIT_READ, Kind.BULK_WAIT)
    found = _refusals(
        protocol(params),
        lambda x: (replace(x, pending=x.pending + 1),) if x.kind in waits else None,
    )
    refused = {w for w, p in found.items() if p}
    if params.deterministic and params.dq_writer:  # the writer's release follows its wait
        assert refused == set(found)
        ordered = found["writer: cp.async.bulk.wait_group (each m-block) after dQ reduce-add"]
        assert any("wait_group 0 of its reduce-add" in p for p in ordered)
    elif params.deterministic:  # the redundant waits stay redundant
        assert set(found) - refused == {w for w in unneeded(params) if "wait_group" in w}
        # the owed release of the previous m-block's ticket, under S^T and dP^T
        ordered = found["consumer: cp.async.bulk.wait_group (each m-block) after dP^T = V dO^T"]
        assert any("wait_group 0 of the reduce-add" in p for p in ordered)
    else:
        assert refused == set(found)
    wgmma = [p for w, ps in found.items() if "wgmma" in w for p in ps]
    assert any(re.search(r"RAW on (dP\^T|dQ acc)", p) for p in wgmma), wgmma


ONE_BUFFER_CASES = [PANELS, Params(3, 3, 64), Params(3, 2, 128), Params(1, 2, 128)]
ONE_BUFFER_CASES += [Params(2, 1, 128), replace(PANELS, deterministic=True), BY_QUERIES]
ONE_BUFFER_CASES += [replace(BY_QUERIES, stages=1)]
ONE_BUFFER_CASES += [replace(p, overlap=True) for p in ONE_BUFFER_CASES] + [
    replace(p, overlap=True, early_dv=True) for p in ONE_BUFFER_CASES
]


@pytest.mark.parametrize("params", ONE_BUFFER_CASES, ids=lambda p: p.describe())
def test_one_ds_buffer(params):
    """dS^T in one buffer: with dQ split by panels, warpgroup w's next dS^T rows overwrite
    bytes another warpgroup's dQ wgmma may still read. It is enough (a finding: kDSBytes of
    SMEM to save) where each warpgroup reads only its own rows after its own wait (dQ split
    by keys, or one consumer), and with one stage, where m-block i + 1's Q waits for every
    consumer thread's release of m-block i, after its dQ wgmma retired. The same holds for
    the overlapped consumer: its dQ retires at its wait_group 1, but another warpgroup may
    write its next rows of dS^T before that."""
    problems = check_protocol(single_ds_buffer(protocol(params)))
    needs_two = not params.dq_by_keys and params.consumers > 1 and params.stages > 1
    if needs_two:
        assert any(re.search(r"(WAR|RAW) on dS\^T.*dQ = dS K", p) for p in problems), problems
    else:
        assert problems == ()


SPLIT_BUFFER_CASES = [replace(SPLIT, block_n=n, stages=s) for n in (80, 64) for s in (1, 2, 3)]


@pytest.mark.parametrize("params", SPLIT_BUFFER_CASES, ids=lambda p: p.describe())
def test_the_split_consumer_needs_two_ds_buffers_and_one_p_buffer(params):
    """head_dim 256: dS in one buffer, the other warpgroup's next dS rows overwrite bytes this
    one's dK^T or dQ^T may still read (with 2 or more Q slots; with one, the next m-block's
    Q waits for both warpgroups' release of this one). One P buffer is enough (a finding:
    kPBytes of SMEM to save): P's only reader, dV^T, retires before the warpgroup releases
    the single dO slot, and the other warpgroup's next P waits for that slot's refill."""
    problems = check_protocol(single_ds_buffer(protocol(params)))
    if params.stages > 1:
        assert any(re.search(r"WAR on dS\^T: .*dK\^T \+= Q\^T dS.*dS -> smem", p) for p in problems)
    else:
        assert problems == ()
    assert check_protocol(single_ds_buffer(protocol(params), StagedTile.P)) == ()
    assert params.do_stages == 1


def _moved(proto: Protocol, name: str, after: str) -> Protocol:
    """The consumer's step ``name`` moved to just after step ``after``."""
    items = list(proto.consumer)
    step = items.pop(next(n for n, x in enumerate(items) if x.name == name))
    items.insert(next(n for n, x in enumerate(items) if x.name == after) + 1, step)
    return proto.with_role(WarpRole.CONSUMER, tuple(items))


@pytest.mark.parametrize("params", SPLITS, ids=lambda p: p.describe())
def test_the_split_slices_are_ordered(params):
    """head_dim 256: dQ^T's first slice added after the second slice's wgmma is issued into
    the same registers (what ptxas would do with both live, PR #2889's spill): the adds read
    registers that wgmma overwrites. The first slice's wgmma.fence taken away: likewise."""
    moved = _moved(protocol(params), "dQ red.add (panel 0)", "dQ^T = K^T dS^T (panel 1)")
    problems = check_protocol(moved)
    assert any(re.search(r"dQ acc", p) for p in problems), problems
    unfenced = _without(_moved(moved, "dQ red.add (panel 0)", "dK^T += Q^T dS (panel 0)"),
                        WarpRole.CONSUMER, Kind.WGMMA_FENCE)  # fmt: skip
    assert check_protocol(unfenced)


@pytest.mark.parametrize("params", SPLITS, ids=lambda p: p.describe())
def test_the_split_do_slot_is_released_after_dv(params):
    """head_dim 256: the dO slot's release moved before the wait that retires dV^T: the
    producer may reload dO while dV^T reads it. With one Q slot it may not (a finding): the
    producer reloads dO after Q, whose slot every consumer releases after its last wait."""
    items = list(protocol(params).consumer)
    n = next(
        n for n, x in enumerate(items) if x.kind is Kind.MBAR_ARRIVE and x.mbar is Mbar.DO_EMPTY
    )
    assert items[n - 1].kind is Kind.WGMMA_WAIT and items[n - 1].pending == 1
    items[n - 1], items[n] = items[n], items[n - 1]
    problems = check_protocol(protocol(params).with_role(WarpRole.CONSUMER, tuple(items)))
    if params.stages == 1:
        assert problems == ()
        return
    assert any(
        re.search(r"WAR on dO\[slot 0\] panel \d: .*dV\^T \+= dO\^T P.*producer", p)
        for p in problems
    ), problems


def _without(
    proto: Protocol, role: WarpRole, kind: Kind, phase: LoopPhase = LoopPhase.LOOP
) -> Protocol:
    items = proto.role(role)
    n = next(n for n, x in enumerate(items) if x.kind is kind and x.phase is phase)
    return proto.with_role(role, items[:n] + items[n + 1 :])


@pytest.mark.parametrize("overlap", [False, True])
def test_the_staging_needs_the_wait_for_the_previous_read(overlap):
    proto = protocol(replace(PANELS, overlap=overlap))
    problems = check_protocol(_without(proto, WarpRole.CONSUMER, Kind.BULK_WAIT_READ))
    assert any(
        re.search(r"WAR on dQ staging of wg0: .*dQ reduce-add \(m-block 0\).*m-block 1", p)
        for p in problems
    ), problems


@pytest.mark.parametrize("overlap", [False, True])
def test_the_exit_needs_the_last_wait(overlap):
    proto = protocol(replace(BY_KEYS, overlap=overlap))
    problems = check_protocol(_without(proto, WarpRole.CONSUMER, Kind.BULK_WAIT, LoopPhase.AFTER))
    assert any("dQ reduce-add" in p and "still in flight when wg0 ends" in p for p in problems)


@pytest.mark.parametrize("params", OVERLAPPED, ids=lambda p: p.describe())
def test_the_overlapped_staging_needs_dq_retired(params):
    """The overlapped order's wait_group 1 after dV's and dK's commit weakened to 2: dQ's
    group may still run when the warpgroup stages its registers."""
    items = protocol(params).consumer
    n = max(n for n, x in enumerate(items) if x.kind is Kind.WGMMA_WAIT and x.pending == 1)
    assert items[n - 1].kind is Kind.WGMMA_COMMIT and items[n - 2].name == "dK += dS^T Q"
    weak = items[:n] + (replace(items[n], pending=2),) + items[n + 1 :]
    problems = check_protocol(protocol(params).with_role(WarpRole.CONSUMER, weak))
    assert any(
        re.search(r"RAW on dQ acc: .*dQ = dS K \(m-block 0\).*dQ (-> staging|red.add) \(m-block", p)
        for p in problems
    ), problems


@pytest.mark.parametrize("params", OVERLAPPED, ids=lambda p: p.describe())
def test_the_overlapped_release_needs_dv_and_dk_retired(params):
    """The overlapped order's q_empty arrive moved before its wait_group 0: the producer
    may reload the slot's Q or dO while dV's or dK's wgmma still reads it."""
    items = list(protocol(params).consumer)
    n = next(n for n, x in enumerate(items) if x.kind is Kind.MBAR_ARRIVE)
    assert items[n - 1].kind is Kind.WGMMA_WAIT and items[n - 1].pending == 0
    items[n - 1], items[n] = items[n], items[n - 1]
    problems = check_protocol(protocol(params).with_role(WarpRole.CONSUMER, tuple(items)))
    assert any(
        re.search(r"WAR on (Q|dO)\[slot 0\]: .*(dK \+= dS\^T Q|dV \+= P\^T dO).*producer", p)
        for p in problems
    ), problems


def test_the_wait_read_can_move_before_the_ds_barrier():
    """A finding: the leader's wait_group.read placed before the dS^T barrier is ordered
    before the other threads' staging writes by that barrier, so the first staging barrier
    goes (one bar.sync less per m-block). The same in the overlapped consumer, where the
    wait moves before meet_and_issue_dq's barrier (right after dS^T's proxy fence)."""
    for params in (p for p in MUTATED if not (p.deterministic or p.dq_red or p.dq_writer)):
        items = list(protocol(params).consumer)
        n = next(n for n, x in enumerate(items) if x.kind is Kind.BULK_WAIT_READ)
        wait, barrier = items.pop(n), items.pop(n)
        assert barrier.kind is Kind.NAMED_BAR_SYNC
        fence = next(n for n, x in enumerate(items) if x.kind is Kind.FENCE_PROXY_ASYNC_SMEM)
        items.insert(fence, wait)
        assert check_protocol(protocol(params).with_role(WarpRole.CONSUMER, tuple(items))) == ()
        # without moving the wait, the barrier is needed
        moved = protocol(params).with_role(WarpRole.CONSUMER, tuple(items))
        assert check_protocol(_without(moved, WarpRole.CONSUMER, Kind.BULK_WAIT_READ))


def test_the_kv_wait_needs_its_guard():
    """The producer loads nothing for a CTA that visits no m-block: an unguarded K/V wait
    hangs there."""
    items = tuple(
        replace(x, guard=Guard.ALWAYS) if x.mbar is Mbar.KV_FULL else x
        for x in protocol(PANELS).consumer
    )
    problems = check_protocol(protocol(PANELS).with_role(WarpRole.CONSUMER, items))
    assert problems and "m_count 0: hang: wg0" in problems[0] and "kv_full" in problems[0]


def test_a_fence_by_the_leader_alone_is_refused():
    items = tuple(
        replace(x, who=Who.LEADER) if x.kind is Kind.FENCE_PROXY_ASYNC_SMEM else x
        for x in protocol(BY_KEYS).consumer
    )
    problems = check_protocol(protocol(BY_KEYS).with_role(WarpRole.CONSUMER, items))
    assert any("no fence.proxy.async by wg0" in p for p in problems), problems


def test_a_wait_or_barrier_by_the_leader_alone_is_refused():
    for kind in (Kind.MBAR_WAIT, Kind.NAMED_BAR_SYNC):
        items = tuple(
            replace(x, who=Who.LEADER) if x.kind is kind else x for x in protocol(PANELS).consumer
        )
        problems = check_protocol(protocol(PANELS).with_role(WarpRole.CONSUMER, items))
        assert any("thread 0 of the consumer warpgroup" in p for p in problems), problems


@pytest.mark.parametrize(
    "kind,site,message",
    [
        (Kind.SEM_ACQUIRE, CodeSite.ORDERED_REDUCE_ADD, "does not follow the ticket's acquire"),
        (
            Kind.FENCE_PROXY_ASYNC_GLOBAL,
            CodeSite.ORDERED_REDUCE_ADD,
            "between the ticket's acquire and the reduce-add",
        ),
        (Kind.SEM_RELEASE, CodeSite.RELEASE_DQ_TICKET, "no release of the next ticket"),
    ],
)
def test_the_semaphore_order_is_checked(kind, site, message):
    proto = protocol(Params(2, 2, 64, True))
    items = proto.consumer
    n = next(n for n, x in enumerate(items) if x.kind is kind and x.source is site)
    problems = check_protocol(proto.with_role(WarpRole.CONSUMER, items[:n] + items[n + 1 :]))
    assert any(message in p for p in problems), problems


def test_the_release_needs_the_adds_performed_and_fenced():
    proto = protocol(Params(3, 2, 128, True))
    items = proto.consumer
    ordered = [n for n, x in enumerate(items) if x.source is CodeSite.RELEASE_DQ_TICKET]
    wait = next(n for n in ordered if items[n].kind is Kind.BULK_WAIT)
    read_only = replace(items[wait], kind=Kind.BULK_WAIT_READ)
    problems = check_protocol(
        proto.with_role(WarpRole.CONSUMER, items[:wait] + (read_only,) + items[wait + 1 :])
    )
    assert any("wait_group 0 of the reduce-add" in p for p in problems), problems
    last_fence = max(n for n in ordered if items[n].kind is Kind.FENCE_PROXY_ASYNC_GLOBAL)
    problems = check_protocol(
        proto.with_role(WarpRole.CONSUMER, items[:last_fence] + items[last_fence + 1 :])
    )
    assert any("between the reduce-add's wait_group 0 and" in p for p in problems), problems


def test_a_semaphore_without_deterministic_mode_is_refused():
    det = protocol(Params(2, 2, 64, True))
    assert check_protocol(replace(det, params=Params(2, 2, 64, False)))


def test_the_setup_is_checked():
    proto = protocol(PANELS)
    for kind, message in (
        (Kind.FENCE_MBAR_INIT, "no fence.mbarrier_init"),
        (Kind.SYNCTHREADS, "no __syncthreads"),
    ):
        problems = check_protocol(_without(proto, WarpRole.SETUP, kind, LoopPhase.BEFORE))
        assert any(message in p for p in problems), problems
    problems = check_protocol(_without(proto, WarpRole.SETUP, Kind.MBAR_INIT, LoopPhase.BEFORE))
    assert any("mbarrier kv_full (one copy) is used but never initialised" in p for p in problems)
