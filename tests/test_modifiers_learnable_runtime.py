"""Gradients of learnable inputs at run time, on the CPU (tests/test_modifiers_backward_runtime.py's
stand-ins): an input that requires grad gets the backward's buffer slice as its gradient,
eagerly and under torch.compile(fullgraph=True), the others None; the variant's kernels get
the buffer, zeroed, in BwdParamsSm90; the refusals name the input (located in the spec where
the reason is the spec's). The kernels: tests/test_gpu_modifiers_learnable.py."""

from __future__ import annotations

import pytest
import torch

import fadsl
from block_text import deterministic as deterministic_block
from fadsl.pipeline import compile_source
from fadsl.runtime import learnable
from fadsl.runtime.attention import FlashAttention
from fadsl.runtime.backward import BackwardKernels
from fadsl.targets.sm90.backward import host
from test_modifiers_backward_runtime import ALIBI, PREFIX, patched, tensors  # noqa: F401

T5 = ALIBI.parent / "t5_bias_causal.fa"


@pytest.fixture
def learning(patched, monkeypatch):  # noqa: F811
    """The variant's kernels stand in: each call's learn set and buffer recorded, the buffer
    filled with 1, 2, 3, ... (its elements' order is the inputs' split)."""
    seen = []

    def call(
        self,
        dtype,
        arch,
        q,
        k,
        v,
        out,
        lse,
        dout,
        dlse,
        scale,
        inputs=(),
        input_grads=None,
        classes=None,
    ):
        seen.append((self.kernel.config.modifiers.learn, input_grads))
        assert input_grads is not None and not input_grads.any()  # zeroed
        input_grads.copy_(torch.arange(1, input_grads.numel() + 1, dtype=torch.float32))
        return torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0)

    monkeypatch.setattr(BackwardKernels, "__call__", call)
    monkeypatch.setattr(learnable, "check_spills", lambda kernels, dtype, arch: None)
    return seen


