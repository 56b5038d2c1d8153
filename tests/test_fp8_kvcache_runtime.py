"""KV-cache calls of an 8-bit spec (issue 42, research/fp8-forward.md §14), on the stand-in
device (tests/fake_cuda.py): examples/serving/fa3_fp8_decode_paged.fa (paged, pack_gqa,
`splits auto`) and tests/specs/fp8/fa3_fp8_kvcache_hdim64.fa (contiguous, one query head a
tile) through kern.kvcache. Q's, K's and V's maps take 8-bit boxes (Q's 5-D when packed), O
its 16-bit ones; the descales, (batch, heads_kv) each, are the attention kernel's second
parameter and not the combine's; O comes in the spec's output type; every bad argument is
named; the traced op returns the eager call's bits. What the kernel does with them is
tests/test_gpu_fp8_kvcache.py's to show."""

from __future__ import annotations

import pytest
import torch

import fadsl
import fake_cuda
from conftest import ROOT
from fadsl.targets.sm90.host import fp8 as fp8_host
from fadsl.targets.sm90.host import kvcache as host_kvcache
from fadsl.targets.sm90.host import tma

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAGED = ROOT / "examples" / "serving" / "fa3_fp8_decode_paged.fa"
CONTIGUOUS = ROOT / "tests" / "specs" / "fp8" / "fa3_fp8_kvcache_hdim64.fa"


@pytest.fixture
def device(monkeypatch):
    found = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(host_kvcache, "sm_count", lambda index: 132)
    yield found
    fake_cuda.uninstall()


def paged_call(dtype=E4M3, batch=2, seqlen_q=1, hq=8, hkv=2, d=128, pages=40, max_pages=16):
    q = torch.randn(batch, seqlen_q, hq, d).to(dtype)
    k = torch.randn(pages, 64, hkv, d).to(dtype)
    v = torch.randn(pages, 64, hkv, d).to(dtype)
    seqlens = torch.tensor([100, 900][:batch], dtype=torch.int32)
    table = torch.randperm(pages)[: batch * max_pages].view(batch, max_pages).to(torch.int32)
    return q, k, v, seqlens, table.contiguous()


def _descales(launch) -> dict:
    return dict(zip(fp8_host.DESCALES_FIELDS, fp8_host.DESCALES.unpack(launch.second)))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_a_paged_packed_call_takes_8bit_boxes_and_its_descales(device, dtype):
    log, _ = device
    kern = fadsl.load(PAGED, verbose=False)
    q, k, v, seqlens, table = paged_call(dtype)
    qd, vd = torch.rand(2, 2), torch.rand(2, 2).t()  # (batch, heads_kv); vd strided
    out, lse = kern.kvcache(q, k, v, seqlens, table, q_descale=qd, v_descale=vd,
                            num_splits=3, return_lse=True)  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (2, 8, 1)
    main, combine = log
    assert combine.kernel.endswith(host_kvcache.COMBINE_SUFFIX) and combine.second is None
    fields = _descales(main)
    assert (fields["q"], fields["k"], fields["v"]) == (qd.data_ptr(), 0, vd.data_ptr())
    assert (fields["v_batch_stride"], fields["v_head_stride"]) == (1, 2)
    cfg = kern.config
    # Q: 5-D, 128 one-byte columns of G = 4 heads; K and V: 128 columns of a page's 64 rows
    assert main.params[:128] == tma.packed_heads_map(q, 4, 128, cfg.block_r)
    assert main.params[:128] != tma.packed_heads_map(q, 4, 64, cfg.block_r)
    assert main.params[128:256] == tma.tensor_map(k, 128, 64, streamed=True)
    assert main.params[256:384] == tma.tensor_map(v, 128, 64, streamed=True)
    assert main.params[384:512] == tma.packed_heads_map(out, 4, 64, 64)  # O: 16-bit boxes
    assert combine.params == main.params


def test_a_contiguous_head_dim_64_call_takes_64_column_boxes(device):
    log, _ = device
    kern = fadsl.load(CONTIGUOUS, verbose=False)
    q = torch.randn(2, 3, 4, 64).to(E5M2)
    k = torch.randn(2, 300, 4, 64).to(E5M2)
    v = torch.randn_like(k, dtype=torch.float32).to(E5M2)
    seqlens = torch.tensor([0, 300], dtype=torch.int32)
    out = kern.kvcache(q, k, v, seqlens, k_descale=torch.rand(2, 4))
    assert out.dtype == torch.float16  # the spec's `output fp16`
    main = log[0]
    assert main.params[:128] == tma.tensor_map(q, 64, kern.config.block_r)
    assert main.params[128:256] == tma.tensor_map(k, 64, kern.config.block_c, streamed=True)
    fields = _descales(main)
    assert fields["q"] == 0 and fields["v"] == 0 and fields["k"] != 0


