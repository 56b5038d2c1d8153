"""The backward main kernel's sync plan (fadsl/targets/sm90/backward/protocol.py: the steps
of schedule.py with the syncs the sync pass placed) is proven in the async model for every
configuration the header admits, with either consumer (bwd_consumer, or
bwd_consumer with `overlap on`), every broken variant of it is refused with the
hazard named, the brute-force interleaving checker agrees on the smallest cases, and the
header (emit/sm90/include/fadsl/sm90_bwd.cuh) and the template
(emit/sm90/backward.cu.j2) make exactly the protocol's calls in the protocol's order."""

from __future__ import annotations

import re
from dataclasses import replace
from math import lcm

import pytest

from backward_header import (
    HEADER,
    LAG_HEADER,
    MBARS,
    OFFSETS,
    SPLIT_HEADER,
    TEMPLATE,
    config_constants,
    consumer_function,
    differences,
    evaluate,
    expected_calls,
    function,
    header_calls,
    kernel_body,
    kernel_template,
    producer_function,
    squash,
    writer_function,
)
from bruteforce_async import explore
from fadsl.passes.asyncmodel.model import Wait
from fadsl.passes.asyncmodel.prove import check
from fadsl.targets.sm90.backward.program import (
    BAR_DQ,
    BAR_DQ_EMPTY,
    BAR_DQ_FULL,
    BAR_DS,
    StagedTile,
    Guard,
    Index,
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
    default_layout,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import (
    build_program,
    check_protocol,
    m_counts,
    parameter_space,
    persistent_space,
    prove,
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
    writers = [p for p in PARAMS if p.dq_writer and not p.ds_stmatrix]
    assert len(writers) == 5 * 4 * (3 + 2) and not any(p.dq_by_keys for p in writers)
    # `dq_lag on`: 5 shapes (dQ not by keys), 1-3 stages, `dq_first` off and on, 8 of them
    # with 2 stages by stmatrix
    lag = [p for p in PARAMS if p.dq_lag]
    assert len(lag) == (5 * 3 + 4) * 2 and sum(p.ds_stmatrix for p in lag) == 8
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

PANELS = Params(2, 2, 128)  # dQ by head_dim panels: both warpgroups read all of dS^T
BY_KEYS = Params(2, 2, 64)  # dQ by keys: each warpgroup reads its own rows
# dQ by queries: each warpgroup reads its panel of dS^T, every warpgroup's rows of it
BY_QUERIES = Params(2, 2, 64, block_m=128)
# dQ transposed: each warpgroup writes its key panel of dS (queries as rows), reads all of it
TRANSPOSED = Params(2, 2, 128, block_m=80)
PLAIN = (
    PANELS,
    BY_KEYS,
    BY_QUERIES,
    TRANSPOSED,
    Params(1, 1, 64),
    Params(3, 3, 128),
    replace(PANELS, deterministic=True),
)
RED = (
    replace(BY_QUERIES, dq_red=True),
    replace(TRANSPOSED, dq_red=True),
    replace(PANELS, dq_red=True),
    Params(1, 1, 64, dq_red=True),
)
# head_dim 256: the consumers split head_dim (bwd_consumer_split), its one order
SPLIT = Params(2, 2, 256, dq_red=True, block_n=80)
SPLITS = (SPLIT, replace(SPLIT, stages=1), replace(SPLIT, block_n=64, stages=3))
MUTATED = PLAIN + RED + tuple(replace(p, overlap=True) for p in PLAIN + RED)
MUTATED += tuple(replace(p, overlap=True, early_dv=True) for p in PLAIN + RED)
MUTATED += tuple(replace(p, overlap=True, dv_before_meeting=True) for p in PLAIN + RED)
MUTATED += SPLITS
# `dq_writer on`: the writer's hand-over, lane-0 waits and ordered add, in both orders
WRITERS = (
    replace(PANELS, dq_writer=True),
    replace(PANELS, deterministic=True, dq_writer=True),
    replace(BY_QUERIES, deterministic=True, dq_writer=True, overlap=True, early_dv=True),
    replace(TRANSPOSED, deterministic=True, dq_writer=True, overlap=True),
    replace(TRANSPOSED, dq_writer=True, overlap=True, dv_before_meeting=True, stages=1),
    Params(1, 3, 64, deterministic=True, dq_writer=True),
)
MUTATED += WRITERS
# dS by stmatrix (store_ds_stmatrix): the st.shared store's step, so the same fence and meeting
STMATRIX = (
    replace(BY_QUERIES, ds_stmatrix=True, dq_red=True, overlap=True),  # the head_dim 64 example's
    replace(PANELS, ds_stmatrix=True),
    replace(BY_KEYS, ds_stmatrix=True, overlap=True, early_dv=True),
    replace(PANELS, ds_stmatrix=True, deterministic=True, dq_writer=True, overlap=True),
)
MUTATED += STMATRIX
OVERLAPPED = tuple(p for p in MUTATED if p.overlap)
# `dq_lag on` (bwd_consumer_lagged): dS^T handed to dQ a step later by ds_full / ds_empty
LAG = Params(2, 2, 128, overlap=True, dq_red=True, dq_lag=True)
LAGGED = (
    LAG,
    replace(LAG, stages=3, block_m=80),  # the fa3_hopper example's (dQ transposed)
    replace(LAG, head_dim=64, block_m=128, ds_stmatrix=True),  # by queries, stmatrix
    Params(1, 1, 64, overlap=True, dq_red=True, dq_lag=True),
    # `dq_first on`: dQ(i - 1) before dV(i) and dK(i), which share a group
    replace(
        LAG, head_dim=64, block_m=128, ds_stmatrix=True, dq_first=True
    ),  # the head_dim 64 examples'
    replace(LAG, stages=3, dq_first=True),
)
MUTATED += LAGGED
LAG_ORDERS = LAGGED[:3] + LAGGED[4:]  # (LAGGED[3]: one consumer warpgroup)


def label(items: tuple[Item, ...], n: int) -> str:
    """'kind (phase) after <the last named step before it>': the same for every config."""
    previous = next((x.name for x in reversed(items[:n]) if x.name), "the start")
    return f"{items[n].kind.value} ({items[n].phase.value}) after {previous}"


def mutants(proto: Protocol, change):
    """(label, mutant) for each item of each role that ``change`` maps to new items."""
    for role in WarpRole:
        items = proto.role(role)
        for n, item in enumerate(items):
            new = change(item)
            if new is not None:
                yield f"{role.value}: {label(items, n)}", proto.with_role(
                    role, items[:n] + new + items[n + 1 :]
                )


def survivors(proto: Protocol, change) -> list[str]:
    return [what for what, mutant in mutants(proto, change) if not check_protocol(mutant)]


def _redundant_staging_syncs(last_wgmma: str) -> set[str]:
    """ordered_reduce_add's wait_group 0 retires the reduce-add's SMEM read at once, and the
    dS^T meeting barrier of the next m-block orders it before the other threads' staging
    writes: the leader's wait_group.read, the barrier after it and the exit's wait_group 0
    are redundant in deterministic mode."""
    return {
        f"consumer: cp.async.bulk.wait_group.read (each m-block) after {last_wgmma}",
        f"consumer: bar.sync (each m-block) after {last_wgmma}",
        "consumer: cp.async.bulk.wait_group (after the m-block loop) after dQ reduce-add",
    }


# Syncs the proof finds unneeded, by (deterministic, overlap) (each a finding for the header;
# the test fails if the set changes either way). bwd_consumer: the commit after dV and dK
# only splits a group that the wait_group 0 after dQ's commit retires anyway (free). The
# overlapped consumer needs every sync: both commits (wait_group 1 means dQ's group), both
# waits (dQ's before the staging, dV's and dK's before the slot's release).
UNNEEDED = {
    (False, False): {"consumer: wgmma.commit_group (each m-block) after dK += dS^T Q"},
    (False, True): set(),
}
UNNEEDED[True, False] = UNNEEDED[False, False] | _redundant_staging_syncs("dQ = dS K")
UNNEEDED[True, True] = _redundant_staging_syncs("dK += dS^T Q")


# `dv_before_meeting`: dV's own group, closed as the warpgroup turns to the dS^T fence and
# the meeting (the pass's rule, as the header does); it is the group just before dQ's, and a
# wait retires groups oldest first, so every wait that retires dQ retires dV anyway
DV_GROUP = "consumer: wgmma.commit_group (each m-block) after dV += P^T dO"


# `dq_lag on`: dV's group only splits one that wait_group 1 retires with dQ's anyway; no
# one waits for the last m-block's ds_empty phase in a CTA of one tile; with one consumer
# the warpgroup's own wait_group retired dQ(i - 2) before its store of dS^T(i) (program
# order), so the ds_empty wait orders nothing more
LAG_DV_GROUP = DV_GROUP
LAG_LAST_EMPTY = (
    "consumer: mbarrier.arrive (after the m-block loop) after dQ = dS K (the last m-block)"
)
LAG_EMPTY_WAIT = "consumer: mbarrier.try_wait.parity (each m-block) after dS^T to 16 bits"


def lag_unneeded(params: Params) -> set[str]:
    # (`dq_first on`: dV and dK share the group after dQ's, so dV closes none of its own)
    found = set() if params.dq_first else {LAG_DV_GROUP}
    found |= set() if params.persistent else {LAG_LAST_EMPTY}
    return found | ({LAG_EMPTY_WAIT} if params.consumers == 1 else set())


def unneeded(params: Params) -> set[str]:
    """The syncs the proof finds redundant: none of the split consumer's (head_dim 256)."""
    if params.split:
        return set()
    if params.dq_lag:
        return lag_unneeded(params)
    extra = {DV_GROUP} if params.dv_before_meeting else set()
    # (with a dQ writer the consumer has no staging syncs that the ordered add makes redundant)
    return UNNEEDED[params.deterministic and not params.dq_writer, params.overlap] | extra


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


def single_ds_buffer(proto: Protocol, tile: StagedTile = StagedTile.DS) -> Protocol:
    """dS^T (or ``tile``) always in buffer 0 (no i % 2)."""
    fix = lambda op: replace(op, index=Index.NONE) if op.buffer is tile else op  # noqa
    items = tuple(
        replace(x, reads=tuple(map(fix, x.reads)), writes=tuple(map(fix, x.writes)))
        for x in proto.consumer
    )
    assert items != proto.consumer
    return proto.with_role(WarpRole.CONSUMER, items)


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


# --- the brute-force interleaving checker -------------------------------------------------

SMALL = [(Params(1, 1, 64), 1), (Params(1, 1, 64), 3), (Params(1, 2, 64), 2)]
SMALL += [(Params(2, 1, 64), 1), (Params(1, 1, 128, True), 2), (Params(2, 1, 128), 2)]
SMALL += [(Params(1, 1, 64, overlap=True), 2), (Params(1, 2, 64, overlap=True), 2)]
SMALL += [(Params(2, 1, 64, overlap=True), 1), (Params(1, 1, 128, True, True), 2)]


@pytest.mark.parametrize("params,m_count", SMALL, ids=str)
def test_bruteforce_agrees_on_the_plan(params, m_count):
    assert explore(build_program(protocol(params), m_count), all_kinds=True) == set()


MODEL_KINDS = frozenset(Kind) - {Kind.MBAR_INIT, Kind.FENCE_MBAR_INIT, Kind.SYNCTHREADS}
MODEL_KINDS -= {Kind.WGMMA_FENCE, Kind.FENCE_PROXY_ASYNC_GLOBAL, Kind.SEM_ACQUIRE}


@pytest.mark.parametrize(
    "params,m_count",
    [(Params(1, 1, 64), 2), (Params(2, 1, 64), 2), (Params(1, 1, 64, overlap=True), 2)],
)
def test_bruteforce_agrees_on_every_dropped_sync(params, m_count):
    refused = 0
    for what, mutant in mutants(
        protocol(params), lambda x: () if x.is_sync and x.kind in MODEL_KINDS else None
    ):
        program = build_program(mutant, m_count)
        found = explore(program)
        assert bool(check(program)) == bool(found), (what, found, check(program))
        refused += bool(found)
    assert refused > 5


def test_bruteforce_finds_the_single_ds_buffer_race():
    """Two stages: the correct plan has too many states for the brute force, the race not."""
    assert explore(build_program(single_ds_buffer(protocol(PANELS)), 2)) == {"race"}
    assert explore(build_program(single_ds_buffer(protocol(Params(2, 1, 128))), 2)) == set()


# --- the header makes the protocol's calls (backward_header.py reads it) ------------------


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.describe())
@pytest.mark.parametrize("role", list(WarpRole), ids=lambda r: r.value)
def test_the_header_makes_the_protocols_calls(role, params):
    expected, found = expected_calls(protocol(params), role), header_calls(role, params)
    assert found == expected, differences(expected, found)


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("a dropped wait_read", "if (tid == 0) tma_store_wait_read<0>();", ""),
        ("a flipped parity", "phase ^ 1u);", "phase);"),
        ("one dS^T buffer", "(run_i % 2) * Cfg::kDSBytes", "0 * Cfg::kDSBytes"),
        ("wait<2>", "wgmma_wait<1>();  // S^T", "wgmma_wait<2>();  // S^T"),
        (
            "a fence moved",
            "fence_proxy_async_smem();\n      meet_and_issue_dq",
            "meet_and_issue_dq",
        ),
        ("expect_tx", "2 * Cfg::kQBytes + 2 * Cfg::kRowFloatsBytes", "2 * Cfg::kQBytes"),
        (
            "the leader's barrier",
            "named_bar_sync(Cfg::kBarDQ + wg, 128);\n    stage_dq",
            "stage_dq",
        ),
        ("no acquire fence", "fence_proxy_async_global();  // the acquire", ""),
        ("no staging fence", "fence_proxy_async_smem();\n    named_bar_sync", "named_bar_sync"),
        (
            "red.add: dQ not added",
            "    red_add_dq<Cfg>(dst, dq, tid);\n  } else if",
            "  } else if",
        ),
        (
            "no ticket released at the end",
            "if (tid == 0 && b.m_count > 0) release_dq_ticket<Cfg>(owed);",
            "",
        ),
        (
            "the ticket's release at once",
            "  tma_store_commit();\n}",
            "  tma_store_commit();\n  bulk_wait_all();\n}",
        ),
        ("no completion before the release", "  bulk_wait_all();             // the adds", ""),
    ],
)
def test_an_edited_header_is_caught(what, old, new):
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    for params in (PANELS, BY_KEYS, Params(2, 2, 64, True), replace(BY_QUERIES, dq_red=True)):
        for role in (WarpRole.PRODUCER, WarpRole.CONSUMER):
            if header_calls(role, params, edited) != expected_calls(protocol(params), role):
                return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("st.shared for stmatrix", "store_ds_stmatrix<Cfg>(ds_buf", "store_ds<Cfg>(ds_buf"),
        (
            "stmatrix for st.shared",
            "      store_ds<Cfg>(ds_buf",
            "      store_ds_stmatrix<Cfg>(ds_buf",
        ),
        ("stmatrix .trans", "store_ds_stmatrix<Cfg>(ds_buf", "store_ds_t<Cfg>(ds_buf"),
        (
            "no fence after the store",
            "      fence_proxy_async_smem();\n      // dq was read",
            "      // dq was read",
        ),
    ],
)
def test_an_edited_ds_store_is_caught(what, old, new):
    """The header stores dS^T by the instruction the spec's path names (Cfg::kDsStmatrix),
    each followed by the proxy fence before the meeting, in every order."""
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    for params in STMATRIX + (PANELS, replace(BY_QUERIES, dq_red=True, overlap=True)):
        calls = header_calls(WarpRole.CONSUMER, params, edited)
        if calls != expected_calls(protocol(params), WarpRole.CONSUMER):
            return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("no __syncwarp", "    __syncwarp();  // lane 0's wait", "    // lane 0's wait"),
        (
            "no __syncwarp after the release",
            "      __syncwarp();\n    }\n  }\n  //",
            "    }\n  }\n  //",
        ),
        ("no exit wait", "    if (lane == 0) bulk_wait_all();\n", ""),
        ("no empty wait", "if (i > 0) named_bar_sync(Cfg::kBarDqEmpty + wg, 160);", ""),
        ("no read wait", "      tma_store_wait_read<0>();   // WAR: the add", "      // WAR"),
        (
            "no release",
            "st_release_gpu(dq_semaphore_share<Cfg>(P, accum_head, m, w), place + 1);",
            "",
        ),
        (
            "no acquire",
            "while (ld_acquire_gpu(dq_semaphore_share<Cfg>(P, accum_head, m, w)) != place)",
            "",
        ),
        (
            "an arrival after the last",
            "if (i + 1 < b.m_count) named_bar_arrive",
            "named_bar_arrive",
        ),
        (
            "no staging fence",
            "fence_proxy_async_smem();\n    named_bar_arrive(Cfg::kBarDqFull",
            "named_bar_arrive(Cfg::kBarDqFull",
        ),
        (
            "the consumer's own release",
            "Cfg::kDeterministic && !Cfg::kDqWriter) {\n    if (tid == 0 &&",
            "Cfg::kDeterministic) {\n    if (tid == 0 &&",
        ),
    ],
)
def test_an_edited_writer_header_is_caught(what, old, new):
    """`dq_writer on`: each of the writer's and the consumer's hand-over syncs, taken out of
    the header, makes its calls differ from the proven plan's."""
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    cases = (WRITERS[1], replace(PANELS, dq_writer=True, overlap=True), WRITERS[2], WRITERS[0])
    for params in cases:
        for role in (WarpRole.CONSUMER, WarpRole.WRITER):
            if header_calls(role, params, edited) != expected_calls(protocol(params), role):
                return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


