"""The public calls' eager path without gradients through launch plans (fadsl/runtime/
plans.py): ``*_lookup`` forms a call's signature and finds its plan (None: the call takes
its checked path), ``*_call`` is that checked path, which keeps a plan at the signature's
second call.

Each signature lists what the checks and the planning of its call read, the addresses and
the device's values apart: fadsl/runtime/public.py's own checks (the flags' and the window's
types, q's dimensions and device), the kernel's choice (fadsl/runtime/dispatch.py), the
kernel's checks (arguments.py, varlen.py, kvcache.py, append.py), the target's plan, and the
stream and device the launches are built for. Tensors enter as shape, strides, dtype and
device; Python values with their type. A plan's call checks what depends on the addresses
(16-byte alignment, with the same error as the checked path) and nothing else.
"""

from __future__ import annotations

import torch

from . import append, dispatch
from .arguments import check_base, check_scale, lse_shape
from .attention import PADDED_SOURCES
from .kvcache import run_kvcache
from .plans import PlanCache, Prepared, clear_all, stream_and_device
from .public_ops import check_kvcache_call
from .varlen import check_max_seqlen, check_varlen, run_varlen, varlen_lse_shape

_ATTENTION = PlanCache(shared=True)
_VARLEN = PlanCache(shared=True)
_KVCACHE = PlanCache(shared=True)
_APPEND = PlanCache(shared=True)
VARLEN_SOURCES = ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k")
KVCACHE_SOURCES = ("q", "k_cache", "v_cache", "out", "lse", "cache_seqlens", "page_table")
KVCACHE_FP8_SOURCES = (*KVCACHE_SOURCES, "q_descale", "k_descale", "v_descale")  # host/fp8.py's
_FLOAT32 = torch.float32


def clear() -> None:
    """Forget every plan and every signature seen, 16- and 8-bit (tests, timings of first
    calls; a plan holds no tensor, only the modules it launches)."""
    clear_all()


def _misaligned(named, target: str) -> None:
    """check_base of each (name, tensor), in order: the checked path's error."""
    for name, t in named:
        check_base(name, t, target)


def _empty_lse(shape, device):
    return torch.empty(shape, dtype=_FLOAT32, device=device)


# ---------------------------------------------------------------- fadsl.attention
def attention_signature(q, k, v, causal, softmax_scale, window_size, softcap, return_lse):
    device = q.device
    window = tuple(window_size)
    return (
        *(q.shape, q.stride(), q.dtype, device),
        *(k.shape, k.stride(), k.dtype, k.device),
        *(v.shape, v.stride(), v.dtype, v.device),
        *(type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse),
        *(type(window_size), window, type(window[0]), type(window[1])),
        *(type(softcap), softcap, *stream_and_device(device.index)),
    )


def attention_lookup(q, k, v, causal, softmax_scale, window_size, softcap, return_lse):
    """(signature, its plan or None) of a fadsl.attention call; (None, None) with gradients
    or an argument no signature can hold (the checked path names it)."""
    try:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return None, None
        key = attention_signature(q, k, v, causal, softmax_scale, window_size, softcap,
                                  return_lse)  # fmt: skip
        return key, _ATTENTION.get(key)
    except Exception:  # (not a tensor, an unhashable or odd value: the checks say what)
        return None, None


def attention_call(key, q, k, v, causal, softmax_scale, return_lse, window_size, softcap):
    """fadsl.attention's checked path (public.py has checked its own arguments): the
    kernel's checks and launch; a plan kept at the second call of the signature ``key``."""
    kern = dispatch.attention_kernel(q, causal, window_size, softcap)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    return kern._launch_planning(_ATTENTION, key, q, k, v, scale, return_lse)


assert PADDED_SOURCES == ("q", "k", "v", "out", "lse")  # AttentionPlan's order


# ---------------------------------------------------------------- fadsl.attention_varlen
def _max_seqlen(value):
    """What the checks and the kernel's choice read of a max_seqlen: its type, its sign and
    whether it reaches LONG_CAUSAL_ROWS (not the value: it changes from batch to batch)."""
    return None if value is None else (type(value), value < 0, value >= dispatch.LONG_CAUSAL_ROWS)


