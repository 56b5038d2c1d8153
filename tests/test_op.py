"""The torch operator around a kernel, on the CPU: the launch is replaced by a reference so
that the plumbing runs here (torch.compile fullgraph, fake tensors, autograd's error);
tests/test_gpu_runtime.py runs the real kernels."""

from __future__ import annotations

import pytest
import torch

import fadsl
from conftest import ROOT
from fadsl.ir import Dtype
from fadsl.runtime.attention import FlashAttention

SPEC = ROOT / "examples" / "fa2_causal.fa"


def reference(q, k, v, scale, causal):
    sq, sk = q.shape[1], k.shape[1]
    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.float().transpose(1, 2) for t in (q, k, v))
    kt, vt = kt.repeat_interleave(groups, 1), vt.repeat_interleave(groups, 1)
    s = qt @ kt.transpose(2, 3) * scale
    if causal:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    return (s.softmax(-1) @ vt).transpose(1, 2).to(q.dtype), s.logsumexp(-1)


@pytest.fixture
def kern(monkeypatch):
    """The causal example with CPU tensors allowed and the launch done by the reference."""
    calls = []
    original = FlashAttention.check_inputs

    def check_inputs(self, q, k, v):
        try:
            return original(self, q, k, v)
        except ValueError as err:  # every check but the last, the device's, applies
            if "must be on a CUDA device" not in str(err):
                raise
            return Dtype.BF16

    def launch(self, dtype, q, k, v, out, lse, scale, inputs=()):
        calls.append(scale)
        o, l = reference(q, k, v, scale, causal=True)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)

    monkeypatch.setattr(FlashAttention, "check_inputs", check_inputs)
    monkeypatch.setattr(FlashAttention, "launch", launch)
    monkeypatch.setattr(fadsl.runtime.arguments, "check_base", lambda name, t, target="sm_80": None)
    kern = fadsl.load(SPEC, verbose=False)
    kern.calls = calls
    return kern


def inputs(requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 48, 4, 128, generator=gen).bfloat16()
    k = torch.randn(2, 64, 2, 128, generator=gen).bfloat16()
    v = torch.randn(2, 64, 2, 128, generator=gen).bfloat16()
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def test_ops_are_registered_under_the_kernel_name_and_spec_hash(kern):
    name = kern.op_name
    assert name.startswith("fa2_causal_") and len(name) == len("fa2_causal_") + 12
    assert hasattr(torch.ops.fadsl, name) and hasattr(torch.ops.fadsl, f"{name}_out")
    schema = str(getattr(torch.ops.fadsl, f"{name}_out").default._schema)
    assert "Tensor(a3!) out" in schema and "Tensor(a4!)? lse" in schema
    again = fadsl.load(SPEC, verbose=False)  # a second load of the spec shares the ops
    assert again._ops is kern._ops


def test_compile_fullgraph_traces_through_the_op(kern):
    q, k, v = inputs()

    def f(q, k, v):
        o, lse = kern(q, k, v, 0.1, return_lse=True)
        return o.float() * 2 + 1, lse

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    (o, lse), (ref_o, ref_lse) = compiled(q, k, v), f(q, k, v)
    assert torch.equal(o, ref_o) and torch.equal(lse, ref_lse)
    assert kern.calls == [0.1, 0.1]  # the kernel ran once compiled, once eager


def test_compile_fullgraph_with_out(kern):
    q, k, v = inputs()

    def f(q, k, v):
        out = torch.empty_like(q)
        kern(q, k, v, out=out)
        return out

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(got, reference(q, k, v, 128**-0.5, True)[0])


def test_fake_tensors_get_the_checks(kern):
    """Shapes are checked while tracing: a bad head_dim fails before anything runs."""
    q, k, v = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="k and v must have the same shape"):
        compiled(q, k, v[:, :32])


def test_backward_says_forward_only(kern):
    q, k, v = inputs(requires_grad=True)
    out = kern(q, k, v)
    assert out.requires_grad and out.grad_fn is not None, "gradients must not be dropped silently"
    with pytest.raises(RuntimeError, match="is forward-only: its spec has no backward block"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not kern(q, k, v).requires_grad  # no autograd: the direct launch


def test_out_with_autograd_is_refused(kern):
    q, k, v = inputs(requires_grad=True)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        kern(q, k, v, out=torch.empty_like(q))


def test_eager_calls_skip_the_dispatcher(kern, monkeypatch):
    """With no autograd and no compiler, a call launches directly (the dispatcher costs tens of
    microseconds a call)."""
    q, k, v = inputs()

    def no_op(*args):
        raise AssertionError("went through the custom op")

    monkeypatch.setattr(kern, "_ops", (no_op, no_op))
    out, lse = kern(q, k, v, return_lse=True)
    ref_o, ref_lse = reference(q, k, v, 128**-0.5, True)
    assert torch.equal(out, ref_o) and torch.equal(lse, ref_lse)
