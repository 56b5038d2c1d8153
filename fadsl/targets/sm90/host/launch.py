"""sm_90a's launch: the persistent tile grid, the split tail's plan, clusters, and
``FwdParamsSm90`` (four TMA descriptors, fadsl/targets/sm90/host/tma.py, then FwdParams and
the scheduler's divisors)."""

from __future__ import annotations

import functools
import struct

from ....ir import Kernel
from ...launch import (
    FWD_PARAMS,
    INPUT_SOURCES,
    AddressSlot,
    Args,
    Launch,
    fwd_pointer_slots,
    pack_fwd_params,
    sm_count,
)
from . import keep_classes
from ..caps import panel_columns
from .fp8 import descale_slots, pack_descales


def cluster_size(kernel: Kernel) -> int:
    """The spec's CTAs per cluster (sm_90a's `cluster N`; 1 without)."""
    hopper = kernel.config.ext
    return 1 if hopper is None else hopper.cluster


# Pairs share K/V traffic, which pays at the power cap over long K/V loops; their fixed
# costs (the cluster barriers, the pair in lockstep) do not shrink with the loop. Measured
# on an H100 (research/performance-history.md, 2026-11-23, `cluster 2`): +1 to +3 % from 32 K/V blocks of 128 keys
# on, level to -2 % at 16, -1 % at 8 and -5 to -10 % on one or two blocks.
PAIR_MIN_KV_BLOCKS = 32


