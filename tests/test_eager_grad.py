"""Eager calls with gradients go through fadsl/runtime/eager_grad.py's autograd.Functions (no
dispatcher: the custom ops' layers cost more host time than a short backward's kernels), on
the CPU with the kernels stood in for: a loaded spec's call, fadsl.attention's and (packed
sequences, their own Function) fadsl.attention_varlen's and a loaded varlen spec's reach the
backward with the same arguments as through the ops (dout, the LSE's gradient or None, the
saved out and LSE, the cu_seqlens, the scale), give the same gradients, and torch.compile
still traces the ops; a forward-only spec still says so at backward. The kernels themselves:
tests/test_gpu_backward.py, tests/test_gpu_public_compile.py."""

from __future__ import annotations

import types
import pytest
import torch

import fadsl
import fadsl.runtime.attention as attention
from conftest import ROOT
from fadsl.ir import Dtype
from fadsl.runtime import dispatch, public, public_ops
from fadsl.runtime.attention import FlashAttention
from fadsl.runtime.backward import BackwardKernels
from test_gpu_general import reference

CAUSAL = ROOT / "examples" / "fa3_causal.fa"
FORWARD_ONLY = ROOT / "examples" / "fa2_causal.fa"


@pytest.fixture
def calls(monkeypatch):
    """CPU tensors allowed; the forward by the float32 reference, the backward's kernels by a
    recorder whose gradients depend on every operand it is given (so a different argument
    gives different gradients)."""
    found = []
    original = FlashAttention.check_inputs

    def check_inputs(self, q, k, v):
        try:
            return original(self, q, k, v)
        except ValueError as err:  # every check but the device's applies
            if "must be on a CUDA device" not in str(err):
                raise
            return Dtype.BF16

    def launch(self, dtype, q, k, v, out, lse, scale, inputs=()):
        o, l = reference(q, k, v, scale, self.config.mask.value == "causal", torch.float32)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)

    def backward(
        self, dtype, arch, q, k, v, out, lse, dout, dlse, scale, inputs=(), classes=None, key=None
    ):
        found.append((dout, dlse, out, lse, scale))
        term = dout.float().sum() + out.float().sum() + lse.sum() + scale
        if dlse is not None:
            term = term + 2 * dlse.sum()
        return tuple(torch.full_like(t, float(term) * n) for n, t in ((1, q), (2, k), (3, v)))

    monkeypatch.setattr(FlashAttention, "check_inputs", check_inputs)
    monkeypatch.setattr(FlashAttention, "launch", launch)
    monkeypatch.setattr(BackwardKernels, "__call__", backward)
    monkeypatch.setattr(attention, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(fadsl.runtime.arguments, "check_base", lambda name, t, target="": None)
    return found


def tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 40, 4, 128, generator=gen).bfloat16()
    k = torch.randn(2, 56, 2, 128, generator=gen).bfloat16()
    v = torch.randn(2, 56, 2, 128, generator=gen).bfloat16()
    return q, k, v


def leaves(*ts):
    return [t.clone().requires_grad_() for t in ts]


def through_op(kern, q, k, v, scale):
    """The call as it went before eager_grad: the custom op with its autograd formula."""
    return kern._call_op(q, k, v, scale, None, True)


@pytest.mark.parametrize("use_lse", [False, True])
def test_a_loaded_specs_eager_call_skips_the_dispatcher_and_matches_the_op(calls, use_lse):
    kern = fadsl.load(CAUSAL, verbose=False)
    q, k, v = tensors()
    got, want = leaves(q, k, v), leaves(q, k, v)
    o, lse = kern(*got, 0.1, return_lse=True)
    assert type(o.grad_fn).__name__ == "_AttentionBackward"  # (the op's node is another)
    o2, lse2 = through_op(kern, *want, 0.1)
    assert type(o2.grad_fn).__name__ != "_AttentionBackward"
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    for out, l, leaves_ in ((o, lse, got), (o2, lse2, want)):
        loss = out.float().square().sum() + (3 * l.sum() if use_lse else 0)
        loss.backward()
    (dout, dlse, out, saved, scale), (dout2, dlse2, *_) = calls
    assert torch.equal(dout, dout2) and torch.equal(out, o) and torch.equal(saved, lse)
    assert scale == 0.1
    if use_lse:
        assert torch.equal(dlse, torch.full_like(lse, 3)) and torch.equal(dlse, dlse2)
    else:  # the op's autograd passes zeros; here None: the kernels add 0 either way
        assert dlse is None and torch.equal(dlse2, torch.zeros_like(lse))
    for a, b in zip(got, want):
        assert torch.equal(a.grad, b.grad)


def test_only_the_lse_reaching_the_loss_gives_a_zero_dout(calls):
    kern = fadsl.load(CAUSAL, verbose=False)
    got = leaves(*tensors(1))
    _, lse = kern(*got, return_lse=True)
    lse.sum().backward()
    ((dout, dlse, out, _, _),) = calls
    assert torch.equal(dout, torch.zeros_like(out)) and torch.equal(dlse, torch.ones_like(dlse))
    assert all(t.grad is not None for t in got)


