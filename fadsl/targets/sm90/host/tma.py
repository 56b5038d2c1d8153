"""TMA descriptors (``CUtensorMap``) for the sm_90a kernels, encoded from torch tensors.

Each (batch, seqlen, heads, head_dim) tensor becomes a 4-D tiled map over (head_dim,
seqlen, heads, batch) with the tensor's own strides, so strided views (a packed qkv) need
no copy. A box is ``box_cols`` columns (one panel of 128-byte rows, the 128-byte swizzle's
span: 64 16-bit elements, 128 8-bit ones; 8-bit head_dim 64's 64 one-byte columns take the
64-byte swizzle) by ``box_rows`` rows of one (head, batch); boxes that reach past seqlen are
zero-filled on load and clipped on store, which is what the kernels' tails rely on.

TMA's rules (cuTensorMapEncodeTiled): the base address 16-byte aligned, every stride but the
innermost a multiple of 16 bytes (below 2^40), the innermost dimension contiguous. The
runtime refuses tensors that break them before anything is encoded (fadsl/runtime/arguments.py).

A descriptor depends only on the tensor's address, dtype, shape and strides and the box, so
encoded descriptors are kept in a small dict: a call on the same tensors (a training step's
buffers, a benchmark's) costs a dict lookup per tensor instead of a driver call.

L2 promotion: maps of tiles that many CTAs read (Q, K, V of the attention kernels, O) ask
the L2 for 256-byte lines (``CU_TENSOR_MAP_L2_PROMOTION_L2_256B``). A KV cache's K and V are
read once, and there the promotion costs bandwidth: on an H200 (2026-12-04,
`research/probes/stream_probe.py --l2 NONE` against `--l2 L2_256B`) TMA boxes of a paged
cache streamed 4.22-4.26 against 3.57-3.90 TB/s at 1 x 131072 keys and 4.59-4.61 against
4.12-4.22 at 128 x 8192 (cuDNN's decode 4.10 and 4.62). So ``streamed=True`` maps (the
kv-cache calls' K and V) encode no promotion.
"""

from __future__ import annotations

import ctypes
import functools

from ....cudadriver import check as _check, driver as _driver

MAP_BYTES = 128
# Entries kept before the dict is emptied (each is a 128-byte descriptor and its key).
CACHE_LIMIT = 4096
_encoded: dict[tuple, bytes] = {}


@functools.cache
def _constants() -> tuple:
    import torch

    driver = _driver()
    types = {
        torch.bfloat16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        torch.float16: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        # FP8 (issue 42): raw bytes to TMA (the kernels convert nothing on load)
        torch.float8_e4m3fn: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
        torch.float8_e5m2: driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    }
    modes = (
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        # NONE fills out-of-bounds elements with zeros (NAN_REQUEST_ZERO_FMA would give NaN)
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    return driver, types, modes, [driver.cuuint32_t(1)] * 4


@functools.cache
def _swizzle(row_bytes: int):
    """The swizzle of boxes whose rows are ``row_bytes`` long: 128 bytes (every 16-bit tile,
    8-bit ones of 128 columns) or 64 (8-bit head_dim 64's Q, K and V)."""
    swizzles = _driver().CUtensorMapSwizzle
    assert row_bytes in (128, 64), row_bytes
    return (
        swizzles.CU_TENSOR_MAP_SWIZZLE_128B
        if row_bytes == 128
        else swizzles.CU_TENSOR_MAP_SWIZZLE_64B
    )


@functools.cache
def _promotion(streamed: bool):
    """The L2 promotion of a map: none for a streamed (read-once) tensor, else 256 bytes."""
    promotions = _driver().CUtensorMapL2promotion
    return (
        promotions.CU_TENSOR_MAP_L2_PROMOTION_NONE
        if streamed
        else promotions.CU_TENSOR_MAP_L2_PROMOTION_L2_256B
    )


@functools.cache
def _box(cols: int, rows: int) -> list:
    u32 = _driver().cuuint32_t
    return [u32(cols), u32(rows), u32(1), u32(1)]


def tma_strides(shape, strides, element_size: int) -> tuple[int, int, int]:
    """The byte strides of (seqlen, heads, batch), TMA's dimensions 1..3. A dimension of size
    1 is never stepped along, so its stride is free: it becomes the row's bytes (a multiple
    of 16) rather than whatever the view carries (a size-1 dimension's stride may be
    anything in PyTorch)."""
    row = shape[3] * element_size
    found = []
    for dim in (1, 2, 0):
        found.append(strides[dim] * element_size if shape[dim] > 1 else row)
    return found[0], found[1], found[2]


def tensor_map(t, box_cols: int, box_rows: int, streamed: bool = False) -> bytes:
    """The 128 bytes of a CUtensorMap over ``t`` (batch, seqlen, heads, head_dim), boxes of
    ``box_cols`` x ``box_rows``; the tensor was checked by the runtime. ``streamed``: each
    element is read once (a KV cache's K and V), so no L2 promotion (the module's note)."""
    shape, strides, ptr = t.shape, t.stride(), t.data_ptr()
    key = (ptr, t.dtype, shape, strides, box_cols, box_rows, streamed)
    found = _encoded.get(key)
    if found is None:
        found = _encode(
            ptr, t.dtype, shape, strides, t.element_size(), box_cols, box_rows, streamed
        )
        if len(_encoded) >= CACHE_LIMIT:
            _encoded.clear()
        _encoded[key] = found
    return found


def ragged_rows_map(t, box_cols: int, box_rows: int) -> bytes:
    """A map over the rows of ``t`` (tokens, heads, head_dim), packed sequences, on which a
    TMA store of ``box_rows`` rows ending at a sequence's end writes no row past it: the
    4-D (head_dim, r < box_rows, heads, anchor) with element (x, r, h, a) at row a + r -
    box_rows, both row dimensions stepping one row. A store at (x, box_rows - n, h, end)
    writes rows end - n .. end - 1 and clips the rest at r = box_rows (fadsl/sm90.cuh,
    store_o_tma). The base lies box_rows rows before the tensor's, where no element is read
    or written."""
    tokens, heads, head_dim = t.shape
    size = t.element_size()
    row, head = t.stride(0) * size, (t.stride(1) * size if heads > 1 else head_dim * size)
    key = ("ragged", t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), box_cols, box_rows)
    found = _encoded.get(key)
    if found is None:
        base = t.data_ptr() - box_rows * row
        dims = (head_dim, box_rows, heads, tokens + 1)
        found = _encode_dims(base, t.dtype, dims, (row, head, row), box_cols, box_rows)
        if len(_encoded) >= CACHE_LIMIT:
            _encoded.clear()
        _encoded[key] = found
    return found


