"""The backward template's slots (emit/sm90/backward.cu.j2), from the kernel's backward block
and its SMEM plan."""

from __future__ import annotations

from typing import Any

from ....ir import Dtype, Kernel, Mask
from ....ir.backward import Backward
from ..modifiers import backward_context as modifier_context
from .plan_smem import (
    do_stages,
    dq_by_keys,
    dq_by_queries,
    dq_transposed,
    plan_smem,
    split_head_dim,
)

TEMPLATE = "sm90/backward.cu.j2"
# A plan buffer -> the header's offset constant (BwdConfig)
_OFFSETS = {
    "K": "kOffK",
    "V": "kOffV",
    "Q": "kOffQ",
    "dO": "kOffDO",
    "P": "kOffP",
    "dS": "kOffDS",
    "dQ": "kOffDQ",
    "LSE": "kOffLSE",
    "D": "kOffD",
    "mbarriers": "kOffBar",
}
# launch slack: the kernel aligns its SMEM base up to 1024 bytes
BASE_ALIGN_SLACK = 1024

AUX_THREADS = 256  # the preprocess's and convert_dq's threads per CTA


def prep_rows_per_cta(head_dim: int) -> int:
    """The preprocess's query rows per CTA: 8 elements of a row per thread
    (sm90_bwd_prep.cuh's bwd_preprocess_row)."""
    return AUX_THREADS * 8 // head_dim


def convert_ctas(m_blocks: int, block_m: int) -> int:
    """convert_dq's CTAs per (head, batch): 16 query rows each, a warp per pair of rows 8
    apart (sm90_bwd_prep.cuh's bwd_convert_dq_row)."""
    return m_blocks * block_m // 16


# The header and the roles' functions: the consumers split the keys (sm90_bwd.cuh), or at
# head_dim 256 head_dim (sm90_bwd_split.cuh)
HEADER, PRODUCER, CONSUMER = "sm90_bwd.cuh", "bwd_producer", "bwd_consumer"
LAGGED_CONSUMER = "bwd_consumer_lagged"  # `dq_lag on` (sm90_bwd_lag.cuh)
SPLIT_HEADER = "sm90_bwd_split.cuh"
SPLIT_PRODUCER, SPLIT_CONSUMER = "bwd_producer_split", "bwd_consumer_split"


def dq_split(bwd: Backward, head_dim: int) -> str:
    """How the consumer warpgroups share dQ = dS K (sm90_bwd.cuh's kDqByKeys)."""
    if split_head_dim(head_dim):
        return (
            f"transposed (dQ^T by head_dim panels, 2 of 64 columns each, one at a time, all "
            f"{bwd.block_m} queries, over all {bwd.block_n} keys)"
        )
    if dq_by_queries(bwd):
        return f"by queries (64 each, all head_dim columns, over all {bwd.block_n} keys)"
    if dq_transposed(bwd):
        return f"transposed (dQ^T by head_dim panels, 64 each, all {bwd.block_m} queries, over all {bwd.block_n} keys)"
    if dq_by_keys(bwd, head_dim):
        return "by keys (all head_dim columns over each warpgroup's own 64 keys)"
    share = head_dim // bwd.consumers
    return f"by head_dim panels ({share} columns each, over all {bwd.block_n} keys)"


def dq_semaphores(bwd: Backward, head_dim: int) -> int:
    """`deterministic on`'s ticket counters per m-block (sm90_bwd.cuh's kDqSemaphores): one
    per warpgroup share of dQ where the shares are disjoint, one where each warpgroup adds
    into all of it (by keys)."""
    return 1 if dq_by_keys(bwd, head_dim) else bwd.consumers


def dq_counters(bwd: Backward, head_dim: int) -> int:
    """The workspace's ints per m-block: `dq_chains N` gives each chain its kDqSemaphores
    counters (sm90_bwd_dq_reduce.cuh's bwd_dq_counters)."""
    return dq_semaphores(bwd, head_dim) * bwd.dq_chains