def test_the_writers_are_called_from_the_producer_warpgroup():
    """The kernel body calls bwd_dq_writers unconditionally in warpgroup 0's branch (after
    setmaxnreg.dec), and it runs bwd_dq_writer only under `if constexpr (Cfg::kDqWriter)`."""
    assert writer_function(False) == writer_function(True) == "bwd_dq_writer"
    assert header_calls(WarpRole.WRITER, PANELS) == []
    with pytest.raises(AssertionError):
        writer_function(False, TEMPLATE.replace("    bwd_dq_writers<Cfg>(P, smem, shared);", ""))


# the overlapped order's lines, each with a neighbour that makes it the only such text
ARRIVE = "      mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));\n    } else {"
REDUCE = (
    "      reduce_dq<Cfg>(P, b, stage, dq, accum_head, m, wg, tid, owed, i);\n"
    "      FADSL_BWD_MARK(wg, i, 8);\n      wgmma_wait<0>();"
)
ISSUE = (
    "      meet_and_issue_dq<Cfg>(dq, smem, ds_buf, wg);\n"
    "      FADSL_BWD_MARK(wg, i, 6);\n      if constexpr (!Cfg::kEarlyDv &&"
)
GRADS = "      issue_grad_kv<Cfg>(dk, ds16, q_slot);\n      wgmma_commit();\n      wgmma_wait<1>();"
DV_BEFORE_MEETING = (
    "      if constexpr (Cfg::kDvBeforeMeeting) {\n"
    "        wgmma_fence();  // p16 (its A operand) and dv written by ordinary instructions\n"
    "        issue_grad_kv<Cfg>(dv, p16, do_slot);\n"
    "        wgmma_commit();\n"
    "      }\n"
)
DS_PACK = "    pack_pairs<Cfg>(dp, ds16);\n"


