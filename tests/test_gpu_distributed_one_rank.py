"""fadsl.distributed on one GPU, a process group of one rank (NCCL): the all-to-all by
groups of heads (UlyssesAttention), whose all-to-alls are then copies, and the ring, which
then runs one step; the kernels, the gradients' adds in fp32 and the memory the backward
holds are what is tested (2 GPUs: tests/test_gpu_distributed.py).

- The output and dq, dk, dv of 1, 2 and 4 groups, GQA and MHA, causal and not, odd lengths,
  within FlashAttention's rule against float32 attention, every tensor the groups write into
  poisoned with NaN first (a head no group writes would show).
- The backward's peak with groups: above what the call returns (dq, dk, dv), one group's
  gathered q, k, v, out and dO, dQ accumulator and gradients at a time, so that the rest of
  the peak falls as 1 / groups from 2 to 8 (within a quarter of it, for the allocator's
  rounding and the LSE's and D's rows)."""

from __future__ import annotations

import importlib
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import fadsl.distributed as fcp
from test_gpu_backward import check_rule, reference_grads
from test_gpu_general import reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


@pytest.fixture(scope="module")
def one_rank_group():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as where:
        init = f"file://{os.path.join(where, 'init')}"
        dist.init_process_group("nccl", init_method=init, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _inputs(batch, seqlen, heads, heads_kv, d, seed=5):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(batch, seqlen, heads_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in "kv"
    )
    dout = torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, dout


# (causal, batch, seqlen, heads, heads_kv, head_dim)
CASES = [(True, 2, 1000, 8, 4, 128), (False, 1, 777, 4, 4, 64), (True, 1, 1536, 16, 2, 128)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_groups_of_heads_match_float32_attention(one_rank_group, case, monkeypatch):
    def poisoned(x):
        return torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)

    # (the module: the package's own `ulysses` is the function of that name)
    monkeypatch.setattr(importlib.import_module("fadsl.distributed.ulysses"), "_like", poisoned)
    causal, batch, seqlen, heads, heads_kv, d = case
    q, k, v, dout = _inputs(batch, seqlen, heads, heads_kv, d)
    scale = 1 / math.sqrt(d)
    truth_out, _ = reference(q, k, v, scale, causal, torch.float32)
    own_out, _ = reference(q, k, v, scale, causal, torch.bfloat16)
    truth = reference_grads(q, k, v, dout, scale, causal, torch.float32)
    own = reference_grads(q, k, v, dout, scale, causal, torch.bfloat16)
    for chunks in (1, 2, 4):
        if heads_kv % chunks:
            continue
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fcp.ulysses_attention(*leaves, causal=causal, head_chunks=chunks)
        check_rule(out.detach(), truth_out.float(), own_out.float(), f"{chunks} groups out")
        out.backward(dout)
        for leaf, t, o, what in zip(leaves, truth, own, ("dq", "dk", "dv")):
            check_rule(leaf.grad, t, o, f"{chunks} groups {what}")


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: "-".join(map(str, c)))
def test_the_ring_of_one_rank_matches_float32_attention(one_rank_group, case):
    causal, batch, seqlen, heads, heads_kv, d = case
    q, k, v, dout = _inputs(batch, seqlen, heads, heads_kv, d, seed=9)
    scale = 1 / math.sqrt(d)
    truth_out, _ = reference(q, k, v, scale, causal, torch.float32)
    own_out, _ = reference(q, k, v, scale, causal, torch.bfloat16)
    truth = reference_grads(q, k, v, dout, scale, causal, torch.float32)
    own = reference_grads(q, k, v, dout, scale, causal, torch.bfloat16)
    for chunks in (1, heads_kv):  # the ring once, and once per K/V head
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fcp.ring_attention(
            *leaves, causal=causal, softmax_scale=scale, layout="contiguous", head_chunks=chunks
        )
        out.backward(dout)
        check_rule(out.detach(), truth_out.float(), own_out.float(), f"ring {chunks} out")
        for leaf, t, o, what in zip(leaves, truth, own, ("dq", "dk", "dv")):
            assert leaf.grad.dtype == torch.bfloat16
            check_rule(leaf.grad, t, o, f"ring {chunks} {what}")


def _backward_peak(q, k, v, dout, chunks: int) -> int:
    """Bytes the backward allocates above what is live before it (inputs, out, dout)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fcp.ulysses_attention(*leaves, causal=True, head_chunks=chunks)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(dout)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_the_backward_holds_one_group_at_a_time(one_rank_group):
    q, k, v, dout = _inputs(1, 16384, 16, 16, 128)
    returned = sum(t.numel() * t.element_size() for t in (q, k, v))  # dq, dk, dv
    _backward_peak(q, k, v, dout, 2)  # (the kernels built, the allocator warm)
    held = {c: _backward_peak(q, k, v, dout, c) - returned for c in (2, 4, 8)}
    # a group of c: gathered q, k, v, out, dO (5), fp32 dQ (2), the group's dq, dk, dv (3),
    # in tensors of the whole problem, / c
    tensor = q.numel() * q.element_size()
    assert held[2] >= 9 * tensor / 2, (held, tensor)
    for chunks in (4, 8):
        assert held[chunks] <= held[2] * 2 / chunks * 1.25, (chunks, held)
