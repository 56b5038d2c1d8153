"""Each ring step's attention on one GPU: fadsl's kernels (ShippedStep) against the same
maths in fp32 torch (ReferenceStep) on the inputs a ring hands a step, for every plan of
fadsl/distributed/varlen.py (the local causal step, all queries against the first chunk of
each sequence's keys, the second chunk of queries against all keys): the step's output and
LSE, and its dq, dk, dv (within 2 % of the largest value: a wrong row shows far above bf16's
rounding) given a whole call's output and LSE, not the step's own (P = exp(S - LSE) then sums
to less than one per row, as in a ring)."""

from __future__ import annotations

import math

import pytest
import torch

from fadsl.distributed.steps import ReferenceStep, ShippedStep
from fadsl.distributed.varlen import _Halves, _plan, _take

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

LOCAL = [256, 768, 512]  # each sequence's local rows on a rank (two chunks of each)


def _inputs(tokens, heads, heads_kv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(
        *s, device="cuda", dtype=torch.bfloat16, generator=g
    )  # noqa: E731
    return rand(tokens, heads, d), rand(tokens, heads_kv, d), rand(tokens, heads_kv, d), g


@pytest.mark.parametrize("src", ["same", "earlier", "later"])
@pytest.mark.parametrize("d, heads, heads_kv", [(128, 8, 2), (64, 4, 4)])
def test_a_varlen_ring_step_matches_the_reference(src, d, heads, heads_kv):
    cu = torch.tensor(
        [0, *torch.tensor(LOCAL).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    tokens = int(cu[-1])
    q, k, v, g = _inputs(tokens, heads, heads_kv, d, seed=d + heads)
    rank, source = 1, {"same": 1, "earlier": 0, "later": 2}[src]
    rows, keys, cu_q, cu_k, max_q, max_k, masked = _plan(True, rank, source, _Halves(cu), cu)
    qs, ks, vs = _take(q, rows), _take(k, keys), _take(v, keys)
    scale = 1.0 / math.sqrt(d)
    shipped, reference = ShippedStep(), ReferenceStep()
    out, lse = shipped.forward_varlen(qs, ks, vs, cu_q, cu_k, max_q, max_k, masked, scale)
    ref_out, ref_lse = reference.forward_varlen(qs, ks, vs, cu_q, cu_k, max_q, max_k, masked, scale)
    assert (
        out.float() - ref_out.float()
    ).abs().max().item() < 2e-2 * ref_out.float().abs().max().item(), "out"
    assert (lse - ref_lse).abs().max().item() < 1e-3, "lse"
    # a whole call's output and LSE: other steps' keys add mass to every row
    whole_out = torch.randn(qs.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    whole_lse = ref_lse + 0.5 + torch.rand(ref_lse.shape, device="cuda", generator=g)
    dout = torch.randn(qs.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    args = (qs, ks, vs, whole_out, whole_lse.contiguous(), dout, cu_q, cu_k, max_q, masked, scale)
    ours = shipped.backward_varlen(*args)
    theirs = reference.backward_varlen(*args)  # fp32 maths, rounded to bf16
    for a, t, what in zip(ours, theirs, ("dq", "dk", "dv")):
        assert a.shape == t.shape and a.dtype == t.dtype, what
        err = (a.float() - t.float()).abs().max().item() / t.float().abs().max().item()
        assert err < 2e-2, f"{src} {what}: max error {err:.3g} of the largest"
