"""D's rounding and the learnable inputs' gradients (fadsl/sm90_bwd_learn.cuh; docs/numerics.md,
"Learnable inputs"), on the CPU: a model of the backward's arithmetic for ALiBi's slopes and the
T5 table at the GPU test's non-square shapes, against float64 autograd and PyTorch's own error
in the input dtype (tests/test_gpu_modifiers_learnable.py's rule).

The model: O rounded to the input dtype (the forward's output), D = rowsum(dO O) - dLSE from
it (the preprocess), dS' = P (dP - D) and the plain sum of dS' x factor at each score's index
(what the kernel added before D's correction); then the correction as the kernel makes it,
per query row: R = -dLSE + sum dS' (ends as eps, D's rounding's error), W = sum of P x factor
over the scores whose index is the row's reference element (the diagonal key's, clamped;
P in 16 bits for uniform reads, fp32 for scattered: bwd_learn_p32), -R W added there. The
corrected sums meet the rule in every case, the plain ones break it as the H200 measured
(ALiBi at non-square shapes, T5 where seqlen_q > seqlen_k: PLAIN_FAILS)."""

from __future__ import annotations

import math

import pytest
import torch

from fadsl.pipeline import compile_source
from modifier_eval import evaluate
from test_modifiers_learnable import ALIBI, T5, t5_bucket

SHAPES = [(300, 1100), (1000, 333), (257, 700)]  # tests/test_gpu_modifiers_backward.py's
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BATCH, HEADS, HEAD_DIM = 2, 2, 128  # the slopes' and table's heads, each over BATCH x sq rows
# (kind, dtype, shape, with_lse) whose plain sum breaks the rule in this model by 1.5x or more:
# ALiBi's factor kv_idx - q_idx has a row-constant part of hundreds, and T5 at 1000 x 333 sees
# bucket 31 alone, whose true gradient is 0. (The H200 broke it at every ALiBi non-square
# case, 2026-11-30; here another draw of the inputs moves both the plain sum's error and
# PyTorch's own, and fp16 rounds O 4 x finer, so some cases stay within the rule.)
PLAIN_FAILS = {("t5", dt, (1000, 333), lse) for dt in DTYPES for lse in (False, True)} | {
    ("alibi", "bf16", (300, 1100), False),
    ("alibi", "bf16", (300, 1100), True),
    ("alibi", "bf16", (1000, 333), True),
    ("alibi", "bf16", (257, 700), False),
    ("alibi", "fp16", (300, 1100), True),
    ("alibi", "fp16", (1000, 333), False),
    ("alibi", "fp16", (1000, 333), True),
}


def reads(kind: str, sq: int, sk: int):
    """(factor, flat index into the input, scattered) per score, (HEADS, sq, sk): the read's
    d score / d x and where x lies in the input (examples' `slopes[h]`, `bias[h, bucket]`)."""
    h = torch.arange(HEADS)[:, None, None]
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    if kind == "alibi":
        return (j - i).double().expand(HEADS, sq, sk), h.expand(HEADS, sq, sk), False
    return torch.ones(HEADS, sq, sk, dtype=torch.float64), h * 32 + t5_bucket(i, j), True


def test_the_models_reads_are_the_irs():
    """reads()'s factors and indices are the examples' derivatives and indices (the IR's,
    evaluated) on a sample of scores."""
    for text, kind, size in ((ALIBI, "alibi", HEADS), (T5, "t5", 32)):
        (grad,) = compile_source(text, "x.fa").kernel.config.modifiers.input_grads
        sq, sk = 40, 1100
        factor, index, _ = reads(kind, sq, sk)
        for h, qi, kj in [(0, 0, 0), (1, 39, 0), (0, 7, 1099), (1, 30, 21), (0, 39, 39)]:
            env = {"s": 0.0, "b": 0, "h": h, "q_idx": qi, "kv_idx": kj}
            where = [evaluate(x, env) for x in grad.indices]
            flat = where[0] * (size if len(where) > 1 else 1) + (where[1] if len(where) > 1 else 0)
            assert index[h, qi, kj].item() == flat
            assert factor[h, qi, kj].item() == evaluate(grad.derivative, env)


def attention(q, k, v, x, kind, work, dtype):
    """out, lse, P of causal (bottom-right) attention with the read's bias, in ``dtype``
    products (softmax in ``work``), as test_gpu_general's reference."""
    sq, sk = q.shape[-2], k.shape[-2]
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    if kind == "alibi":
        bias = x.to(work)[:, None, None] * (j - i).to(work)
    else:
        bias = x.to(work)[:, t5_bucket(i, j)]
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)).to(work) * HEAD_DIM**-0.5 + bias
    s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.matmul(p.to(dtype), v.to(dtype)).to(work), lse, p


