"""fadsl.attention_with_kvcache on 8-bit inputs (issue 42), on the stand-in device
(tests/fake_cuda.py): the kernel dispatch.fp8_kvcache_kernel writes from
examples/serving/fa3_fp8_decode_paged.fa for the cache's layout, the mask, the query-head
group, q's head_dim and out_dtype; the descales in the attention kernel's second parameter
(after the new tokens' append); a planned call writing each call's descale addresses; the
fadsl::attention_with_kvcache_fp8 op launching what the eager call does; every bad argument
named; the 16-bit call as before (descales and out_dtype refused there). What the kernel
computes is tests/test_gpu_fp8_kvcache.py's to show."""

from __future__ import annotations

import pytest
import torch

import fadsl
import fake_cuda
from fadsl.runtime import append as append_module
from fadsl.runtime import dispatch, fp8_planned, fp8_public_ops
from fadsl.targets.sm90.host import fp8 as fp8_host
from fadsl.targets.sm90.host import kvcache as host_kvcache

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BASE = "fa3_fp8_decode_paged"


@pytest.fixture
def device(monkeypatch):
    found = fake_cuda.install(monkeypatch)
    monkeypatch.setattr(host_kvcache, "sm_count", lambda index: 132)
    yield found
    fake_cuda.uninstall()


def cache_call(dtype=E4M3, paged=True, d=128, heads=(8, 2), batch=2, sq=1, new=0, page=64):
    """q, k_cache, v_cache, cache_seqlens, k, v, page_table (8-bit) of a decode step."""
    hq, hkv = heads
    q = torch.randn(batch, sq, hq, d).to(dtype)
    rows = (batch * 8, page) if paged else (batch, 512)
    k_cache, v_cache = (torch.randn(*rows, hkv, d).to(dtype) for _ in "kv")
    table = torch.randperm(batch * 8).to(torch.int32).view(batch, 8) if paged else None
    seqlens = torch.tensor([300, 17, 5, 64][:batch], dtype=torch.int32)
    k = v = None
    if new:
        k, v = (torch.randn(batch, new, hkv, d).to(dtype) for _ in "kv")
    return q, k_cache, v_cache, seqlens, k, v, table


def _descales(launch) -> dict:
    return dict(zip(fp8_host.DESCALES_FIELDS, fp8_host.DESCALES.unpack(launch.second)))


def _main(log):
    """The attention kernel's launch (not the append's or the combine's)."""
    (main,) = [x for x in log if x.second is not None]
    return main


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_the_kernel_follows_the_cache_mask_group_and_head_dim(device, paged, causal, head_dim):
    log, _ = device
    args = cache_call(paged=paged, d=head_dim)
    q, k_cache, v_cache, seqlens, _, _, table = args
    out = fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table,
                                       causal=causal)  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    kern = dispatch.fp8_kvcache_kernel(q, k_cache, table, causal, None)
    assert _main(log).kernel == kern.config.name and kern.config.name.startswith(BASE)
    cfg = kern.config
    assert (cfg.head_dim, cfg.mask.value, cfg.out_dtype.value) == (
        head_dim, "causal" if causal else "none", "bf16"
    )  # fmt: skip
    assert cfg.features.kv_cache == (64 if paged else 0)
    assert cfg.features.pack_gqa and cfg.features.split_all  # (a group of 4 divides 64)
    if paged and causal and head_dim == 128:  # the example's own lines, renamed
        assert cfg.name == f"{BASE}_causal_paged_64_pack_splits_hdim128"


