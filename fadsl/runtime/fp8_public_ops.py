"""fadsl.attention's 8-bit (FP8) forward as a torch.library custom op (issue 42), so that
torch.compile (fullgraph, dynamic shapes) traces it (no `from __future__ import annotations`
here: custom_op reads the annotations as types):

- ``fadsl::attention_fp8(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale,
  out_dtype, with_lse) -> (out, lse)``: the shipped 8-bit spec's kernel, chosen when it runs
  (fadsl/runtime/dispatch.py); no autograd formula (the FP8 forward has no backward);
- ``fadsl::attention_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, q_descale,
  k_descale, v_descale, causal, softmax_scale, out_dtype, with_lse) -> (out, lse)``: its
  `varlen on` variant (fadsl.attention_varlen on 8-bit inputs; max_seqlen_q chooses the
  short queries' tile, both exact);
- ``fadsl::attention_with_kvcache_fp8(q, k_cache, v_cache, cache_seqlens, k, v, page_table,
  q_descale, k_descale, v_descale, causal, softmax_scale, out_dtype, num_splits, with_lse) ->
  (out, lse)``: the 8-bit kv-cache spec's variant (fadsl.attention_with_kvcache on 8-bit
  inputs), which writes the new tokens k and v into the caches first (``mutates_args``, as
  fadsl::attention_with_kvcache).

A loaded 8-bit spec's own op is fadsl/runtime/fp8_ops.py's, as the 16-bit kernels' are in
fadsl/runtime/custom_op.py and fadsl.attention's in fadsl/runtime/public_ops.py.
"""

from typing import Optional

import torch
from torch.library import custom_op

from . import dispatch
from .arguments import check_scale
from .public_ops import append_and_attend, concrete, check_kvcache_kernel_call, check_new_tokens
from .fp8_ops import NO_LSE, fp8_outputs, fp8_varlen_outputs


def attention_fp8_call(q, k, v, descales, causal: bool, softmax_scale, out_dtype, with_lse):
    """fadsl.attention's 8-bit call without a plan (the op's body): the shipped kernel's
    checks and launch."""
    kern = dispatch.fp8_attention_kernel(q, causal, out_dtype)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    return kern.fp8_forward(q, k, v, scale, descales, None, with_lse)


@custom_op("fadsl::attention_fp8", mutates_args=())
def attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    out_dtype: Optional[torch.dtype],
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    descales = (q_descale, k_descale, v_descale)
    found = attention_fp8_call(q, k, v, descales, causal, softmax_scale, out_dtype, with_lse)
    return found if with_lse else (found, q.new_empty(NO_LSE, dtype=torch.float32))


@attention_fp8.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, causal, softmax_scale, out_dtype, with_lse):
    kern = dispatch.fp8_attention_kernel(q, causal, out_dtype)
    check_scale(softmax_scale, kern.config.head_dim)
    kern.check_fp8_call(q, k, v, (q_descale, k_descale, v_descale))
    return fp8_outputs(q, kern.out_torch_dtype, with_lse)


def attention_varlen_fp8_call(q, k, v, cu_q, cu_k, max_q, descales, causal: bool, softmax_scale,
                              out_dtype, with_lse):  # fmt: skip
    """fadsl.attention_varlen's 8-bit call without a plan (the op's body)."""
    kern = dispatch.fp8_varlen_kernel(q, causal, out_dtype, max_q)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    return kern.varlen_forward(q, k, v, cu_q, cu_k, scale, None, with_lse, descales=descales)


@custom_op("fadsl::attention_varlen_fp8", mutates_args=())
def attention_varlen_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int],
    q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    out_dtype: Optional[torch.dtype],
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, (q_descale, k_descale, v_descale))
    found = attention_varlen_fp8_call(*args, causal, softmax_scale, out_dtype, with_lse)
    return found if with_lse else (found, q.new_empty(NO_LSE, dtype=torch.float32))


@attention_varlen_fp8.register_fake
def _(q, k, v, cu_q, cu_k, max_q, q_descale, k_descale, v_descale, causal, softmax_scale,
      out_dtype, with_lse):  # fmt: skip
    # max_seqlen_q chooses the tile only (both exact): the fake need not read a SymInt
    kern = dispatch.fp8_varlen_kernel(q, causal, out_dtype)
    check_scale(softmax_scale, kern.config.head_dim)
    kern.check_varlen_call(q, k, v, cu_q, cu_k, (q_descale, k_descale, v_descale))
    return fp8_varlen_outputs(q, kern.out_torch_dtype, with_lse)


def check_kvcache_fp8_call(q, k_cache, v_cache, cache_seqlens, k, v, page_table, descales,
                           causal: bool, softmax_scale, out_dtype, num_splits,
                           with_lse):  # fmt: skip
    """Every check of an 8-bit kv-cache call, the descales' and the new tokens' included,
    before anything is written: (the kernel, the scale, the dtype, k and v)."""
    check_new_tokens(k, v)
    kern = dispatch.fp8_kvcache_kernel(q, k_cache, page_table, causal, out_dtype)
    return check_kvcache_kernel_call(kern, q, k_cache, v_cache, cache_seqlens, k, v, page_table,
                                     softmax_scale, num_splits, with_lse, descales)  # fmt: skip


def kvcache_fp8_call(q, k_cache, v_cache, cache_seqlens, k, v, page_table, descales,
                     causal: bool, softmax_scale, out_dtype, num_splits, with_lse):  # fmt: skip
    """fadsl.attention_with_kvcache's 8-bit call without a plan (the op's body): every
    argument checked, the new tokens appended, the attention with the descales."""
    checked = check_kvcache_fp8_call(q, k_cache, v_cache, cache_seqlens, k, v, page_table,
                                     descales, causal, softmax_scale, out_dtype, num_splits,
                                     with_lse)  # fmt: skip
    return append_and_attend(checked, q, k_cache, v_cache, cache_seqlens, page_table, num_splits,
                             with_lse, descales)  # fmt: skip


@custom_op("fadsl::attention_with_kvcache_fp8", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    page_table: Optional[torch.Tensor],
    q_descale: Optional[torch.Tensor],
    k_descale: Optional[torch.Tensor],
    v_descale: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    out_dtype: Optional[torch.dtype],
    num_splits: Optional[int],
    with_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, k_cache, v_cache, cache_seqlens, k, v, page_table)
    descales = (q_descale, k_descale, v_descale)
    (splits,) = concrete(num_splits)  # (by value: a SymInt under torch.compile)
    found = kvcache_fp8_call(*args, descales, causal, softmax_scale, out_dtype, splits, with_lse)
    return found if with_lse else (found, q.new_empty(NO_LSE, dtype=torch.float32))


@attention_with_kvcache_fp8.register_fake
def _(q, k_cache, v_cache, seqlens, k, v, table, q_descale, k_descale, v_descale, causal, scale,
      out_dtype, num_splits, with_lse):  # fmt: skip
    descales, (splits,) = (q_descale, k_descale, v_descale), concrete(num_splits)
    kern, *_ = check_kvcache_fp8_call(q, k_cache, v_cache, seqlens, k, v, table, descales, causal,
                                      scale, out_dtype, splits, with_lse)  # fmt: skip
    # O with q's strides, as kvcache_forward's torch.empty_like makes it
    _, lse = fp8_outputs(q, kern.out_torch_dtype, with_lse)
    return torch.empty_like(q, dtype=kern.out_torch_dtype), lse
