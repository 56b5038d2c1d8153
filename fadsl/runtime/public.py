"""fadsl's public calls: ``attention``, ``attention_varlen``, ``attention_with_kvcache`` and
``append_kv``, each through a kernel a target ships (fadsl/runtime/dispatch.py chooses it).

Each call is written for torch.compile as much as for eager use: under tracing, or when an
input requires grad, it calls its custom op (fadsl/runtime/public_ops.py: fullgraph, dynamic
shapes, autograd); an eager call without gradients calls the kernel directly, since the
dispatcher costs host time, and a call of a signature met before launches through its plan
without the checks (fadsl/runtime/planned.py; a refused argument changes the signature).
What dynamo traces here is argument checks and the op: no import statement, no file read,
no kernel choice (the op makes it when it runs). torch is
imported at the top, so ``fadsl`` loads this module on first use of one of its names
(fadsl/__init__.py), and ``import fadsl`` alone stays quick.
"""

from __future__ import annotations

import torch

from . import dispatch, eager_grad, fp8_planned, fp8_public_ops, planned, public_ops
from .arguments import check_scale
from .fp8_calls import DESCALE_NAMES, check_out_dtype, is_fp8, refuse_gradients
from .varlen import check_max_seqlen


def check_q(q, dims: int, shape: str) -> None:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != dims:
        raise ValueError(f"q must be {dims}-d ({shape}), got shape {tuple(q.shape)}")
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _window(window_size) -> tuple[int, int]:
    """(left, right) as ints (their ranges are the op's to check)."""
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    return window_size[0], window_size[1]