@pytest.mark.parametrize(
    "head_dim, page, block_c", [(256, 64, 64), (256, 16, 64), (128, 16, 128), (64, 16, 128),
                                (128, 32, 256), (64, 256, 256)],
)  # fmt: skip
def test_head_dim_256_and_16_key_pages_take_the_blocks_that_build(device, head_dim, page, block_c):
    """The spec's B_c 256 where it builds; 64 at head_dim 256 (registers and SMEM), 128 on
    pages of 16 keys (16 boxes a block spill), dispatch.fp8_kvcache_block_c."""
    log, _ = device
    q, k_cache, v_cache, seqlens, _, _, table = cache_call(d=head_dim, page=page)
    fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table, causal=True)
    kern = dispatch.fp8_kvcache_kernel(q, k_cache, table, True, None)
    assert _main(log).kernel == kern.config.name
    assert (kern.config.head_dim, kern.config.block_c) == (head_dim, block_c)
    assert kern.config.features.kv_cache == page
    assert kern.config.name.endswith(f"bc{block_c}") == (block_c != 256)


def test_out_dtype_fp16_group_3_and_other_pages_choose_their_variants(device):
    log, _ = device
    q, k_cache, v_cache, seqlens, _, _, table = cache_call(E5M2, heads=(6, 2), page=128)
    out = fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table,
                                       out_dtype=torch.float16)  # fmt: skip
    assert out.dtype == torch.float16
    kern = dispatch.fp8_kvcache_kernel(q, k_cache, table, False, torch.float16)
    assert _main(log).kernel == kern.config.name
    assert kern.config.out_dtype.value == "fp16" and kern.config.features.kv_cache == 128
    assert not kern.config.features.pack_gqa  # (3 does not divide 64)
    assert kern is not dispatch.fp8_kvcache_kernel(q, k_cache, table, False, None)


def test_descales_and_new_tokens_reach_their_kernels(device):
    """k and v appended first (the append kernel, no second parameter), then the attention
    with each descale's address and strides in its second parameter (not the combine's)."""
    log, _ = device
    q, k_cache, v_cache, seqlens, k, v, table = cache_call(new=2)
    qd, vd = torch.rand(2, 2), torch.rand(2, 2).t()  # (batch, heads_kv); vd strided
    out, lse = fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, k, v, page_table=table,
                                            causal=True, q_descale=qd, v_descale=vd,
                                            num_splits=3, return_lse=True)  # fmt: skip
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 8, 1)
    append, main, combine = log
    assert append.kernel == append_module.KERNEL and append.second is None
    assert combine.kernel.endswith(host_kvcache.COMBINE_SUFFIX) and combine.second is None
    fields = _descales(main)
    assert (fields["q"], fields["k"], fields["v"]) == (qd.data_ptr(), 0, vd.data_ptr())
    assert (fields["v_batch_stride"], fields["v_head_stride"]) == (1, 2)


def test_a_planned_call_writes_each_calls_descales(device):
    """The second call of a signature keeps a plan; a third, on other descales (and new
    tokens), launches the bytes the checked path launches for it."""
    log, allocator = device
    q, k_cache, v_cache, seqlens, k, v, table = cache_call(new=1)
    calls = [(torch.rand(2, 2), torch.rand(2, 2)) for _ in range(3)]

    def call(kd, vd, checked=False):
        log.clear()
        descales = (None, kd, vd)
        if checked:
            fp8_planned.kvcache_call(None, q, k_cache, v_cache, seqlens, k, v, table, descales,
                                     True, None, None, None, True)  # fmt: skip
        else:
            fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, k, v, page_table=table,
                                         causal=True, k_descale=kd, v_descale=vd,
                                         return_lse=True)  # fmt: skip
        return list(log)

    fp8_planned.clear()
    for kd, vd in calls[:2]:
        call(kd, vd)
    assert len(fp8_planned._FP8_KVCACHE._plans) == 1
    allocator.next_call(1)
    hit = call(*calls[2])
    allocator.next_call(1)
    expected = call(*calls[2], checked=True)
    assert hit == expected and len(hit) >= 2  # (the append's launch too)
    fields = _descales(_main(hit))
    assert (fields["q"], fields["k"], fields["v"]) == (0, *(t.data_ptr() for t in calls[2]))