@pytest.mark.parametrize(
    "what,edits",
    [
        ("wait<2> before the staging", [("wgmma_wait<1>();  // dQ", "wgmma_wait<2>();  // dQ")]),
        (
            "the arrive before wait<0>",
            [
                (ARRIVE, "    } else {"),
                (
                    REDUCE,
                    REDUCE.replace(
                        "\n", "\n      mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));\n", 1
                    ),
                ),
            ],
        ),
        (
            "dQ issued after dV and dK",
            [
                (ISSUE, "      if constexpr (!Cfg::kEarlyDv &&"),
                (
                    GRADS,
                    GRADS.replace(
                        "\n", "\n      meet_and_issue_dq<Cfg>(dq, smem, ds_buf, wg);\n", 1
                    ),
                ),
            ],
        ),
        ("one dS^T buffer", [("(run_i % 2) * Cfg::kDSBytes", "0 * Cfg::kDSBytes")]),
        ("a flipped parity", [("Cfg::kStages) & 1u);", "Cfg::kStages) & 1u ^ 1u);")]),
        ("no meeting by keys", [("named_bar_sync(Cfg::kBarDQ + wg, 128);  // RAW", "// ")]),
        ("a meeting too small", [("kBarDS, Cfg::kConsumerThreads);", "kBarDS, 128);")]),
        ("no wgmma fence", [("wgmma_fence();\n      meet_and_issue_dq", "meet_and_issue_dq")]),
        (
            "early dV: wait<2> for dP^T",
            [("wgmma_wait<1>();  // dP^T", "wgmma_wait<2>();  // dP^T")],
        ),
        ("early dV: no fence for P^T", [("wgmma_fence();  // the A registers p16", "")]),
        (
            "early dV: dV in dK's group",
            [("issue_grad_kv<Cfg>(dv, p16, do_slot);\n      wgmma_commit();", "")],
        ),
        ("by queries: dS^T panel 0", [("ds_buf + wg * Cfg::kDSPanelBytes", "ds_buf")]),
        (
            "dV before the meeting: no fence",
            [("wgmma_fence();  // p16 (its A operand) and dv written", "// ")],
        ),
        (
            "dV before the meeting: issued before the dS^T store (its old place)",
            [
                (DV_BEFORE_MEETING, ""),
                (DS_PACK, DV_BEFORE_MEETING.replace("\n  ", "\n") + DS_PACK),
            ],
        ),
        (
            "dV before the meeting: dQ's fence kept",
            [("if constexpr (!Cfg::kDvBeforeMeeting) wgmma_fence();", "wgmma_fence();")],
        ),
        (
            "dV before the meeting: issued after the meeting too",
            [
                (
                    "      if constexpr (!Cfg::kEarlyDv && !Cfg::kDvBeforeMeeting) issue_grad_kv",
                    "      if constexpr (!Cfg::kEarlyDv) issue_grad_kv",
                )
            ],
        ),
    ],
)
def test_an_edited_overlap_header_is_caught(what, edits):
    edited = HEADER
    for old, new in edits:
        assert edited.count(old) == 1, (what, old)
        edited = edited.replace(old, new)
    for params in OVERLAPPED:
        found = header_calls(WarpRole.CONSUMER, params, header=edited)
        if found != expected_calls(protocol(params), WarpRole.CONSUMER):
            return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("a dropped dO release", "    mbar_arrive(bwd_bar_do_empty<Cfg>(smem, i % Cfg::kDoStages));\n", ""),
        ("a dropped dO wait", "mbar_wait_parity(bwd_bar_do_empty<Cfg>(smem, do_slot), ((i / Cfg::kDoStages) & 1u) ^ 1u);", ""),
        ("a flipped dO parity", "static_cast<uint32_t>(i / Cfg::kDoStages) & 1u);", "(static_cast<uint32_t>(i / Cfg::kDoStages) & 1u) ^ 1u);"),
        ("dO's bytes on q_full", "bulk_load(smem + Cfg::kOffD + do_slot * Cfg::kRowFloatsBytes, P.dpsum + row0, Cfg::kRowFloatsBytes, do_full);", "bulk_load(smem + Cfg::kOffD + do_slot * Cfg::kRowFloatsBytes, P.dpsum + row0, Cfg::kRowFloatsBytes, q_full);"),
        ("no fence before dQ^T's second slice", "    wgmma_fence();  // dq was read by the adds above\n", ""),
        ("the first slice added late", "    red_add_dq<Cfg>(dq_accum_share<Cfg>(P, accum_head, m, 2 * wg), dq, tid);\n    wgmma_fence();", "    wgmma_fence();"),
        ("one P buffer", "(i % 2) * Cfg::kPBytes", "0 * Cfg::kPBytes"),
        ("the meeting of one warpgroup", "named_bar_sync(Cfg::kBarDS, Cfg::kConsumerThreads);", "named_bar_sync(Cfg::kBarDS, 128);"),
        ("dK^T's second panel on the first's", "q_panels + Cfg::kBlockM * Cfg::kRowBytes, ds_buf", "q_panels, ds_buf"),
        ("dQ^T's second slice on K's first panel", "k_panels + Cfg::kBlockN * Cfg::kRowBytes, ds_buf", "k_panels, ds_buf"),
        ("the Q slot released before dK^T retires", "    wgmma_wait<0>();  // dK^T retired: Q read\n", ""),
    ],
)  # fmt: skip
def test_an_edited_split_header_is_caught(what, old, new):
    assert SPLIT_HEADER.count(old) == 1, what
    edited = SPLIT_HEADER.replace(old, new)
    for params in SPLITS:
        for role in (WarpRole.PRODUCER, WarpRole.CONSUMER):
            found = header_calls(role, params, split_header=edited)
            if found != expected_calls(protocol(params), role):
                return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


