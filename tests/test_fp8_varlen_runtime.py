"""Varlen calls on 8-bit inputs (issue 42, research/fp8-forward.md §12), on the stand-in
device (tests/fake_cuda.py): the shipped 8-bit spec with `varlen on` chosen, Q's, K's and V's
maps with 8-bit boxes, the descales (sequences, heads_kv) in the attention kernel's second
parameter and not the tile list's, every bad argument named, plans that write each call's
descale addresses, a padded call of a varlen 8-bit spec, and torch.compile tracing both ops.
What the kernel does with the descales (sequence b's tiles read row b) is
tests/test_gpu_fp8_varlen.py's to show."""

from __future__ import annotations

import pytest
import torch

import fadsl
import fake_cuda
from conftest import ROOT
from fadsl.frontend.rewrite import rewrite
from fadsl.runtime import dispatch, fp8_planned
from fadsl.targets.sm90.host import fp8 as fp8_host
from fadsl.targets.sm90.host import tma
from fadsl.targets.sm90.host.varlen import TILES_SUFFIX

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LENGTHS_Q, LENGTHS_K = (130, 0, 257, 64), (200, 5, 257, 0)


@pytest.fixture
def device(monkeypatch):
    found = fake_cuda.install(monkeypatch)
    yield found
    fake_cuda.uninstall()


