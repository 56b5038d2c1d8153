"""Ring attention: each rank keeps its query shard, K and V shards pass around the ring.

Step s of W: rank r holds the K/V shard of rank src = (r - s) mod W, attends its queries to
it (ShippedStep or another ``AttentionStep``) and merges the partial output by its LSE
(merge.py); meanwhile the shard moves on to rank r + 1 (``torch.distributed``'s batched
isend/irecv, which NCCL runs on its own stream, under this step's attention). The backward
runs the ring again with the whole call's output and LSE: dQ stays with its rank; each
shard's dK and dV accumulate in fp32 buffers that travel with it, one step behind, and
after W steps arrive back at the shard's owner.

The causal mask needs the queries and keys in global order per shard. ``zigzag`` (rank r
holds chunks r and 2W - 1 - r of 2W, shard_zigzag) gives every rank equal work at every
step: step 0 is the local causal block; at a later step, from an earlier rank (src < r) all
queries see the first chunk of the keys only, from a later rank (src > r) only the second
chunk of the queries sees keys, all of them; either is half a block without a mask.
``contiguous`` (rank r holds chunk r) skips the later ranks' shards: simple, unbalanced.
Without a mask the order does not matter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .merge import merge_into

LAYOUTS = ("zigzag", "contiguous")


class Ring:
    """The ranks of ``group`` in a ring: send to the next, receive from the previous."""

    def __init__(self, group):
        group = group if group is not None else dist.group.WORLD
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)

    def pass_on(self, tensors):
        """Send ``tensors`` to the next rank and receive their like from the previous one;
        returns (received, wait): call wait() before reading the received tensors or
        writing the sent ones."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in received]
        requests = dist.batch_isend_irecv(ops)

        def wait():
            for request in requests:
                request.wait()
            sent.clear()  # (held until here: a contiguous copy must outlive its send)

        return received, wait


def ring_steps(ring: Ring, kv):
    """Yields (src, the K/V shard of rank src) for each of the W steps, starting to pass
    each shard on to the next rank before the caller works on it and waiting for the next
    one only when the caller asks for it."""
    for s in range(ring.world):
        wait = None
        if s + 1 < ring.world:
            upcoming, wait = ring.pass_on(kv)
        yield (ring.rank - s) % ring.world, kv
        if wait is not None:
            wait()
            kv = tuple(upcoming)


class TravellingGrads:
    """The fp32 dK and dV accumulators of the shard this rank holds (its own at step 0):
    each moves on with its shard one step behind it and is waited for only where the next
    step adds to it; after the last step's hand-on, each shard's arrives at its owner."""

    def __init__(self, ring: Ring, k, v):
        self.ring = ring
        self.dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v)]
        self.arriving = None  # (the accumulators of the shard held next, wait)

    def current(self) -> list[torch.Tensor]:
        if self.arriving is not None:
            self.dkv, wait = self.arriving
            self.arriving = None
            wait()
        return self.dkv

    def hand_on(self) -> None:
        if self.ring.world > 1:
            self.arriving = self.ring.pass_on(self.current())

    def home(self, k, v):
        dk, dv = self.current()
        return dk.to(k.dtype), dv.to(v.dtype)


def no_lse_gradient(dlse, name: str) -> None:
    if dlse is not None and torch.any(dlse != 0):
        raise RuntimeError(
            f"fadsl.distributed.{name}: a gradient through the returned LSE is not supported; "
            "use the output's"
        )


def _plan(causal: bool, layout: str, rank: int, src: int, seqlen_q: int, seqlen_k: int):
    """What step (rank, src) computes: (query rows, key rows, causal) as slices, or None."""
    every_q, every_k = slice(0, seqlen_q), slice(0, seqlen_k)
    if not causal:
        return every_q, every_k, False
    if src == rank:
        return every_q, every_k, True
    if layout == "contiguous":
        return (every_q, every_k, False) if src < rank else None
    if src < rank:  # the earlier rank's first chunk precedes both of ours; its second follows
        return every_q, slice(0, seqlen_k // 2), False
    return slice(seqlen_q // 2, seqlen_q), every_k, False  # our second chunk sees all of theirs


def _part(x: torch.Tensor, rows: slice) -> torch.Tensor:
    if rows.start == 0 and rows.stop == x.shape[1]:
        return x
    return x[:, rows].contiguous()


class _Rows:
    """This rank's own tensors cut to a plan's rows, each cut made once per call (every
    later step from a later rank takes the same second half of the queries)."""

    def __init__(self, **tensors):
        self.tensors, self.cuts = tensors, {}

    def __call__(self, name: str, rows: slice) -> torch.Tensor:
        key = (name, rows.start, rows.stop)
        if key not in self.cuts:
            x = self.tensors[name]
            self.cuts[key] = (
                x[:, :, rows].contiguous() if name == "lse" else _part(x, rows)
            )  # the LSE: (batch, heads, seqlen)
        return self.cuts[key]


def ring_forward(ring: Ring, step, q, k, v, causal: bool, scale: float, layout: str):
    """(out in q's dtype, lse fp32 (batch, heads, seqlen_q)) over every rank's keys."""
    batch, seqlen_q, heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), float("-inf"), device=q.device)
    mine = _Rows(q=q)
    for src, kv in ring_steps(ring, (k, v)):
        plan = _plan(causal, layout, ring.rank, src, seqlen_q, k.shape[1])
        if plan is not None:
            rows, keys, masked = plan
            part_out, part_lse = step.forward(
                mine("q", rows), _part(kv[0], keys), _part(kv[1], keys), masked, scale
            )
            merge_into(out[:, rows], lse[:, :, rows], part_out, part_lse)
    return out.to(q.dtype), lse