def _check_softcap(softcap) -> None:
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number, got {type(softcap).__name__}")
    if isinstance(softcap, int) and not -(2**53) <= softcap <= 2**53:  # (float() would overflow)
        raise ValueError(f"softcap must be 0 or a whole number from 1 to 1000, got {softcap}")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def attention(
    q,
    k,
    v,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
    window_size=(-1, -1),
    softcap=0.0,
    return_lse=False,
    deterministic=False,
):
    """softmax(q k^T * softmax_scale [+ causal mask]) v through a shipped spec for q's GPU.

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim) in
    bf16 or fp16 on one CUDA device; heads_q a multiple of heads_kv (GQA, MQA). 8-bit q, k
    and v (all torch.float8_e4m3fn or all torch.float8_e5m2; sm_90a, head_dim 128): the
    attention of q * q_descale, k * k_descale and v * v_descale, each descale float32 of
    shape (batch, heads_kv) on q's device at any strides (an expanded scalar: one for the
    tensor), None for 1 (their values are not checked: a scale that makes softmax_scale *
    q_descale * k_descale no positive normal float32 makes that (batch, head)'s rows NaN);
    out_dtype torch.bfloat16 (None) or torch.float16; no window, softcap or gradients
    (fadsl/runtime/fp8_calls.py). causal:
    FlashAttention's bottom-right aligned mask. softmax_scale: 1 / sqrt(head_dim) if None.
    window_size (left, right): FlashAttention's sliding window (-1: unbounded on that side;
    with causal the right side is 0). softcap: the scores capped, softcap tanh(s
    softmax_scale / softcap), before the mask (0: none; a whole number 1 to 1000). A window
    or a softcap runs the shipped spec's variant with them (built on its first call).
    Returns out, or (out, lse) with ``return_lse`` (lse: float32, natural log, shape
    (batch, heads_q, seqlen_q)). Gradients flow through q, k and v (and the LSE) where the
    shipped spec has a backward, windows and softcap included. deterministic: the gradients
    bitwise the same run to run (dQ's adds in a fixed order: the shipped spec's backward
    with `deterministic on`, docs/backward.md; about 0.88-0.96x the default's speed; no
    window or softcap with it). torch.compile(fullgraph=True)
    traces it. The same checks and messages as a loaded spec's call.
    """
    key = None
    if deterministic is not False:  # (checked before any plan: a plan's key leaves it out)
        dispatch.check_deterministic(deterministic, window_size, softcap)
    plain = q_descale is None and k_descale is None and v_descale is None and out_dtype is None
    if plain and not torch.compiler.is_compiling():  # a call of a signature met before
        key, plan = planned.attention_lookup(q, k, v, causal, softmax_scale, window_size,
                                             softcap, return_lse)  # fmt: skip
        if plan is not None:
            return plan(q, k, v)
    if not plain or is_fp8(q):
        descales = (q_descale, k_descale, v_descale)
        return _attention_fp8(q, k, v, causal, softmax_scale, descales, out_dtype, window_size,
                              softcap, return_lse)  # fmt: skip
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    check_q(q, 4, "batch, seqlen, heads, head_dim")
    left, right = _window(window_size)
    _check_softcap(softcap)
    grad = _needs_grad(q, k, v)
    compiling = torch.compiler.is_compiling()
    if grad or compiling:
        check_scale(softmax_scale, 1)  # (named here, not by the op's schema)
    if grad and not compiling:  # eagerly: the kernels without the dispatcher (eager_grad.py)
        kern = dispatch.attention_kernel(q, causal, (left, right), float(softcap), deterministic)
        if kern.has_backward:  # (else the op, whose backward says there is none)
            scale = check_scale(softmax_scale, kern.config.head_dim)
            out, lse = eager_grad.attention(kern, scale, q, k, v)
            return (out, lse) if return_lse else out
    if grad or compiling:
        # with gradients the LSE is saved for the backward whether or not the caller asked
        out, lse = public_ops.attention(
            q, k, v, causal, softmax_scale, left, right, float(softcap), return_lse or grad,
            deterministic,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    return planned.attention_call(key, q, k, v, causal, softmax_scale, return_lse, window_size,
                                  softcap)  # fmt: skip


def _attention_fp8(q, k, v, causal, softmax_scale, descales, out_dtype, window_size, softcap,
                   return_lse):  # fmt: skip
    """fadsl.attention with descales or an out_dtype, or on 8-bit q (issue 42)."""
    key = None
    compiling = torch.compiler.is_compiling()
    if not compiling:  # a call of a signature met before: its plan
        key, plan = fp8_planned.lookup(q, k, v, descales, causal, softmax_scale, out_dtype,
                                       window_size, softcap, return_lse)  # fmt: skip
        if plan is not None:
            return plan(q, k, v, descales)
    _check_fp8_call("fadsl.attention", q, (("k", k), ("v", v)), 4,
                    "batch, seqlen, heads, head_dim", causal, descales, out_dtype, window_size,
                    softcap, return_lse)  # fmt: skip
    if compiling:
        check_scale(softmax_scale, 1)  # (named here, not by the op's schema)
        out, lse = fp8_public_ops.attention_fp8(q, k, v, *descales, causal, softmax_scale, out_dtype,
                                         return_lse)  # fmt: skip
        return (out, lse) if return_lse else out
    return fp8_planned.call(key, q, k, v, descales, causal, softmax_scale, out_dtype, return_lse)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    window_size=(-1, -1),
    softcap: float = 0,
    return_lse: bool = False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
):
    """Attention over a packed batch of sequences through a shipped spec (FlashAttention's
    ``flash_attn_varlen_func``): q (tokens_q, heads_q, head_dim), k and v (tokens_k, heads_kv,
    head_dim), bf16 or fp16 on one CUDA device (or 8-bit, as fadsl.attention takes them, each
    descale (sequences, heads_kv): sequence b's row b); sequence b at rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 of q and likewise of k and v (int32 prefix sums on q's device).
    causal: bottom-right aligned per sequence. window_size (left, right): a sliding window,
    -1 unbounded. softcap: scores capped by softcap tanh(s / softcap), 0 none (a whole
    number). Returns the output, or (output, lse) with the LSE (heads_q, tokens_q), float32.
    Each mask / softcap combination is its own kernel, built on its first call; a causal call
    whose max_seqlen_q is LONG_CAUSAL_ROWS or more runs the spec with `scheduler grid` (a
    wrong max_seqlen_q costs speed only: both schedules are exact for any lengths).
    torch.compile(fullgraph=True) traces it. Gradients flow through q, k and v (and the
    LSE), each sequence's on its own rows; rows outside every sequence get zero gradients
    and must hold finite values (a NaN there, times P = 0, reaches a neighbour's dK and dV)."""
    key = None
    plain = q_descale is None and k_descale is None and v_descale is None and out_dtype is None
    if not plain or is_fp8(q):
        descales = (q_descale, k_descale, v_descale)
        return _varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal, softmax_scale, descales, out_dtype, window_size, softcap,
                           return_lse)  # fmt: skip
    if not torch.compiler.is_compiling():  # a call of a signature met before: its plan
        key, plan = planned.varlen_lookup(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, causal, softmax_scale, window_size,
                                          softcap, return_lse)  # fmt: skip
        if plan is not None:
            return plan(q, k, v, cu_seqlens_q, cu_seqlens_k)
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    check_q(q, 3, "tokens, heads, head_dim")
    left, right = _window(window_size)
    _check_softcap(softcap)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    grad = _needs_grad(q, k, v)
    compiling = torch.compiler.is_compiling()
    if grad or compiling:
        check_scale(softmax_scale, 1)  # (named here, not by the op's schema)
        check_max_seqlen("max_seqlen_q", max_seqlen_q)
        check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if grad and not compiling:  # eagerly: the varlen kernels without the dispatcher
        kern = dispatch.varlen_kernel(q, causal, (left, right), float(softcap), max_seqlen_q)
        if kern.has_backward:  # (else the op, whose backward says there is none)
            scale = check_scale(softmax_scale, kern.config.head_dim)
            out, lse = eager_grad.varlen(kern, scale, q, k, v, cu_seqlens_q, cu_seqlens_k)
            return (out, lse) if return_lse else out
    if grad or compiling:
        # with gradients the LSE is saved for the backward whether or not the caller asked
        out, lse = public_ops.attention_varlen(
            *args, softmax_scale, left, right, float(softcap), return_lse or grad
        )
        return (out, lse) if return_lse else out
    return planned.varlen_call(key, *args, softmax_scale, window_size, softcap, return_lse)


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    k=None,
    v=None,
    *,
    page_table=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=(-1, -1),
    softcap: float = 0,
    num_splits: int | None = None,
    return_lse: bool = False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    out_dtype=None,
):
    """Attention of q against a KV cache through a shipped spec (FlashAttention's
    ``flash_attn_with_kvcache``): q (batch, seqlen_q, heads_q, head_dim); k_cache and v_cache
    contiguous (batch, capacity, heads_kv, head_dim), or paged (pages, page_size, heads_kv,
    head_dim) with page_table (batch, max_pages) int32; cache_seqlens (batch,) int32: the keys
    each batch's cache holds. k and v (batch, seqlen_new, heads_kv, head_dim), if given, are
    written into the caches after those keys (fadsl.append_kv) once every argument has been
    checked, and attended too; cache_seqlens is not advanced (the caller adds seqlen_new, as
    with FlashAttention). A batch whose keys would not fit (cache_seqlens + seqlen_new past
    its capacity, a negative length, a page-table entry outside the cache) has nothing
    written out of bounds and its rows of the output NaN; the CUDA context lives on.
    causal: bottom-right aligned. window_size, softcap: as attention_varlen's. num_splits:
    pieces per tile (None or 0: as many as fill the SMs in one wave; 1: none; a window runs
    whole tiles). Returns the output, or (output, lse) with the LSE (batch, heads_q,
    seqlen_q), float32. Unlike flash_attn_with_kvcache, cache_seqlens comes before k and v:
    pass what follows them by keyword. torch.compile(fullgraph=True) traces it. 8-bit q,
    caches and new tokens (all torch.float8_e4m3fn or all torch.float8_e5m2; sm_90a,
    head_dim 64, 128 or 256): as attention_varlen's 8-bit call, each
    descale (batch, heads_kv), batch b's row read by its queries and its cache's keys (a page
    read by several batches needs the same descales in each), O in out_dtype."""
    key = None
    plain = q_descale is None and k_descale is None and v_descale is None and out_dtype is None
    if plain and not torch.compiler.is_compiling():  # a call of a signature met before
        key, plan = planned.kvcache_lookup(q, k_cache, v_cache, cache_seqlens, k, v, page_table,
                                           causal, softmax_scale, window_size, softcap,
                                           num_splits, return_lse)  # fmt: skip
        if plan is not None:
            return plan(q, k_cache, v_cache, cache_seqlens, k, v, page_table)
    if not plain or is_fp8(q):
        descales = (q_descale, k_descale, v_descale)
        return _kvcache_fp8(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal,
                            softmax_scale, descales, out_dtype, window_size, softcap, num_splits,
                            return_lse)  # fmt: skip
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    check_q(q, 4, "batch, seqlen, heads, head_dim")
    left, right = _window(window_size)
    _check_softcap(softcap)
    if _needs_grad(q, k_cache, v_cache, k, v):
        raise RuntimeError(
            "fadsl.attention_with_kvcache has no backward; call it under torch.no_grad() or "
            "on detached inputs"
        )
    args = (q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, softmax_scale)
    if torch.compiler.is_compiling():
        check_scale(softmax_scale, 1)  # (named here, not by the op's schema)
        out, lse = public_ops.attention_with_kvcache(
            *args, left, right, float(softcap), num_splits, return_lse
        )
        return (out, lse) if return_lse else out
    return planned.kvcache_call(key, *args, window_size, softcap, num_splits, return_lse)


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=None) -> None:
    """Write k_new and v_new (batch, seqlen_new, heads_kv, head_dim) into the caches after
    each batch's cache_seqlens[b] keys (FlashAttention-3's AppendKV, as an op beside the
    attention call): contiguous caches (batch, capacity, heads_kv, head_dim), or paged ones
    (pages, page_size, heads_kv, head_dim) through page_table (batch, max_pages). One kernel
    on the device (a CUDA graph captures it with the decode step; torch.compile traces it);
    the caller advances cache_seqlens. The lengths stay on the device, so the kernel guards
    the writes: a token whose position falls past its batch's capacity, after a negative
    length, or on a page-table entry outside the cache is not written (fadsl/runtime/append.py)."""
    if torch.compiler.is_compiling():
        public_ops.append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)
        return
    key, plan = planned.append_lookup(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)
    if plan is not None:  # a call of a signature met before
        plan(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, None)
    else:
        planned.append_call(key, k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)


