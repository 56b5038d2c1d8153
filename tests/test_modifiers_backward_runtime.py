"""The backward of score and mask modifiers (issue 41, step 4) at run time, on the CPU: a
modified call whose q, k, v require grad runs through the modified op
(fadsl/runtime/modified_op.py) with autograd, eagerly and under torch.compile(fullgraph=True),
its inputs reaching the backward; on the stand-in device (tests/fake_cuda.py) the backward's
three kernels are launched with the inputs' pointers and the batch in BwdParamsSm90. The
kernels themselves: tests/test_gpu_modifiers_backward.py."""

from __future__ import annotations


import pytest
import torch

import fadsl
import fadsl.runtime.attention as attention
from conftest import ROOT
from fadsl.ir import Dtype
from fadsl.runtime.attention import FlashAttention
from fadsl.runtime.backward import BackwardKernels
from fadsl.targets.sm90.backward import host
from test_gpu_general import reference

ALIBI = ROOT / "examples" / "modifiers" / "alibi_causal.fa"
PREFIX = ROOT / "examples" / "modifiers" / "prefix_lm_alibi.fa"


def modified_reference(q, k, v, scale, slopes, prefix=None):
    """Attention with ALiBi (and prefix-LM's keep where ``prefix``; else the causal mask) in
    float32, differentiable in q, k and v."""
    sq, sk = q.shape[1], k.shape[1]

    def bias(i, j):
        return slopes[:, None, None].to(torch.float32) * (j - i)

    keep = None
    if prefix is not None:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        keep = (j <= i + sk - sq)[None, None] | (j[None, None] < prefix[:, None, None, None])
    return reference(q, k, v, scale, prefix is None, torch.float32, bias=bias, keep=keep)


@pytest.fixture
def patched(monkeypatch):
    """CPU tensors allowed, the forward's launch done by the reference and the backward's
    kernels by the reference's autograd; each backward call's inputs recorded."""
    calls = {"forward": [], "backward": [], "dout": []}
    original = FlashAttention.check_inputs

    def check_inputs(self, q, k, v):
        try:
            return original(self, q, k, v)
        except ValueError as err:  # every check but the last, the device's, applies
            if "must be on a CUDA device" not in str(err):
                raise
            return Dtype.BF16

    def launch(self, dtype, q, k, v, out, lse, scale, inputs=()):
        calls["forward"].append(tuple(inputs))
        o, l = modified_reference(q, k, v, scale, *inputs[::-1] if len(inputs) == 2 else inputs)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)

    def backward(
        self, dtype, arch, q, k, v, out, lse, dout, dlse, scale, inputs=(), classes=None, key=None
    ):
        # (the op's implementation runs below autograd: the kernels' stand-in records what
        # it was given and returns constant gradients)
        calls["backward"].append(tuple(inputs))
        calls["dout"].append((dout, dlse, out, lse))
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)

    monkeypatch.setattr(FlashAttention, "check_inputs", check_inputs)
    monkeypatch.setattr(FlashAttention, "launch", launch)
    monkeypatch.setattr(BackwardKernels, "__call__", backward)
    monkeypatch.setattr(attention, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(fadsl.runtime.arguments, "check_base", lambda name, t, target="": None)
    return calls


def tensors(seed=0, sq=48, sk=64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, 4, 128, generator=gen).bfloat16()
    k = torch.randn(2, sk, 2, 128, generator=gen).bfloat16()
    v = torch.randn(2, sk, 2, 128, generator=gen).bfloat16()
    slopes = 2.0 ** -torch.arange(1, 5, dtype=torch.float32)
    return q, k, v, slopes


def test_gradients_flow_through_the_modified_op(patched):
    kern = fadsl.load(ALIBI, verbose=False)
    q, k, v, slopes = tensors()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = kern(*leaves, 0.1, slopes=slopes, return_lse=True)
    ro, rl = modified_reference(q, k, v, 0.1, slopes)
    assert torch.equal(o, ro.to(o.dtype)) and torch.equal(lse, rl)
    (o.float().square().sum() + 3 * lse.sum()).backward()
    assert patched["forward"] == [(slopes,)] and patched["backward"] == [(slopes,)]
    ((dout, dlse, out, saved_lse),) = patched["dout"]
    assert torch.equal(dout, (2 * o.float()).to(o.dtype)) and torch.equal(
        dlse, torch.full_like(lse, 3)
    )
    assert torch.equal(out, o) and torch.equal(saved_lse, lse)
    for t, value in zip(leaves, (1.0, 2.0, 3.0)):
        assert torch.equal(t.grad, torch.full_like(t, value))


def test_two_inputs_reach_the_backward_in_declared_order(patched):
    kern = fadsl.load(PREFIX, verbose=False)
    q, k, v, slopes = tensors(1)
    prefix = torch.tensor([5, 70], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern(*leaves, slopes=slopes, prefix=prefix).float().sum().backward()
    assert [tuple(x is y for x, y in zip(c, (prefix, slopes))) for c in patched["backward"]] == [
        (True, True)
    ]
    assert all(t.grad is not None for t in leaves)


def test_compile_fullgraph_traces_the_forward_and_the_backward(patched):
    kern = fadsl.load(ALIBI, verbose=False)
    q, k, v, slopes = tensors(2)

    def f(q, k, v, slopes):
        o, lse = kern(q, k, v, 0.1, slopes=slopes, return_lse=True)
        return o.float().square().sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*got, slopes).backward()
    want = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*want, slopes).backward()
    for a, b in zip(got, want):
        assert torch.equal(a.grad, b.grad)
    assert len(patched["backward"]) == 2 and patched["backward"][0] == patched["backward"][1]
    (d0, l0, *_), (d1, l1, *_) = patched["dout"]
    assert torch.equal(d0, d1) and torch.equal(l0, l1)


