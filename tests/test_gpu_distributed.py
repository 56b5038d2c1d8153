"""fadsl.distributed on 2 GPUs (NCCL): ring attention with fadsl's kernels in every step
(zigzag causal, contiguous without a mask, GQA, head_dim 64 and 128, bf16; once per group of
heads too) and the all-to-all
(fadsl's kernels as steps over one group of heads or a group per K/V head, or around
fadsl.attention itself), each rank's shards gathered and held to FlashAttention's rule
against float32 attention of the whole sequence (forward output and dq, dk, dv). Each case
in fresh processes (torch.multiprocessing.spawn), NVLink multicast off (the GPU machine's
KINDS.md)."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fadsl
import fadsl.distributed as fcp
from test_gpu_backward import check_rule, reference_grads
from test_gpu_general import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]

# (name, how, causal, head_dim, batch, seqlen (whole), heads, heads_kv)
CASES = [
    ("ring_zigzag_causal_gqa", "zigzag", True, 128, 2, 2048, 8, 2),
    ("ring_contiguous_plain", "contiguous", False, 128, 1, 3072, 4, 4),
    ("ring_zigzag_causal_hd64", "zigzag", True, 64, 1, 4096, 8, 8),
    ("ring_contiguous_causal", "contiguous", True, 128, 1, 1024, 4, 2),
    ("ring_zigzag_causal_gqa_groups", "zigzag_groups", True, 128, 1, 2048, 8, 2),
    ("ulysses_causal_gqa", "ulysses", True, 128, 1, 2048, 8, 4),
    ("ulysses_groups_causal_gqa", "ulysses_groups", True, 128, 2, 2048, 8, 4),
    ("ulysses_attend_plain", "ulysses_attend", False, 64, 1, 3000, 4, 2),
]


def _worker(rank, world, init_file, case):
    name, how, causal, d, batch, seqlen, heads, heads_kv = case
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        g = torch.Generator(device="cuda").manual_seed(1234)  # the same tensors on every rank
        shape_q, shape_k = (batch, seqlen, heads, d), (batch, seqlen, heads_kv, d)
        q, k, v = (
            torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=g)
            for s in (shape_q, shape_k, shape_k)
        )
        dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
        scale = 1.0 / math.sqrt(d)
        if how.startswith("zigzag"):
            shard, unshard = (lambda t: fcp.shard_zigzag(t, rank, world)), fcp.unshard_zigzag
        else:
            shard = lambda t: t.chunk(world, dim=1)[rank].contiguous()  # noqa: E731
            unshard = lambda parts: torch.cat(parts, dim=1)  # noqa: E731
        mine = [shard(t).clone().requires_grad_() for t in (q, k, v)]
        if how == "ulysses":
            out = fcp.ulysses_attention(*mine, causal=causal)
        elif how == "ulysses_groups":  # a K/V head of the rank a group
            out = fcp.ulysses_attention(*mine, causal=causal, head_chunks=heads_kv // world)
        elif how == "ulysses_attend":
            attend = lambda *t: fadsl.attention(*t, causal=causal)  # noqa: E731
            out = fcp.ulysses_attention(*mine, causal=causal, attend=attend)
        elif how == "zigzag_groups":  # the ring once per K/V head
            out = fcp.ring_attention(*mine, causal=causal, head_chunks=heads_kv)
        else:
            out = fcp.ring_attention(*mine, causal=causal, layout=how)
        out.backward(shard(dout))

        def gathered(x):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
            return unshard(parts)

        truth_out, _ = reference(q, k, v, scale, causal, torch.float32)
        own_out, _ = reference(q, k, v, scale, causal, torch.bfloat16)
        check_rule(gathered(out.detach()), truth_out.float(), own_out.float(), f"{name} out")
        truth = reference_grads(q, k, v, dout, scale, causal, torch.float32)
        own = reference_grads(q, k, v, dout, scale, causal, torch.bfloat16)
        for leaf, t, o, what in zip(mine, truth, own, ("dq", "dk", "dv")):
            assert leaf.grad.dtype == torch.bfloat16
            check_rule(gathered(leaf.grad), t, o, f"{name} {what}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_context_parallel_attention_on_two_gpus(case):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as where:
        mp.spawn(_worker, args=(2, os.path.join(where, "init"), case), nprocs=2)


def _varlen_worker(rank, world, init_file):
    """Packed sequences (lengths 512, 1536 and 1024, multiples of 2 x 2 ranks), head_dim
    128, causal, GQA 8/2, bf16: ring_attention_varlen with the shipped varlen kernels."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        lengths = [512, 1536, 1024]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        g = torch.Generator(device="cuda").manual_seed(99)
        q = torch.randn(cu[-1], 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (
            torch.randn(cu[-1], 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in "kv"
        )
        # the same on every rank: the generator's, not each process's default one
        dout = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=g)
        scale = 128**-0.5
        shards = [fcp.shard_zigzag_varlen(t, cu, rank, world) for t in (q, k, v, dout)]
        mine = [t.clone().requires_grad_() for t, _ in shards[:3]]
        out = fcp.ring_attention_varlen(*mine, shards[0][1], causal=True)
        out.backward(shards[3][0])

        def gathered(x):
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous())
            return fcp.unshard_zigzag_varlen(parts, cu)

        spans = list(zip(cu, cu[1:]))

        def per_sequence(fn):
            return [fn(*(t[None, a:b] for t in (q, k, v, dout))) for a, b in spans]

        truth = per_sequence(lambda *t: reference(*t[:3], scale, True, torch.float32)[0][0])
        own = per_sequence(lambda *t: reference(*t[:3], scale, True, torch.bfloat16)[0][0])
        check_rule(gathered(out.detach()), torch.cat(truth).float(), torch.cat(own).float(), "out")
        t_grads = per_sequence(lambda *t: reference_grads(*t, scale, True, torch.float32))
        o_grads = per_sequence(lambda *t: reference_grads(*t, scale, True, torch.bfloat16))
        for i, (leaf, what) in enumerate(zip(mine, ("dq", "dk", "dv"))):
            t = torch.cat([g_[i][0] for g_ in t_grads])
            o = torch.cat([g_[i][0] for g_ in o_grads])
            check_rule(gathered(leaf.grad), t, o, f"varlen {what}")
    finally:
        dist.destroy_process_group()


def test_packed_sequences_on_two_gpus():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as where:
        mp.spawn(_varlen_worker, args=(2, os.path.join(where, "init")), nprocs=2)