def varlen_signature(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size,
                     softcap, return_lse):  # fmt: skip
    device = q.device
    window = tuple(window_size)
    return (
        *(q.shape, q.stride(), q.dtype, device),
        *(k.shape, k.stride(), k.dtype, k.device),
        *(v.shape, v.stride(), v.dtype, v.device),
        *(cu_q.shape, cu_q.stride(), cu_q.dtype, cu_q.device),
        *(cu_k.shape, cu_k.stride(), cu_k.dtype, cu_k.device),
        *(_max_seqlen(max_q), _max_seqlen(max_k)),
        *(type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse),
        *(type(window_size), window, type(window[0]), type(window[1])),
        *(type(softcap), softcap, *stream_and_device(device.index)),
    )


class VarlenPlan:
    """A varlen call's plan: out (and the LSE) allocated, the addresses checked and
    written, the tile list's and the attention's launches."""

    def __init__(self, prepared, target: str, return_lse: bool, lse_shape_, device) -> None:
        self.launch, self.target, self.device = prepared.launch, target, device
        self.return_lse, self.lse_shape = return_lse, lse_shape_

    def __call__(self, q, k, v, cu_q, cu_k):
        out = torch.empty_like(q)
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        if (qp | kp | vp | op) % 16:
            _misaligned((("q", q), ("k", k), ("v", v), ("out", out)), self.target)
        lse = _empty_lse(self.lse_shape, self.device) if self.return_lse else None
        lp = 0 if lse is None else lse.data_ptr()
        self.launch((qp, kp, vp, op, lp, cu_q.data_ptr(), cu_k.data_ptr()))
        return (out, lse) if self.return_lse else out


def varlen_lookup(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size,
                  softcap, return_lse):  # fmt: skip
    """(signature, its plan or None) of a fadsl.attention_varlen call (as attention_lookup)."""
    try:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return None, None
        key = varlen_signature(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                               window_size, softcap, return_lse)  # fmt: skip
        return key, _VARLEN.get(key)
    except Exception:
        return None, None


def varlen_call(key, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_size,
                softcap, return_lse):  # fmt: skip
    """fadsl.attention_varlen's checked path: the kernel's checks and launches; a plan kept
    at the second call of the signature ``key``."""
    kern = dispatch.varlen_kernel(q, causal, window_size, softcap, max_q)
    check_max_seqlen("max_seqlen_q", max_q)
    check_max_seqlen("max_seqlen_k", max_k)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    dtype = check_varlen(kern, q, k, v, cu_q, cu_k)
    out = torch.empty_like(q)
    lse = _empty_lse(varlen_lse_shape(q), q.device) if return_lse else None
    plan = run_varlen(kern, dtype, q, k, v, cu_q, cu_k, out, lse, scale)
    if plan.reusable and _VARLEN.worth_planning(key):
        tensors = (q, k, v, out, lse, cu_q, cu_k)
        addresses = tuple(0 if t is None else t.data_ptr() for t in tensors)
        prepared = kern.prepared(dtype, q.device.index, key[-2], plan, VARLEN_SOURCES, addresses)
        target = kern.config.target
        _VARLEN.put(key, VarlenPlan(prepared, target, return_lse, varlen_lse_shape(q), q.device))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- fadsl.append_kv