def packed(dtype=E4M3, hq=8, hkv=2, d=128, lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K):
    q = torch.randn(sum(lengths_q), hq, d).to(dtype)
    k = torch.randn(sum(lengths_k), hkv, d).to(dtype)
    v = torch.randn(sum(lengths_k), hkv, d).to(dtype)

    def cu(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    return q, k, v, cu(lengths_q), cu(lengths_k)


def loaded(name="fa3_fp8_hdim128"):
    base = (ROOT / "examples" / f"{name}.fa").read_text()
    settings = {"varlen": "on", "tail": "whole"}  # (as dispatch.fp8_varlen_kernel's)
    return fadsl.load(rewrite(base, settings, {}, f"{name}_packed"), verbose=False)


def _descales(launch) -> dict:
    return dict(zip(fp8_host.DESCALES_FIELDS, fp8_host.DESCALES.unpack(launch.second)))


def _split(log):
    (tiles,) = [x for x in log if x.kernel.endswith(TILES_SUFFIX)]
    (main,) = [x for x in log if not x.kernel.endswith(TILES_SUFFIX)]
    return tiles, main


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_loaded_varlen_8bit_spec_packs_8bit_boxes_and_per_sequence_descales(device, dtype):
    log, _ = device
    kern = loaded()
    q, k, v, cu_q, cu_k = packed(dtype)
    qd, vd = torch.rand(4, 2), torch.rand(2, 4).t()  # (sequences, heads_kv); vd strided
    out, lse = kern.varlen(q, k, v, cu_q, cu_k, q_descale=qd, v_descale=vd, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (8, 451)
    tiles, main = _split(log)
    assert tiles.second is None  # (the tile list has one parameter)
    fields = _descales(main)
    assert (fields["q"], fields["k"], fields["v"]) == (qd.data_ptr(), 0, vd.data_ptr())
    assert (fields["q_batch_stride"], fields["q_head_stride"]) == (2, 1)
    assert (fields["v_batch_stride"], fields["v_head_stride"]) == (1, 4)
    # Q's, K's and V's maps: boxes of 128 one-byte columns (a 16-bit varlen call's: 64)
    cfg = kern.config
    for i, (t, rows) in enumerate(((q, cfg.block_r), (k, cfg.block_c), (v, cfg.block_c))):
        expected = tma.tensor_map(t.unsqueeze(0), 128, rows)
        assert main.params[128 * i : 128 * (i + 1)] == expected
        assert tma.tensor_map(t.unsqueeze(0), 64, rows) != expected
    assert tiles.params == main.params


def test_head_dim_64_takes_64_column_boxes(device):
    log, _ = device
    kern = loaded("fa3_fp8_hdim64")
    q, k, v, cu_q, cu_k = packed(d=64)
    kern.varlen(q, k, v, cu_q, cu_k)
    _, main = _split(log)
    assert main.params[:128] == tma.tensor_map(q.unsqueeze(0), 64, kern.config.block_r)
    assert set(_descales(main).values()) == {0}  # no descale: 1 each, strides 0


def test_bad_descales_out_and_a_16bit_spec_are_named(device):
    kern = loaded()
    q, k, v, cu_q, cu_k = packed()
    with pytest.raises(ValueError, match=r"q_descale must have shape \(sequences, heads_kv\)"):
        kern.varlen(q, k, v, cu_q, cu_k, q_descale=torch.rand(5, 2))
    with pytest.raises(TypeError, match="k_descale must be float32"):
        kern.varlen(q, k, v, cu_q, cu_k, k_descale=torch.rand(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out must match q: shape \(451, 8, 128\), .*bfloat16"):
        kern.varlen(q, k, v, cu_q, cu_k, out=torch.empty(q.shape, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="v_descale requires grad"):
        kern.varlen(q, k, v, cu_q, cu_k, v_descale=torch.rand(4, 2, requires_grad=True))
    sixteen = fadsl.load(ROOT / "examples" / "serving" / "fa3_varlen_causal.fa", verbose=False)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(TypeError, match="v_descale: .* descales are for an 8-bit spec"):
        sixteen.varlen(q16, k16, v16, cu_q, cu_k, v_descale=torch.rand(4, 2))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fadsl_attention_varlen_runs_the_shipped_8bit_spec_with_varlen(device, causal, head_dim):
    log, _ = device
    q, k, v, cu_q, cu_k = packed(d=head_dim)
    kd = torch.rand(4, 2)
    out = fadsl.attention_varlen(q, k, v, cu_q, cu_k, 257, 257, causal, k_descale=kd)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    _, main = _split(log)
    name = get_shipped(head_dim, causal, 257)  # (max_seqlen_q 257: the short spec if any)
    assert main.kernel == f"{name}_varlen"
    assert _descales(main)["k"] == kd.data_ptr()
    kern = dispatch.fp8_varlen_kernel(q, causal, None, 257)
    assert kern.is_varlen and kern.config.block_c == dispatch._shipped(name).config.block_c
    assert not kern.config.ext.split_kv  # (a spec's tail split is for launches of equal tiles)
    fp16 = fadsl.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, out_dtype=torch.float16)
    long = get_shipped(head_dim, causal)  # (no max_seqlen_q: the long spec)
    assert fp16.dtype == torch.float16 and log[-1].kernel == f"{long}_varlen_out_fp16"


def get_shipped(head_dim: int, causal: bool, seqlen_q: int | None = None) -> str:
    """The padded call's 8-bit spec for ``seqlen_q`` queries (a short one within its limit)."""
    return dispatch.shipped_fp8_spec((9, 0), head_dim, causal, E4M3, seqlen_q)


@pytest.mark.parametrize("max_seqlen_q", [None, 1024, 1025, 2048, 2049])
def test_max_seqlen_q_chooses_the_short_queries_spec_as_the_padded_call(device, max_seqlen_q):
    """fadsl.attention_varlen runs a short-query spec where max_seqlen_q is within its limit
    (Target.shipped_fp8_short: 1024 at head_dim 128, 2048 at 64 causal), the long one past it
    or without it; a plan per choice (the signature holds the limits it is within)."""
    log, _ = device
    for head_dim, causal in ((128, False), (128, True), (64, True), (64, False)):
        q, k, v, cu_q, cu_k = packed(d=head_dim)
        for _ in range(3):  # (the third call through the plan)
            fadsl.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, None, causal)
            expected = get_shipped(head_dim, causal, max_seqlen_q) + "_varlen"
            assert _split(log)[1].kernel == expected
            log.clear()


def test_a_plan_kept_for_one_max_seqlen_q_is_not_reused_past_its_limit(device):
    """The plans of one cache: 1024 (the short spec's limit at head_dim 128) twice, so that
    its plan is kept, then 1025 and 1024 again: each runs its own spec."""
    log, _ = device
    fp8_planned.clear()
    q, k, v, cu_q, cu_k = packed()
    for longest in (1024, 1024, 1024, 1025, 1025, 1024, None):
        log.clear()
        fadsl.attention_varlen(q, k, v, cu_q, cu_k, longest, None, True)
        assert _split(log)[1].kernel == get_shipped(128, True, longest) + "_varlen", longest


def test_the_public_varlen_call_refuses_what_8bit_inputs_cannot_take(device):
    q, k, v, cu_q, cu_k = packed()
    with pytest.raises(ValueError, match="not built with a window or a softcap"):
        fadsl.attention_varlen(q, k, v, cu_q, cu_k, window_size=(64, 0))
    with pytest.raises(ValueError, match="not built with a window or a softcap"):
        fadsl.attention_varlen(q, k, v, cu_q, cu_k, softcap=30)
    with pytest.raises(TypeError, match="q_descale is for 8-bit q"):
        bf = q.to(torch.bfloat16)
        fadsl.attention_varlen(bf, bf, bf, cu_q, cu_q, q_descale=torch.rand(4, 8))
    with pytest.raises(TypeError, match="out_dtype must be"):
        fadsl.attention_varlen(q, k, v, cu_q, cu_k, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="max_seqlen_q"):
        fadsl.attention_varlen(q, k, v, cu_q, cu_k, 2.5)
    with pytest.raises(ValueError, match="v_descale must have shape"):
        fadsl.attention_varlen(q, k, v, cu_q, cu_k, v_descale=torch.rand(4, 8))


def test_a_planned_varlen_call_writes_each_calls_descales(device):
    """The second call of a signature keeps a plan; a third, on other descales (and other
    tensors), launches the bytes the checked path launches for it."""
    log, allocator = device
    q, k, v, cu_q, cu_k = packed()
    calls = [(torch.rand(4, 2), torch.rand(4, 2)) for _ in range(3)]

    def call(qd, vd, checked=False):
        log.clear()
        if checked:
            fp8_planned.varlen_call(None, q, k, v, cu_q, cu_k, (qd, None, vd), None, None,
                                    True, True)  # fmt: skip
        else:
            fadsl.attention_varlen(q, k, v, cu_q, cu_k, causal=True, q_descale=qd,
                                   v_descale=vd, return_lse=True)  # fmt: skip
        return list(log)

    fp8_planned.clear()
    for qd, vd in calls[:2]:
        call(qd, vd)
    assert len(fp8_planned._FP8_VARLEN._plans) == 1
    allocator.next_call(1)
    hit = call(*calls[2])
    allocator.next_call(1)
    expected = call(*calls[2], checked=True)
    assert hit == expected
    _, main = _split(hit)
    fields = _descales(main)
    assert (fields["q"], fields["v"]) == (calls[2][0].data_ptr(), calls[2][1].data_ptr())


def test_a_padded_call_of_a_varlen_8bit_spec_passes_its_descales(device, monkeypatch):
    log, _ = device
    arange = torch.arange  # (the stand-in device has no arange of its own: the host's)
    monkeypatch.setattr(torch, "arange", lambda *a, device=None, **kw: arange(*a, **kw))
    kern = loaded()
    q = torch.randn(2, 300, 8, 128).to(E4M3)
    k = v = torch.randn(2, 400, 2, 128).to(E4M3)
    kd = torch.rand(2, 2)
    out = kern(q, k, v, 128**-0.5, k_descale=kd)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    _, main = _split(log)
    assert _descales(main)["k"] == kd.data_ptr()


@pytest.fixture
def cpu_varlen(monkeypatch):
    """The loaded varlen 8-bit spec on CPU tensors: the device check skipped and the launch
    a per-sequence reference, so that the op's plumbing (schema, fake, checks) runs here;
    the public op needs q on a GPU (tests/test_gpu_fp8_varlen.py traces it)."""
    from fadsl.runtime import varlen as varlen_module
    from fadsl.runtime.attention import FlashAttention

    original = varlen_module.check_varlen

    def check_varlen(kern, q, k, v, cu_q, cu_k):
        try:
            return original(kern, q, k, v, cu_q, cu_k)
        except ValueError as err:
            if "CUDA device" not in str(err):
                raise
            return kern.config.dtypes[0]

    def varlen_forward(self, q, k, v, cu_q, cu_k, scale, out, return_lse, lse=None,
                       descales=None):  # fmt: skip
        self.check_varlen_call(q, k, v, cu_q, cu_k, descales)
        out = _reference(q, k, v, cu_q, cu_k, descales, scale).to(self.out_torch_dtype)
        lse = torch.zeros(q.shape[1], q.shape[0])
        return (out, lse) if return_lse else out

    monkeypatch.setattr(varlen_module, "check_varlen", check_varlen)
    monkeypatch.setattr(FlashAttention, "varlen_forward", varlen_forward)
    return loaded()


def _reference(q, k, v, cu_q, cu_k, descales, scale):
    """Each sequence's dequantized attention (its row of each descale)."""
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape)
    for b in range(cu_q.shape[0] - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qd, kd, vd = (torch.ones(k.shape[1]) if d is None else d[b] for d in descales)
        qf = q[rows].float() * qd.repeat_interleave(groups)[None, :, None]
        kf = (k[keys].float() * kd[None, :, None]).repeat_interleave(groups, 1)
        vf = (v[keys].float() * vd[None, :, None]).repeat_interleave(groups, 1)
        s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
        out[rows] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vf)
    return out


def test_torch_compile_traces_the_8bit_varlen_op(cpu_varlen):
    q, k, v, cu_q, cu_k = packed(lengths_q=(30, 50), lengths_k=(40, 70))
    qd, kd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    torch._dynamo.reset()

    def f(q, k, v, qd, kd):
        return cpu_varlen.varlen(q, k, v, cu_q, cu_k, q_descale=qd, k_descale=kd)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qd, kd)
    expected = _reference(q, k, v, cu_q, cu_k, (qd, kd, None), 128**-0.5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected.to(torch.bfloat16))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"k_descale must have shape \(sequences, heads_kv\)"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qd, torch.rand(3, 2))


