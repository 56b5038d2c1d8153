"""fadsl.attention on 8-bit q, k and v (issue 42), eager and without gradients, through
launch plans (fadsl/runtime/plans.py) as the 16-bit calls' (fadsl/runtime/planned.py).

A signature adds the descales to the 16-bit one's: each None, or its shape, strides, dtype
and device (the checks read those and the kernel's Fp8Descales holds the strides), and
out_dtype with its type. The descales' addresses are a call's own, as q's: a plan writes
them into the kernel's second parameter (host/fp8.py's slots) on every call that moves
them. The values are never read on the host (fadsl/runtime/fp8_calls.py).
"""

from __future__ import annotations

import torch

from . import dispatch, fp8_public_ops, planned
from .arguments import check_bases, check_scale, lse_shape
from .plans import PlanCache, stream_and_device

_FP8 = PlanCache(shared=True)
_FP8_VARLEN = PlanCache(shared=True)
_FP8_KVCACHE = PlanCache(shared=True)
# an 8-bit varlen call's addresses in a plan's order (host/varlen.py's and host/fp8.py's slots)
VARLEN_FP8_SOURCES = (
    *("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k"),
    *("q_descale", "k_descale", "v_descale"),
)
_FLOAT32 = torch.float32


def clear() -> None:
    """Forget every 8-bit plan and signature (as planned.clear)."""
    _FP8.clear()
    _FP8_VARLEN.clear()
    _FP8_KVCACHE.clear()


def _tensor(t):
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def signature(q, k, v, descales, causal, softmax_scale, out_dtype, window_size, softcap,
              return_lse):  # fmt: skip
    device = q.device
    window = tuple(window_size)
    return (
        *(q.shape, q.stride(), q.dtype, device),
        *(k.shape, k.stride(), k.dtype, k.device),
        *(v.shape, v.stride(), v.dtype, v.device),
        *(_tensor(t) for t in descales),
        *(type(out_dtype), out_dtype),
        *(type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse),
        *(type(window_size), window, type(window[0]), type(window[1])),
        *(type(softcap), softcap, *stream_and_device(device.index)),
    )


class Fp8AttentionPlan:
    """An 8-bit call's plan: O (of the output type) and the LSE allocated, q's, k's and v's
    addresses checked, every address written, one launch."""

    def __init__(self, prepared, target: str, out_dtype, return_lse: bool, lse_shape_, device):
        self.launch, self.target, self.out_dtype = prepared.launch, target, out_dtype
        self.return_lse, self.lse_shape, self.device = return_lse, lse_shape_, device

    def __call__(self, q, k, v, descales):
        out = torch.empty(q.shape, dtype=self.out_dtype, device=self.device)
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        if (addresses[0] | addresses[1] | addresses[2]) % 16:
            check_bases(q, k, v, self.target)
        lse = None
        if self.return_lse:
            lse = torch.empty(self.lse_shape, dtype=_FLOAT32, device=self.device)
        scales = tuple(0 if t is None else t.data_ptr() for t in descales)
        self.launch((*addresses, 0 if lse is None else lse.data_ptr(), *scales))
        return (out, lse) if self.return_lse else out


class Fp8VarlenPlan:
    """An 8-bit varlen call's plan (planned.VarlenPlan's, with O of the output type and the
    descales' addresses)."""

    def __init__(self, prepared, target: str, out_dtype, return_lse: bool, lse_shape_, device):
        self.launch, self.target, self.out_dtype = prepared.launch, target, out_dtype
        self.return_lse, self.lse_shape, self.device = return_lse, lse_shape_, device

    def __call__(self, q, k, v, cu_q, cu_k, descales):
        out = torch.empty_like(q, dtype=self.out_dtype)
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        if (addresses[0] | addresses[1] | addresses[2]) % 16:
            check_bases(q, k, v, self.target)
        lse = None
        if self.return_lse:
            lse = torch.empty(self.lse_shape, dtype=_FLOAT32, device=self.device)
        scales = tuple(0 if t is None else t.data_ptr() for t in descales)
        self.launch((*addresses, 0 if lse is None else lse.data_ptr(), cu_q.data_ptr(),
                     cu_k.data_ptr(), *scales))  # fmt: skip
        return (out, lse) if self.return_lse else out


def varlen_lookup(q, k, v, cu_q, cu_k, max_q, max_k, descales, causal, softmax_scale, out_dtype,
                  window_size, softcap, return_lse):  # fmt: skip
    """(signature, its plan or None) of an 8-bit fadsl.attention_varlen call (as lookup)."""
    try:
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, *descales)
        ):
            return None, None
        key = (  # (the padded signature last: its stream at key[-2])
            *(cu_q.shape, cu_q.stride(), cu_q.dtype, cu_q.device),
            *(cu_k.shape, cu_k.stride(), cu_k.dtype, cu_k.device),
            *(_max_seqlen(max_q), _max_seqlen(max_k)),
            *signature(q, k, v, descales, causal, softmax_scale, out_dtype, window_size,
                       softcap, return_lse),  # fmt: skip
        )
        return key, _FP8_VARLEN.get(key)
    except Exception:
        return None, None


def _max_seqlen(value):
    """What the checks and the kernel's choice read of a max_seqlen: its type, its sign and
    the short-query limits it is within (dispatch.fp8_varlen_kernel)."""
    if value is None:
        return None
    return (type(value), value < 0, dispatch.fp8_short_limits_within(value))


