"""The configurations and m-block counts the backward's sync plan is proven for (verify.py):
``parameter_space`` (every configuration the header admits), ``persistent_space`` (`scheduler
persistent`'s, verify_tiles.py) and ``m_counts`` (per configuration; verify.py's docstring
says why they cover every count, and for `dq_lag on` ``m_counts`` itself)."""

from __future__ import annotations

from dataclasses import replace
from math import lcm

from .program import BLOCK_M, SPLIT_BLOCK_NS, TRANSPOSED_BLOCK_M, Params
from . import verify_tiles
from .verify_tiles import tile_counts


def m_counts(p: Params) -> tuple[int | tuple[int, ...], ...]:
    """The m-block counts the plan is proven for (verify.py's docstring: why they suffice);
    with `scheduler persistent` sequences of tiles, each tile's m-block count.

    `dq_lag on` (bwd_consumer_lagged): an m-block's end no longer leaves a state that
    depends only on the ring: dQ(i) is issued in m-block i + 1, so m-block i + 1 depends on
    the past through the ring slot's phase ((i / stages) & 1 of slot i % stages), dS^T's
    buffers, each with a full and an empty mbarrier whose phase counts the buffer's uses
    (buffer i % 2, use i / 2: the pair's state repeats every 4 m-blocks), and the one
    m-block of lag (dQ(i) from buffer i % 2, always the m-block before, its registers fresh
    per use and retired within the m-block that issues it: wait_group 1 before its adds,
    wait_group 0 before the m-block ends). A dS^T hazard spans 3 m-blocks (written at i,
    read by dQ(i) in m-block i + 1, written again at i + 2 once empty's phase of i is
    complete), a ring hazard stages m-blocks. The joint phase of the ring and of dS^T's
    barriers repeats every L = lcm(2 stages, 4) m-blocks, so m = 0 .. L + 3 starts a hazard
    at every joint phase with its whole span after it; L + 3 >= 7 also waits on each
    dS^T barrier with both parities when no longer fresh (empty from m-block 2 on, parity 1
    from 4 on; full a third time from 4 on), and the last dQ after the loop (m = 1 .. 4)
    reads either buffer in either parity. m = 0 is the CTA without an m-block: no dQ, no
    hand-over, nothing waited for. With `scheduler persistent` the m-block index and the
    buffers' phases run on over the tiles: tile_counts' first tile of 0 .. 2 stages + 1
    m-blocks starts the second at every ring position and dS^T phase with stages 2 (L = 4),
    and its second tile's 0 .. stages + 2 m-blocks reuse each buffer, the last dQ of each
    tile ending the tile's hand-over (the next tile's first store waits on empty from the
    running index 2 on: ``Guard.REUSED``)."""
    if p.persistent:
        return tile_counts(p)
    if p.dq_lag:
        return tuple(range(0, lcm(2 * p.stages, 4) + 4))
    return tuple(range(0, 2 * p.stages + 3))


def persistent_space() -> tuple[Params, ...]:
    """`scheduler persistent`'s proven configurations (verify_tiles.persistent_space)."""
    return verify_tiles.persistent_space(parameter_space())


