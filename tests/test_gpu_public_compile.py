"""The public calls under torch.compile(fullgraph=True) on the GPU (issue 45): fadsl.attention
forward and backward, attention_varlen, attention_with_kvcache (with and without new tokens,
paged and contiguous) and append_kv, each traced with no graph break and equal to the eager
call bit for bit; fadsl.attention with dynamic=True over three shapes; a call whose kernel is
not built yet builds it when the compiled graph first runs.
`GPU_TESTS=tests/test_gpu_public_compile.py bash scripts/device.sh tests`."""

from __future__ import annotations

import pytest
import torch

import fadsl

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]
BF16 = torch.bfloat16


def randn(*shape, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen).to(BF16)


def fullgraph(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, **options)


@pytest.mark.parametrize("heads_kv", [8, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_forward_and_backward_compile(head_dim, causal, heads_kv):
    q = randn(2, 300, 8, head_dim, seed=1)
    k, v = randn(2, 333, heads_kv, head_dim, seed=2), randn(2, 333, heads_kv, head_dim, seed=3)
    dout = randn(2, 300, 8, head_dim, seed=4)

    def step(q, k, v):
        out, lse = fadsl.attention(q, k, v, causal=causal, return_lse=True)
        return (out.float() * dout.float()).sum() + lse.sum(), out

    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    loss, out = step(*eager)
    loss.backward()
    traced = [t.clone().requires_grad_() for t in (q, k, v)]
    loss_c, out_c = fullgraph(step)(*traced)
    loss_c.backward()
    assert torch.equal(out_c, out)  # (the loss's sums may add in another order)
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    # dQ is added up across CTAs in whatever order they finish; so are dK and dV under GQA
    # (each query head's share added into the K/V head's fp32 accumulator by red.add:
    # fadsl/targets/sm90/backward/host.py, DKV_ADD_FP32); without GQA each CTA owns its rows
    torch.testing.assert_close(traced[0].grad, eager[0].grad, atol=2e-3, rtol=1e-2)
    for got, want in zip(traced[1:], eager[1:]):
        if heads_kv == 8:
            assert torch.equal(got.grad, want.grad)
        else:
            torch.testing.assert_close(got.grad, want.grad, atol=2e-3, rtol=1e-2)
    with torch.no_grad():  # the inference path traces too (no LSE saved)
        assert torch.equal(fullgraph(fadsl.attention)(q, k, v, causal), out.detach())


def test_attention_dynamic_shapes_one_graph():
    compiled = fullgraph(lambda q, k, v: fadsl.attention(q, k, v, causal=True), dynamic=True)
    for seqlen, batch in ((128, 1), (517, 2), (1000, 3)):
        q, k, v = (randn(batch, seqlen, 4, 128, seed=seqlen + i) for i in range(3))
        assert torch.equal(compiled(q, k, v), fadsl.attention(q, k, v, causal=True))


def test_varlen_compiles_with_dynamic_lengths():
    lengths = [0, 1, 130, 77]
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = starts.cuda()
    q, k, v = (randn(sum(lengths), 8, 128, seed=10 + i) for i in range(3))

    def call(q, k, v, cu, longest):
        return fadsl.attention_varlen(
            q, k, v, cu, cu, longest, longest, causal=True, window_size=(64, 0),
            softcap=30, return_lse=True,
        )  # fmt: skip

    out, lse = call(q, k, v, cu, max(lengths))
    out_c, lse_c = fullgraph(call, dynamic=True)(q, k, v, cu, max(lengths))
    assert torch.equal(out_c, out) and torch.equal(lse_c, lse)


@pytest.mark.parametrize("paged", [True, False])
def test_kvcache_with_new_tokens_compiles(paged):
    batch, heads_kv, capacity = 3, 8, 512
    if paged:
        k_cache = randn(batch * 8, 64, heads_kv, 128, seed=20)
        table = torch.randperm(batch * 8, device="cuda").to(torch.int32).view(batch, 8)
    else:
        k_cache, table = randn(batch, capacity, heads_kv, 128, seed=20), None
    v_cache = randn(*k_cache.shape, seed=21)
    seqlens = torch.tensor([100, 0, 300], device="cuda", dtype=torch.int32)
    q = randn(batch, 2, 32, 128, seed=22)
    k, v = randn(batch, 2, heads_kv, 128, seed=23), randn(batch, 2, heads_kv, 128, seed=24)

    def step(q, k_cache, v_cache, seqlens, k, v, table):
        return fadsl.attention_with_kvcache(
            q, k_cache, v_cache, seqlens, k, v, page_table=table, causal=True
        )

    caches = [t.clone() for t in (k_cache, v_cache)]
    out = step(q, *caches, seqlens, k, v, table)
    traced = [t.clone() for t in (k_cache, v_cache)]
    out_c = fullgraph(step)(q, *traced, seqlens, k, v, table)
    assert torch.equal(out_c, out)
    assert torch.equal(traced[0], caches[0]) and torch.equal(traced[1], caches[1])
    assert not torch.equal(traced[0], k_cache), "the new tokens were written"
    attend_only = fullgraph(
        lambda q, kc, vc, s, t: fadsl.attention_with_kvcache(q, kc, vc, s, page_table=t)
    )
    assert torch.equal(
        attend_only(q, *traced, seqlens + 2, table),
        fadsl.attention_with_kvcache(q, *traced, seqlens + 2, page_table=table),
    )


def test_serving_calls_compile_with_a_window_softcap_and_splits_as_arguments():
    """window_size, softcap and num_splits passed as arguments (dynamo makes them SymInts
    with dynamic=True, and on a second value without it): one kernel per value, as eager."""
    lengths = [100, 37]
    cu = torch.tensor([0, 100, 137], device="cuda", dtype=torch.int32)
    q, k, v = (randn(137, 8, 128, seed=50 + i) for i in range(3))

    def varlen(q, k, v, cu, left, cap):
        return fadsl.attention_varlen(
            q, k, v, cu, cu, 100, 100, causal=True, window_size=(left, 0), softcap=cap
        )

    compiled = fullgraph(varlen, dynamic=True)
    for left, cap in ((32, 30), (64, 50)):
        assert torch.equal(compiled(q, k, v, cu, left, cap), varlen(q, k, v, cu, left, cap))
    cache = randn(2, 256, 8, 128, seed=60)
    seqlens = torch.tensor([200, 7], device="cuda", dtype=torch.int32)
    q1 = randn(2, 1, 32, 128, seed=61)

    def decode(q, cache, seqlens, splits):
        return fadsl.attention_with_kvcache(q, cache, cache, seqlens, num_splits=splits)

    compiled = fullgraph(decode, dynamic=True)
    for splits in (1, 2):
        assert torch.equal(compiled(q1, cache, seqlens, splits), decode(q1, cache, seqlens, splits))


def test_append_kv_compiles():
    k_cache, v_cache = randn(2, 64, 4, 128, seed=30), randn(2, 64, 4, 128, seed=31)
    k_new, v_new = randn(2, 3, 4, 128, seed=32), randn(2, 3, 4, 128, seed=33)
    seqlens = torch.tensor([5, 62], device="cuda", dtype=torch.int32)  # batch 1's 3rd: past 64
    eager = [k_cache.clone(), v_cache.clone()]
    fadsl.append_kv(*eager, k_new, v_new, seqlens)
    traced = [k_cache.clone(), v_cache.clone()]
    fullgraph(fadsl.append_kv)(*traced, k_new, v_new, seqlens)
    assert torch.equal(traced[0], eager[0]) and torch.equal(traced[1], eager[1])
    assert torch.equal(eager[0][0, 5:8], k_new[0]) and torch.equal(eager[0][1, 62:], k_new[1, :2])


def test_a_kvcache_call_with_grad_is_refused_by_name():
    q = randn(1, 1, 8, 128, seed=40).requires_grad_()
    cache = randn(1, 64, 8, 128, seed=41)
    seqlens = torch.tensor([10], device="cuda", dtype=torch.int32)
    with pytest.raises(RuntimeError, match="attention_with_kvcache has no backward"):
        fadsl.attention_with_kvcache(q, cache, cache, seqlens)