def test_a_forward_only_spec_still_says_so_at_backward(calls):
    kern = fadsl.load(FORWARD_ONLY, verbose=False)
    o = kern(*leaves(*tensors(2)))
    with pytest.raises(RuntimeError, match="forward-only"):
        o.float().sum().backward()
    assert calls == []


def test_fadsl_attention_eagerly_matches_its_op(calls, monkeypatch):
    kern = fadsl.load(CAUSAL, verbose=False)
    picked = []

    def attention_kernel(q, causal, window_size=(-1, -1), softcap=0.0, deterministic=False):
        picked.append((causal, tuple(window_size), softcap))
        return kern

    monkeypatch.setattr(dispatch, "attention_kernel", attention_kernel)
    monkeypatch.setattr(public, "check_q", lambda q, dims, shape: None)  # (CPU tensors)
    q, k, v = tensors(3)
    got, want = leaves(q, k, v), leaves(q, k, v)
    o, lse = public.attention(*got, causal=True, return_lse=True)
    assert type(o.grad_fn).__name__ == "_AttentionBackward"
    o2, lse2 = public_ops.attention(*want, True, None, -1, -1, 0.0, True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    o.float().sum().backward()
    o2.float().sum().backward()
    for a, b in zip(got, want):
        assert torch.equal(a.grad, b.grad)
    assert calls[0][4] == calls[1][4] == pytest.approx(128**-0.5, rel=1e-12)
    assert picked[0] == picked[1] == (True, (-1, -1), 0.0)  # (the op: the same kernel)


def test_compile_still_traces_the_ops(calls):
    kern = fadsl.load(CAUSAL, verbose=False)
    q, k, v = tensors(4)

    def f(q, k, v):
        o, lse = kern(q, k, v, 0.1, return_lse=True)
        return o.float().square().sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got, want = leaves(q, k, v), leaves(q, k, v)
    compiled(*got).backward()
    f(*want).backward()
    for a, b in zip(got, want):
        assert torch.equal(a.grad, b.grad)
    assert len(calls) == 2


class _FakeDriver:
    """cuCtx* calls of one thread, recorded: ``current`` is the context current on it (0:
    none), ``devices`` each context's device."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, current=0):
        self.current, self.devices, self.calls = current, {11: 0, 22: 1}, []

    def cuCtxGetCurrent(self):
        self.calls.append("get")
        return 0, self.current

    def cuCtxGetDevice(self):
        return 0, self.devices[self.current]

    def cuDeviceGet(self, index):
        return 0, index

    def cuDevicePrimaryCtxRetain(self, device):
        self.calls.append(f"retain {device}")
        return 0, {0: 11, 1: 22}[device]

    def cuCtxSetCurrent(self, context):
        self.calls.append(f"set {context}")
        self.current = context
        return (0,)


@pytest.mark.parametrize(
    "current, index, made", [(0, 0, "set 11"), (22, 0, "set 11"), (11, 0, None)]
)
def test_ensure_context_makes_the_devices_primary_context_current_once(
    monkeypatch, current, index, made
):
    import threading

    from fadsl.runtime import driver

    fake = _FakeDriver(current)
    monkeypatch.setattr(driver, "_driver", lambda: fake)
    monkeypatch.setattr(driver, "_CONTEXTS", {})
    monkeypatch.setattr(driver, "_THREAD", threading.local())
    driver.ensure_context(index)
    assert fake.current == {0: 11, 1: 22}[index]
    assert (made in fake.calls) if made else not any(c.startswith("set") for c in fake.calls)
    calls = len(fake.calls)
    driver.ensure_context(index)  # (known for this thread: no driver call)
    assert len(fake.calls) == calls
    seen = []  # another thread asks again
    worker = threading.Thread(target=lambda: seen.append(driver.ensure_context(index)))
    worker.start()
    worker.join()
    assert fake.calls[calls] == "get"


class StandInVarlen:
    """A `varlen on` spec with a backward block, its kernels stood in for: the forward a
    function of q, k, v and the scale, the backward recording its arguments and giving
    gradients that depend on every operand."""

    has_backward = True
    is_varlen = True

    def __init__(self, found):
        self.found = found
        self.config = types.SimpleNamespace(head_dim=64, name="stand_in_varlen")

    def varlen_forward(self, q, k, v, cu_q, cu_k, scale, out, return_lse, lse=None):
        o = (q.float() * scale + k.float().mean() + v.float().mean()).to(q.dtype)
        lse = (q.float().sum(-1) * scale).t().contiguous()  # (heads, tokens)
        return (o, lse) if return_lse else o

    def varlen_backward(self, q, k, v, out, lse, dout, dlse, cu_q, cu_k, scale):
        self.found.append((dout, dlse, out, lse, cu_q, cu_k, scale))
        term = dout.float().sum() + out.float().sum() + lse.sum() + scale + cu_q.sum() + cu_k.sum()
        if dlse is not None:
            term = term + 2 * dlse.sum()
        return tuple(torch.full_like(t, float(term) * n) for n, t in ((1, q), (2, k), (3, v)))


@pytest.fixture
def varlen_calls(monkeypatch):
    """fadsl.attention_varlen on CPU tensors with its kernel stood in for (StandInVarlen)."""
    found = []
    kern = StandInVarlen(found)
    monkeypatch.setattr(dispatch, "varlen_kernel", lambda *args: kern)
    monkeypatch.setattr(public, "check_q", lambda q, dims, shape: None)  # (CPU tensors)
    return found


def packed(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(9, 4, 64, generator=gen).bfloat16()
    k = torch.randn(11, 2, 64, generator=gen).bfloat16()
    v = torch.randn(11, 2, 64, generator=gen).bfloat16()
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 11], dtype=torch.int32)
    return (q, k, v), (cu_q, cu_k)


@pytest.mark.parametrize("use_lse", [False, True])
def test_attention_varlen_with_gradients_skips_the_dispatcher_and_matches_its_op(
    varlen_calls, use_lse
):
    """The eager call goes through eager_grad's Function with the varlen kernel and
    the same cu_seqlens (never a padded kernel, which would attend across the sequences),
    and reaches the same backward with the same arguments as the varlen op."""
    (q, k, v), (cu_q, cu_k) = packed()
    got, want = leaves(q, k, v), leaves(q, k, v)
    o, lse = public.attention_varlen(*got, cu_q, cu_k, 5, 6, causal=True, softmax_scale=0.1,
                                     return_lse=True)  # fmt: skip
    assert type(o.grad_fn).__name__ == "_AttentionBackward"
    o2, lse2 = public_ops.attention_varlen(*want, cu_q, cu_k, 5, 6, True, 0.1, -1, -1, 0.0, True)
    assert type(o2.grad_fn).__name__ != "_AttentionBackward"
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    for out, l in ((o, lse), (o2, lse2)):
        loss = out.float().square().sum() + (3 * l.sum() if use_lse else 0)
        loss.backward()
    (dout, dlse, out, saved, cu_q1, cu_k1, scale), (dout2, dlse2, *_) = varlen_calls
    assert torch.equal(dout, dout2) and torch.equal(out, o) and torch.equal(saved, lse)
    assert torch.equal(cu_q1, cu_q) and torch.equal(cu_k1, cu_k) and scale == 0.1
    if use_lse:
        assert torch.equal(dlse, torch.full_like(lse, 3)) and torch.equal(dlse, dlse2)
    else:  # the op's autograd passes zeros; here None: the kernels add 0 either way
        assert dlse is None and torch.equal(dlse2, torch.zeros_like(lse))
    for a, b in zip(got, want):
        assert torch.equal(a.grad, b.grad)


def test_attention_varlen_with_only_the_lse_in_the_loss_gives_a_zero_dout(varlen_calls):
    (q, k, v), cu = packed(1)
    got = leaves(q, k, v)
    _, lse = public.attention_varlen(*got, *cu, return_lse=True)
    lse.sum().backward()
    ((dout, dlse, out, *_),) = varlen_calls
    assert torch.equal(dout, torch.zeros_like(out)) and torch.equal(dlse, torch.ones_like(dlse))
    assert all(t.grad is not None for t in got)


def test_attention_varlen_without_a_backward_keeps_its_op(varlen_calls, monkeypatch):
    """A varlen spec without a backward block is the op's (whose backward says so), and
    eager_grad's varlen Function is not reached."""
    from fadsl.runtime import eager_grad

    monkeypatch.setattr(StandInVarlen, "has_backward", False)
    seen = []

    def refused(*args, **kwargs):
        raise AssertionError("a forward-only varlen spec reached eager_grad")

    def varlen_op(q, k, v, *rest):
        seen.append(rest)
        return torch.zeros_like(q), q.new_zeros((q.shape[1], q.shape[0]))

    monkeypatch.setattr(eager_grad, "varlen", refused)
    monkeypatch.setattr(eager_grad, "attention", refused)
    monkeypatch.setattr(public_ops, "attention_varlen", varlen_op)
    (q, k, v), cu = packed(2)
    public.attention_varlen(*leaves(q, k, v), *cu, 5, 6, causal=True)
    assert len(seen) == 1


def test_a_loaded_varlen_specs_call_with_gradients_skips_the_dispatcher(monkeypatch):
    """A loaded `varlen on` spec's varlen call with gradients runs eager_grad's varlen
    Function on its own kernels (here stood in for), as fadsl.attention_varlen does."""
    kern = fadsl.load(ROOT / "examples" / "serving" / "fa3_varlen_causal.fa", verbose=False)
    found = []
    monkeypatch.setattr(type(kern), "varlen_forward", StandInVarlen.varlen_forward)
    monkeypatch.setattr(type(kern), "varlen_backward", StandInVarlen.varlen_backward)
    monkeypatch.setattr(kern, "found", found, raising=False)
    (q, k, v), cu = packed(3)
    got = leaves(q, k, v)
    o = kern.varlen(*got, *cu, softmax_scale=0.1)
    assert type(o.grad_fn).__name__ == "_AttentionBackward"
    o.float().sum().backward()
    ((dout, dlse, *_),) = found
    assert dlse is None and torch.equal(dout, torch.ones_like(o))
    assert all(t.grad is not None for t in got)