def _cfg_argument(template: str, index: int) -> str:
    """The template's ``index``-th argument of ``struct Cfg : BwdConfig<...>``."""
    (cfg,) = re.findall(r"struct Cfg : BwdConfig<(.*?)> \{", template)
    return re.split(r",\s*(?={{)", cfg)[index]


def test_an_edited_template_is_caught():
    """The kernel's Cfg must pass the block's `overlap` on (BwdConfig's kOverlap_, which
    picks bwd_consumer's order), and call bwd_consumer once, after the producer's branch."""
    overlap = '{{ "true" if overlap else "false" }}'
    assert _cfg_argument(TEMPLATE, 8) == overlap
    assert _cfg_argument(TEMPLATE.replace(overlap, '"false"'), 8) != overlap
    call = "{{ consumer }}<Cfg>(P, smem, block, warpgroup - 1);"
    with pytest.raises(ValueError):
        consumer_function(False, TEMPLATE.replace(call, call + call))


def test_the_header_agrees_on_layout_barriers_and_roles():
    for params in PARAMS:
        env = config_constants(params)
        assert (env["kBarDS"], env["kBarDQ"]) == (BAR_DS, BAR_DQ)
        assert (env["kBarDqFull"], env["kBarDqEmpty"]) == (BAR_DQ_FULL, BAR_DQ_EMPTY)
        # the writers' barriers: distinct ids of the 16, past the consumers' own
        ids = {BAR_DS} | {BAR_DQ + wg for wg in range(3)}
        writer_ids = {b + wg for b in (BAR_DQ_FULL, BAR_DQ_EMPTY) for wg in range(3)}
        assert not ids & writer_ids and len(writer_ids) == 6 and max(writer_ids) < 16
        assert env["kThreads"] == 128 * (1 + params.consumers)
        assert env["kDqByKeys"] == params.dq_by_keys and env["kDqFloats"] == params.dq_floats
        assert env["kOverlap"] == params.overlap and env["kEarlyDv"] == params.early_dv
        assert env["kDqByQueries"] == params.dq_by_queries and env["kDqRed"] == params.dq_red
        for buffer, offset, size in default_layout(params).offsets:
            name = next(k for k, v in OFFSETS.items() if v is buffer)
            assert env[name] == offset, (params, buffer)
        # the mbarriers: distinct 8-byte words inside the kNumBars the plan reserves
        words = []
        for name in MBARS:
            if "_do_" in name and not params.split:  # the dO ring's own: head_dim 256
                continue
            if name == "bwd_bar_kv_empty":  # `scheduler persistent`'s: kNumBars one more
                continue
            if "_ds_" in name:  # `dq_lag on`'s, after kv_empty: below
                continue
            _, body = function(HEADER, rf"uint32_t {name}\(")
            (expr,) = re.findall(r"return ([^;]+);", body)
            ring = params.do_stages if "_do_" in name else params.stages
            slots = range(ring) if "slot" in expr else [0]
            words += [evaluate(expr, env, smem=0, slot=s) - env["kOffBar"] for s in slots]
        assert sorted(words) == [8 * n for n in range(env["kNumBars"])]
        # kv_empty: the word after them (the persistent Cfg's kNumBars counts it)
        _, body = function(HEADER, r"uint32_t bwd_bar_kv_empty\(")
        (expr,) = re.findall(r"return ([^;]+);", body)
        assert evaluate(expr, env, smem=0) - env["kOffBar"] == 8 * env["kNumBars"]
        # dq_lag's ds_full, ds_empty per buffer: the 4 words after those (and kv_empty's), which
        # the template's kNumBars counts (4 more with dq_lag)
        _, full = function(LAG_HEADER, r"uint32_t bwd_bar_ds_full\(")
        (expr,) = re.findall(r"return ([^;]+);", full)
        expr = expr.replace("(Cfg::kPersistent ? 1 : 0)", str(int(params.persistent)))
        at = lambda buf: evaluate(expr, env, smem=0, buf=buf) - env["kOffBar"]  # noqa
        _, empty = function(LAG_HEADER, r"uint32_t bwd_bar_ds_empty\(")
        assert squash(empty) == "returnbwd_bar_ds_full<Cfg>(smem,2+buf);"
        first = env["kNumBars"] + params.persistent
        assert [at(b) for b in range(4)] == [8 * (first + n) for n in range(4)]
    for overlap in (False, True):
        split = squash(kernel_body(overlap))
        assert producer_function(overlap) == "bwd_producer"
        assert "if(warpgroup==0){" in split and "threadIdx.x/32==0&&elect_one()" in split
        # the elected thread's block, then the writer warps' call (warpgroup 0's other warps)
        assert "bwd_producer<Cfg>(P,smem,block);}bwd_dq_writers<Cfg>(P,smem,shared);}else{" in split
        assert consumer_function(overlap) == "bwd_consumer"
        assert split.count("warpgroup-1);") == 1
    # head_dim 256: the kernel calls the split header's roles
    assert consumer_function(False, split=True) == "bwd_consumer_split"
    assert producer_function(False, split=True) == "bwd_producer_split"
    assert '#include "fadsl/sm90_bwd_split.cuh"' in kernel_template(False, split=True)
    # the template's Cfg passes `overlap` as BwdConfig's kOverlap_ (its ninth parameter)
    (cfg,) = re.findall(r"struct Cfg : BwdConfig<(.*?)> \{", TEMPLATE)
    head = HEADER[: HEADER.index("struct BwdConfig")]
    names = re.findall(r"(?:class|int|bool) (\w+)", head[head.rindex("template") :])
    assert names[8] == "kOverlap_" and re.split(r",\s*(?={{)", cfg)[8] == (
        '{{ "true" if overlap else "false" }}'
    )
    assert names[9] == "kEarlyDv_" and re.split(r",\s*(?={{)", cfg)[9] == (
        '{{ "true" if early_dv else "false" }}'
    )
    assert names[10] == "kDqRed_" and re.split(r",\s*(?={{)", cfg)[10] == (
        '{{ "true" if dq_red else "false" }}'
    )


