"""The backward sync plan's cases and mutation helpers, shared by tests/test_verify_backward.py
(the plan proven, each broken variant refused), test_verify_backward_header.py (the header
makes the plan's calls) and test_verify_backward_lag.py (`dq_lag on`, the brute force)."""

from __future__ import annotations

from dataclasses import replace


from fadsl.targets.sm90.backward.program import (
    Index,
    Item,
    StagedTile,
    Params,
    Protocol,
    WarpRole,
)
from fadsl.targets.sm90.backward.verify import (
    check_protocol,
)

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
# `dq_lag on` with `dq_writer on`: the lagged staging handed to the writer warps, in either mode
STAGED_LAG = dict(dq_red=False, dq_writer=True)
LAGGED_WRITERS = (
    replace(LAG, **STAGED_LAG),
    replace(LAG, stages=3, block_m=80, deterministic=True, **STAGED_LAG),  # dQ transposed
    # head_dim 64's deterministic block: by queries, stmatrix, dq_first (dK and dV by TMA:
    # tests/test_backward_dkv_tma.py)
    replace(
        LAG, head_dim=64, block_m=128, ds_stmatrix=True, dq_first=True, deterministic=True,
        **STAGED_LAG,
    ),
    Params(1, 2, 64, deterministic=True, overlap=True, dq_lag=True, **STAGED_LAG),
)  # fmt: skip
MUTATED += LAGGED_WRITERS
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


def single_ds_buffer(proto: Protocol, tile: StagedTile = StagedTile.DS) -> Protocol:
    """dS^T (or ``tile``) always in buffer 0 (no i % 2)."""
    fix = lambda op: replace(op, index=Index.NONE) if op.buffer is tile else op  # noqa
    items = tuple(
        replace(x, reads=tuple(map(fix, x.reads)), writes=tuple(map(fix, x.writes)))
        for x in proto.consumer
    )
    assert items != proto.consumer
    return proto.with_role(WarpRole.CONSUMER, items)
