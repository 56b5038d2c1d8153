"""The host side of a `varlen on` launch (fadsl/sm90_varlen.cuh): FwdParamsSm90 over packed
tensors and the grid of the attention kernel; the tile-list kernel runs first, one CTA.

The tensors are (tokens, heads, head_dim). Q's, K's and V's maps see them as one batch of
``tokens`` rows, so that a tile of a sequence loads at its first row; rows past a sequence's
end are the next sequence's (or TMA's zeros past the tensor), which the mask removes from
S (keys) or which no one stores (queries). O's map is ragged (tma.ragged_rows_map): a store
stops at its sequence's end. The LSE is (heads, tokens). FwdParams' batch is the number of
sequences and its seqlen_q and seqlen_k the tensors' rows, which the tile list checks
cu_seqlens against.

An 8-bit kernel (issue 42) reads Q, K and V through boxes of 128 one-byte columns (64 at
head_dim 64: caps.panel_columns), as a padded 8-bit launch does, and takes the call's descales
as its second parameter (host/fp8.py's Fp8Descales), each (sequences, heads_kv): sequence b's
tiles read row b (fadsl/sm90_fp8.cuh, descale_of). The tile-list kernel has one parameter and
ignores the second.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from ....ir import Kernel
from ...launch import (
    FWD_PARAMS,
    AddressSlot,
    Args,
    CallPlan,
    KernelStep,
    Workspace,
    fwd_pointer_slots,
)
from ..caps import panel_columns
from .fp8 import descale_slots, pack_descales
from .launch import (
    DIVISORS,
    O_BOX_ROWS,
    PANEL_COLS,
    SM90_BASE_OFFSET,
    SM90_PARAMS_BYTES,
    TENSOR_MAP_BYTES,
    SPLIT_TAIL,
    VARLEN_OFFSET,
    VARLEN_TAIL,
    check_tile_count,
    fast_div,
    grid_ctas,
)

TILES_SUFFIX = "_varlen_tiles"  # the tile-list kernel's symbol after the attention kernel's
TILES_THREADS = 1024  # its one CTA (kVarlenTileThreads)
MAX_SEQUENCES = 8192  # kVarlenMaxBatch: the sequences of one launch
SEQUENCE_INTS = 8  # two int4 per listed sequence
COUNT_INTS = 4  # the tile and sequence counts, padded to 16 bytes before the list


class VarlenArgs(NamedTuple):
    """One varlen call's tensors, checked by the runtime (fadsl/runtime/varlen.py)."""

    q: Any  # (tokens_q, heads_q, head_dim)
    k: Any  # (tokens_k, heads_kv, head_dim)
    v: Any
    out: Any  # q's shape
    lse: Any  # float32 (heads_q, tokens_q), or None
    softmax_scale: float
    cu_seqlens_q: Any  # int32 (sequences + 1,)
    cu_seqlens_k: Any
    workspace: Any  # int32: the counts (COUNT_INTS), then the list (workspace_ints)
    # an 8-bit kernel's (q_descale, k_descale, v_descale), each float32 (sequences, heads_kv)
    # or None (= 1); None for a 16-bit kernel
    descales: tuple | None = None


def sequences(a: VarlenArgs) -> int:
    return a.cu_seqlens_q.shape[0] - 1


