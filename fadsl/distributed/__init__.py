"""Context parallelism: attention over a sequence sharded across the ranks of a
``torch.distributed`` process group, forward and backward (docs/distributed.md).

    import fadsl.distributed as fcp
    q, k, v = (fcp.shard_zigzag(t, rank, world) for t in (q, k, v))   # (batch, seqlen, heads, d)
    out = fcp.ring_attention(q, k, v, causal=True)                      # this rank's rows
    full = fcp.gather_zigzag(out)

- ``ring_attention``: K and V shards pass around the ring (NCCL send/recv under each step's
  attention), partial outputs merged by their LSE in fp32; the backward passes dK and dV
  around the same way. Causal needs the zigzag (balanced) or contiguous layout.
- ``ulysses_attention``: heads split and sequence gathered by all-to-alls around the local
  attention, a group of heads at a time (``head_chunks``: the backward then holds one group's
  gathered tensors); heads_q and heads_kv divisible by the group's size; contiguous shards.

Each step's attention is an ``AttentionStep`` (fadsl/distributed/steps.py): fadsl.attention's
shipped kernels by default, ``SpecStep`` for two loaded specs with backward blocks,
``ReferenceStep`` (fp32 torch) for checks and for CPU process groups (gloo).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .agree import agreed, signature_of
from .ring import LAYOUTS, RingAttention
from .steps import ReferenceStep, ShippedStep, SpecStep, AttentionStep
from .ulysses import UlyssesAttention, ulysses
from .varlen import RingAttentionVarlen, shard_zigzag_varlen, unshard_zigzag_varlen

__all__ = [
    "ring_attention",
    "ring_attention_varlen",
    "shard_zigzag_varlen",
    "unshard_zigzag_varlen",
    "ulysses_attention",
    "shard_zigzag",
    "unshard_zigzag",
    "gather_zigzag",
    "ReferenceStep",
    "ShippedStep",
    "SpecStep",
    "AttentionStep",
]


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fadsl.distributed: torch.distributed is not initialised "
            "(torch.distributed.init_process_group, or run under torchrun)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor (batch, seqlen, heads, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"k: batch and head_dim {k.shape[0]}, {k.shape[3]} differ from q's "
            f"{q.shape[0]}, {q.shape[3]}"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"k: {k.shape[2]} heads do not divide q's {q.shape[2]} (GQA)")
    if q.dtype != k.dtype or q.dtype != v.dtype or q.device != k.device or q.device != v.device:
        raise ValueError("k, v: q, k and v need one dtype and one device")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")


def _scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"softmax_scale: expected a positive number, got {softmax_scale!r}")
    return float(softmax_scale)


def _default_step(q) -> AttentionStep:
    if q.device.type != "cuda":
        raise ValueError(
            f"q: on {q.device}; fadsl's kernels run on CUDA devices (pass step=ReferenceStep() "
            "to run the fp32 reference instead)"
        )
    return ShippedStep()


def ring_attention(
    q,
    k,
    v,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    group=None,
    layout: str = "zigzag",
    step: AttentionStep | None = None,
    return_lse: bool = False,
    head_chunks: int | None = 1,
):
    """Attention of this rank's query shard over every rank's K/V shards in ``group`` (the
    default group if None). q (batch, seqlen_q, heads_q, head_dim), k and v (batch,
    seqlen_k, heads_kv, head_dim): this rank's shards, laid out by ``layout`` ("zigzag":
    shard_zigzag's, "contiguous": rank r holds the r-th of W chunks; without a mask either).
    causal: the mask over global positions (every rank's shards of equal length, queries
    and keys of one sequence). Returns this rank's rows of the output (and with
    ``return_lse`` their LSE, fp32 (batch, heads_q, seqlen_q), natural log). Gradients flow
    to q, k and v (not through the LSE). ``head_chunks``: the ring runs once per group of
    heads (dividing heads_kv; 1, the default: all heads at once; None: as ulysses_attention
    chooses, over this rank's rows), so that the K/V shards in flight and the travelling fp32
    dK and dV are one group's. With more than one group the backward reads the saved inputs
    and output: an in-place edit of them after the call makes backward raise."""
    rank, world = _world(group)

    def ring_chunks() -> int:
        return _head_chunks(head_chunks, q, k.shape[2], q.shape[2], _tiles(q.shape[0], q.shape[1]))

    def check() -> tuple[int, ...]:
        _check_flag("causal", causal)
        _check_flag("return_lse", return_lse)
        _check_qkv(q, k, v)
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
        if causal:
            if q.shape[1] != k.shape[1]:
                raise ValueError(
                    f"k: causal ring attention needs shards of equal length, q {q.shape[1]} "
                    f"and k {k.shape[1]}"
                )
            if layout == "zigzag" and q.shape[1] % 2:
                raise ValueError(
                    f"q: a zigzag shard holds two chunks; its length {q.shape[1]} is odd"
                )
        if step is None:
            _default_step(q)
        # what travels (K and V shards, then dK and dV), in how many groups, and what the
        # merge assumes
        return signature_of(
            *k.shape, q.shape[2], str(q.dtype), causal, layout, _scale(softmax_scale, q.shape[3]),
            ring_chunks(),
        )  # fmt: skip

    agreed(group, rank, world, check)
    scale = _scale(softmax_scale, q.shape[3])
    out, lse = RingAttention.apply(
        q, k, v, causal, scale, layout, group, step or _default_step(q), ring_chunks()
    )
    return (out, lse) if return_lse else out


def ring_attention_varlen(
    q,
    k,
    v,
    cu_seqlens,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    group=None,
    step: AttentionStep | None = None,
    return_lse: bool = False,
):
    """ring_attention over packed sequences: q (tokens, heads_q, head_dim), k and v (tokens,
    heads_kv, head_dim), this rank's shard_zigzag_varlen shards, with their ``cu_seqlens``
    (int32, on q's device: the same on every rank). Returns this rank's rows of the output
    (and with ``return_lse`` their LSE, fp32 (heads_q, tokens)); gradients flow to q, k and v."""
    rank, world = _world(group)

    def check() -> tuple[int, ...]:
        _check_flag("causal", causal)
        _check_flag("return_lse", return_lse)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name}: expected a 3-D tensor (tokens, heads, head_dim)")
        _check_qkv(q[None], k[None], v[None])
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"k: {k.shape[0]} tokens where q has {q.shape[0]} (one cu_seqlens)")
        if (
            not isinstance(cu_seqlens, torch.Tensor)
            or cu_seqlens.dim() != 1
            or cu_seqlens.dtype != torch.int32
            or cu_seqlens.device != q.device
        ):
            raise ValueError("cu_seqlens: expected a 1-D int32 tensor on q's device")
        bounds = cu_seqlens.tolist()
        if not bounds or bounds[0] != 0 or bounds[-1] != q.shape[0]:
            raise ValueError(
                f"cu_seqlens: must run from 0 to the {q.shape[0]} tokens, got {bounds}"
            )
        if any(b < a or (b - a) % 2 for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"cu_seqlens: each sequence's shard holds two equal chunks (even, non-decreasing "
                f"lengths), got {bounds}"
            )
        if step is None:
            _default_step(q)
        return signature_of(
            *q.shape, k.shape[1], str(q.dtype), causal, bounds, _scale(softmax_scale, q.shape[2])
        )

    agreed(group, rank, world, check)
    scale = _scale(softmax_scale, q.shape[2])
    out, lse = RingAttentionVarlen.apply(
        q, k, v, cu_seqlens, causal, scale, group, step or _default_step(q)
    )
    return (out, lse) if return_lse else out


def ulysses_attention(
    q,
    k,
    v,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    group=None,
    attend=None,
    step: AttentionStep | None = None,
    head_chunks: int | None = None,
):
    """Attention over the whole sequence with heads split across ``group``'s ranks: q, k, v
    are this rank's contiguous sequence shards (rank r holds the r-th of W chunks) of every
    head; returns this rank's shard of the output.

    By default the attention is ``step`` (an ``AttentionStep``; fadsl.attention's kernels
    unless given) over ``head_chunks`` groups of this rank's heads in turn, each group's
    q, k, v, output and dO gathered again in the backward (``UlyssesAttention``: the backward
    holds one group's gathered tensors at a time). ``head_chunks`` divides heads_kv / W;
    None: as many as keep each group at least 16 waves of 128-row tiles on the device's SMs
    (at most 8; one off CUDA devices); with more than one group the backward gathers again
    from the saved input shards and output shard, so an in-place edit of them after the call
    makes backward raise (autograd's version check). ``attend(q, k, v)`` instead: any
    autograd-aware local attention over all of this rank's heads at once (it then keeps what
    it saves)."""
    rank, world = _world(group)

    def ulysses_chunks() -> int:  # (the rank's heads, over the whole sequence)
        kv_heads, q_heads = k.shape[2] // world, q.shape[2] // world
        return _head_chunks(
            head_chunks, q, kv_heads, q_heads, _tiles(q.shape[0], world * q.shape[1])
        )

    def check() -> tuple[int, ...]:
        _check_flag("causal", causal)
        _check_qkv(q, k, v)
        for name, t in (("q", q), ("k", k)):
            if t.shape[2] % world:
                raise ValueError(f"{name}: {t.shape[2]} heads do not split over {world} ranks")
        if attend is not None and (step is not None or head_chunks is not None):
            raise ValueError("attend: a local attention of its own takes no step or head_chunks")
        if attend is None and step is None:
            _default_step(q)
        chunks = 1 if attend is not None else ulysses_chunks()
        # the all-to-alls exchange equal chunks of q, k and v, in as many groups on every rank
        return signature_of(
            *q.shape, *k.shape[1:3], str(q.dtype), causal, _scale(softmax_scale, q.shape[3]),
            chunks,
        )  # fmt: skip

    agreed(group, rank, world, check)
    scale = _scale(softmax_scale, q.shape[3])
    if attend is not None:
        return ulysses(attend, q, k, v, group)
    chunks = ulysses_chunks()
    return UlyssesAttention.apply(q, k, v, causal, scale, group, step or _default_step(q), chunks)


TILE_ROWS = 128  # the rows of a forward tile the automatic head_chunks counts waves in
MIN_WAVES = 16  # the waves of tiles each group of heads keeps (head_chunks=None)
MAX_CHUNKS = 8


def _head_chunks(head_chunks, q, kv_heads: int, q_heads: int, tiles_per_head: int) -> int:
    """The groups of heads a call runs in turn, of the ``kv_heads`` K/V heads and ``q_heads``
    query heads a rank attends with: ``head_chunks`` checked, or (None) as many (dividing
    kv_heads, at most MAX_CHUNKS) as keep a group's attention at least MIN_WAVES waves of
    ``tiles_per_head`` tiles a query head on the device's SMs; one off CUDA devices."""
    if head_chunks is not None:
        if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1:
            raise ValueError(f"head_chunks: expected a positive int, got {head_chunks!r}")
        if kv_heads % head_chunks:
            raise ValueError(
                f"head_chunks: {head_chunks} does not divide the {kv_heads} K/V heads of a rank"
            )
        return head_chunks
    if q.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    best = 1
    for chunks in range(1, MAX_CHUNKS + 1):
        if kv_heads % chunks == 0 and q_heads // chunks * tiles_per_head >= MIN_WAVES * sms:
            best = chunks
    return best


def _tiles(batch: int, rows: int) -> int:
    return batch * -(-rows // TILE_ROWS)


def shard_zigzag(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim``: chunks rank and 2 world - 1 - rank
    of 2 world, concatenated (every rank then does equal causal work)."""
    if x.shape[dim] % (2 * world):
        raise ValueError(
            f"x: length {x.shape[dim]} along dim {dim} is not a multiple of 2 x {world} ranks"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is not in 0 .. {world - 1}")
    chunks = x.chunk(2 * world, dim)
    return torch.cat((chunks[rank], chunks[2 * world - 1 - rank]), dim)


def unshard_zigzag(shards, dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's zigzag shard, in rank order."""
    world = len(shards)
    halves = [s.chunk(2, dim) for s in shards]
    chunks = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(chunks, dim)


def gather_zigzag(x: torch.Tensor, group=None, dim: int = 1) -> torch.Tensor:
    """Every rank's zigzag shard gathered and put in order (all_gather: every rank gets it)."""
    _, world = _world(group)
    shards = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    return unshard_zigzag(shards, dim)