def _check_fp8_call(what: str, q, named, dims: int, shape: str, causal, descales, out_dtype,
                    window_size, softcap, return_lse) -> None:  # fmt: skip
    """The public checks of a call with descales or an out_dtype, or on 8-bit q (``what``:
    the call's name; ``named``: its other tensors, (name, tensor) each): 8-bit q, no window
    or softcap, no gradients, an output type."""
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    check_q(q, dims, shape)
    if not is_fp8(q):
        named = zip((*DESCALE_NAMES, "out_dtype"), (*descales, out_dtype))
        given = next(name for name, value in named if value is not None)
        raise TypeError(
            f"{given} is for 8-bit q, k and v (torch.float8_e4m3fn or torch.float8_e5m2); "
            f"q is {q.dtype}"
        )
    left, right = _window(window_size)
    _check_softcap(softcap)
    if (left, right) != (-1, -1) or softcap:
        raise ValueError(
            f"window_size={tuple(window_size)}, softcap={softcap} with 8-bit q, k and v: the "
            "FP8 forward is not built with a window or a softcap yet (issue 42); leave them "
            "(-1, -1) and 0"
        )
    refuse_gradients(what, (("q", q), *named, *zip(DESCALE_NAMES, descales)))
    check_out_dtype(out_dtype)


