"""Ring attention over packed sequences (varlen): every sequence of the batch sharded over
the ranks in zigzag order, so that each rank holds, packed, two chunks of each sequence
(shard_zigzag_varlen) and the causal work stays balanced per sequence.

q, k, v: (tokens, heads, head_dim) shards with one ``cu_seqlens`` (int32, the shards'
offsets: every rank's are the same, each sequence's length over the ranks). The steps are
ring.py's plan per sequence: step 0 the local causal blocks; from an earlier rank every local
query sees the first chunk of each sequence's keys; from a later rank the second chunk of
each sequence's queries sees all its keys. A chunk set is gathered by an index over the
packed rows (its own cu_seqlens halved), attended by the step's varlen attention, and
merged (merge.py) or added back at those rows.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .merge import merge_into
from .ring import Ring, TravellingGrads, no_lse_gradient, ring_steps


def _lengths(cu) -> list[int]:
    cu = [int(c) for c in (cu.tolist() if isinstance(cu, torch.Tensor) else cu)]
    return [b - a for a, b in zip(cu, cu[1:])]


def shard_zigzag_varlen(x: torch.Tensor, cu_seqlens, rank: int, world: int):
    """Rank ``rank``'s packed zigzag shard of ``x`` (tokens first) whose sequences start at
    ``cu_seqlens``: (shard, its cu_seqlens as an int32 tensor on x's device)."""
    lengths = _lengths(cu_seqlens)
    if any(n % (2 * world) for n in lengths):
        raise ValueError(
            f"cu_seqlens: every sequence's length must be a multiple of 2 x {world} ranks, "
            f"got {lengths}"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is not in 0 .. {world - 1}")
    parts, start = [], 0
    for n in lengths:
        chunks = x[start : start + n].chunk(2 * world, 0)
        parts += [chunks[rank], chunks[2 * world - 1 - rank]]
        start += n
    local = [0]
    for n in lengths:
        local.append(local[-1] + n // world)
    return torch.cat(parts, 0), torch.tensor(local, dtype=torch.int32, device=x.device)


def unshard_zigzag_varlen(shards, cu_seqlens) -> torch.Tensor:
    """The packed whole from every rank's shard (rank order), sequences at ``cu_seqlens``."""
    world = len(shards)
    lengths = _lengths(cu_seqlens)
    out, offset = [], 0
    for n in lengths:
        piece = n // world
        halves = [s[offset : offset + piece].chunk(2, 0) for s in shards]
        out += [halves[r][0] for r in range(world)]
        out += [halves[r][1] for r in reversed(range(world))]
        offset += piece
    return torch.cat(out, 0)


class _Halves:
    """The packed rows of each sequence's first and second local chunk, and their
    cu_seqlens (the local ones halved)."""

    def __init__(self, cu_local: torch.Tensor):
        lengths = _lengths(cu_local)
        starts = cu_local[:-1].tolist()
        device = cu_local.device
        self.cu = (cu_local // 2).to(torch.int32)
        self.max_half = max((n // 2 for n in lengths), default=0)
        self.max_local = max(lengths, default=0)
        self.first = torch.cat(
            [torch.arange(s, s + n // 2) for s, n in zip(starts, lengths)] or [torch.zeros(0)]
        ).to(device=device, dtype=torch.long)
        self.second = torch.cat(
            [torch.arange(s + n // 2, s + n) for s, n in zip(starts, lengths)] or [torch.zeros(0)]
        ).to(device=device, dtype=torch.long)


def _plan(causal, rank, src, halves, cu_local):
    """(query rows, key rows (index tensors or None: all), cu_q, cu_k, max_q, max_k, causal)."""
    if not causal or src == rank:
        return None, None, cu_local, cu_local, halves.max_local, halves.max_local, causal
    if src < rank:
        return None, halves.first, cu_local, halves.cu, halves.max_local, halves.max_half, False
    return halves.second, None, halves.cu, cu_local, halves.max_half, halves.max_local, False


def _take(x, rows):
    return x if rows is None else x.index_select(0, rows)


def ring_forward_varlen(ring: Ring, step, q, k, v, cu, causal, scale):
    halves = _Halves(cu)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for src, kv in ring_steps(ring, (k, v)):
        rows, keys, cu_q, cu_k, max_q, max_k, masked = _plan(causal, ring.rank, src, halves, cu)
        part_out, part_lse = step.forward_varlen(
            _take(q, rows), _take(kv[0], keys), _take(kv[1], keys), cu_q, cu_k, max_q, max_k,
            masked, scale,
        )  # fmt: skip
        if rows is None:
            merge_into(out[None], lse[None], part_out[None], part_lse[None])
        else:
            o, l = out.index_select(0, rows), lse.index_select(1, rows)
            merge_into(o[None], l[None], part_out[None], part_lse[None])
            out.index_copy_(0, rows, o)
            lse.index_copy_(1, rows, l)
    return out.to(q.dtype), lse


def ring_backward_varlen(ring: Ring, step, q, k, v, out, lse, dout, cu, causal, scale):
    halves = _Halves(cu)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads_kv = TravellingGrads(ring, k, v)
    for src, kv in ring_steps(ring, (k, v)):
        rows, keys, cu_q, cu_k, max_q, max_k, masked = _plan(causal, ring.rank, src, halves, cu)
        lse_rows = lse if rows is None else lse.index_select(1, rows)
        grads = step.backward_varlen(
            _take(q, rows), _take(kv[0], keys), _take(kv[1], keys), _take(out, rows),
            lse_rows.contiguous(), _take(dout, rows), cu_q, cu_k, max_q, masked, scale,
        )  # fmt: skip
        dk, dv = grads_kv.current()
        for target, g, at in ((dq, grads[0], rows), (dk, grads[1], keys), (dv, grads[2], keys)):
            if at is None:
                target.add_(g)  # (widened as it is read: no fp32 copy)
            else:
                target.index_add_(0, at, g.float())
        grads_kv.hand_on()
    return (dq.to(q.dtype), *grads_kv.home(k, v))


class RingAttentionVarlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, causal, scale, group, step):
        ring = Ring(group)
        out, lse = ring_forward_varlen(ring, step, q, k, v, cu, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.args = (ring, step, causal, scale)
        return out, lse

    @staticmethod
    @once_differentiable  # (a double backward is not defined: refused, not silently wrong)
    def backward(ctx, dout, dlse):
        no_lse_gradient(dlse, "ring_attention_varlen")
        q, k, v, out, lse, cu = ctx.saved_tensors
        ring, step, causal, scale = ctx.args
        grads = ring_backward_varlen(
            ring, step, q, k, v, out, lse, dout.contiguous(), cu, causal, scale
        )
        return (*grads, None, None, None, None, None)
