"""`softcap N` on the GPU: the capped specs (tests/specs/sm90/fa3_softcap*.fa) in every rescale
mode, both dtypes, causal and not, GQA, tails, rows that see no key, and large logits (where
the cap decides the result), against float64 with FlashAttention's rule; the LSE within 1e-3."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from gpu_specs import softcap_specs
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

SPECS = softcap_specs()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SHAPES = [(1, 1, 1.0), (300, 1100, 1.0), (1000, 333, 1.0), (257, 700, 30.0)]  # sq, sk, q/k scale
CASES = [(n, d, *shape) for n in SPECS for d in DTYPES for shape in SHAPES]
_loaded: dict[str, object] = {}


def kernel(name):
    if name not in _loaded:
        _loaded[name] = fadsl.load(SPECS[name], verbose=False)
    return _loaded[name]


@pytest.mark.parametrize(
    "name, dtype, sq, sk, size",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}-x{c[4]:g}" for c in CASES],
)
def test_capped_attention_matches_float64(name, dtype, sq, sk, size):
    kern = kernel(name)
    cap = kern.config.ext.softcap
    causal = kern.config.mask.value == "causal"
    d = kern.config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(sq * 31 + sk)
    q = size * torch.randn(2, sq, 8, d, device="cuda", generator=gen)
    k = size * torch.randn(2, sk, 2, d, device="cuda", generator=gen)
    v = torch.randn(2, sk, 2, d, device="cuda", generator=gen)
    q, k, v = (t.to(DTYPES[dtype]) for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 8, sq), float("nan"), device="cuda", dtype=torch.float32)
    scale = d**-0.5
    kern.forward_into(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, scale, causal, torch.float64, softcap=cap)
    low, _ = reference(q, k, v, scale, causal, q.dtype, softcap=cap)
    assert not out.isnan().any(), "outputs never written (or NaN)"
    bound = 2 * (low - ref).abs().max().item() + 1e-3
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"
    empty = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty)
    if (~empty).any():
        rel = (lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
        assert rel[~empty].max().item() <= 1e-3
    if size > 1:  # the cap decides: without it the result differs
        uncapped = reference(q, k, v, scale, causal, torch.float64)[0]
        assert (uncapped - ref).abs().max().item() > 10 * bound, "the cap did not matter here"
