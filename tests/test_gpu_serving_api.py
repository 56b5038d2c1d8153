"""fadsl.attention_varlen and fadsl.attention_with_kvcache on the GPU (issue 31): the shipped
serving specs (examples/serving/) with the lines each call sets (mask, window, softcap, the
cache's layout, PackGQA or not, splits), against float64 per sequence or batch with
FlashAttention's rule; the LSE within 1e-3 and -inf exactly where the reference's is. The
kv-cache calls append new tokens first where given (the cache then holds them after each
batch's keys, and cache_seqlens is left as it was). Lengths include 0 and 1 and page edges.
`GPU_TESTS=tests/test_gpu_serving_api.py bash scripts/device.sh tests`."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]


def _window(causal: bool, window_size):
    """The reference's window: (left, right) with -1 read as unbounded, or None."""
    left, right = window_size
    if left < 0 and (right < 0 or causal):
        return None
    return (left if left >= 0 else 1 << 30, 0 if causal else right)


def compare(what, q, k, v, out, lse, scale, causal, window, softcap):
    """One sequence (q (1, sq, hq, d), k and v (1, sk, hkv, d)) against float64."""
    cap = softcap or None
    ref, ref_lse = reference(q, k, v, scale, causal, torch.float64, cap, window)
    low, _ = reference(q, k, v, scale, causal, q.dtype, cap, window)
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"
    empty = ref_lse[0] == -math.inf
    got = lse.double()
    assert torch.equal(got == -math.inf, empty), f"{what}: LSE -inf rows"
    if (~empty).any():
        rel = (got - ref_lse[0]).abs() / ref_lse[0].abs().clamp_min(1.0)
        assert rel[~empty].max().item() <= 1e-3, f"{what}: LSE"


VARLEN_CASES = [  # head_dim, causal, window_size, softcap, dtype
    (128, True, (-1, -1), 0, torch.bfloat16),
    (128, False, (-1, -1), 0, torch.float16),
    (64, True, (-1, -1), 0, torch.bfloat16),
    (128, True, (64, 0), 30, torch.bfloat16),
]


@pytest.mark.parametrize(
    "head_dim, causal, window_size, softcap, dtype",
    VARLEN_CASES,
    ids=[f"d{c[0]}-{'causal' if c[1] else 'none'}-w{c[2][0]}-cap{c[3]}" for c in VARLEN_CASES],
)
def test_attention_varlen_matches_each_sequence(head_dim, causal, window_size, softcap, dtype):
    lengths_q, lengths_k = [1, 300, 0, 129, 1000, 64], [1, 300, 5, 0, 1000, 700]
    hq, hkv = 8, 2
    torch.manual_seed(head_dim + softcap)
    q = torch.randn(sum(lengths_q), hq, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths_k), hkv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    starts_q = [0, *torch.tensor(lengths_q).cumsum(0).tolist()]
    starts_k = [0, *torch.tensor(lengths_k).cumsum(0).tolist()]
    cu_q = torch.tensor(starts_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(starts_k, dtype=torch.int32, device="cuda")
    out, lse = fadsl.attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        return_lse=True,
    )
    torch.cuda.synchronize()
    scale = head_dim**-0.5
    window = _window(causal, window_size)
    for b in range(len(lengths_q)):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 > q0:
            compare(
                f"sequence {b}",
                q[None, q0:q1],
                k[None, k0:k1],
                v[None, k0:k1],
                out[None, q0:q1],
                lse[:, q0:q1],
                scale,
                causal,
                window,
                softcap,
            )