def test_bench_varlens_8bit_check_takes_the_fp8_bound_and_refuses_a_wrong_output():
    """fadsl bench on an 8-bit varlen spec checks its output against float32 attention of
    the values it reads within bench.fp8_bound: P rounded to e4m3 passes, another head's
    values do not (bench_varlen._check, on CPU tensors)."""
    from fadsl.tools.bench_varlen import _check

    torch.manual_seed(0)
    lengths, heads, d = [40, 90], 2, 64
    q, k, v = (torch.randn(sum(lengths), heads, d) for _ in range(3))
    out = torch.empty_like(q)
    for start, n in ((0, 40), (40, 90)):
        rows = slice(start, start + n)
        s = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * d**-0.5
        p = s.softmax(-1)
        p8 = (p * 256).to(torch.float8_e4m3fn).float() / 256  # P as the kernel rounds it
        out[rows] = torch.einsum("hqk,khd->qhd", p8, v[rows]).to(torch.bfloat16).float()
    _check(out, q, k, v, lengths, d**-0.5, False, 90, eight=True)
    wrong = out.clone()
    wrong[:, 0] = out[:, 1]  # head 1's output in head 0
    with pytest.raises(RuntimeError, match="differs from float32 attention"):
        _check(wrong, q, k, v, lengths, d**-0.5, False, 90, eight=True)
