"""GPU tests of general attention: tails, seqlen_q != seqlen_k, causal, GQA/MQA, head dims, LSE.

FlashAttention's matrix of sequence-length pairs, head dims 64, 96, 128 and 256, causal on and off,
GQA ratios 1, 4 and 8 and MQA, both dtypes; tolerance as in test_gpu.py, and the LSE within
1e-3 relative of torch.logsumexp over the float32 scores. Outputs are poisoned first.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import fadsl
from gpu_specs import general_specs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SEQLENS = [(113, 203), (128, 217), (108, 256), (1023, 1024), (1024, 1023), (1, 4096), (4096, 1),
           (64, 128), (256, 512), (512, 256), (200, 100), (1, 1)]  # fmt: skip
HEADS = [(8, 8), (8, 2), (16, 2), (8, 1)]  # GQA ratios 1, 4, 8 and MQA
SPECS = general_specs()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

CASES = [
    (name, dtype, sq, sk, *HEADS[i % len(HEADS)])
    for i, (name, dtype, (sq, sk)) in enumerate(itertools.product(SPECS, DTYPES, SEQLENS))
]


@pytest.fixture(scope="module")
def kernels():
    return {name: fadsl.load(text, verbose=False) for name, text in SPECS.items()}


def reference(q, k, v, scale, causal, dtype, softcap=None, window=None, bias=None, keep=None):
    """Attention and LSE with GQA and a bottom-right causal mask, in ``dtype`` (softmax in fp32;
    all of it in float64 for float64). Rows that see no key give 0 and LSE -inf. ``softcap``:
    the scores capped, softcap tanh(s scale / softcap), before the mask. ``window``: (left,
    right), FlashAttention's window_size: query i sees key j iff i + sk - sq - left <= j <=
    i + sk - sq + right (with ``causal`` too). ``bias(i, j)``: added to the scaled scores (a
    (heads, sq, sk) tensor); ``keep``: a boolean (batch, heads, sq, sk) or broadcastable
    tensor, False masked (score modifiers and keep predicates)."""
    sq, sk = q.shape[1], k.shape[1]
    groups = q.shape[2] // k.shape[2]
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    scores = torch.matmul(q, k.transpose(2, 3)).to(work) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        rows = torch.arange(sq, device=q.device)[:, None]
        scores = scores + bias(rows, torch.arange(sk, device=q.device)[None, :]).to(work)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + sk - sq, float("-inf"))
    if window is not None:
        left, right = window
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        outside = (j < i + sk - sq - left) | (j > i + sk - sq + right)
        scores = scores.masked_fill(outside, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs.to(dtype), v).to(work)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize(
    "name, dtype, sq, sk, hq, hkv", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_general_attention(kernels, name, dtype, sq, sk, hq, hkv):
    kern = kernels[name]
    d = kern.config.head_dim
    causal = kern.config.mask.value == "causal"
    torch.manual_seed(sq * 7919 + sk)
    q = torch.randn(2, sq, hq, d, device="cuda", dtype=DTYPES[dtype])
    k = torch.randn(2, sk, hkv, d, device="cuda", dtype=DTYPES[dtype])
    v = torch.randn(2, sk, hkv, d, device="cuda", dtype=DTYPES[dtype])
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    out, lse = kern(q, k, v, scale, out=out, return_lse=True)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, scale, causal, torch.float64)
    low, _ = reference(q, k, v, scale, causal, DTYPES[dtype])
    assert not out.isnan().any(), "some outputs were never written (or are NaN)"
    err = (out.float() - ref.float()).abs().max().item()
    bound = 2 * (low - ref.float()).abs().max().item() + 1e-3
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"
    ref_lse = ref_lse.float()
    empty = ref_lse == float("-inf")
    assert torch.equal(lse == float("-inf"), empty), "rows with no key must have LSE -inf"
    rel = ((lse[~empty] - ref_lse[~empty]).abs() / ref_lse[~empty].abs().clamp_min(1.0)).max()
    assert rel.item() <= 1e-3 if (~empty).any() else True
    if empty.any():
        rows = empty.transpose(1, 2)  # (batch, seqlen_q, heads)
        assert (out.float()[rows] == 0).all(), "rows with no key must output 0"


def test_causal_skips_blocks_above_the_diagonal(kernels):
    """Causal at seqlen 4096 runs at least 1.7x faster than the same spec without the mask."""
    times = {}
    for mask in ("none", "causal"):
        kern = kernels[f"general_d128_{mask}"]
        q, k, v = (
            torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
        )
        for _ in range(5):
            kern(q, k, v)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(20):
            start.record()
            kern(q, k, v)
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        times[mask] = sorted(samples)[len(samples) // 2]
    assert times["none"] / times["causal"] >= 1.7, times