def autograd(q, k, v, dout, dlse, x0, kind, dtype):
    """The input's gradient of <out, dout> + <lse, dlse> (rows that see no key: no LSE term),
    computed in ``dtype`` (float64: the truth)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    x = x0.to(work).requires_grad_()
    out, lse, _ = attention(q, k, v, x, kind, work, dtype)
    seen = torch.where(lse.isinf(), 0.0, lse)
    ((out.double() * dout.double()).sum() + (seen.double() * dlse.double()).sum()).backward()
    return x.grad.double()


def model(q, k, v, dout, dlse, x0, kind, dtype):
    """(plain, corrected): the kernel's sums, before and with D's correction (module doc)."""
    sq, sk = q.shape[-2], k.shape[-2]
    factor, index, scattered = reads(kind, sq, sk)
    factor, index = (t.expand(BATCH, HEADS, sq, sk) for t in (factor, index))
    out, lse, p = attention(q, k, v, x0.double(), kind, torch.float64, torch.float64)
    seen = ~lse.isinf()
    d = (dout.double() * out.to(dtype).double()).sum(-1) - dlse.double()  # the preprocess's D
    ds = p * (dout.double() @ v.double().transpose(-1, -2) - d[..., None])
    plain = torch.zeros(x0.numel(), dtype=torch.float64).index_add_(
        0, index.flatten(), (ds * factor).flatten()
    )
    eps = torch.where(seen, ds.sum(-1) - dlse.double(), 0.0)  # R: -dLSE, then every dS'
    ref = torch.clamp(torch.arange(sq) + sk - sq, 0, sk - 1)  # bwd_learn_ref
    at_ref = index.gather(3, ref.expand(BATCH, HEADS, sq)[..., None])  # (BATCH, HEADS, sq, 1)
    p_w = p.float().double() if scattered else p.to(dtype).double()  # bwd_learn_p32
    w = (p_w * factor * (index == at_ref)).sum(-1)
    fixed = plain.clone().index_add_(0, at_ref.flatten(), (-eps * w).flatten())
    return plain.view_as(x0), fixed.view_as(x0)


def inputs(kind: str, dtype, sq: int, sk: int, with_lse: bool):
    g = torch.Generator().manual_seed(sq * 31 + sk + (7 if with_lse else 0))
    q, k, v, dout = (
        torch.randn(BATCH, HEADS, n, HEAD_DIM, generator=g).to(dtype) for n in (sq, sk, sk, sq)
    )
    dlse = torch.randn(BATCH, HEADS, sq, generator=g) if with_lse else torch.zeros(BATCH, HEADS, sq)
    if kind == "alibi":
        x0 = torch.tensor([2.0 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)])
    else:
        x0 = torch.randn(HEADS, 32, generator=g) * 0.5
    return q, k, v, dout, dlse, x0


CASES = [
    (kind, dt, s, lse)
    for kind in ("alibi", "t5")
    for dt in DTYPES
    for s in SHAPES
    for lse in (False, True)
]


@pytest.mark.parametrize(
    "kind, dt, shape, with_lse",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{c[2][0]}x{c[2][1]}{'-lse' if c[3] else ''}" for c in CASES],
)
def test_d_rounding_correction_meets_the_gpu_rule(kind, dt, shape, with_lse):
    dtype = DTYPES[dt]
    q, k, v, dout, dlse, x0 = inputs(kind, dtype, *shape, with_lse)
    truth = autograd(q, k, v, dout, dlse, x0, kind, torch.float64)
    own = autograd(q, k, v, dout, dlse, x0, kind, dtype)
    plain, fixed = model(q, k, v, dout, dlse, x0, kind, dtype)
    mine = (own - truth).abs().max().item()
    rule = 2 * mine + 1e-4 + 1e-6 * truth.abs().max().item()  # the GPU test's, for an input
    err = (fixed - truth).abs().max().item()
    assert math.isfinite(err) and err <= rule, f"corrected: {err:.3g} > {rule:.3g}"
    before = (plain - truth).abs().max().item()
    if (kind, dt, shape, with_lse) in PLAIN_FAILS:
        assert before > rule, f"the plain sum meets the rule ({before:.3g} <= {rule:.3g})"
    assert err <= before  # never worse than without it, here