def max_pairs(kernel: Kernel, tokens_q: int, batch: int) -> int:
    """At most this many (sequence, q block) pairs: a sequence of n rows has cdiv(n, B_r)
    blocks, at most n / B_r + 1, and one of 0 rows has none (so never more than rows)."""
    return min(tokens_q // kernel.config.block_r + batch, tokens_q)


def workspace_ints(batch: int) -> int:
    """The int32s of a call's workspace: the counts, then the list of sequences."""
    return COUNT_INTS + SEQUENCE_INTS * max(1, batch)


def tile_bound(kernel: Kernel, a: VarlenArgs) -> int:
    """At most this many tiles: pairs x heads."""
    return max_pairs(kernel, a.q.shape[0], sequences(a)) * a.q.shape[1]


def varlen_grid(kernel: Kernel, a: VarlenArgs) -> tuple[int, int, int]:
    """The attention kernel's grid: `ctas_per_sm` CTAs per SM at most (persistent), else one
    per tile the list may hold (those past its count return at once)."""
    tiles = max(1, tile_bound(kernel, a))
    check_tile_count(tiles, f"tiles at most of {kernel.config.block_r} rows x heads")
    if kernel.config.ext.persistent:
        tiles = min(tiles, grid_ctas(kernel, a.q.device.index))
    return (tiles, 1, 1)


def pack_varlen_params(kernel: Kernel, a: VarlenArgs) -> bytes:
    """FwdParamsSm90 for a varlen launch: the maps, FwdParams over the packed tensors, no
    split, the divisors (heads and the GQA group), the cu_seqlens and the workspace."""
    from .tma import ragged_rows_map, tensor_map

    cfg = kernel.config
    q, k, v, o, lse = a.q, a.k, a.v, a.out, a.lse
    heads_q, heads_kv = q.shape[1], k.shape[1]
    params = FWD_PARAMS.pack(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        o.data_ptr(),
        0 if lse is None else lse.data_ptr(),
        *(0, q.stride(0), q.stride(1)),
        *(0, k.stride(0), k.stride(1)),
        *(0, v.stride(0), v.stride(1)),
        *(0, o.stride(0), o.stride(1)),
        0,
        0 if lse is None else lse.stride(0),
        sequences(a),
        heads_q,
        heads_kv,
        q.shape[0],
        k.shape[0],
        a.softmax_scale,
    )
    base = a.workspace.data_ptr()
    cols = panel_columns(cfg.head_dim, q.element_size())  # (8-bit: 128 one-byte columns)
    raw = b"".join(
        (
            tensor_map(q.unsqueeze(0), cols, cfg.block_r),
            tensor_map(k.unsqueeze(0), cols, cfg.block_c),
            tensor_map(v.unsqueeze(0), cols, cfg.block_c),
            ragged_rows_map(o, PANEL_COLS, O_BOX_ROWS),
            params,
            SPLIT_TAIL.pack(0, 0, 0, 1),
            DIVISORS.pack(
                *fast_div(1), *fast_div(heads_q), *fast_div(heads_q // heads_kv), *fast_div(1)
            ),
            VARLEN_TAIL.pack(
                a.cu_seqlens_q.data_ptr(),
                a.cu_seqlens_k.data_ptr(),
                base + 4 * COUNT_INTS,  # the list, 16-byte aligned
                base,  # the counts
            ),
        )
    )
    assert len(raw) == VARLEN_OFFSET + VARLEN_TAIL.size
    return raw + bytes(SM90_PARAMS_BYTES - len(raw))


def varlen_slots(a: VarlenArgs) -> tuple[AddressSlot, ...]:
    """Every address in pack_varlen_params' struct: the Q, K and V maps', O's ragged map's
    (based box_rows rows before out), FwdParams' pointers, cu_seqlens and the workspace
    (its list 16 bytes in, after the counts)."""
    before_out = -O_BOX_ROWS * a.out.stride(0) * a.out.element_size()
    return _varlen_slots(a.lse is not None, before_out)


@functools.cache
def _varlen_slots(with_lse: bool, before_out: int) -> tuple[AddressSlot, ...]:
    return (
        *(AddressSlot(i * TENSOR_MAP_BYTES, name, 0, True) for i, name in enumerate("qkv")),
        AddressSlot(3 * TENSOR_MAP_BYTES, "out", before_out, True),
        *fwd_pointer_slots(SM90_BASE_OFFSET, ("q", "k", "v", "out", "lse" if with_lse else None)),
        AddressSlot(VARLEN_OFFSET, "cu_seqlens_q"),
        AddressSlot(VARLEN_OFFSET + 8, "cu_seqlens_k"),
        AddressSlot(VARLEN_OFFSET + 16, "workspace", 4 * COUNT_INTS),
        AddressSlot(VARLEN_OFFSET + 24, "workspace"),
    )


def plan_varlen(
    kernel: Kernel, q, k, v, cu_q, cu_k, out, lse, scale: float, descales=None
) -> CallPlan:
    """A varlen call's kernels (ServingLaunch.varlen): the tile list, then attention; the
    workspace allocated on q's device (stream-ordered, so a CUDA graph captures it);
    ``descales``: an 8-bit kernel's three (checked), its second parameter and their slots."""
    import torch

    if q.shape[0] == 0:  # no query row: nothing to write
        return CallPlan(b"", (), ())
    reusable = True
    if k.shape[0] == 0:  # TMA maps need a row: one of zeros, which cu_seqlens_k (all 0) never reach
        k = v = k.new_zeros((1, *k.shape[1:]))
        reusable = False  # (the plan would point at this call's row)
    batch = cu_q.shape[0] - 1
    ints = workspace_ints(batch)
    workspace = torch.empty(ints, dtype=torch.int32, device=q.device)
    eight = kernel.config.dtypes[0].is_8bit
    assert (descales is not None) == eight, "an 8-bit kernel takes descales, no other does"
    args = VarlenArgs(q, k, v, out, lse, scale, cu_q, cu_k, workspace, descales)
    params = pack_varlen_params(kernel, args)
    slots, second = varlen_slots(args), None
    if descales is not None:
        second = pack_descales(Args(q, k, v, out, lse, scale, (), descales))
        slots += descale_slots(len(params), tuple(t is not None for t in descales))
    steps = (
        KernelStep(TILES_SUFFIX, (1, 1, 1), (TILES_THREADS, 1, 1)),
        KernelStep("", varlen_grid(kernel, args), (kernel.config.threads, 1, 1)),
    )
    return CallPlan(
        params,
        steps,
        slots,
        (Workspace("workspace", ints, "int32"),),
        held=(workspace, k),
        reusable=reusable,
        second=second,
    )