# --- `dq_lag on`: dS^T handed over by ds_full / ds_empty ---------------------------------


def _lag_edit(params: Params, edit) -> tuple[str, ...]:
    """The problems of the plan with its consumer's items edited by ``edit`` (a list)."""
    items = list(protocol(params).consumer)
    edit(items)
    return check_protocol(protocol(params).with_role(WarpRole.CONSUMER, tuple(items)))


def _at(items: list, kind: Kind, mbar: Mbar | None = None) -> int:
    return next(n for n, x in enumerate(items) if x.kind is kind and x.mbar is mbar)


def _drop(kind: Kind, mbar: Mbar | None = None):
    return lambda items: items.pop(_at(items, kind, mbar))


def _wrong_parity(items: list) -> None:
    n = _at(items, Kind.MBAR_WAIT, Mbar.DS_FULL)
    items[n] = replace(items[n], parity=WaitParity.ALTERNATE_PREVIOUS)


def _empty_before_its_wait(items: list) -> None:
    n = _at(items, Kind.MBAR_ARRIVE, Mbar.DS_EMPTY)
    assert items[n - 1].kind is Kind.WGMMA_WAIT and items[n - 1].pending == 1
    items[n - 1], items[n] = items[n], items[n - 1]


def _full_before_the_store(items: list) -> None:
    arrive = items.pop(_at(items, Kind.MBAR_ARRIVE, Mbar.DS_FULL))
    items.insert(next(n for n, x in enumerate(items) if x.kind is Kind.ST_SHARED), arrive)