def _varlen_fp8(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, descales, out_dtype,
                window_size, softcap, return_lse):  # fmt: skip
    """fadsl.attention_varlen with descales or an out_dtype, or on 8-bit q (issue 42)."""
    key = None
    compiling = torch.compiler.is_compiling()
    if not compiling:  # a call of a signature met before: its plan
        key, plan = fp8_planned.varlen_lookup(q, k, v, cu_q, cu_k, max_q, max_k, descales,
                                              causal, softmax_scale, out_dtype, window_size,
                                              softcap, return_lse)  # fmt: skip
        if plan is not None:
            return plan(q, k, v, cu_q, cu_k, descales)
    _check_fp8_call("fadsl.attention_varlen", q, (("k", k), ("v", v)), 3,
                    "tokens, heads, head_dim", causal, descales, out_dtype, window_size, softcap,
                    return_lse)  # fmt: skip
    check_max_seqlen("max_seqlen_q", max_q)
    check_max_seqlen("max_seqlen_k", max_k)
    if compiling:
        check_scale(softmax_scale, 1)  # (named here, not by the op's schema)
        out, lse = fp8_public_ops.attention_varlen_fp8(q, k, v, cu_q, cu_k, max_q, *descales,
                                                       causal, softmax_scale, out_dtype,
                                                       return_lse)  # fmt: skip
        return (out, lse) if return_lse else out
    return fp8_planned.varlen_call(key, q, k, v, cu_q, cu_k, descales, softmax_scale, out_dtype,
                                   causal, return_lse, max_q)  # fmt: skip


def _kvcache_fp8(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, softmax_scale,
                 descales, out_dtype, window_size, softcap, num_splits, return_lse):  # fmt: skip
    """fadsl.attention_with_kvcache with descales or an out_dtype, or on 8-bit q (issue 42)."""
    key = None
    compiling = torch.compiler.is_compiling()
    if not compiling:  # a call of a signature met before: its plan
        key, plan = fp8_planned.kvcache_lookup(q, k_cache, v_cache, cache_seqlens, k, v,
                                               page_table, descales, causal, softmax_scale,
                                               out_dtype, window_size, softcap, num_splits,
                                               return_lse)  # fmt: skip
        if plan is not None:
            return plan(q, k_cache, v_cache, cache_seqlens, k, v, page_table, descales)
    named = (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v))
    _check_fp8_call("fadsl.attention_with_kvcache", q, named, 4, "batch, seqlen, heads, head_dim",
                    causal, descales, out_dtype, window_size, softcap, return_lse)  # fmt: skip
    args = (q, k_cache, v_cache, cache_seqlens, k, v, page_table)
    if compiling:
        check_scale(softmax_scale, 1)  # (named here, not by the op's schema)
        out, lse = fp8_public_ops.attention_with_kvcache_fp8(*args, *descales, causal,
                                                             softmax_scale, out_dtype,
                                                             num_splits, return_lse)  # fmt: skip
        return (out, lse) if return_lse else out
    return fp8_planned.kvcache_call(key, *args, descales, causal, softmax_scale, out_dtype,
                                    num_splits, return_lse)  # fmt: skip
