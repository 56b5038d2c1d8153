"""All-to-all context parallelism (DeepSpeed-Ulysses): the sequence gathered, heads split.

Each rank enters with a shard of the sequence for every head, (batch, seqlen / W, heads,
head_dim); an all-to-all gives it the whole sequence for heads / W heads, the attention runs
locally (any mask: each rank holds whole sequences), and an all-to-all takes the output back
to sequence shards. Needs heads_q and heads_kv divisible by W; moves 4 tensors of the shard's
size per call each way (q, k, v, out), whatever the sequence length, where the ring moves K and
V W - 1 times: it wins when heads outnumber ranks and the links are slow (docs/distributed.md).

Two forms:
- ``ulysses``: around any autograd-aware local attention (``attend``); autograd keeps what
  ``attend`` saves, the gathered q, k, v and output of this rank's heads.
- ``UlyssesAttention``: around an ``AttentionStep`` (forward with the LSE, backward given the
  output and LSE), a group of heads at a time (``chunks`` groups of heads_kv / (W chunks) K/V
  heads and their query heads). With one group it keeps the gathered q, k, v and output as
  autograd around ``attend`` would. With more it keeps only the shards it was given, its
  output shard and the gathered LSE (fp32, one value a row): the backward gathers each
  group's q, k, v, output and dO again, so that a rank holds one group's gathered tensors,
  dQ accumulator and gradients at a time rather than all its heads'. At 128k tokens, 32
  heads of 128, two ranks, that is 2.5 GiB of gathered bf16 tensors, 1 GiB of fp32 dQ
  accumulator and 1.5 GiB of gradients with one group, a quarter of it with four. The
  forward gathers the next group while this one's attention runs (its three tensors are
  small beside the backward's peak); the backward does not (it would hold two groups'
  five), and its four extra all-to-alls of shard-sized tensors run between the groups'
  attentions (docs/distributed.md, "Memory: groups of heads").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable


def _exchange(x: torch.Tensor, group, async_op: bool = False):
    """all_to_all_single over dim 0 (W equal chunks: chunk j goes to rank j): the received
    tensor, and with ``async_op`` the work to wait for before reading it."""
    x = x.contiguous()  # (a permuted view: empty_like would copy its strides)
    out = torch.empty_like(x)
    work = dist.all_to_all_single(out, x, group=group, async_op=async_op)
    return (out, work, x) if async_op else out


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


def _group_view(x: torch.Tensor, world: int, chunks: int) -> torch.Tensor:
    """(batch, part, heads, d) as (batch, part, W, chunks, heads / (W chunks), d): rank j's
    heads are [j heads / W, (j + 1) heads / W), group c the c-th run of them."""
    batch, part, heads, d = x.shape
    return x.reshape(batch, part, world, chunks, heads // (world * chunks), d)


def _like(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of ``x``'s shape, dtype and device (written a group at a time
    through _group_view, which must be a view of it)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


class _Gathered:
    """Group ``c``'s whole sequence of each of ``shards`` (this rank's heads of the group), its
    all-to-alls started at construction (NCCL runs them on its own stream) and finished by
    ``wait``."""

    def __init__(self, shards, c: int, world: int, chunks: int, group):
        self.started = []
        for x in shards:
            part = _group_view(x, world, chunks)[:, :, :, c]  # (batch, part, W, h, d)
            self.started.append(_exchange(part.permute(2, 0, 1, 3, 4), group, async_op=True))

    def wait(self) -> list[torch.Tensor]:
        out = []
        while self.started:  # (each sent copy held until its exchange ends, then let go)
            got, work, _sent = self.started.pop(0)
            work.wait()  # got[i]: rank i's sequence shard of this rank's heads of the group
            w, batch, part, h, d = got.shape
            out.append(got.permute(1, 0, 2, 3, 4).reshape(batch, w * part, h, d))
        return out


def _scatter(outputs: list, into, c: int, world: int, chunks: int, group) -> None:
    """Group ``c``'s outputs taken back to sequence shards, into the group's heads of each of
    ``into``, one at a time (``outputs`` emptied as it goes: each let go once copied)."""
    for dest in into:
        y = outputs.pop(0)
        batch, seqlen, h, d = y.shape
        part = y.reshape(batch, world, seqlen // world, h, d).permute(1, 0, 2, 3, 4)
        del y
        got = _exchange(part, group)  # got[i]: this rank's sequence shard of rank i's heads
        del part
        _group_view(dest, world, chunks)[:, :, :, c].copy_(got.permute(1, 2, 0, 3, 4))


class UlyssesAttention(torch.autograd.Function):
    """The all-to-all around ``step`` (an ``AttentionStep``), one group of heads at a time;
    (q, k, v) this rank's contiguous sequence shards of every head; returns this rank's shard
    of the output. Memory: see the module's docstring."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, group, step, chunks: int):
        world = dist.get_world_size(group)
        ctx.causal, ctx.scale, ctx.group, ctx.step, ctx.chunks = causal, scale, group, step, chunks
        if chunks == 1:  # all the rank's heads: their gathered tensors kept, none gathered again
            qc, kc, vc = _Gathered((q, k, v), 0, world, 1, group).wait()
            out_c, lse = step.forward(qc, kc, vc, causal, scale)
            ctx.save_for_backward(qc, kc, vc, out_c, lse)
            return heads_to_seq(out_c, group)
        out = _like(q)
        lses = []
        nxt = _Gathered((q, k, v), 0, world, chunks, group)
        for c in range(chunks):
            qc, kc, vc = nxt.wait()
            if c + 1 < chunks:  # the next group's all-to-alls under this group's attention
                nxt = _Gathered((q, k, v), c + 1, world, chunks, group)
            out_c, lse_c = step.forward(qc, kc, vc, causal, scale)
            lses.append(lse_c)
            outputs = [out_c]
            del out_c  # (the list's reference the only one: _scatter lets it go)
            _scatter(outputs, (out,), c, world, chunks, group)
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    @once_differentiable  # (a double backward is not defined: refused, not silently wrong)
    def backward(ctx, dout):
        world, chunks, group = dist.get_world_size(ctx.group), ctx.chunks, ctx.group
        dout = dout.contiguous()
        if chunks == 1:
            qc, kc, vc, out_c, lse = ctx.saved_tensors
            (doc,) = _Gathered((dout,), 0, world, 1, group).wait()
            found = list(ctx.step.backward(qc, kc, vc, out_c, lse, doc, ctx.causal, ctx.scale))
            del doc
            grads = []
            while found:  # (each gathered gradient let go once its shard is made)
                grads.append(heads_to_seq(found.pop(0), group))
            return (*grads, None, None, None, None, None)
        q, k, v, out, *lses = ctx.saved_tensors
        grads = tuple(_like(t) for t in (q, k, v))
        for c in range(chunks):  # (no group gathered ahead: its five tensors would be held)
            qc, kc, vc, oc, doc = _Gathered((q, k, v, out, dout), c, world, chunks, group).wait()
            found = list(ctx.step.backward(qc, kc, vc, oc, lses[c], doc, ctx.causal, ctx.scale))
            del qc, kc, vc, oc, doc
            _scatter(found, grads, c, world, chunks, group)
        return (*grads, None, None, None, None, None)
