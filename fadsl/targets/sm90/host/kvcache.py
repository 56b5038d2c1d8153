"""The host side of a `kv_cache` launch (fadsl/sm90_kvcache.cuh): FwdParamsSm90 over q, the
cache and its lengths (and page table), the split count, the grid; and the combine kernel's
grid after a split launch.

q is (batch, seqlen_q, heads_q, head_dim). A contiguous cache is (batch, capacity, heads_kv,
head_dim), a paged one (pages, page_size, heads_kv, head_dim) with page_table (batch,
max_pages) int32; cache_seqlens (batch,) int32 says how many keys of each batch's cache
count. With `pack_gqa on`, Q's and O's maps are 5-D (tma.packed_heads_map) and the tiles run
over K/V heads. An 8-bit kernel's Q, K and V maps take 8-bit boxes (caps.panel_columns: 128
one-byte columns, 64 at head_dim 64), O keeps its 16-bit 64-column boxes, and the call's
descales (each (batch, heads_kv): a cache's batch is q's) are the attention kernel's second
parameter (host/fp8.py); the combine kernel reads none (fp8_piece_partial, fadsl/sm90_fp8.cuh).
"""

from __future__ import annotations

import functools
import struct
from typing import Any, NamedTuple

from ....ir import Kernel
from ...launch import (
    AddressSlot,
    Args,
    CallPlan,
    KernelStep,
    Workspace,
    fwd_pointer_slots,
    pack_fwd_params,
    sm_count,
)
from ..caps import panel_columns
from .fp8 import descale_slots, pack_descales
from .launch import (
    DIVISORS,
    O_BOX_ROWS,
    PANEL_COLS,
    SM90_BASE_OFFSET,
    SM90_PARAMS_BYTES,
    SPLIT_OFFSET,
    SPLIT_TAIL,
    TENSOR_MAP_BYTES,
    VARLEN_OFFSET,
    VARLEN_TAIL,
    check_tile_count,
    fast_div,
    grid_ctas,
)

COMBINE_SUFFIX = "_combine"  # the combine kernel's symbol after the attention kernel's
COMBINE_THREADS = 128
# head_dim columns a combine CTA handles: 8 per float4 of a thread's O registers, times
# fadsl/sm90_kvcache.cuh's kCombineVecs (2)
COMBINE_SLICE_COLUMNS = 16
# FwdParamsSm90's kv_cache fields after the varlen ones: cache_seqlens, page_table,
# page_table_stride, num_pages (tests/test_params.py checks them against the C++ struct)
KVCACHE_TAIL = struct.Struct("<QQii")  # (no padding: the struct pads its tail)
KVCACHE_TAIL_FIELDS = ("cache_seqlens", "page_table", "page_table_stride", "num_pages")
KVCACHE_OFFSET = VARLEN_OFFSET + VARLEN_TAIL.size
MAX_SPLITS = 128
# K/V blocks a piece holds at least: its prologue and partial cost about a block or two. A
# block of 256 keys or more (the 8-bit decode example's) is a piece alone: at batch 1 and
# 2k-8k keys, 8-16 pieces of one block each ran 12-21 % faster than 2-4 pieces of four
# (H200, 2026-12-04, the 8-bit decode example, CUDA-graph replays).
MIN_BLOCKS_PER_SPLIT = 4
WIDE_BLOCK = 256
# Tests only: the pieces' workspace filled with NaN before each split call, so that a
# combine reading a partial no piece wrote (a row outside the threads that write,
# sm90_kvcache.cuh's holds_rows) shows in the output rather than reusing stale bytes.
POISON_PARTIALS = False


class KvCacheArgs(NamedTuple):
    """One kv-cache call's tensors, checked by the runtime (fadsl/runtime/kvcache.py)."""

    q: Any
    k_cache: Any
    v_cache: Any
    out: Any
    lse: Any  # float32 (batch, heads_q, seqlen_q), or None
    softmax_scale: float
    cache_seqlens: Any  # int32 (batch,)
    page_table: Any  # int32 (batch, max_pages), or None (contiguous)
    splits: int  # pieces per tile (1: whole tiles)
    partials: Any  # fp32 workspace of the pieces (None with one piece)


def group(a) -> int:
    return a.q.shape[2] // a.k_cache.shape[2]


def capacity(kernel: Kernel, a) -> int:
    """Keys a batch's cache holds: its rows, or its pages' rows."""
    if a.page_table is None:
        return a.k_cache.shape[1]
    return a.page_table.shape[1] * kernel.config.ext.kv_cache