def ring_backward(ring: Ring, step, q, k, v, out, lse, dout, causal: bool, scale, layout):
    """(dq, dk, dv) of this rank's shards."""
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads_kv = TravellingGrads(ring, k, v)
    mine = _Rows(q=q, out=out, lse=lse, dout=dout)
    for src, kv in ring_steps(ring, (k, v)):
        plan = _plan(causal, layout, ring.rank, src, seqlen_q, seqlen_k)
        if plan is not None:
            rows, keys, masked = plan
            dq_part, dk_part, dv_part = step.backward(
                mine("q", rows),
                _part(kv[0], keys),
                _part(kv[1], keys),
                mine("out", rows),
                mine("lse", rows),
                mine("dout", rows),
                masked,
                scale,
            )
            # (added in place, each bf16 value widened as it is read: no fp32 copy of a part)
            dq[:, rows].add_(dq_part)
            dk, dv = grads_kv.current()
            dk[:, keys].add_(dk_part)
            dv[:, keys].add_(dv_part)
        grads_kv.hand_on()
    return (dq.to(q.dtype), *grads_kv.home(k, v))


def head_groups(heads_q: int, heads_kv: int, chunks: int) -> list[tuple[slice, slice]]:
    """(query heads, K/V heads) of each of ``chunks`` groups: GQA's groups kept whole (query
    head h reads K/V head h // (heads_q / heads_kv))."""
    per_q, per_kv = heads_q // chunks, heads_kv // chunks
    return [
        (slice(c * per_q, (c + 1) * per_q), slice(c * per_kv, (c + 1) * per_kv))
        for c in range(chunks)
    ]


def _heads(x: torch.Tensor, heads: slice, dim: int = 2) -> torch.Tensor:
    """``x``'s heads ``heads`` (dim 2 of (batch, seqlen, heads, d); 1 of the LSE's (batch,
    heads, seqlen)) as a tensor of their own (the whole of x with one group)."""
    if heads.start == 0 and heads.stop == x.shape[dim]:
        return x
    return x[:, heads].contiguous() if dim == 1 else x[:, :, heads].contiguous()


class RingAttention(torch.autograd.Function):
    """The ring over ``chunks`` groups of heads in turn: each group's K/V shards travel the
    ring, then its dK and dV, while the other groups' wait (one group's fp32 accumulators and
    shards in flight at a time)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, group, step, chunks=1):
        ring = Ring(group)
        groups = head_groups(q.shape[2], k.shape[2], chunks)
        if chunks == 1:
            out, lse = ring_forward(ring, step, q, k, v, causal, scale, layout)
        else:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), device=q.device)
            for hq, hk in groups:
                out[:, :, hq], lse[:, hq] = ring_forward(
                    ring, step, _heads(q, hq), _heads(k, hk), _heads(v, hk), causal, scale, layout
                )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, step, causal, scale, layout, groups)
        return out, lse

    @staticmethod
    @once_differentiable  # (a double backward is not defined: refused, not silently wrong)
    def backward(ctx, dout, dlse):
        no_lse_gradient(dlse, "ring_attention")
        q, k, v, out, lse = ctx.saved_tensors
        ring, step, causal, scale, layout, groups = ctx.args
        dout = dout.contiguous()
        if len(groups) == 1:
            grads = ring_backward(ring, step, q, k, v, out, lse, dout, causal, scale, layout)
        else:
            grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
            for hq, hk in groups:
                found = ring_backward(
                    ring, step, _heads(q, hq), _heads(k, hk), _heads(v, hk), _heads(out, hq),
                    _heads(lse, hq, dim=1), _heads(dout, hq), causal, scale, layout,
                )  # fmt: skip
                for grad, part, heads in zip(grads, found, (hq, hk, hk)):
                    grad[:, :, heads] = part
        return (*grads, None, None, None, None, None, None)