def test_without_descales_the_second_parameter_says_1(device):
    log, _ = device
    kern = fadsl.load(PAGED, verbose=False)
    kern.kvcache(*paged_call(), num_splits=1)
    (main,) = log
    assert set(_descales(main).values()) == {0}


def test_bad_arguments_are_named(device):
    kern = fadsl.load(PAGED, verbose=False)
    q, k, v, seqlens, table = paged_call()
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, heads_kv\)"):
        kern.kvcache(q, k, v, seqlens, table, q_descale=torch.rand(2, 8))
    with pytest.raises(TypeError, match="v_descale must be float32"):
        kern.kvcache(q, k, v, seqlens, table, v_descale=torch.rand(2, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="k_descale requires grad"):
        kern.kvcache(q, k, v, seqlens, table, k_descale=torch.rand(2, 2, requires_grad=True))
    with pytest.raises(TypeError, match="k_cache has dtype torch.bfloat16"):
        kern.kvcache(q, k.to(torch.bfloat16), v, seqlens, table)
    with pytest.raises(ValueError, match="out must match q"):
        kern.kvcache(q, k, v, seqlens, table, out=torch.empty(q.shape, dtype=torch.float16))
    sixteen = fadsl.load(ROOT / "examples" / "serving" / "fa3_decode_paged.fa", verbose=False)
    q16, k16, v16 = (t.to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(TypeError, match="q_descale: .* descales are for an 8-bit spec"):
        sixteen.kvcache(q16, k16, v16, seqlens, table, q_descale=torch.rand(2, 2))


@pytest.fixture
def cpu_kvcache(monkeypatch):
    """The 8-bit decode spec on CPU tensors: the device check skipped and the launch a
    per-batch reference, so that the op's plumbing (schema, fake, checks) runs here."""
    from fadsl.runtime import kvcache as kvcache_module
    from fadsl.runtime.attention import FlashAttention

    original = kvcache_module.check_kvcache

    def check_kvcache(kern, q, k_cache, v_cache, cache_seqlens, page_table):
        try:
            return original(kern, q, k_cache, v_cache, cache_seqlens, page_table)
        except ValueError as err:
            if "device" not in str(err):
                raise
            return kern.config.dtypes[0]

    def kvcache_forward(self, q, k, v, seqlens, table, scale, num_splits, out, return_lse,
                        lse=None, dtype=None, descales=None):  # fmt: skip
        self.check_kvcache_call(q, k, v, seqlens, table, scale, num_splits, return_lse, descales)
        out = _reference(q, k, v, seqlens, table, descales, scale).to(self.out_torch_dtype)
        lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])
        return (out, lse) if return_lse else out

    monkeypatch.setattr(kvcache_module, "check_kvcache", check_kvcache)
    monkeypatch.setattr(FlashAttention, "kvcache_forward", kvcache_forward)
    return fadsl.load(PAGED, verbose=False)


def _reference(q, k, v, seqlens, table, descales, scale):
    """Each batch's dequantized attention over its first seqlens[b] keys (its row of each
    descale; causal from the bottom right)."""
    batch, seqlen_q, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.zeros(q.shape)
    for b in range(batch):
        n = int(seqlens[b])
        keys = k[table[b].long()].reshape(-1, hkv, d)[:n].float()
        values = v[table[b].long()].reshape(-1, hkv, d)[:n].float()
        qd, kd, vd = (torch.ones(hkv) if t is None else t[b] for t in descales)
        g = hq // hkv
        qf = q[b].float() * qd.repeat_interleave(g)[None, :, None]
        kf = (keys * kd[None, :, None]).repeat_interleave(g, 1)
        vf = (values * vd[None, :, None]).repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
        rows = torch.arange(seqlen_q)[:, None] + n - seqlen_q
        s = s.masked_fill(torch.arange(n)[None, :] > rows, float("-inf"))
        out[b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vf)
    return out


def test_torch_compile_traces_the_8bit_kvcache_op(cpu_kvcache):
    q, k, v, seqlens, table = paged_call(seqlen_q=2)
    qd, vd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    torch._dynamo.reset()

    def f(q, k, v, qd, vd):
        return cpu_kvcache.kvcache(q, k, v, seqlens, table, q_descale=qd, v_descale=vd)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qd, vd)
    expected = _reference(q, k, v, seqlens, table, (qd, None, vd), 128**-0.5)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected.to(torch.bfloat16))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"v_descale must have shape \(batch, heads_kv\)"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qd, torch.rand(3, 2))
