"""A `keep` that reads inputs per token (document ids: ``TileRule.by_pass``) on sm_90a:
before each padded forward launch, <kernel>_keep_classes evaluates the predicate at every
score of every (q block, kv block) tile of the call (fadsl/sm90_modifiers.cuh, keep_classes)
and writes each tile's class and each q block's list of kept blocks into two workspaces,
which the kernel reads as the inputs after the spec's (P.inputs[len(inputs)], [len(inputs)
+ 1]). The kernel then visits only the listed blocks (the EMPTY ones between kept ones too
are neither loaded nor run) and masks only PARTIAL ones. ``LAUNCH.before`` (host/launch.py) plans it; the runtime launches it first, with the
attention kernel's params. The backward does the same at its own B_r x B_c, before its main
kernel (backward/host.py; fadsl/sm90_bwd_modifiers.cuh, bwd_keep_classes), with each
n-block's list of kept m-blocks, so that an n-block visits only those (but with `deterministic
on`, whose n-blocks visit every m-block of their range, the EMPTY ones masked)."""

from __future__ import annotations

from ....ir import Kernel
from ....ir.expr import (
    GRID_YZ_LIMIT,
)  # CUDA's grid in y and z: the pass's q blocks and rows of tiles
from ...launch import KernelStep

CLASSES_SUFFIX = "_keep_classes"  # the classing kernel's symbol after the attention kernel's
CLASSES_THREADS = 128  # its CTA (__launch_bounds__(128, 1) in kernel.cu.j2)


def plan_keep_classes(kernel: Kernel, q, k) -> tuple[tuple, KernelStep] | None:
    """The classing kernel of a call of ``kernel`` (None: its keep needs none): the
    workspaces it fills, as the call's inputs after the spec's, and its launch."""
    if not classes_per_call(kernel):
        return None
    config = kernel.config
    hidden, grid = workspaces(config, q, k, config.block_r, config.block_c, queries_on_x=False)
    return hidden, KernelStep(CLASSES_SUFFIX, grid, (CLASSES_THREADS, 1, 1))


def plan_backward_classes(kernel: Kernel, q, k) -> tuple[tuple, tuple] | None:
    """The backward's classing kernel (the same suffix, in the backward's source; None: its
    keep needs none): the workspaces at the backward's B_r x B_c, m-blocks along the grid's x
    and each n-block's list of kept m-blocks, and its grid."""
    if not classes_per_call(kernel):
        return None
    bwd = kernel.backward
    return workspaces(kernel.config, q, k, bwd.block_m, bwd.block_n, queries_on_x=True)


def classes_per_call(kernel: Kernel) -> bool:
    """Whether ``kernel``'s keep reads inputs per token, so each call classes its tiles."""
    m = kernel.config.modifiers
    return m is not None and m.rule is not None and m.rule.by_pass


def workspaces(config, q, k, block_q: int, block_k: int, queries_on_x: bool) -> tuple:
    """A call's class bytes (one per tile of block_q queries x block_k keys) and lists of kept
    blocks along the grid's x (int32: CTAs done, count, the blocks, the last first; zeroed):
    kv blocks per q block, or with ``queries_on_x`` (the backward) m-blocks per n-block; and
    the classing kernel's grid (x, y, rows), for q (batch, seqlen_q, heads, head_dim) and k
    (batch, seqlen_k, ...)."""
    import torch

    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    q_blocks = -(-seqlen_q // block_q)
    kv_blocks = -(-k.shape[1] // block_k)
    rows = batch * (heads if config.modifiers.rule.per_head else 1)
    x, y = (q_blocks, kv_blocks) if queries_on_x else (kv_blocks, q_blocks)
    if y > GRID_YZ_LIMIT:
        what = (
            f"{k.shape[1]} keys are {kv_blocks} blocks of {block_k}"
            if queries_on_x
            else f"{seqlen_q} queries are {q_blocks} blocks of {block_q}"
        )
        raise ValueError(
            f"{'k' if queries_on_x else 'q'}: {what}, and kernel '{config.name}' classes its "
            f"keep's tiles with a CTA per tile, at most {GRID_YZ_LIMIT} "
            f"{'kv' if queries_on_x else 'q'} blocks (CUDA's grid); split the call along the "
            f"{'keys' if queries_on_x else 'queries'}"
        )
    if rows > GRID_YZ_LIMIT:
        raise ValueError(
            f"q: batch {batch} x {heads} heads is {rows} rows of tiles to class (kernel "
            f"'{config.name}''s keep reads h), at most {GRID_YZ_LIMIT} (CUDA's grid); split "
            "the call along the batch"
        )
    classes = torch.empty(rows * q_blocks * kv_blocks, dtype=torch.uint8, device=q.device)
    # each row of tiles' list of kept blocks along x, its count of CTAs done zeroed
    # (fadsl/sm90_modifiers.cuh, keep_kept_list)
    lists = torch.zeros((rows * y, 2 + x), dtype=torch.int32, device=q.device)
    return (classes, lists), (x, y, rows)