def launch_cluster(kernel: Kernel, seqlen_q: int, seqlen_k: int) -> int:
    """The CTAs per cluster a launch uses: the spec's when a head's query blocks pair up (an
    even count, FlashAttention-3's rule; else a block past seqlen_q would run for nothing)
    and each tile has PAIR_MIN_KV_BLOCKS K/V blocks or more; else 1: the runtime launches the
    spec's cluster-free variant, `<name>_alone` (fadsl/targets/sm90/alone.py)."""
    cluster = cluster_size(kernel)
    blocks = -(-seqlen_q // kernel.config.block_r)
    kv_blocks = -(-seqlen_k // kernel.config.block_c)
    return cluster if blocks % cluster == 0 and kv_blocks >= PAIR_MIN_KV_BLOCKS else 1


TILE_LIMIT = 2**30  # the kernel's int tile indices (steps past the last tile stay below 2^31)


def check_tile_count(tiles: int, what: str) -> None:
    """A launch's tiles (``what`` says which) within the kernel's int indices."""
    if tiles >= TILE_LIMIT:
        raise ValueError(f"q has {tiles} {what}, over {TILE_LIMIT - 1}; split the batch")


def m_blocks(kernel: Kernel, seqlen_q: int, cluster: int = 1) -> int:
    """sm_90a's query blocks per (batch, head), rounded up to a multiple of the launch's CTAs
    per cluster as the kernel's num_m_blocks does (the CTAs of a cluster run consecutive
    tiles, which must be of one head). launch_cluster pairs only an even count, so the
    rounding never adds a block there."""
    blocks = -(-seqlen_q // kernel.config.block_r)
    return -(-blocks // cluster) * cluster


def tile_count(kernel: Kernel, a: Args) -> int:
    """sm_90a's tiles: (q block of B_r rows, head, batch)."""
    batch, seqlen_q, heads_q = a.q.shape[0], a.q.shape[1], a.q.shape[2]
    cluster = launch_cluster(kernel, seqlen_q, a.k.shape[1])
    return m_blocks(kernel, seqlen_q, cluster) * heads_q * batch


def resident_ctas(device_index: int, cluster: int, ctas_per_sm: int = 1) -> int:
    """A persistent grid's CTAs: ``ctas_per_sm`` per SM (the spec's `ctas_per_sm`), whole
    clusters only. (An H100 or H200 runs 66 clusters of 2 at once, every SM:
    tests/test_gpu_sm90.py checks it with cuOccupancyMaxActiveClusters.)"""
    return sm_count(device_index) * ctas_per_sm // cluster * cluster


def grid_ctas(kernel: Kernel, device_index: int) -> int:
    """A persistent grid's CTAs without clusters, `ctas_per_sm` an SM: the varlen and KV-cache
    grids' bound, and what a `tail split_kv` plan deals its last round over (split_kv and
    `cluster 2` do not combine: validate.py), so that the whole rounds before it are whole
    rounds of the grid (sm90_tiles.cuh)."""
    return sm_count(device_index) * kernel.config.ext.ctas_per_sm


def tile_grid(kernel: Kernel, a: Args) -> tuple[int, int, int]:
    """sm_90a: a 1-D grid over the tiles (q block, head, batch), which the kernel's
    TileScheduler deals out: `ctas_per_sm` CTAs per SM at most (``scheduler persistent``),
    or one CTA per tile (``scheduler grid``)."""
    tiles = tile_count(kernel, a)
    check_tile_count(tiles, f"tiles of {kernel.config.block_r} rows x heads x batch")
    hopper = kernel.config.ext
    if hopper is not None and hopper.split_kv:
        start, splits = split_plan(tiles, grid_ctas(kernel, a.q.device.index), kv_blocks(kernel, a))
        tiles = start + (tiles - start) * splits  # work items: whole tiles, then pieces
    if hopper is not None and hopper.persistent:
        cluster = launch_cluster(kernel, a.q.shape[1], a.k.shape[1])
        tiles = min(tiles, resident_ctas(a.q.device.index, cluster, hopper.ctas_per_sm))
    return (tiles, 1, 1)


# tail split_kv: a piece's cost beyond its K/V blocks (its prologue, epilogue and hand-over),
# in blocks' time: an estimate, which only weighs more pieces against fewer.
SPLIT_FIXED_BLOCKS = 2
MAX_SPLITS = 8


def kv_blocks(kernel: Kernel, a: Args) -> int:
    """The K/V blocks of a (non-causal) tile."""
    return -(-a.k.shape[1] // kernel.config.block_c)


def split_plan(tiles: int, ctas: int, blocks: int) -> tuple[int, int]:
    """(split_start, splits) for ``tail split_kv``: the whole rounds of tiles stay whole;
    the last, part-full round's tiles are split into the number of pieces of their
    ``blocks`` K/V blocks that finishes that round soonest (pieces dealt out over the
    ``ctas`` as the kernel's scheduler does, each costing its blocks plus
    SPLIT_FIXED_BLOCKS); (tiles, 1) when nothing is gained."""
    full = tiles // ctas * ctas
    rest = tiles - full
    best_cost, best = 1.0, 1  # the last round's time, in whole tiles' time
    if rest and blocks >= 2:
        for splits in range(2, min(MAX_SPLITS, blocks) + 1):
            rounds = -(-rest * splits // ctas)
            cost = rounds * (blocks / splits + SPLIT_FIXED_BLOCKS) / (blocks + SPLIT_FIXED_BLOCKS)
            if cost < best_cost - 1e-9:
                best_cost, best = cost, splits
    return (full, best) if best > 1 else (tiles, 1)


# FwdParamsSm90 (emit/sm90/include/fadsl/sm90.cuh): the Q, K, V and O tensor maps (128
# bytes each, 128-byte aligned), then FwdParams at 512, the split and scheduler fields, the
# varlen fields, the kv-cache fields, the modifiers' 8 input pointers; 896 bytes in all
# (the maps' 128-byte alignment rounds 864 up).
# tests/test_params.py checks these against the C++ struct.
TENSOR_MAP_BYTES = 128
SM90_BASE_OFFSET = 4 * TENSOR_MAP_BYTES
SM90_PARAMS_BYTES = 896
# FwdParamsSm90's tail after FwdParams (tail split_kv): split_partials, split_counts,
# split_start, splits; zeros for every other kernel.
SPLIT_TAIL = struct.Struct("<QQii")
SPLIT_TAIL_FIELDS = ("split_partials", "split_counts", "split_start", "splits")
_NO_SPLIT = SPLIT_TAIL.pack(0, 0, 0, 0)
# Then the scheduler's divisors as FastDiv (mul, shift) pairs: fast_div.
DIVISORS = struct.Struct("<8I")
DIVISOR_FIELDS = ("div_m_blocks", "div_heads", "div_group", "div_splits")
_SPLITS_DIVISOR = struct.Struct("<2I")  # the last pair, div_splits
# Then `varlen on`'s pointers (fadsl/sm90_varlen.cuh); zeros for a padded batch's kernels.
VARLEN_TAIL = struct.Struct("<QQQQ")
VARLEN_TAIL_FIELDS = ("cu_seqlens_q", "cu_seqlens_k", "varlen_tiles", "varlen_tile_count")
_NO_VARLEN = VARLEN_TAIL.pack(0, 0, 0, 0)
SPLIT_OFFSET = SM90_BASE_OFFSET + FWD_PARAMS.size  # where the split fields start
VARLEN_OFFSET = SPLIT_OFFSET + SPLIT_TAIL.size + DIVISORS.size
_SM90_PAD = bytes(SM90_PARAMS_BYTES - VARLEN_OFFSET - VARLEN_TAIL.size)
# Then the kv-cache fields (host/kvcache.py's KVCACHE_TAIL, 24 bytes), and the score and mask
# modifiers' input pointers (issue 41), in declared order, zeros past the spec's.
INPUTS = struct.Struct("<8Q")
INPUTS_OFFSET = VARLEN_OFFSET + VARLEN_TAIL.size + struct.calcsize("<QQii")
# The kernels move tiles as 64-column panels (128-byte rows, the 128-byte swizzle's span;
# 8-bit Q, K, V: caps.panel_columns), and each consumer warpgroup stores its own 64
# rows of O.
PANEL_COLS = 64
O_BOX_ROWS = 64


@functools.cache
def fast_div(d: int) -> tuple[int, int]:
    """(mul, shift) with n // d == (n * mul) >> shift for every 0 <= n < 2**31 (d >= 1), the
    kernel's FastDiv: shift = 31 + ceil(log2 d), mul = ceil(2**shift / d) < 2**32
    (Granlund and Montgomery's multiplier for 31-bit dividends)."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor {d} out of range")
    shift = 31 + (d - 1).bit_length()
    return -(-(1 << shift) // d), shift


def _divisors(kernel: Kernel, a: Args) -> bytes:
    """FwdParamsSm90's FastDiv fields for this launch's shapes (one piece per tile: a split
    launch puts its own split count's, pack_fwd_params_sm90)."""
    seqlen_q, heads_q, heads_kv = a.q.shape[1], a.q.shape[2], a.k.shape[2]
    cluster = launch_cluster(kernel, seqlen_q, a.k.shape[1])
    return DIVISORS.pack(
        *fast_div(max(m_blocks(kernel, seqlen_q, cluster), 1)),
        *fast_div(heads_q),
        *fast_div(heads_q // heads_kv),
        *fast_div(1),
    )


# Packed FwdParamsSm90 by everything they are made of: a call on tensors seen before (the
# usual case: the caching allocator hands the same blocks back) costs one key and one lookup
# instead of four descriptor lookups and a struct pack (about 3 us less per call). The
# runtime's checks make part of the key redundant (out's shape, k's, v's and out's dtypes);
# it stays, so that no caller can be handed a stale struct.
_SM90_PACKED: dict[tuple, bytes] = {}
_SM90_PACKED_LIMIT = 4096


def pack_fwd_params_sm90(kernel: Kernel, a: Args) -> bytes:
    """FwdParamsSm90: Q's map with B_r-row boxes, K's and V's with B_c-row boxes, O's with
    64-row boxes (one consumer warpgroup's rows), then FwdParams; the modifiers' inputs."""
    packed = _pack_fwd_params_sm90(kernel, a)
    if a.inputs:
        pointers = [t.data_ptr() for t in a.inputs]
        inputs = INPUTS.pack(*pointers, *[0] * (8 - len(pointers)))
        packed = packed[:INPUTS_OFFSET] + inputs + packed[INPUTS_OFFSET + INPUTS.size :]
    # address_slots places an 8-bit kernel's descale pointers after this many bytes
    assert len(packed) == SM90_PARAMS_BYTES, len(packed)
    return packed


def _pack_fwd_params_sm90(kernel: Kernel, a: Args) -> bytes:
    q, k, v, o, lse = a.q, a.k, a.v, a.out, a.lse
    cfg = kernel.config
    key = (
        cfg.block_r,
        cfg.block_c,
        q.dtype,
        k.dtype,
        v.dtype,
        o.dtype,
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        o.data_ptr(),
        None if lse is None else (lse.data_ptr(), lse.stride()),
        q.shape,
        k.shape,
        o.shape,
        q.stride(),
        k.stride(),
        v.stride(),
        o.stride(),
        a.softmax_scale,
        launch_cluster(kernel, q.shape[1], k.shape[1]),  # the divisors' count is rounded to it
    )
    found = _SM90_PACKED.get(key)
    if found is None:
        from .tma import tensor_map

        # Q, K, V: 64 two-byte columns a panel, or 128 one-byte ones (issue 42; 64 at head_dim 64)
        cols = panel_columns(cfg.head_dim, q.element_size())
        found = b"".join(
            (
                tensor_map(q, cols, cfg.block_r),
                tensor_map(k, cols, cfg.block_c),
                tensor_map(v, cols, cfg.block_c),
                tensor_map(o, PANEL_COLS, O_BOX_ROWS),
                pack_fwd_params(kernel, a),
                _NO_SPLIT,
                _divisors(kernel, a),
                _NO_VARLEN,
                _SM90_PAD,
            )
        )
        if len(_SM90_PACKED) >= _SM90_PACKED_LIMIT:
            _SM90_PACKED.clear()
        _SM90_PACKED[key] = found
    if cfg.ext is not None and cfg.ext.split_kv:
        # the split fields, and the split count's divisor, are this call's (split_tail)
        split, splits = split_tail(kernel, a)
        divisors = SPLIT_OFFSET + SPLIT_TAIL.size
        return b"".join(
            (
                found[:SPLIT_OFFSET],
                split,
                found[divisors : divisors + DIVISORS.size - _SPLITS_DIVISOR.size],
                _SPLITS_DIVISOR.pack(*fast_div(splits)),
                _NO_VARLEN,
                _SM90_PAD,
            )
        )
    return found


def split_tail(kernel: Kernel, a: Args) -> tuple[bytes, int]:
    """FwdParamsSm90's split fields for ``tail split_kv``: this launch's split plan and the
    workspace of q's device and current stream (host/workspace.py); and the split count."""
    from .workspace import split_workspace

    cfg = kernel.config
    tiles = tile_count(kernel, a)
    start, splits = split_plan(tiles, grid_ctas(kernel, a.q.device.index), kv_blocks(kernel, a))
    if splits == 1:
        return SPLIT_TAIL.pack(0, 0, start, 1), 1
    consumers = cfg.ext.consumers
    floats = (tiles - start) * splits * consumers * 128 * (cfg.head_dim // 2 + 4)
    partials, counts = split_workspace(a.q.device, floats, (tiles - start) * consumers)
    return SPLIT_TAIL.pack(partials, counts, start, splits), splits


def check_loaded(kernel: Kernel, registers: int, threads: int) -> None:
    """Refuse a cubin whose launch allocation cannot hold the setmaxnreg split
    (setmaxnreg.inc would wait forever); the spec check assumes ptxas's usual count."""
    from ....errors import BuildError
    from ..caps import registers_asked

    hw = kernel.config.ext
    wanted = registers_asked(hw.producer_regs, hw.consumers, hw.consumer_regs)
    if registers * threads < wanted:
        raise BuildError(
            f"{kernel.config.name}: the cubin launches {threads} threads with {registers} "
            f"registers each ({registers * threads} in all), fewer than its setmaxnreg split "
            f"needs (128 x {hw.producer_regs} + {threads - 128} x {hw.consumer_regs} = {wanted}); "
            "the consumers' setmaxnreg.inc would never return"
        )


def fit_grid(kernel: Kernel, grid: tuple[int, int, int], co_resident: int) -> tuple[int, int, int]:
    """A persistent grid of pairs: no more CTAs than the pairs that run at once (a larger
    grid would run its last CTAs in a second wave)."""
    return (min(grid[0], co_resident), 1, 1) if kernel.config.ext.persistent else grid


def address_slots(kernel: Kernel, a: Args) -> tuple[AddressSlot, ...] | None:
    """The addresses in pack_fwd_params_sm90's struct: the four maps' and FwdParams'
    pointers; None where the tiles are split (the split workspace is the stream's, and a
    capture's own: its address is not the call's)."""
    hopper = kernel.config.ext
    if hopper is not None and hopper.split_kv:
        tiles = tile_count(kernel, a)
        if split_plan(tiles, grid_ctas(kernel, a.q.device.index), kv_blocks(kernel, a))[1] > 1:
            return None
    if a.descales is None:
        slots = _address_slots(a.lse is not None)
        if a.inputs:  # the modifiers' inputs (and a keep's classes): P.inputs' pointers
            slots += tuple(
                AddressSlot(INPUTS_OFFSET + 8 * i, INPUT_SOURCES[i]) for i in range(len(a.inputs))
            )
        return slots
    present = tuple(t is not None for t in a.descales)
    return _address_slots(a.lse is not None) + descale_slots(SM90_PARAMS_BYTES, present)


@functools.cache
def _address_slots(with_lse: bool) -> tuple[AddressSlot, ...]:
    names = ("q", "k", "v", "out")
    return (
        *(AddressSlot(i * TENSOR_MAP_BYTES, name, 0, True) for i, name in enumerate(names)),
        *fwd_pointer_slots(SM90_BASE_OFFSET, (*names, "lse" if with_lse else None)),
    )


LAUNCH = Launch(
    pack=pack_fwd_params_sm90,
    grid=tile_grid,
    kernel_suffix="",
    launch_info=True,
    spec_cluster_of=cluster_size,
    cluster_of=lambda kernel, a: launch_cluster(kernel, a.q.shape[1], a.k.shape[1]),
    check_loaded=check_loaded,
    fit_grid=fit_grid,
    slots=address_slots,
    pack_second=pack_descales,  # an 8-bit kernel's Fp8Descales (host/fp8.py)
    before=keep_classes.plan_keep_classes,  # a keep's tile classes (host/keep_classes.py)
)
