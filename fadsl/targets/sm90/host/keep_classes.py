"""A `keep` that reads inputs per token (document ids: ``TileRule.by_pass``) on sm_90a:
before each padded forward launch, <kernel>_keep_classes evaluates the predicate at every
score of every (q block, kv block) tile of the call (fadsl/sm90_modifiers.cuh, keep_classes)
and writes each tile's class and each q block's range of kept blocks into two workspaces,
which the kernel reads as the inputs after the spec's (P.inputs[len(inputs)], [len(inputs)
+ 1]). The kernel then skips the blocks outside a q block's range and masks only PARTIAL
ones. ``LAUNCH.before`` (host/launch.py) plans it; the runtime launches it first, with the
attention kernel's params."""

from __future__ import annotations

from ....ir import Kernel
from ...launch import KernelStep

CLASSES_SUFFIX = "_keep_classes"  # the classing kernel's symbol after the attention kernel's
CLASSES_THREADS = 128  # its CTA (__launch_bounds__(128, 1) in kernel.cu.j2)
INT_MAX = 2**31 - 1
GRID_YZ_LIMIT = 65535  # CUDA's grid in y and z: the pass's q blocks and rows of tiles


def plan_keep_classes(kernel: Kernel, q, k) -> tuple[tuple, KernelStep] | None:
    """The classing kernel of a call of ``kernel`` (None: its keep needs none): the
    workspaces it fills, as the call's inputs after the spec's, and its launch."""
    m = kernel.config.modifiers
    if m is None or m.rule is None or not m.rule.by_pass:
        return None
    hidden, grid = workspaces(kernel.config, q, k)
    return hidden, KernelStep(CLASSES_SUFFIX, grid, (CLASSES_THREADS, 1, 1))


def workspaces(config, q, k) -> tuple:
    """The call's class bytes (one per tile) and q-block ranges (int32 pairs, started at
    (INT_MAX, -1): none kept), and the classing kernel's grid (kv blocks, q blocks, rows),
    for q (batch, seqlen_q, heads, head_dim) and k (batch, seqlen_k, ...)."""
    import torch

    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    q_blocks = -(-seqlen_q // config.block_r)
    kv_blocks = -(-k.shape[1] // config.block_c)
    rows = batch * (heads if config.modifiers.rule.per_head else 1)
    if q_blocks > GRID_YZ_LIMIT:
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