DS = r"dS\^T\[buffer \d\][^:]*"
LAG_BREAKS = [
    ("no ds_empty wait", _drop(Kind.MBAR_WAIT, Mbar.DS_EMPTY), rf"WAR on {DS}: .*dQ = dS K"),
    ("no ds_full wait", _drop(Kind.MBAR_WAIT, Mbar.DS_FULL), rf"RAW on {DS}.*dS\^T -> smem"),
    ("ds_full's parity flipped", _wrong_parity, r"hang: wg\d .*wait on ds_full\[0\], parity 1"),
    ("ds_empty before dQ's wait_group", _empty_before_its_wait, rf"WAR on {DS}: .*dQ = dS K"),
    ("no proxy fence", _drop(Kind.FENCE_PROXY_ASYNC_SMEM), r"no fence.proxy.async by wg\d"),
    ("ds_full before the store", _full_before_the_store, rf"RAW on {DS}.*dS\^T -> smem"),
]


@pytest.mark.parametrize("what,edit,hazard", LAG_BREAKS, ids=[b[0] for b in LAG_BREAKS])
@pytest.mark.parametrize("params", LAG_ORDERS, ids=lambda p: p.describe())
def test_a_broken_lag_plan_is_refused(params, what, edit, hazard):
    """Each of the hand-over's syncs taken out, moved or given the wrong parity: the proof
    names the hazard (the dS^T bytes, the dQ or store that races) or the hang."""
    problems = _lag_edit(params, edit)
    assert any(re.search(hazard, p) for p in problems), (what, problems)


def test_one_lagged_consumer_needs_no_empty_wait():
    """A finding: with one consumer warpgroup its own wait_group retired dQ(i - 2) before
    it stores dS^T(i) (program order), so ds_empty's wait and arrivals order nothing more
    (the header keeps them: one program for every consumer count)."""
    one = LAGGED[3]
    assert one.consumers == 1
    assert _lag_edit(one, _drop(Kind.MBAR_WAIT, Mbar.DS_EMPTY)) == ()
    assert _lag_edit(one, _empty_before_its_wait) == ()