def _tensor_or_none(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def append_signature(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table):
    device = k_cache.device
    return (
        *(k_cache.shape, k_cache.stride(), k_cache.dtype, device),
        *(v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device),
        *(k_new.shape, k_new.stride(), k_new.dtype, k_new.device),
        *(v_new.shape, v_new.stride(), v_new.dtype, v_new.device),
        *(cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device),
        _tensor_or_none(page_table),
        *stream_and_device(device.index),
    )


class AppendPlan:
    """An append's plan (arguments of one signature, at least one new token and one batch):
    k_new and v_new copied where their rows are not contiguous (as check_append does), the
    16-byte flag from the addresses, one launch."""

    def __init__(self, prepared, copy_k: bool, copy_v: bool, vector16: bool) -> None:
        self.launch = prepared.launch
        self.copy_k, self.copy_v, self.vector16 = copy_k, copy_v, vector16

    def __call__(self, k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out):
        if self.copy_k:
            k_new = k_new.contiguous()
        if self.copy_v:
            v_new = v_new.contiguous()
        self.launch_rows(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out)

    def launch_rows(self, k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out):
        """The launch of new tokens whose rows are contiguous (check_append's k_new, v_new)."""
        kn, vn, kc, vc = k_new.data_ptr(), v_new.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        vector16 = int(self.vector16 and not (kn | vn | kc | vc) % 16)
        table = 0 if page_table is None else page_table.data_ptr()
        out = 0 if seqlens_out is None else seqlens_out.data_ptr()
        self.launch((kn, vn, kc, vc, cache_seqlens.data_ptr(), table, out, vector16))


class NoAppend:
    """The plan of an append with no new token or no batch: nothing to launch."""

    def __call__(self, *args) -> None:
        pass

    launch_rows = __call__


def prepare_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out,
                   checked, stream: int):  # fmt: skip
    """The plan of an append whose arguments check_append has passed (``checked``: its k_new
    and v_new), for its later calls; not launched."""
    k_rows, v_rows = checked
    if k_rows.shape[0] == 0 or k_rows.shape[1] == 0:
        return NoAppend()
    plan = append.plan_append(k_cache, v_cache, k_rows, v_rows, cache_seqlens, page_table,
                              seqlens_out)  # fmt: skip
    tensors = (k_rows, v_rows, k_cache, v_cache, cache_seqlens, page_table, seqlens_out)
    addresses = tuple(0 if t is None else t.data_ptr() for t in tensors)
    by_strides = append.vector16_by_strides(k_cache, v_cache, k_rows, v_rows)
    addresses += (int(by_strides and not (addresses[0] | addresses[1] | addresses[2]
                                          | addresses[3]) % 16),)  # fmt: skip
    index = k_cache.device.index
    prepared = Prepared(plan, append.SOURCES, addresses, (append.module(index),), stream, index)
    return AppendPlan(prepared, k_rows is not k_new, v_rows is not v_new, by_strides)


def append_lookup(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table):
    """(signature, its plan or None) of a fadsl.append_kv call."""
    try:
        key = append_signature(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)
        return key, _APPEND.get(key)
    except Exception:
        return None, None


def append_call(key, k_cache, v_cache, k_new, v_new, cache_seqlens, page_table) -> None:
    """fadsl.append_kv's checked path: every check and the launch; a plan kept at the
    second call of the signature ``key``."""
    checked = append.check_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, None)
    if not _APPEND.worth_planning(key):
        append.launch_append(k_cache, v_cache, *checked, cache_seqlens, page_table, None)
        return
    plan = prepare_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, None,
                          checked, key[-2])  # fmt: skip
    _APPEND.put(key, plan)
    plan.launch_rows(k_cache, v_cache, *checked, cache_seqlens, page_table, None)


# ---------------------------------------------------------------- fadsl.attention_with_kvcache
def kvcache_signature(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal,
                      softmax_scale, window_size, softcap, num_splits, return_lse):  # fmt: skip
    device = q.device
    window = tuple(window_size)
    return (
        *(q.shape, q.stride(), q.dtype, device),
        *(k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device),
        *(v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device),
        *(cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device),
        None if k is None else (k.shape, k.stride(), k.dtype, k.device),
        None if v is None else (v.shape, v.stride(), v.dtype, v.device),
        None if page_table is None else (page_table.shape, page_table.stride(), page_table.dtype,
                                         page_table.device),  # fmt: skip
        *(type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse),
        *(type(num_splits), num_splits, type(softcap), softcap),
        *(type(window_size), window, type(window[0]), type(window[1])),
        *stream_and_device(device.index),
    )


class KvCachePlan:
    """A kv-cache call's plan: out (and the LSE) allocated, the addresses checked, the new
    tokens appended (their lengths after them in a tensor of the call's own), the attention
    (and the combine after split pieces) launched. An 8-bit call's: O of ``out_dtype``, and
    each call's descales' addresses (KVCACHE_FP8_SOURCES)."""

    def __init__(self, prepared, appending, target: str, return_lse: bool, lse_shape_, device,
                 out_dtype=None):  # fmt: skip
        self.launch, self.append, self.target = prepared.launch, appending, target
        self.return_lse, self.lse_shape, self.device = return_lse, lse_shape_, device
        self.out_dtype = out_dtype

    def __call__(self, q, k_cache, v_cache, cache_seqlens, k, v, page_table, descales=None):
        out = torch.empty_like(q, dtype=self.out_dtype)
        qp, kp, vp, op = q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr()
        if (qp | kp | vp | op) % 16:
            named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out))
            _misaligned(named, self.target)
        seqlens = cache_seqlens
        if self.append is not None:
            seqlens = torch.empty_like(cache_seqlens)
            self.append(k_cache, v_cache, k, v, cache_seqlens, page_table, seqlens)
        lse = _empty_lse(self.lse_shape, self.device) if self.return_lse else None
        lp = 0 if lse is None else lse.data_ptr()
        table = 0 if page_table is None else page_table.data_ptr()
        if descales is None:
            self.launch((qp, kp, vp, op, lp, seqlens.data_ptr(), table))
        else:
            scales = tuple(0 if t is None else t.data_ptr() for t in descales)
            self.launch((qp, kp, vp, op, lp, seqlens.data_ptr(), table, *scales))
        return (out, lse) if self.return_lse else out