# `fused_convert on`: the main kernel's CTAs convert dQ (sm90_bwd_convert.cuh) for calls of at
# most this many queries; past it the host launches convert_dq as without the knob. The CTA
# that completes a (batch, head)'s m-blocks converts them alone: about 768 bytes per query at
# head_dim 128 through one SM (some 200 GB/s), so the grid's last wave ends that much later,
# against the 50-60 us of convert_dq at 16k tokens, hidden 2048 (research/backward-fused-convert.md).
# Measured on an H200 (2026-12-01, docs/backward.md): the knob loses at every length (0.75-1.01x
# its unfused twin), so no example ships it and the bound was not tuned further.
FUSED_CONVERT_MAX_QUERIES = 4096


def smem_bytes(bwd: Backward, head_dim: int) -> int:
    return plan_smem(bwd, head_dim).total + BASE_ALIGN_SLACK


def context(kernel: Kernel, dtype: Dtype) -> dict[str, Any]:
    bwd = kernel.backward
    cfg = kernel.config
    plan = plan_smem(bwd, cfg.head_dim)
    split = split_head_dim(cfg.head_dim)
    # `score` and `keep` (issue 41): the SpecModifiers struct's slots; a score that is the
    # built-in softcap written out compiles as `softcap N`
    modifiers = modifier_context(cfg)
    return {
        "header": SPLIT_HEADER if split else HEADER,
        "producer": SPLIT_PRODUCER if split else PRODUCER,
        "consumer": SPLIT_CONSUMER if split else LAGGED_CONSUMER if bwd.dq_lag else CONSUMER,
        "split": split,
        "do_stages": do_stages(bwd, cfg.head_dim),
        "cuda_type": dtype.cuda_type,
        "head_dim": cfg.head_dim,
        "block_m": bwd.block_m,
        "block_n": bwd.block_n,
        "consumers": bwd.consumers,
        "stages": bwd.stages,
        "deterministic": bwd.deterministic,
        "overlap": bwd.overlap,
        "early_dv": bwd.early_dv,
        "dv_before_meeting": bwd.dv_before_meeting,
        "dq_lag": bwd.dq_lag,
        "dq_first": bwd.dq_first,
        "fused_convert": bwd.fused_convert,
        "fused_convert_max_queries": FUSED_CONVERT_MAX_QUERIES,
        "longest_first": bwd.longest_first,
        "persistent": bwd.persistent,
        "varlen": cfg.features.varlen,
        "dq_red": bwd.dq_red,
        "dq_writer": bwd.dq_writer,
        "dq_chains": bwd.dq_chains,
        "ds_stmatrix": bwd.ds_stmatrix,
        "dkv_tma": bwd.dkv_tma,
        "prefetch_kv": bwd.prefetch_kv,
        "dv_out_first": bwd.dv_out_first,
        "peel_dead": bwd.peel_dead,
        "late_v": bwd.late_v,
        "causal": cfg.mask is Mask.CAUSAL,
        "mask": cfg.mask_text,  # the mask line's value, window included
        # the forward's sliding window and softcap: compile-time constants of the Cfg
        "window": cfg.window,
        "softcap": cfg.features.softcap or modifiers["modifier_softcap"],
        **modifiers,
        # a keep that reads inputs per token: its tiles classed by <kernel>_keep_classes
        "keep_classes": (modifiers["keep"] or {}).get("classes"),
        "threads": bwd.threads,
        "producer_regs": bwd.producer_regs,
        "consumer_regs": bwd.consumer_regs,
        "dq_split": dq_split(bwd, cfg.head_dim),
        # sm90_bwd_prep.cuh's bwd_convert_dq_t (transposed) or bwd_convert_dq_row
        "convert_layout": (
            "a thread per float4 of each head_dim panel, pairs of columns by shuffle"
            if dq_transposed(bwd) or split
            else "a warp per pair of rows 8 apart"
        ),
        "prep_rows": prep_rows_per_cta(cfg.head_dim),
        "offsets": [(_OFFSETS[b.name], b.offset) for b in plan.buffers],
        "smem_bytes": smem_bytes(bwd, cfg.head_dim),
    }