def tiles(kernel: Kernel, a) -> int:
    """(q block, head, batch) tiles; with pack_gqa the rows are seqlen_q x G per K/V head."""
    hw = kernel.config.ext
    batch, seqlen_q, heads_q = a.q.shape[0], a.q.shape[1], a.q.shape[2]
    rows = seqlen_q * group(a) if hw.pack_gqa else seqlen_q
    heads = a.k_cache.shape[2] if hw.pack_gqa else heads_q
    return -(-rows // kernel.config.block_r) * heads * batch


def choose_splits(kernel: Kernel, a, device_index: int, asked: int | None) -> int:
    """Pieces per tile: the call's num_splits, or as many as fill the SMs in one wave where
    the tiles are fewer than the SMs, each of MIN_BLOCKS_PER_SPLIT K/V blocks or more (one
    of WIDE_BLOCK keys or more), over the cache's capacity (the lengths stay on the device).
    1 without `splits auto`. Counted in SMs whatever `ctas_per_sm` says: pieces planned for
    two CTAs an SM ran 4-7 % slower at 1 x 8k and 1 x 128k (H200, 2026-12-04,
    research/probes/decode_two_ctas.py; docs/serving.md)."""
    if not kernel.config.ext.split_all:
        return 1
    blocks = -(-capacity(kernel, a) // kernel.config.block_c)
    if asked:
        return max(1, min(asked, MAX_SPLITS, blocks))
    count = tiles(kernel, a)
    sms = sm_count(device_index)
    if count >= sms:
        return 1
    # as many pieces as fit on the SMs in one wave (one more would run a second wave on a
    # few SMs: 17 x 8 tiles on 132 SMs took twice 16 x 8's time, H200, 2026-11-27)
    per_piece = 1 if kernel.config.block_c >= WIDE_BLOCK else MIN_BLOCKS_PER_SPLIT
    return max(1, min(sms // count, blocks // per_piece, MAX_SPLITS))


def partial_floats(kernel: Kernel, a, splits: int) -> int:
    """The fp32 workspace of a split launch: per piece, warpgroup and thread, O's registers
    and one float4 of m and l."""
    cfg = kernel.config
    return tiles(kernel, a) * splits * cfg.ext.consumers * 128 * (cfg.head_dim // 2 + 4)


def kvcache_grid(kernel: Kernel, a) -> tuple[int, int, int]:
    count = tiles(kernel, a) * a.splits
    check_tile_count(count, "tiles (and pieces)")
    if kernel.config.ext.persistent:  # `ctas_per_sm` CTAs an SM (the pieces: choose_splits)
        count = min(count, grid_ctas(kernel, a.q.device.index))
    return (max(count, 1), 1, 1)


def combine_grid(kernel: Kernel, a) -> tuple[int, int, int]:
    """(split tile x consumer warpgroup, slice of head_dim's columns): combine_pieces."""
    slices = kernel.config.head_dim // COMBINE_SLICE_COLUMNS
    return (tiles(kernel, a) * kernel.config.ext.consumers, slices, 1)


def pack_kvcache_params(kernel: Kernel, a: KvCacheArgs) -> bytes:
    from .tma import packed_heads_map, tensor_map

    cfg = kernel.config
    hw = cfg.ext
    q, k, v, o = a.q, a.k_cache, a.v_cache, a.out
    g = group(a)
    kv_rows = cfg.block_c if a.page_table is None else min(cfg.block_c, hw.kv_cache)
    cols = panel_columns(cfg.head_dim, q.element_size())  # (8-bit: 128 one-byte columns)
    if hw.pack_gqa:
        q_map = packed_heads_map(q, g, cols, cfg.block_r)
        o_map = packed_heads_map(o, g, PANEL_COLS, O_BOX_ROWS)
    else:
        q_map = tensor_map(q, cols, cfg.block_r)
        o_map = tensor_map(o, PANEL_COLS, O_BOX_ROWS)
    base = pack_fwd_params(kernel, Args(q, k, v, o, a.lse, a.softmax_scale))
    # FwdParams' seqlen_k: the capacity, which the kernel clamps cache_seqlens to
    base = base[:-8] + struct.pack("<if", capacity(kernel, a), a.softmax_scale)
    count = tiles(kernel, a)
    rows = q.shape[1] * g if hw.pack_gqa else q.shape[1]
    heads = k.shape[2] if hw.pack_gqa else q.shape[2]
    split = a.splits > 1
    raw = b"".join(
        (
            q_map,
            tensor_map(k, cols, kv_rows, streamed=True),  # read once: no L2 promotion
            tensor_map(v, cols, kv_rows, streamed=True),
            o_map,
            base,
            SPLIT_TAIL.pack(
                a.partials.data_ptr() if split else 0, 0, 0 if split else count, a.splits
            ),
            DIVISORS.pack(
                *fast_div(max(1, -(-rows // cfg.block_r))),
                *fast_div(heads),
                *fast_div(g),
                *fast_div(a.splits),
            ),
            VARLEN_TAIL.pack(0, 0, 0, 0),
            KVCACHE_TAIL.pack(
                a.cache_seqlens.data_ptr(),
                0 if a.page_table is None else a.page_table.data_ptr(),
                0 if a.page_table is None else a.page_table.stride(0),
                0 if a.page_table is None else k.shape[0],
            ),
        )
    )
    assert len(raw) == KVCACHE_OFFSET + KVCACHE_TAIL.size
    return raw + bytes(SM90_PARAMS_BYTES - len(raw))


def kvcache_slots(a: KvCacheArgs) -> tuple[AddressSlot, ...]:
    """Every address in pack_kvcache_params' struct: the Q, K, V and O maps' (Q's and O's
    5-D with pack_gqa: the same base), FwdParams' pointers, the pieces' partials, the
    lengths and the page table."""
    return _kvcache_slots(a.lse is not None, a.splits > 1, a.page_table is not None)


@functools.cache
def _kvcache_slots(with_lse: bool, split: bool, paged: bool) -> tuple[AddressSlot, ...]:
    maps = ("q", "k_cache", "v_cache", "out")
    return (
        *(AddressSlot(i * TENSOR_MAP_BYTES, name, 0, True) for i, name in enumerate(maps)),
        *fwd_pointer_slots(SM90_BASE_OFFSET, (*maps, "lse" if with_lse else None)),
        *((AddressSlot(SPLIT_OFFSET, "partials"),) if split else ()),
        AddressSlot(KVCACHE_OFFSET, "cache_seqlens"),
        *((AddressSlot(KVCACHE_OFFSET + 8, "page_table"),) if paged else ()),
    )


def plan_kvcache(
    kernel: Kernel, q, k_cache, v_cache, seqlens, page_table, out, lse, scale, num_splits,
    descales=None,
) -> CallPlan:  # fmt: skip
    """A kv-cache call's kernels (ServingLaunch.kvcache): attention, then the combine kernel
    when the tiles are split (the pieces' workspace allocated on q's device). ``descales``:
    an 8-bit kernel's three (checked), its second parameter and their slots."""
    import torch

    eight = kernel.config.dtypes[0].is_8bit
    assert (descales is not None) == eight, "an 8-bit kernel takes descales, no other does"
    probe = KvCacheArgs(q, k_cache, v_cache, out, lse, scale, seqlens, page_table, 1, None)
    splits = choose_splits(kernel, probe, q.device.index, num_splits)
    partials, workspaces = None, ()
    if splits > 1:
        floats = partial_floats(kernel, probe, splits)
        partials = torch.empty(floats, dtype=torch.float32, device=q.device)
        if POISON_PARTIALS:
            partials.fill_(float("nan"))
        workspaces = (Workspace("partials", floats, "float32", POISON_PARTIALS),)
    args = probe._replace(splits=splits, partials=partials)
    steps = [KernelStep("", kvcache_grid(kernel, args), (kernel.config.threads, 1, 1))]
    if splits > 1:
        # a programmatic dependent: placed while the pieces run, it waits for them to finish
        # (griddepcontrol.wait in combine_pieces) and so starts without a launch's gap
        block = (COMBINE_THREADS, 1, 1)
        steps.append(KernelStep(COMBINE_SUFFIX, combine_grid(kernel, args), block, True))
    params = pack_kvcache_params(kernel, args)
    slots, second = kvcache_slots(args), None
    if descales is not None:
        second = pack_descales(Args(q, k_cache, v_cache, out, lse, scale, (), descales))
        slots += descale_slots(len(params), tuple(t is not None for t in descales))
    return CallPlan(
        params,
        tuple(steps),
        slots,
        workspaces,
        held=(partials,) if partials is not None else (),
        second=second,
    )