def lag_space() -> tuple[Params, ...]:
    """`dq_lag on`'s configurations (knobs.py's _dq_lag: overlap on, dQ by red.add or
    staged for the writer warps, none of early_dv, dv_before_meeting, head_dim 256 or dQ by
    keys, deterministic only with the writer):
    one consumer at head_dim 64 or 128, two at head_dim 128 with B_r 64 (dQ by head_dim
    panels) or 80 (dQ transposed) and at head_dim 64 with B_r 128 (dQ by queries), 1-3
    stages, each with `dq_first` off and on (dQ(i - 1) issued before dV(i)) and with dK and
    dV stored from registers or by TMA through the dead K and V tiles (dV's store after the
    last dQ, or before it: `dv_out_first on`); each also with dQ staged for the writer
    warps, deterministic or not; each 2-stage one whose dS^T keeps the keys as rows also with
    `peel_dead on` (proven with each warpgroup peeled or not); each 2-stage one with dQ by
    red.add, peeled or not, or staged for the writer warps (not deterministic) also with
    `late_v on` (V on its own barrier, loaded in the first m-block). The mask (causal or
    not) changes no call of the plan: the m-block range is the host's, and the masked
    m-blocks run the same steps."""
    shapes = ((1, 64, BLOCK_M), (1, 128, BLOCK_M), (2, 128, BLOCK_M))
    shapes += ((2, 64, 2 * BLOCK_M), (2, 128, TRANSPOSED_BLOCK_M))
    lag = dict(overlap=True, dq_red=True, dq_lag=True)
    # (dkv_tma, dv_out_first): from registers, by TMA after the last dQ, dV's before it
    stores = ((False, False), (True, False), (True, True))
    red = tuple(
        Params(c, stages, d, block_m=m, dq_first=f, dkv_tma=t, dv_out_first=v, **lag)
        for c, d, m in shapes
        for stages in (1, 2, 3)
        for f in (False, True)  # dq_first
        for t, v in stores
    )
    # dQ staged for the writer warps (`dq_writer on`), in either mode (deterministic: 2 or 3
    # stages, BwdConfig's static_assert)
    staged = dict(dq_red=False, dq_writer=True)
    writer = tuple(
        replace(p, deterministic=det, **staged)
        for p in red
        for det in (False, True)
        if p.stages >= 2 or not det
    )
    # `peel_dead on`: the first m-block peeled (dS^T's rows keys: not dQ transposed), each
    # 2-stage one
    peel = tuple(
        replace(p, peel_dead=True) for p in red + writer if p.stages == 2 and not p.dq_transposed
    )
    # `late_v on`: V loaded after the first m-block's slot, with or without the peel
    late = tuple(
        replace(p, late_v=True)
        for p in red + writer + peel
        if p.stages == 2 and not p.deterministic and (p.dq_red or not p.peel_dead)
    )
    return red + writer + peel + late


def parameter_space() -> tuple[Params, ...]:
    """Every configuration the header admits: 1-3 consumer warpgroups, head_dim 64 or 128
    with B_r 64 (dQ split by keys or by panels), and 2 consumers at head_dim 64 with B_r 128
    (dQ split by queries) or at head_dim 128 with B_r 80 (dQ transposed), 1-3 stages,
    deterministic or not (deterministic: 2-3 stages), dQ staged or added from registers, each
    with either of bwd_consumer's orders (the default, or the overlapped one of `overlap on`,
    dV issued with dK, early or before the meeting); and head_dim 256's bwd_consumer_split
    with B_c 80 or 64, 1-3 stages (of the Q ring; dO's has one slot). Each staged one whose
    shares of dQ are disjoint (not split by keys) also with `dq_writer on`, and each with 2
    stages not at B_r 80 with dS stored by stmatrix. And `dq_lag on`'s (``lag_space``)."""
    # (overlap, early_dv, dv_before_meeting)
    orders = ((False, False, False), (True, False, False), (True, True, False), (True, False, True))
    shapes = [(c, d, BLOCK_M) for c in (1, 2, 3) for d in (64, 128)]
    shapes += [(2, 64, 2 * BLOCK_M), (2, 128, TRANSPOSED_BLOCK_M)]
    # (deterministic, dq_red): dQ staged in either mode, or added from registers (not in
    # deterministic mode, whose ordered adds go through the staging)
    adds = ((False, False), (True, False), (False, True))
    keys = tuple(
        Params(
            consumers, stages, head_dim, deterministic, overlap, block_m, early_dv, dq_red, dv_meet
        )
        for overlap, early_dv, dv_meet in orders
        for consumers, head_dim, block_m in shapes
        for stages in (1, 2, 3)
        for deterministic, dq_red in adds
        if stages >= 2 or not deterministic  # BwdConfig's static_assert (the deferred release)
    )
    keys += lag_space()  # `dq_lag on`: the overlapped order, dQ one m-block behind
    # `dq_writer on`: where dQ is staged in shares of their own (not split by keys)
    # (lag_space's own writers are there already)
    keys += tuple(
        replace(p, dq_writer=True) for p in keys if not (p.dq_red or p.dq_by_keys or p.dq_writer)
    )
    # dS by stmatrix (the same step as st.shared's): each 2-stage one that keeps dS^T's keys as rows
    keys += tuple(
        replace(p, ds_stmatrix=True) for p in keys if p.stages == 2 and not p.dq_transposed
    )
    # head_dim 256 (the consumers split head_dim): its one order, dQ from registers
    split = tuple(
        Params(2, stages, 256, block_m=BLOCK_M, dq_red=True, block_n=block_n)
        for block_n in SPLIT_BLOCK_NS
        for stages in (1, 2, 3)
    )
    return keys + split
