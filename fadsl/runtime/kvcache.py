"""KV-cache calls of a `kv_cache` spec (FlashAttention's ``flash_attn_with_kvcache``
convention); fadsl/runtime/append.py writes new tokens' keys and values into a cache.

q is (batch, seqlen_q, heads_q, head_dim). A contiguous cache (`kv_cache contiguous`) is
(batch, capacity, heads_kv, head_dim); a paged one (`kv_cache paged(N)`) is (pages, N,
heads_kv, head_dim) with ``page_table`` (batch, max_pages) int32: key j of batch b is row
j % N of page page_table[b, j // N]. ``cache_seqlens`` (batch,) int32 counts each batch's
keys, 0 to the capacity (the cache's rows, or max_pages x N). The host never reads the
lengths or the page table (that would wait for the GPU), so the kernel checks them: a length
outside 0 .. capacity makes that batch's rows of O and the LSE NaN, and a page-table entry
outside the cache the rows of every tile that reads that page (the kernel reads only the
clamped length's keys, and TMA's zeros for a page outside the cache). cache_seqlens and
page_table must not change while a call runs (another stream writing them could leave the kernel's roles disagreeing).
A causal spec aligns the diagonal to the bottom right (the new queries are the last ones).
``num_splits``: pieces per tile with `splits auto` (None: from the shape; a spec without
`splits auto` refuses it).
"""

from __future__ import annotations

from ..ir import Dtype
from .arguments import check_base, check_operand, torch_dtypes


def _int32_vector(name: str, t, device, length: int | None = None, dims: int = 1) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or t.dim() != dims:
        raise ValueError(
            f"{name} must be a {dims}-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} has {t.shape[0]} rows; q's batch is {length}")
    if t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension; pass {name}.contiguous()"
        )


def check_kvcache(kern, q, k_cache, v_cache, cache_seqlens, page_table) -> Dtype:
    """Shapes, dtypes, strides and devices of a kv-cache call, each error naming the argument
    (no memory access: fake tensors pass)."""
    import torch

    cfg = kern.config
    hw = cfg.features
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        check_operand(name, t, q, cfg)
        if t.device.type != "cuda" or t.device != q.device:
            raise ValueError(f"{name} must be on q's CUDA device, got {t.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    batch, seqlen_q, heads_q, _ = q.shape
    heads_kv = k_cache.shape[2]
    if seqlen_q == 0 or batch == 0:
        raise ValueError(f"q must have at least one row and one batch, got shape {tuple(q.shape)}")
    if heads_q == 0 or heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"q's heads ({heads_q}) must be a multiple of the cache's heads ({heads_kv})"
        )
    group = heads_q // heads_kv
    if hw.pack_gqa and (64 % group or group > 64):
        raise ValueError(
            f"pack_gqa packs a K/V head's {group} query heads into 64-row tiles: q's heads / the "
            "cache's heads must divide 64"
        )
    _int32_vector("cache_seqlens", cache_seqlens, q.device, batch)
    if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
        raise ValueError(f"k_cache holds no key (shape {tuple(k_cache.shape)})")
    if hw.kv_cache == 0:
        if page_table is not None:
            raise ValueError(
                f"kernel '{cfg.name}' reads a contiguous cache ('kv_cache contiguous'): page_table must be None"
            )
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]} but q has {batch}")
    else:
        if page_table is None:
            raise ValueError(
                f"kernel '{cfg.name}' reads a paged cache ('kv_cache paged({hw.kv_cache})'): pass page_table"
            )
        if k_cache.shape[1] != hw.kv_cache:
            raise ValueError(
                f"k_cache must be (pages, {hw.kv_cache}, heads_kv, head_dim) for pages of {hw.kv_cache} "
                f"rows, got shape {tuple(k_cache.shape)}"
            )
        _int32_vector("page_table", page_table, q.device, batch, dims=2)
        if page_table.shape[1] == 0 or page_table.shape[1] * hw.kv_cache >= 2**31:
            raise ValueError(
                f"page_table has {page_table.shape[1]} pages a sequence; a sequence's pages x "
                f"{hw.kv_cache} rows must be between 1 and 2^31 - 1"
            )
    return torch_dtypes()[q.dtype]


def run_kvcache(kern, dtype: Dtype, q, k_cache, v_cache, cache_seqlens, page_table, out, lse,
                scale: float, num_splits: int | None, descales=None):  # fmt: skip
    """Launch the target's kv-cache kernels on q's device's current stream; the plan they
    were launched by (``targets.launch.CallPlan``). ``descales``: an 8-bit kernel's,
    checked (None: all 1)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        check_base(name, t, kern.config.target)
    args = (kern.compiled.kernel, q, k_cache, v_cache, cache_seqlens, page_table, out, lse,
            scale, num_splits)  # fmt: skip
    if kern.is_fp8:  # (an 8-bit kernel always takes its second parameter)
        plan = kern.serving.kvcache(*args, tuple(descales or (None, None, None)))
    else:
        plan = kern.serving.kvcache(*args)
    launch = kern.launcher(dtype, q.device.index)
    for kl in plan.launches():
        launch(kl)
    return plan