def test_the_lagged_plan_has_no_meeting():
    """`dq_lag on`: no named barrier at all (the meeting's kBarDS replaced by the hand-over),
    and every hand-over sync of the loop's dQ acts for the previous m-block."""
    for params in (p for p in PARAMS if p.dq_lag):
        items = protocol(params).consumer
        assert not any(x.kind in (Kind.NAMED_BAR_SYNC, Kind.NAMED_BAR_ARRIVE) for x in items)
        for x in items:
            if x.mbar is Mbar.DS_FULL and x.kind is Kind.MBAR_WAIT or x.mbar is Mbar.DS_EMPTY:
                lagged = x.kind is Kind.MBAR_ARRIVE or x.phase is not LoopPhase.LOOP
                assert x.guard is (
                    Guard.LAGGED if lagged or x.mbar is Mbar.DS_FULL else Guard.REUSED
                )


@pytest.mark.parametrize(
    "params", [p for p in persistent_space() if p.dq_lag], ids=lambda p: p.describe()
)
def test_the_persistent_lag_needs_the_last_empty_arrival(params):
    """`scheduler persistent`: the last dQ's ds_empty arrival after the loop is needed, as
    the next tile's stores wait on it (in a CTA of one tile it is not: LAG_LAST_EMPTY)."""
    items = list(protocol(params).consumer)
    n = max(n for n, x in enumerate(items) if x.mbar is Mbar.DS_EMPTY)
    assert items[n].phase is LoopPhase.AFTER
    problems = _lag_edit(params, lambda its: its.pop(n))
    assert any("ds_empty" in p for p in problems), problems


LAG_EDITS = [
    ("no ds_empty wait", "    if (run_i >= 2) mbar_wait_parity(bwd_bar_ds_empty<Cfg>(smem, buf), static_cast<uint32_t>(run_i / 2 - 1) & 1u);\n", ""),
    ("ds_empty from the first use", "if (run_i >= 2) mbar_wait_parity", "mbar_wait_parity"),
    ("ds_empty's parity", "static_cast<uint32_t>(run_i / 2 - 1) & 1u", "static_cast<uint32_t>(run_i / 2) & 1u"),
    ("ds_full's parity", "static_cast<uint32_t>(prev / 2) & 1u", "static_cast<uint32_t>(prev / 2 - 1) & 1u"),
    ("no fence", "    fence_proxy_async_smem();\n    mbar_arrive(bwd_bar_ds_full", "    mbar_arrive(bwd_bar_ds_full"),
    ("no ds_full wait", "      mbar_wait_parity(bwd_bar_ds_full<Cfg>(smem, prev % 2), static_cast<uint32_t>(prev / 2) & 1u);\n", ""),
    ("this buffer, not the previous", "(smem, prev % 2), static_cast", "(smem, buf), static_cast"),
    ("ds_empty before the wait_group", "      wgmma_wait<1>();  // dQ(i - 1) in registers, and dV(i) issued before it (the newest group still runs)\n      fence_regs(dq);\n      mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, prev % 2));", "      mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, prev % 2));\n      wgmma_wait<1>();\n      fence_regs(dq);"),
    ("dQ's wait_group 2", "wgmma_wait<1>();  // dQ(i - 1) in registers", "wgmma_wait<2>();  // dQ(i - 1) in registers"),
    ("no last dQ", "    issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (last % 2) * Cfg::kDSBytes, wg);\n", ""),
    ("the last dQ's wait_group 1", "    wgmma_wait<0>();  // the last dQ", "    wgmma_wait<1>();  // the last dQ"),
    ("no last ds_empty", "    mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, last % 2));", ""),
    ("dQ of this m-block's buffer", "(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes", "(dq, smem, ds_buf"),
    # `dq_first on`'s lines
    ("dq_first: dV and dK apart", "        issue_grad_kv<Cfg>(dv, p16, do_slot);\n      }\n      issue_grad_kv<Cfg>(dk, ds16, q_slot);\n      wgmma_commit();\n      wgmma_wait<1>();", "        issue_grad_kv<Cfg>(dv, p16, do_slot);\n        wgmma_commit();\n      }\n      issue_grad_kv<Cfg>(dk, ds16, q_slot);\n      wgmma_commit();\n      wgmma_wait<1>();"),
    ("dq_first: no fence in m-block 0", "    } else {\n      if constexpr (Cfg::kDqFirst) {\n        wgmma_fence();", "    } else {\n      if constexpr (Cfg::kDqFirst) {"),
    ("dq_first: the fence after dQ", "      if constexpr (Cfg::kDqFirst) {\n        wgmma_fence();  // dv and its A registers p16, dk and ds16, dq written by ordinary instructions\n      }\n      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);", "      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);\n      if constexpr (Cfg::kDqFirst) {\n        wgmma_fence();\n      }"),
    ("dq_first: dV before dQ", "      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);\n      FADSL_BWD_MARK(wg, i, 6);\n      if constexpr (Cfg::kDqFirst) {  // dV(i) after dQ(i - 1), in dK(i)'s group\n        issue_grad_kv<Cfg>(dv, p16, do_slot);\n      }", "      if constexpr (Cfg::kDqFirst) {\n        issue_grad_kv<Cfg>(dv, p16, do_slot);\n      }\n      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);\n      FADSL_BWD_MARK(wg, i, 6);"),
]  # fmt: skip


def _nth_replaced(text: str, old: str, new: str, n: int) -> str:
    """``text`` with the n-th occurrence of ``old`` (from 0) replaced by ``new``."""
    at = -1
    for _ in range(n + 1):
        at = text.index(old, at + 1)
    return text[:at] + new + text[at + len(old) :]


