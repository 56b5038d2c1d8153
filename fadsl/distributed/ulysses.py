"""All-to-all context parallelism (DeepSpeed-Ulysses): the sequence gathered, heads split.

Each rank enters with a shard of the sequence for every head, (batch, seqlen / W, heads,
head_dim); one all-to-all gives it the whole sequence for heads / W heads, the attention runs
locally (any mask: each rank holds whole sequences), and one all-to-all takes the output back
to sequence shards. The backward is the same two exchanges reversed around the attention's
own backward. Needs heads_q and heads_kv divisible by W; moves 4 tensors of the shard's size
per call each way (q, k, v, out), whatever the sequence length, where the ring moves K and V
W - 1 times: it wins when heads outnumber ranks and the links are slow (docs/distributed.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single over dim 0 (W equal chunks: chunk j goes to rank j)."""
    x = x.contiguous()  # (a permuted view: empty_like would copy its strides)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(batch, seqlen / W, heads, d) shards -> (batch, seqlen, heads / W, d) in rank order."""
    world = dist.get_world_size(group)
    batch, part, heads, d = x.shape
    chunks = x.reshape(batch, part, world, heads // world, d).permute(2, 0, 1, 3, 4)
    got = _exchange(chunks, group)  # got[i]: rank i's sequence shard of this rank's heads
    return got.permute(1, 0, 2, 3, 4).reshape(batch, world * part, heads // world, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of seq_to_heads."""
    world = dist.get_world_size(group)
    batch, seqlen, part_heads, d = x.shape
    chunks = x.reshape(batch, world, seqlen // world, part_heads, d).permute(1, 0, 2, 3, 4)
    got = _exchange(chunks, group)  # got[i]: this rank's sequence shard of rank i's heads
    return got.permute(1, 2, 0, 3, 4).reshape(batch, seqlen // world, world * part_heads, d)


class _AllToAll(torch.autograd.Function):
    """seq_to_heads (``to_heads``) or heads_to_seq; the gradient of each is the other."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (seq_to_heads if to_heads else heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (heads_to_seq if ctx.to_heads else seq_to_heads)(grad, ctx.group), None, None


def ulysses(attend, q, k, v, group):
    """``attend(q, k, v)`` (autograd-aware, e.g. fadsl.attention) over the whole sequence
    for this rank's heads; returns this rank's sequence shard of the output, all heads."""
    q, k, v = (_AllToAll.apply(t, group, True) for t in (q, k, v))
    return _AllToAll.apply(attend(q, k, v), group, False)