def varlen_call(key, q, k, v, cu_q, cu_k, descales, softmax_scale, out_dtype, causal,
                return_lse, max_seqlen_q=None):  # fmt: skip
    """The checked path of an 8-bit varlen call (fadsl.attention_varlen has checked its own
    arguments and the max_seqlens): the kernel's checks and launches; a plan kept at the
    second call of the signature ``key``."""
    from .varlen import run_varlen, varlen_lse_shape

    kern = dispatch.fp8_varlen_kernel(q, causal, out_dtype, max_seqlen_q)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    dtype = kern.check_varlen_call(q, k, v, cu_q, cu_k, descales)
    out = torch.empty_like(q, dtype=kern.out_torch_dtype)
    lse = torch.empty(varlen_lse_shape(q), dtype=_FLOAT32, device=q.device) if return_lse else None
    plan = run_varlen(kern, dtype, q, k, v, cu_q, cu_k, out, lse, scale, descales)
    if plan.reusable and _FP8_VARLEN.worth_planning(key):
        tensors = (q, k, v, out, lse, cu_q, cu_k, *descales)
        addresses = tuple(0 if t is None else t.data_ptr() for t in tensors)
        prepared = kern.prepared(dtype, q.device.index, key[-2], plan, VARLEN_FP8_SOURCES,
                                 addresses)  # fmt: skip
        _FP8_VARLEN.put(key, Fp8VarlenPlan(prepared, kern.config.target, kern.out_torch_dtype,
                                           return_lse, varlen_lse_shape(q), q.device))  # fmt: skip
    return (out, lse) if return_lse else out


def kvcache_lookup(q, k_cache, v_cache, cache_seqlens, k, v, page_table, descales, causal,
                   softmax_scale, out_dtype, window_size, softcap, num_splits,
                   return_lse):  # fmt: skip
    """(signature, its plan or None) of an 8-bit fadsl.attention_with_kvcache call: the
    16-bit call's signature (planned.kvcache_signature) after the descales and out_dtype."""
    try:
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v, *descales)
        ):
            return None, None
        key = (  # (the 16-bit signature last: its stream at key[-2])
            *(_tensor(t) for t in descales),
            *(type(out_dtype), out_dtype),
            *planned.kvcache_signature(q, k_cache, v_cache, cache_seqlens, k, v, page_table,
                                       causal, softmax_scale, window_size, softcap, num_splits,
                                       return_lse),
        )  # fmt: skip
        return key, _FP8_KVCACHE.get(key)
    except Exception:  # (not a tensor, an unhashable or odd value: the checks say what)
        return None, None


def kvcache_call(key, q, k_cache, v_cache, cache_seqlens, k, v, page_table, descales, causal,
                 softmax_scale, out_dtype, num_splits, return_lse):  # fmt: skip
    """The checked path of an 8-bit kv-cache call (fadsl.attention_with_kvcache has checked
    its own arguments): every check, the new tokens appended, the attention; a plan kept at
    the second call of the signature ``key``."""
    checked = fp8_public_ops.check_kvcache_fp8_call(
        q, k_cache, v_cache, cache_seqlens, k, v, page_table, descales, causal, softmax_scale,
        out_dtype, num_splits, return_lse,
    )  # fmt: skip
    return planned.kvcache_planning(
        _FP8_KVCACHE, key, checked, q, k_cache, v_cache, cache_seqlens, k, v, page_table,
        num_splits, return_lse, tuple(descales),
    )  # fmt: skip


def lookup(q, k, v, descales, causal, softmax_scale, out_dtype, window_size, softcap,
           return_lse):  # fmt: skip
    """(signature, its plan or None); (None, None) where an argument requires grad or no
    signature can hold one (the checked path names it)."""
    try:
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, *descales)
        ):
            return None, None
        key = signature(q, k, v, descales, causal, softmax_scale, out_dtype, window_size,
                        softcap, return_lse)  # fmt: skip
        return key, _FP8.get(key)
    except Exception:  # (not a tensor, an unhashable or odd value: the checks say what)
        return None, None


def call(key, q, k, v, descales, causal, softmax_scale, out_dtype, return_lse):
    """The checked path (fadsl.attention has checked its own arguments): the kernel's checks
    and launch; a plan kept at the second call of the signature ``key``."""
    kern = dispatch.fp8_attention_kernel(q, causal, out_dtype)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    dtype = kern.check_fp8_call(q, k, v, descales)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        check_bases(q, k, v, kern.config.target)
    out = torch.empty(q.shape, dtype=kern.out_torch_dtype, device=q.device)
    lse = torch.empty(lse_shape(q), dtype=_FLOAT32, device=q.device) if return_lse else None
    prepared = None
    if _FP8.worth_planning(key):
        prepared = kern.prepare(dtype, q, k, v, out, lse, scale, key[-2], descales)
    if prepared is None:  # a first call
        kern.launch(dtype, q, k, v, out, lse, scale, (), descales)
    else:
        tensors = (q, k, v, out, lse, *descales)
        prepared.launch(tuple(0 if t is None else t.data_ptr() for t in tensors))
        plan = Fp8AttentionPlan(
            prepared, kern.config.target, kern.out_torch_dtype, return_lse, lse_shape(q), q.device
        )
        _FP8.put(key, plan)
    return (out, lse) if return_lse else out