def test_the_op_launches_what_the_eager_call_launches(device):
    """fadsl::attention_with_kvcache_fp8 (torch.compile's path) on the same tensors: the
    same launches as the eager call, O of the out dtype, the placeholder LSE without it."""
    log, allocator = device
    q, k_cache, v_cache, seqlens, k, v, table = cache_call(new=1)
    kd = torch.rand(2, 2)
    allocator.next_call(1)
    eager = fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, k, v, page_table=table,
                                         k_descale=kd, out_dtype=torch.float16)  # fmt: skip
    launched = list(log)
    log.clear()
    allocator.next_call(1)
    out, lse = fp8_public_ops.attention_with_kvcache_fp8(
        q, k_cache, v_cache, seqlens, k, v, table, None, kd, None, False, None, torch.float16,
        None, False,
    )  # fmt: skip
    # the append, the attention's pieces and their combine (512 keys: a 256-key block a piece)
    assert log == launched and len(log) == 3
    assert out.dtype == eager.dtype == torch.float16 and lse.numel() == 0


def test_bad_arguments_are_named(device):
    q, k_cache, v_cache, seqlens, k, v, table = cache_call(new=1)

    def call(*args, **kw):
        a = dict(zip(("q", "k_cache", "v_cache", "k", "v", "table"), args)) or {}
        return fadsl.attention_with_kvcache(
            a.get("q", q), a.get("k_cache", k_cache), v_cache, seqlens, a.get("k", k),
            a.get("v", v), page_table=a.get("table", table), **kw,
        )  # fmt: skip

    with pytest.raises(ValueError, match="not built with a window or a softcap"):
        call(window_size=(64, 0))
    with pytest.raises(ValueError, match="not built with a window or a softcap"):
        call(softcap=30)
    with pytest.raises(TypeError, match="out_dtype must be"):
        call(out_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"q_descale must have shape \(batch, heads_kv\)"):
        call(q_descale=torch.rand(2, 8))
    with pytest.raises(TypeError, match="v_descale must be float32"):
        call(v_descale=torch.rand(2, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="k_descale requires grad"):
        call(k_descale=torch.rand(2, 2, requires_grad=True))
    with pytest.raises(ValueError, match="k and v: give the new tokens"):
        fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, k, None, page_table=table)
    with pytest.raises(TypeError, match="k_cache has dtype torch.float8_e5m2"):
        fadsl.attention_with_kvcache(q, k_cache.float().to(E5M2), v_cache, seqlens,
                                     page_table=table)  # fmt: skip
    odd = cache_call(d=96)
    with pytest.raises(ValueError, match=r"head_dim\) = 96 with 8-bit q: .* 64, 128, 256"):
        fadsl.attention_with_kvcache(*odd[:4], page_table=odd[6])
    before = k_cache.clone()
    with pytest.raises(ValueError, match="q_descale"):  # (nothing appended first)
        call(q_descale=torch.rand(3, 2))
    assert torch.equal(k_cache.view(torch.uint8), before.view(torch.uint8))


def test_a_16bit_call_is_unchanged_and_refuses_descales(device):
    log, _ = device
    q, k_cache, v_cache, seqlens, _, _, table = (
        t if t is None else t.float().to(torch.bfloat16) if t.is_floating_point() else t
        for t in cache_call()
    )
    out = fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table)
    assert out.dtype == torch.bfloat16
    kern = dispatch.kvcache_kernel(q, k_cache, table, False, (-1, -1), 0)
    assert log[0].kernel == kern.config.name == "fa3_decode_paged_nomask_paged_64_pack_splits"
    assert all(x.second is None for x in log)  # (no 8-bit second parameter)
    for name in ("q_descale", "k_descale", "v_descale"):
        with pytest.raises(TypeError, match=f"{name} is for 8-bit q"):
            fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table,
                                         **{name: torch.rand(2, 2)})  # fmt: skip
    with pytest.raises(TypeError, match="out_dtype is for 8-bit q"):
        fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table,
                                     out_dtype=torch.bfloat16)  # fmt: skip
