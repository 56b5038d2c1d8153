"""A padded backward call's launch plan (fadsl/runtime/backward_plans.py) on the GPU: through
``torch.autograd.grad``, a signature's third call (on other tensors, through its plan) gives
the checked path's gradients on the same tensors (bit for bit with `deterministic on`, to
the fp32 atomics' reordering otherwise), leaves the gradients of the call before untouched
(no address of an earlier call survives in the plan), and stays within FlashAttention's rule
against a float32 reference. CPU twin: tests/test_backward_plans.py.
`GPU_TESTS=tests/test_gpu_backward_plans.py bash scripts/device.sh tests`."""

from __future__ import annotations

import pytest
import torch

import fadsl
from conftest import ROOT
from training_specs import training_spec

from fadsl.runtime.plans import PlanCache

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]
BF = torch.bfloat16
# (spec as training_spec names it, heads (q, kv), seqlen_q, seqlen_k, causal)
CASES = {
    "fa3_causal GQA": ("fa3_causal", (4, 2), 300, 317, True),
    "fa3_hopper MQA": ("fa3_hopper", (4, 1), 257, 130, False),
    "fa3_hdim64 persistent": ("fa3_hdim64", (4, 2), 200, 333, False),
    "fa3_hdim64_causal": ("fa3_hdim64_causal", (2, 2), 333, 200, True),
    "deterministic GQA": ("fa3_causal+deterministic-dqred", (4, 2), 300, 317, True),
    "fused_convert, keyless rows": ("fa3_causal+fused_convert", (2, 2), 400, 150, True),
}
_loaded: dict[str, object] = {}


def kernel(name: str):
    if name not in _loaded:
        if name.startswith("modifiers/"):
            text = (ROOT / "examples" / f"{name}.fa").read_text()
        else:
            text = training_spec(name)
        _loaded[name] = fadsl.load(text, verbose=False)
    return _loaded[name]


def tensors(kern, heads, sq, sk, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d = kern.config.head_dim

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=BF, generator=gen)

    return (
        randn(2, sq, heads[0], d),
        randn(2, sk, heads[1], d),
        randn(2, sk, heads[1], d),
        randn(2, sq, heads[0], d),
    )


def grads(kern, q, k, v, dout, checked=False, **named):
    """(dq, dk, dv) through torch.autograd.grad; ``checked``: the signature unseen (a fresh
    PlanCache for the backward), so the checked path runs."""
    kernels = kern._backward_kernels()
    kept = kernels.plans
    if checked:
        kernels.plans = PlanCache()
    try:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = kern(*leaves, **named)
        return torch.autograd.grad(out, leaves, dout)
    finally:
        kernels.plans = kept


def reference(q, k, v, dout, causal: bool):
    """float32 gradients (bottom-right causal mask, GQA by repeating K/V heads)."""
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    qf, kf, vf = leaves
    group = q.shape[2] // k.shape[2]
    kf2, vf2 = (t.repeat_interleave(group, dim=2) for t in (kf, vf))
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf2) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device="cuda")[:, None]
        j = torch.arange(sk, device="cuda")[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf2)
    return torch.autograd.grad(out, leaves, dout.float())


@pytest.mark.parametrize("case", list(CASES))
def test_a_plans_gradients_are_the_checked_paths(case):
    name, heads, sq, sk, causal = CASES[case]
    kern = kernel(name)
    kern._backward_kernels().plans.clear()
    first = tensors(kern, heads, sq, sk, 1)
    grads(kern, *first)  # a signature's first call
    before = [g.clone() for g in grads(kern, *first)]  # its second: planned
    kept = grads(kern, *first)  # (a planned call's gradients, to watch below)
    assert len(kern._backward_kernels().plans) == 1
    kept_copy = [g.clone() for g in kept]
    second = tensors(kern, heads, sq, sk, 2)
    planned = grads(kern, *second)
    checked = grads(kern, *second, checked=True)
    bitwise = "deterministic" in name
    for p, c, g, name_ in zip(planned, checked, reference(*second, causal), "qkv"):
        if bitwise:
            assert torch.equal(p, c), name_
        else:  # (fp32 atomics add in another order each run)
            torch.testing.assert_close(p.float(), c.float(), atol=2e-2, rtol=2e-2)
        base = (c.float() - g).abs().max()
        assert (p.float() - g).abs().max() <= 2 * base + 1e-3, (name_, base)
    for g, copy in zip(kept, kept_copy):
        assert torch.equal(g, copy)  # (the later calls wrote nothing of this call's)
    for b, g in zip(before, kept):
        torch.testing.assert_close(b, g, atol=2e-2, rtol=2e-2)


def test_a_document_plan_with_classes_made_ahead():
    kern = kernel("modifiers/document_causal")
    kern._backward_kernels().plans.clear()

    def call(seed):
        q, k, v, dout = tensors(kern, (4, 2), 300, 300, seed)
        ids = (torch.arange(300, device="cuda") // 97).int().expand(2, 300).contiguous()
        named = {"q_doc": ids, "kv_doc": ids.clone()}
        named["keep_classes"] = kern.keep_classes(q, k, **named)
        return (q, k, v, dout), named

    for seed in (1, 2):
        args, named = call(seed)
        grads(kern, *args, **named)
    assert len(kern._backward_kernels().plans) == 1
    args, named = call(3)
    planned = grads(kern, *args, **named)
    checked = grads(kern, *args, checked=True, **named)
    for p, c in zip(planned, checked):
        torch.testing.assert_close(p.float(), c.float(), atol=2e-2, rtol=2e-2)