def kvcache_lookup(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal,
                   softmax_scale, window_size, softcap, num_splits, return_lse):  # fmt: skip
    """(signature, its plan or None) of a fadsl.attention_with_kvcache call; (None, None)
    with gradients (the checked path refuses them)."""
    try:
        if torch.is_grad_enabled() and (
            q.requires_grad
            or k_cache.requires_grad
            or v_cache.requires_grad
            or (k is not None and k.requires_grad)
            or (v is not None and v.requires_grad)
        ):
            return None, None
        key = kvcache_signature(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal,
                                softmax_scale, window_size, softcap, num_splits, return_lse)  # fmt: skip
        return key, _KVCACHE.get(key)
    except Exception:
        return None, None


def kvcache_call(key, q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal,
                 softmax_scale, window_size, softcap, num_splits, return_lse):  # fmt: skip
    """fadsl.attention_with_kvcache's checked path (public_ops.kvcache_call's): every
    argument checked, the new tokens appended, the attention; a plan kept at the second
    call of the signature ``key``."""
    checked = check_kvcache_call(
        q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, softmax_scale,
        window_size, softcap, num_splits, return_lse,
    )  # fmt: skip
    return kvcache_planning(_KVCACHE, key, checked, q, k_cache, v_cache, cache_seqlens, k, v,
                            page_table, num_splits, return_lse)  # fmt: skip


def kvcache_planning(cache: PlanCache, key, checked, q, k_cache, v_cache, cache_seqlens, k, v,
                     page_table, num_splits, return_lse, descales=None):  # fmt: skip
    """A checked kv-cache call (``checked``: public_ops.check_kvcache_kernel_call's) launched,
    its plan kept in ``cache`` at the second call of the signature ``key`` (an 8-bit call's
    with its ``descales``)."""
    kern, scale, dtype, k_rows, v_rows = checked
    planning = cache.worth_planning(key)
    target = kern.config.target
    seqlens, appending = cache_seqlens, None
    if k_rows is not None and k_rows.shape[0] and k_rows.shape[1]:
        # the addresses too before the new tokens are written (run_kvcache checks them, with
        # out's, before the attention's launch)
        _misaligned((("q", q), ("k_cache", k_cache), ("v_cache", v_cache)), target)
        # the lengths after the new tokens (cache_seqlens + seqlen_new), written by the append
        seqlens = torch.empty_like(cache_seqlens)
        if planning:
            appending = prepare_append(k_cache, v_cache, k, v, cache_seqlens, page_table,
                                       seqlens, (k_rows, v_rows), key[-2])  # fmt: skip
            appending.launch_rows(k_cache, v_cache, k_rows, v_rows, cache_seqlens, page_table,
                                  seqlens)  # fmt: skip
        else:
            append.launch_append(k_cache, v_cache, k_rows, v_rows, cache_seqlens, page_table,
                                 seqlens)  # fmt: skip
    out = torch.empty_like(q, dtype=kern.out_torch_dtype)  # (None: q's)
    lse = _empty_lse(lse_shape(q), q.device) if return_lse else None
    plan = run_kvcache(kern, dtype, q, k_cache, v_cache, seqlens, page_table, out, lse, scale,
                       num_splits or None, descales)  # fmt: skip
    if planning and plan.reusable:
        tensors = (q, k_cache, v_cache, out, lse, seqlens, page_table, *(descales or ()))
        addresses = tuple(0 if t is None else t.data_ptr() for t in tensors)
        sources = KVCACHE_SOURCES if descales is None else KVCACHE_FP8_SOURCES
        prepared = kern.prepared(dtype, q.device.index, key[-2], plan, sources, addresses)
        found = KvCachePlan(prepared, appending, target, return_lse, lse_shape(q), q.device,
                            kern.out_torch_dtype)  # fmt: skip
        cache.put(key, found)
    return (out, lse) if return_lse else out