def _encode(ptr, dtype, shape, strides, element_size, box_cols, box_rows, streamed) -> bytes:
    batch, seqlen, heads, head_dim = shape
    dims = (head_dim, seqlen, heads, batch)
    byte_strides = tma_strides(shape, strides, element_size)
    return _encode_dims(ptr, dtype, dims, byte_strides, box_cols, box_rows, streamed=streamed)


def packed_heads_map(t, group: int, box_cols: int, box_rows: int) -> bytes:
    """`pack_gqa on`: a 5-D map over ``t`` (batch, seqlen, heads, head_dim) as (head_dim,
    group, seqlen, heads / group, batch), so that a box of ``box_rows`` rows is box_rows /
    group query rows of the group's query heads, laid out row by row: tile row r is query
    row r / group of query head r % group (fadsl/sm90_kvcache.cuh). Rows past seqlen are
    zero-filled on load and clipped on store."""
    batch, seqlen, heads, head_dim = t.shape
    size = t.element_size()
    key = ("packed", t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), group, box_cols, box_rows)
    found = _encoded.get(key)
    if found is None:
        head = t.stride(2) * size
        seq = t.stride(1) * size if seqlen > 1 else heads * head
        strides = (head, seq, group * head, t.stride(0) * size if batch > 1 else seqlen * seq)
        dims = (head_dim, group, seqlen, heads // group, batch)
        box = (box_cols, group, box_rows // group, 1, 1)
        found = _encode_dims(t.data_ptr(), t.dtype, dims, strides, box_cols, box_rows, box)
        if len(_encoded) >= CACHE_LIMIT:
            _encoded.clear()
        _encoded[key] = found
    return found


def _encode_dims(
    ptr, dtype, dims, byte_strides, box_cols, box_rows, box=None, streamed=False
) -> bytes:
    """A tiled map of ``dims`` (innermost first) with dimensions 1.. ``byte_strides`` apart;
    boxes of ``box_cols`` x ``box_rows`` x 1 x 1 (or ``box``); ``streamed``: tensor_map's."""
    driver, types, (interleave, oob), element_strides = _constants()
    swizzle = _swizzle(box_cols * dtype.itemsize)  # a box's row: the swizzle's span
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    rank = len(dims)
    tmap = _check(
        driver,
        driver.cuTensorMapEncodeTiled(
            types[dtype],
            rank,
            ptr,
            [u64(d) for d in dims],
            [u64(s) for s in byte_strides],
            _box(box_cols, box_rows) if box is None else [u32(b) for b in box],
            [u32(1)] * rank,
            interleave,
            swizzle,
            _promotion(streamed),
            oob,
        ),
        f"encoding a TMA descriptor (cuTensorMapEncodeTiled) for dimensions {tuple(dims)}, "
        f"byte strides {tuple(byte_strides)}, {dtype}",
    )
    return ctypes.string_at(tmap.getPtr(), MAP_BYTES)
