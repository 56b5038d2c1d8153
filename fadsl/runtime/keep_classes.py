"""A `keep` that reads inputs per token (document ids: ``TileRule.by_pass``): before each
forward launch, <kernel>_keep_classes evaluates the predicate at every score of every
(q block, kv block) tile of the call (fadsl/sm90_modifiers.cuh, keep_classes) and writes
each tile's class and each q block's range of kept blocks into two workspaces, which the
kernel reads as the inputs after the spec's (P.inputs[len(inputs)], [len(inputs) + 1]).
The kernel then skips the blocks outside a q block's range and masks only PARTIAL ones."""

from __future__ import annotations

from .arguments import GRID_YZ_LIMIT

CLASSES_SUFFIX = "_keep_classes"  # the classing kernel's symbol after the attention kernel's
CLASSES_THREADS = 128
INT_MAX = 2**31 - 1


def by_pass(config) -> bool:
    """Whether the spec's keep has its tiles classed by a pass each call."""
    m = config.modifiers
    return m is not None and m.rule is not None and m.rule.by_pass


def workspaces(config, q, k) -> tuple:
    """The call's class bytes (one per tile) and q-block ranges (int32 pairs, started at
    (INT_MAX, -1): none kept), and the classing kernel's grid (kv blocks, q blocks, rows),
    for q (batch, seqlen_q, heads, head_dim) and k (batch, seqlen_k, ...)."""
    import torch

    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    q_blocks = -(-seqlen_q // config.block_r)
    kv_blocks = -(-k.shape[1] // config.block_c)
    rows = batch * (heads if config.modifiers.rule.per_head else 1)
    if q_blocks > GRID_YZ_LIMIT:  # (the pass's grid: q blocks along y, rows along z)
        raise ValueError(
            f"q: {seqlen_q} queries are {q_blocks} blocks of {config.block_r}, and kernel "
            f"'{config.name}' classes its keep's tiles with a CTA per tile, at most "
            f"{GRID_YZ_LIMIT} q blocks (CUDA's grid); split the call along the queries"
        )
    if rows > GRID_YZ_LIMIT:
        raise ValueError(
            f"q: batch {batch} x {heads} heads is {rows} rows of tiles to class (kernel "
            f"'{config.name}''s keep reads h), at most {GRID_YZ_LIMIT} (CUDA's grid); split "
            "the call along the batch"
        )
    classes = torch.empty(rows * q_blocks * kv_blocks, dtype=torch.uint8, device=q.device)
    ranges = torch.full((rows * q_blocks, 2), -1, dtype=torch.int32, device=q.device)
    ranges[:, 0] = INT_MAX
    return (classes, ranges), (kv_blocks, q_blocks, rows)