def test_alibis_slopes_get_their_gradient(learning):
    kern = fadsl.load(ALIBI, verbose=False)
    q, k, v, slopes = tensors()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    slopes = slopes.clone().requires_grad_()
    kern(*leaves, 0.1, slopes=slopes).float().sum().backward()
    ((learn, buffer),) = learning
    assert learn == ("slopes",) and buffer.dtype == torch.float32 and buffer.shape == (4,)
    assert torch.equal(slopes.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert all(torch.equal(t.grad, torch.full_like(t, x)) for t, x in zip(leaves, (1.0, 2.0, 3.0)))


def test_prefix_lm_alibis_slopes_learn_at_b_r_64(learning):
    """prefix_lm_alibi's backward block is B_r 80; its learnable variant is the spec with B_r
    64 (the target's learn_lines: B_r 80 spilled), its own backward untouched."""
    kern = fadsl.load(PREFIX, verbose=False)
    q, k, v, slopes = tensors(2)
    prefix = torch.tensor([5, 70], dtype=torch.int32)
    slopes = slopes.clone().requires_grad_()
    kern(q, k, v, slopes=slopes, prefix=prefix).float().sum().backward()
    assert learning[0][0] == ("slopes",)
    assert torch.equal(slopes.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert kern._learn_backward[("slopes",)].kernel.backward.block_m == 64
    assert kern.compiled.kernel.backward.block_m == 80


def test_an_input_alone_may_require_grad(learning, monkeypatch):
    """q, k and v without gradients: the call still goes through the op (the table learns)."""

    def launch(self, dtype, q, k, v, out, lse, scale, inputs=()):  # (no reference of T5's here)
        out.zero_()
        if lse is not None:
            lse.zero_()

    monkeypatch.setattr(FlashAttention, "launch", launch)
    kern = fadsl.load(T5, verbose=False)
    q, k, v, _ = tensors(1)
    bias = torch.zeros(4, 32, requires_grad=True)
    kern(q, k, v, bias=bias).float().sum().backward()
    assert learning[0][0] == ("bias",)
    assert torch.equal(bias.grad, torch.arange(1, 129, dtype=torch.float32).view(4, 32))


def test_an_input_without_grad_gets_none_and_the_spec_own_kernels(patched):  # noqa: F811
    kern = fadsl.load(PREFIX, verbose=False)
    q, k, v, slopes = tensors(2)
    prefix = torch.tensor([5, 70], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern(*leaves, slopes=slopes, prefix=prefix).float().sum().backward()
    assert slopes.grad is None and len(patched["backward"]) == 1


def test_compile_fullgraph_gives_the_same_gradients(learning):
    kern = fadsl.load(ALIBI, verbose=False)
    q, k, v, slopes = tensors(3)

    def f(q, k, v, slopes):
        o, lse = kern(q, k, v, 0.1, slopes=slopes, return_lse=True)
        return o.float().square().sum() + lse.sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
    compiled(*got).backward()
    want = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
    f(*want).backward()
    for a, b in zip(got, want):
        assert torch.equal(a.grad, b.grad)
    assert [learn for learn, _ in learning] == [("slopes",), ("slopes",)]


def test_the_buffer_goes_into_bwd_params():
    buffer, rows = torch.zeros(8), torch.zeros(16)
    slopes = torch.zeros(4)
    fields = host.MODIFIERS.unpack(host.modifier_fields((slopes,), 3, buffer, rows))
    assert fields == (slopes.data_ptr(), *[0] * 7, 3, buffer.data_ptr(), rows.data_ptr())
    assert host.MODIFIERS_OFFSET + host.MODIFIERS.size <= host.MAIN_BYTES  # 752 + 8 = 760


def _variant(path, learn):
    text = path.read_text()
    return learnable.learn_variant(compile_source(text, path.name), learn).kernel


def test_the_learnable_backward_fixes_d_rounding_after_the_main_kernel(monkeypatch):
    """The variant's fourth kernel, `_learn` (sm90_bwd_learn.cuh's bwd_learn_fix), runs after
    the others with the main kernel's params, a query row per thread; the per-row sums it
    reads (learn_rows) start as -dLSE in their first float (so that the sum of dS' ends as
    D's rounding's eps), zeros elsewhere, their pointer at BwdParamsSm90's offset 752. The
    spec's own backward launches three kernels and passes no such buffer."""
    monkeypatch.setattr(host, "tensor_map", lambda t, cols, rows: bytes(128))
    made = []
    rows_buffer = host.learn_rows_buffer
    monkeypatch.setattr(
        host, "learn_rows_buffer", lambda *a: made.append(rows_buffer(*a)) or made[-1]
    )
    b, sq, sk, hq = 2, 300, 1100, 4
    q, out, dout = (torch.randn(b, sq, hq, 128).bfloat16() for _ in range(3))
    k, v = (torch.randn(b, sk, 1, 128).bfloat16() for _ in range(2))
    lse, dlse = torch.randn(b, hq, sq), torch.randn(b, hq, sq)
    slopes, grads = torch.ones(hq), torch.zeros(hq)
    kernel = _variant(ALIBI, ("slopes",))
    assert host.suffixes(kernel) == ("_preprocess", "", "_convert_dq", "_learn")
    seen = []
    host.run(kernel, seen.append, q, k, v, out, lse, dout, dlse, 0.1, (slopes,), grads)
    assert [x.suffix for x in seen] == ["_preprocess", "", "_convert_dq", "_learn"]
    fix = seen[3]
    assert fix.grid == (2, hq, b) and fix.block == (256, 1, 1)  # cdiv(300, 256) rows
    assert fix.params == seen[1].params
    *_, batch, at_grads, at_rows = host.MODIFIERS.unpack_from(fix.params, host.MODIFIERS_OFFSET)
    (rows,) = made
    assert (batch, at_grads, at_rows) == (b, grads.data_ptr(), rows.data_ptr())
    assert rows.shape == (b, hq, 320, 2)  # B_r 64's padded rows; the sum of dS', slopes' W
    assert torch.equal(rows[:, :, :sq, 0], -dlse) and not rows[:, :, sq:].any()
    assert not rows[..., 1].any()
    seen.clear()
    host.run(kernel, seen.append, q, k, v, out, lse, dout, None, 0.1, (slopes,), grads)
    assert not made[-1].any()  # no LSE gradient: the sums start at 0
    own = compile_source(ALIBI.read_text(), ALIBI.name).kernel
    assert host.suffixes(own) == host.SUFFIXES
    seen.clear()
    host.run(own, seen.append, q, k, v, out, lse, dout, dlse, 0.1, (slopes,))
    assert [x.suffix for x in seen] == list(host.SUFFIXES) and len(made) == 2
    assert host.MODIFIERS.unpack_from(seen[1].params, host.MODIFIERS_OFFSET)[-2:] == (0, 0)


# --- refusals -------------------------------------------------------------------------------


def test_an_integer_or_mask_only_input_is_refused_by_name_at_its_line(patched):  # noqa: F811
    text = ALIBI.read_text().replace(
        "  score      s + slopes[h] * (kv_idx - q_idx)     # added before the row max, as softcap is\n",
        "  keep       kv_idx - q_idx < slopes[h]\n",
    )
    kern = fadsl.load(text, verbose=False)
    q, k, v, slopes = tensors(4)
    with pytest.raises(RuntimeError) as err:
        kern(q, k, v, slopes=slopes.requires_grad_())
    message = str(err.value)
    assert "input 'slopes' requires grad, but it has no gradient here" in message
    assert "is read only by keep, and a mask has no gradient" in message
    assert "<spec>:14:14: input 'slopes'" in message and message.endswith("^")  # with a caret


def test_a_derivative_that_reads_the_score_is_refused(patched):  # noqa: F811
    text = ALIBI.read_text().replace("s + slopes[h] * (kv_idx - q_idx)", "s * slopes[h]")
    kern = fadsl.load(text, verbose=False)
    q, k, v, slopes = tensors(5)
    with pytest.raises(RuntimeError, match="reads s, which the backward no longer holds"):
        kern(q, k, v, slopes=slopes.requires_grad_())


def test_deterministic_and_forward_only_specs_refuse_a_learnable_input(patched):  # noqa: F811
    text = ALIBI.read_text()
    det = deterministic_block(text)
    q, k, v, slopes = tensors(6)
    with pytest.raises(RuntimeError, match="`deterministic on`: learnable inputs"):
        fadsl.load(det, verbose=False)(q, k, v, slopes=slopes.clone().requires_grad_())
    forward_only = text[: text.index("  # The backward pass")].rstrip() + "\n}\n"
    with pytest.raises(RuntimeError, match="the spec has no backward block"):
        fadsl.load(forward_only, verbose=False)(q, k, v, slopes=slopes.clone().requires_grad_())
    with torch.no_grad():  # (no gradient asked for: nothing refused)
        fadsl.load(det, verbose=False)(q, k, v, slopes=slopes.clone().requires_grad_())
