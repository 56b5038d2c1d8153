"""fadsl.attention's window_size and softcap on the GPU: the output, the LSE and the gradients
of q, k and v against float32 autograd of the reference (FlashAttention's rule), both
dtypes, head_dim 64 and 128, causal and not, GQA; and torch.compile(fullgraph=True) over a
capped, windowed forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from test_gpu_backward import assert_compiled_gradients_match_eager, check_rule, inputs
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (causal, window_size, softcap)
CALLS = [
    (False, (128, 64), 0.0),
    (True, (200, 0), 0.0),
    (False, (-1, -1), 30.0),
    (True, (-1, -1), 50.0),
    (False, (-1, 100), 50.0),
    (True, (96, 0), 30.0),
]
# (batch, seqlen_q, seqlen_k, heads, kv heads); the last past 2,048 queries, where head_dim 64
# causal runs examples/fa3_hdim64_causal.fa (persistent CTAs) rather than the short spec
SHAPES = [(1, 1, 1, 2, 1), (2, 300, 700, 4, 2), (1, 900, 333, 8, 2), (1, 2113, 2300, 2, 1)]
CASES = [(c, d, hd, s) for c in CALLS for d in DTYPES for hd in (64, 128) for s in SHAPES]


def _reference(q, k, v, dout, causal, window_size, softcap, dtype):
    """out, lse and the gradients of the reference in ``dtype`` (FlashAttention's
    window_size: -1 unbounded; with causal the right side is 0)."""
    left, right = window_size
    window = None
    if left >= 0 or (right >= 0 and not causal):
        big = 1 << 30
        window = (left if left >= 0 else big, 0 if causal else (right if right >= 0 else big))
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = reference(*leaves, scale, causal, dtype, softcap=softcap or None, window=window)
    (out.to(torch.float32) * dout.to(torch.float32)).sum().backward()
    return out.float(), lse, [t.grad.float() for t in leaves]


@pytest.mark.parametrize(
    "call, dtype, head_dim, shape",
    CASES,
    ids=[f"{c}-{d}-hd{hd}-{'x'.join(map(str, s))}" for c, d, hd, s in CASES],
)
def test_windowed_and_capped_attention_and_its_gradients(call, dtype, head_dim, shape):
    causal, window_size, softcap = call
    torch_dtype = DTYPES[dtype]
    q, k, v, dout = inputs(shape, torch_dtype, head_dim, seed=sum(shape) + head_dim)
    if softcap:
        q = q * 6  # logits past the cap
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fadsl.attention(
        *leaves, causal, window_size=window_size, softcap=softcap, return_lse=True
    )
    out.backward(dout)
    truth_out, truth_lse, truth = _reference(
        q, k, v, dout, causal, window_size, softcap, torch.float32
    )
    own_out, _, own = _reference(q, k, v, dout, causal, window_size, softcap, torch_dtype)
    check_rule(out, truth_out, own_out, "out")
    seen = truth_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)  # rows that see no key: -inf
    if seen.any():
        assert (lse[seen] - truth_lse[seen]).abs().max().item() < 1e-2
    for grad, t, o, what in zip((x.grad for x in leaves), truth, own, ("dq", "dk", "dv")):
        check_rule(grad, t, o, what)


def test_no_grad_calls_take_the_same_kernel():
    q, k, v, _ = inputs((1, 256, 256, 2, 2), torch.bfloat16, 128, seed=4)
    with torch.no_grad():
        eager = fadsl.attention(q, k, v, True, window_size=(64, 0), softcap=30)
    traced = fadsl.attention(
        q.requires_grad_(), k, v, True, window_size=(64, 0), softcap=30
    ).detach()
    assert torch.equal(eager, traced)


def test_compile_fullgraph_over_a_capped_windowed_step():
    q, k, v, dout = inputs((2, 300, 300, 4, 2), torch.bfloat16, 128, seed=11)

    def step(q, k, v):
        out = fadsl.attention(q, k, v, False, window_size=(100, 20), softcap=30.0)
        return (out.float() * dout.float()).sum()

    assert_compiled_gradients_match_eager(step, q, k, v)