@pytest.mark.parametrize("what,old,new", LAG_EDITS, ids=[e[0] for e in LAG_EDITS])
def test_an_edited_lag_header_is_caught(what, old, new):
    """`dq_lag on`: each of bwd_consumer_lagged's hand-over calls taken out, moved or changed
    (in each order's branch, `dq_first` on or off, where both spell it) makes its calls
    differ from the proven plan's."""
    count = LAG_HEADER.count(old)
    assert count in (1, 2), what
    for n in range(count):
        edited = _nth_replaced(LAG_HEADER, old, new, n)
        found = [
            header_calls(WarpRole.CONSUMER, params, lag_header=edited)
            != expected_calls(protocol(params), WarpRole.CONSUMER)
            for params in LAGGED
        ]
        assert any(found), f"{what} (occurrence {n}): the edited header still matches the protocol"


def test_an_edited_lag_template_is_caught():
    """The template's dS^T barrier inits: both per buffer, every consumer thread, and the
    lagged consumer called with `dq_lag on`."""
    for old, new in (
        ("      mbar_init(bwd_bar_ds_empty<Cfg>(smem, buf), Cfg::kConsumerThreads);", ""),
        ("mbar_init(bwd_bar_ds_full<Cfg>(smem, buf), Cfg::kConsumerThreads)", "mbar_init(bwd_bar_ds_full<Cfg>(smem, buf), 128)"),
    ):  # fmt: skip
        assert TEMPLATE.count(old) == 1
        edited = TEMPLATE.replace(old, new)
        assert header_calls(WarpRole.SETUP, LAG, template=edited) != expected_calls(
            protocol(LAG), WarpRole.SETUP
        )
    assert consumer_function(True, dq_lag=True) == "bwd_consumer_lagged"


LAG_SMALL = LAGGED[3]  # one consumer warpgroup, one stage: the brute force's lagged plan


LAG_SMALL_FIRST = replace(LAG_SMALL, dq_first=True)  # (`dq_first on`'s order)


@pytest.mark.parametrize(
    "params,m_count",
    [(LAG_SMALL, 1), (LAG_SMALL, 2), (LAG, 1), (LAG_SMALL_FIRST, 2)],
    ids=str,
)
def test_bruteforce_agrees_on_the_lag(params, m_count):
    """`dq_lag on`: the brute force also takes the warpgroup's ds_full hand-over (every
    thread's arrival after its part of dS^T, then their wait for that phase) as ordering the
    store before dQ's wgmma, as a bar.sync would. LAG's two warpgroups of two m-blocks pass
    the brute force's state limit (400,000 states, about 35 s to give up)."""
    assert explore(build_program(protocol(params), m_count), all_kinds=True) == set()


def _fence_after_the_arrival(items: list) -> None:
    n = _at(items, Kind.FENCE_PROXY_ASYNC_SMEM)
    assert items[n + 1].kind is Kind.MBAR_ARRIVE and items[n + 1].mbar is Mbar.DS_FULL
    items[n], items[n + 1] = items[n + 1], items[n]


BRUTE_LAG_BREAKS = {  # what the brute force finds with one consumer warpgroup, two m-blocks
    "no ds_empty wait": set(),  # test_one_lagged_consumer_needs_no_empty_wait
    "no ds_full wait": {"race"},
    "ds_full's parity flipped": {"hang"},
    "ds_empty before dQ's wait_group": set(),
    "no proxy fence": {"proxy race"},
    "ds_full before the store": {"race"},
    "fence after ds_full's arrival": {"proxy race"},
}


@pytest.mark.parametrize(
    "what,edit",
    [b[:2] for b in LAG_BREAKS] + [("fence after ds_full's arrival", _fence_after_the_arrival)],
    ids=[b[0] for b in LAG_BREAKS] + ["fence after ds_full's arrival"],
)
def test_bruteforce_agrees_on_a_broken_lag_plan(what, edit):
    """The lag's hand-over broken (its wait dropped, its arrival before the store or before
    the fence, ...): the brute force finds the race (or hang) exactly when the proof refuses."""
    items = list(protocol(LAG_SMALL).consumer)
    edit(items)
    program = build_program(protocol(LAG_SMALL).with_role(WarpRole.CONSUMER, tuple(items)), 2)
    found = explore(program, all_kinds=True)
    assert found == BRUTE_LAG_BREAKS[what], (what, found)
    assert bool(found) == bool(check(program)), (what, found, check(program))


def _moved_wait(parity: int | None):
    """The one-m-block lag program with wg0's ds_full wait dropped (``parity`` None) or moved
    just before its arrival, waiting with ``parity``."""
    program = build_program(protocol(LAG_SMALL), 1)
    (agent,) = [a for a in program.agents if a.threads > 1]
    events = list(agent.events)
    (wait,) = [e for e in events if isinstance(e, Wait) and e.barrier == "ds_full[0]"]
    events.remove(wait)
    if parity is not None:
        arrive = next(n for n, e in enumerate(events) if getattr(e, "barrier", "") == "ds_full[0]")
        events.insert(arrive, replace(wait, parity=parity))
    agents = tuple(replace(a, events=tuple(events)) if a is agent else a for a in program.agents)
    return replace(program, agents=agents)


@pytest.mark.parametrize(
    "parity,kind",
    [(None, "race"), (0, "hang"), (1, "race")],
    ids=["no wait", "wait before the arrival", "wait for the phase before"],
)
def test_bruteforce_needs_the_wait_for_the_arrivals_phase(parity, kind):
    """One m-block: without ds_full's wait the store and dQ's wgmma race; the wait moved
    before the arrival hangs (wg0 is its only arriver), or with the other parity returns at
    once, for no phase wg0 arrived on, and orders nothing. The proof agrees."""
    program = _moved_wait(parity)
    assert explore(program, all_kinds=True) == {kind}
    problems = check(program)
    assert problems and (kind == "hang") == any(p.startswith("hang") for p in problems), problems