@pytest.mark.parametrize("head_dim", [128, 64])
def test_a_long_causal_batch_runs_a_cta_per_tile_and_matches(monkeypatch, head_dim):
    """max_seqlen_q >= LONG_CAUSAL_ROWS: the call runs its spec with `scheduler grid`; each
    sequence (a long one among short and empty ones) against float64."""
    from fadsl.runtime import dispatch

    lengths = [9000, 1, 2500, 0, 129]
    hq, hkv, dtype = 8, 2, torch.bfloat16
    torch.manual_seed(head_dim)
    q = torch.randn(sum(lengths), hq, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths), hkv, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(starts, dtype=torch.int32, device="cuda")
    ran = []
    monkeypatch.setattr(dispatch, "_CHOSEN", {})
    serving_kernel = dispatch._serving_kernel
    monkeypatch.setattr(
        dispatch, "_serving_kernel", lambda *a: ran.append(serving_kernel(*a)) or ran[-1]
    )
    out, lse = fadsl.attention_varlen(
        q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_lse=True
    )
    torch.cuda.synchronize()
    assert len(ran) == 1 and not ran[0].config.ext.persistent
    for b in range(len(lengths)):
        q0, q1 = starts[b], starts[b + 1]
        if q1 > q0:
            compare(
                f"sequence {b}",
                q[None, q0:q1],
                k[None, q0:q1],
                v[None, q0:q1],
                out[None, q0:q1],
                lse[:, q0:q1],
                head_dim**-0.5,
                True,
                None,
                0,
            )


KV_CASES = [  # page (0: contiguous), causal, window_size, new tokens, heads_q, heads_kv, softcap
    (64, True, (-1, -1), 0, 32, 8, 0),
    (16, False, (-1, -1), 3, 32, 8, 0),
    (0, True, (-1, -1), 1, 32, 8, 30),
    (64, True, (100, 0), 0, 32, 8, 0),  # a window: no PackGQA, no splits
    (64, False, (40, 2), 3, 32, 8, 0),  # a window on both sides
    (32, True, (-1, -1), 2, 24, 8, 0),  # a group of 3: no PackGQA
]


@pytest.mark.parametrize(
    "page, causal, window_size, new, hq, hkv, softcap",
    KV_CASES,
    ids=[f"p{c[0]}-{'causal' if c[1] else 'none'}-w{c[2][0]}-new{c[3]}-{c[4]}_{c[5]}-cap{c[6]}" for c in KV_CASES],
)  # fmt: skip
def test_attention_with_kvcache_matches_each_batch(
    page, causal, window_size, new, hq, hkv, softcap
):
    lengths, d, capacity, dtype = [0, 1, 63, 64, 65, 1000], 128, 1088, torch.bfloat16
    batch = len(lengths)
    torch.manual_seed(page + new + hq)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if page:
        per = capacity // page
        pages = batch * per + 2
        k_cache = torch.randn(pages, page, hkv, d, device="cuda", dtype=dtype)
        table = torch.randperm(pages, device="cuda")[: batch * per].view(batch, per)
        table = table.to(torch.int32).contiguous()
    else:
        k_cache = torch.randn(batch, capacity, hkv, d, device="cuda", dtype=dtype)
        table = None
    v_cache = torch.randn_like(k_cache)
    k_new = torch.randn(batch, new, hkv, d, device="cuda", dtype=dtype) if new else None
    v_new = torch.randn_like(k_new) if new else None
    q = torch.randn(batch, max(new, 1), hq, d, device="cuda", dtype=dtype)
    out, lse = fadsl.attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        seqlens,
        k_new,
        v_new,
        page_table=table,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        return_lse=True,
    )
    torch.cuda.synchronize()
    assert seqlens.tolist() == lengths, "cache_seqlens is the caller's to advance"
    scale = d**-0.5
    window = _window(causal, window_size)
    for b, n in enumerate(lengths):
        if page:
            rows = table[b].long()
            kb = k_cache[rows].reshape(-1, hkv, d)[: n + new]
            vb = v_cache[rows].reshape(-1, hkv, d)[: n + new]
        else:
            kb, vb = k_cache[b, : n + new], v_cache[b, : n + new]
        if new:
            assert torch.equal(kb[n:], k_new[b]) and torch.equal(vb[n:], v_new[b]), "appended"
        compare(
            f"batch {b} ({n} + {new} keys)",
            q[b : b + 1],
            kb[None],
            vb[None],
            out[b : b + 1],
            lse[b],
            scale,
            causal,
            window,
            softcap,
        )
