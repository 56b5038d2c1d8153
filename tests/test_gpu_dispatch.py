"""fadsl.attention on the GPU: every shipped spec this GPU runs, both dtypes, against float64
with FlashAttention's rule (LSE within 1e-3), GQA and a tail; the kernel it loads is the
example's, built once."""

from __future__ import annotations

import pytest
import torch

import fadsl
from fadsl.runtime import dispatch
from test_gpu_numerics import assert_fa_rule

GPU = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")]


def covered() -> list[tuple[int, bool]]:
    if not GPU:
        return []
    capability = torch.cuda.get_device_capability(0)
    return sorted({key for t in dispatch._candidates(capability) for key in t.shipped})


CASES = [(d, c, dtype) for d, c in covered() for dtype in (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(
    "head_dim, causal, dtype", CASES, ids=[f"{d}-{c}-{t}" for d, c, t in CASES]
)
def test_attention_matches_float64(head_dim, causal, dtype):
    gen = torch.Generator(device="cuda").manual_seed(head_dim + causal)
    q = torch.randn(2, 333, 8, head_dim, device="cuda", generator=gen).to(dtype)
    k = torch.randn(2, 500, 2, head_dim, device="cuda", generator=gen).to(dtype)
    v = torch.randn(2, 500, 2, head_dim, device="cuda", generator=gen).to(dtype)
    out, lse = fadsl.attention(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert_fa_rule(out, lse, q, k, v, head_dim**-0.5, causal)
    capability = torch.cuda.get_device_capability(0)
    name = dispatch.shipped_spec(capability, head_dim, causal, q.shape[1])
    assert dispatch._LOADED[name].config.name == name  # the example's kernel, kept
    again = fadsl.attention(q, k, v, causal=causal)
    assert torch.equal(again, out)


def short_specs() -> list[tuple[int, bool, int]]:
    if not GPU:
        return []
    capability = torch.cuda.get_device_capability(0)
    return sorted(
        (d, c, limit)
        for t in dispatch._candidates(capability)
        for (d, c), (limit, _) in t.shipped_short.items()
    )


@pytest.mark.parametrize("head_dim, causal, limit", short_specs())
def test_short_and_long_queries_run_their_specs_and_agree_with_float64(head_dim, causal, limit):
    """On both sides of Target.shipped_short's threshold: the spec each side runs (the short
    one up to the limit), its output within FlashAttention's rule, and under
    torch.compile(dynamic=True) the same outputs as eager on both sides."""
    capability = torch.cuda.get_device_capability(0)
    compiled = torch.compile(
        lambda q, k, v: fadsl.attention(q, k, v, causal=causal), fullgraph=True, dynamic=True
    )
    for seqlen in (limit - 77, limit, limit + 1, limit + 300):
        gen = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k, v = (
            torch.randn(1, seqlen, 4, head_dim, device="cuda", generator=gen).to(torch.bfloat16)
            for _ in range(3)
        )
        out, lse = fadsl.attention(q, k, v, causal=causal, return_lse=True)
        torch.cuda.synchronize()
        assert_fa_rule(out, lse, q, k, v, head_dim**-0.5, causal)
        name = dispatch.shipped_spec(capability, head_dim, causal, seqlen)
        long_name = dispatch.shipped_spec(capability, head_dim, causal)
        assert (name != long_name) == (seqlen <= limit), seqlen
        assert dispatch._LOADED[name].config.name == name
        assert torch.equal(compiled(q, k, v), out), seqlen


def test_this_gpu_has_shipped_specs():
    assert any(t.shipped for t in dispatch._candidates(torch.cuda.get_device_capability(0)))