def test_a_forward_only_modified_spec_says_so_at_backward(patched):
    text = ALIBI.read_text()
    text = text[: text.index("  # The backward pass")].rstrip() + "\n}\n"
    kern = fadsl.load(text, verbose=False)
    q, k, v, slopes = tensors(3)
    out = kern(q.requires_grad_(), k, v, slopes=slopes)
    with pytest.raises(RuntimeError, match="is forward-only: its spec has no backward block"):
        out.float().sum().backward()


def test_out_with_autograd_is_refused(patched):
    kern = fadsl.load(ALIBI, verbose=False)
    q, k, v, slopes = tensors(4)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        kern(q.requires_grad_(), k, v, slopes=slopes, out=torch.empty_like(q))


def test_the_backward_launches_carry_the_inputs_on_the_stand_in_device(monkeypatch):
    """BwdParamsSm90's modifier fields (sm90_bwd.cuh's static_assert: inputs at 672, batch at
    736) hold the inputs' pointers in declared order and the batch; the preprocess and
    dQ's conversion take their params as ever."""
    import fake_cuda

    log, _ = fake_cuda.install(monkeypatch)
    fake_cuda.install_backward(monkeypatch, log)
    try:
        kern = fadsl.load(PREFIX, verbose=False)
        q, k, v, slopes = tensors(5, sq=100, sk=130)
        prefix = torch.tensor([3, 200], dtype=torch.int32)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kern(*leaves, slopes=slopes, prefix=prefix).float().sum().backward()
        names = [x.kernel for x in log]
        assert names == [
            "prefix_lm_alibi",
            "prefix_lm_alibi_bwd_bf16_preprocess",
            "prefix_lm_alibi_bwd_bf16",
            "prefix_lm_alibi_bwd_bf16_convert_dq",
        ]
        main = log[2].params
        found = host.MODIFIERS.unpack_from(main, host.MODIFIERS_OFFSET)
        assert found == (
            prefix.data_ptr(),
            slopes.data_ptr(),
            *[0] * 6,
            2,
            0,
            0,
        )  # (no learnable input: no gradient buffer, no per-row sums)
        assert log[2].grid == (2, 4, 2)  # cdiv(130, 64) n-blocks (B_c 128: 2), heads, batch
    finally:
        fake_cuda.uninstall()


def test_a_spec_without_modifiers_packs_zeros_there(monkeypatch):
    import fadsl.targets.sm90.host.tma as tma
    from fadsl.pipeline import compile_file

    monkeypatch.setattr(tma, "_encode", lambda *a: bytes(tma.MAP_BYTES))
    monkeypatch.setattr(tma, "_encoded", {})
    kernel = compile_file("examples/fa3_hopper.fa").kernel
    q, k, v = (torch.randn(1, 130, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    launches = []
    host.run(kernel, launches.append, q, k, v, q, torch.randn(1, 4, 130), q, None, 0.125)
    main = launches[1].params
    assert len(main) == host.MAIN_BYTES
    assert main[host.MODIFIERS_OFFSET - 4 :] == bytes(host.MAIN_BYTES - host.MODIFIERS_OFFSET + 4)


def test_compile_sets_keep_classes_aside(patched):
    """Under torch.compile a call's keep_classes is set aside (its checks would hold at trace
    time only): the traced call passes the spec's inputs alone, and classes its own tiles."""
    kern = fadsl.load(ALIBI, verbose=False)
    q, k, v, slopes = tensors(3)

    def f(q, k, v, slopes):
        return kern(q, k, v, 0.1, slopes=slopes, keep_classes="not looked at").float().sum()

    torch._dynamo.reset()
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.compile(f, fullgraph=True, backend="aot_eager")(*got, slopes).backward()
    assert all(len(c) == 1 and c[0] is not None for c in patched["backward"])
    assert patched["forward"] and all(len(c) == 1 for c in patched["forward"])
    with pytest.raises(TypeError, match="keep_classes must be what kernel"):
        kern(q, k, v, 0.1, slopes=slopes, keep_classes="not looked at")


def test_eager_calls_with_gradients_skip_the_dispatcher(patched):
    """An eager call whose q, k, v require grad runs the kernels through one autograd
    Function (fadsl/runtime/eager_grad.py, _Modified), not the modified op: the same launches
    with the same inputs, each input that requires grad getting its gradient there too."""
    kern = fadsl.load(PREFIX, verbose=False)
    q, k, v, slopes = tensors(4)
    prefix = torch.tensor([5, 70], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = kern(*leaves, slopes=slopes, prefix=prefix)
    assert type(o.grad_fn).__name__ == "_ModifiedBackward"
    o.float().sum().backward()
    assert [tuple(x is y for x, y in zip(c, (prefix, slopes))) for c in patched["backward"]] == [
        (True, True)
    ]
    assert all(t.grad is not None for t in leaves)
