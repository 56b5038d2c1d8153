"""The public calls as torch.library custom ops, which torch.compile traces with no graph
break and autograd differentiates (no `from __future__ import annotations` here: custom_op
reads the annotations as types).

- ``fadsl::attention(q, k, v, causal, softmax_scale, window_left, window_right, softcap,
  with_lse) -> (out, lse)``, with an autograd formula through ``fadsl::attention_backward``
  (the shipped spec's backward, or its variant's for a window or a softcap);
- ``fadsl::attention_varlen(...) -> (out, lse)``, with an autograd formula through
  ``fadsl::attention_varlen_backward`` (the varlen spec's variant's backward, chosen by the
  forward's key), and ``fadsl::attention_with_kvcache(...) -> (out, lse)``, which writes new
  tokens into the caches (``mutates_args`` names them; such an op takes no autograd
  formula, so fadsl.attention_with_kvcache refuses inputs that require grad);
- ``fadsl::append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table) -> ()``.

Each op chooses its kernel when it runs (fadsl/runtime/dispatch.py), so a graph that
torch.compile traced builds a kernel it has not met on its first run, outside the traced
region. The fake implementations choose it too (loading the spec, not building it) and run
the kernel's own checks on the fake tensors, so that a bad argument is named at trace time.
Eager calls without gradients skip the ops (fadsl/runtime/public.py): the dispatcher costs
host time.
"""

from typing import Optional

import torch
from torch.library import custom_op

from . import append, dispatch
from .arguments import check_base, check_scale, lse_shape
from .varlen import check_max_seqlen, check_varlen, varlen_lse_shape

_NO_LSE = (0,)


def _empty_lse(q) -> torch.Tensor:
    return q.new_empty(_NO_LSE, dtype=torch.float32)


def concrete(*values):
    """The values of a call's Python numbers that choose its kernel (a window's sides, the
    softcap, num_splits): under torch.compile they may arrive as SymInt or SymFloat, and
    the kernel is chosen by value (int() and float() specialise them: a guard)."""
    return tuple(
        float(v) if isinstance(v, torch.SymFloat) else int(v) if isinstance(v, torch.SymInt) else v
        for v in values
    )


# ---------------------------------------------------------------- the calls' bodies
# (fadsl/runtime/public.py calls them directly when no op is needed)
def attention_call(q, k, v, causal: bool, softmax_scale, return_lse: bool, window_size=(-1, -1),
                   softcap=0.0):  # fmt: skip
    kern = dispatch.attention_kernel(q, causal, window_size, softcap)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    return kern.forward(q, k, v, scale, None, return_lse)


def varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                softmax_scale, window_size, softcap, return_lse: bool):  # fmt: skip
    kern = dispatch.varlen_kernel(q, causal, window_size, softcap, max_seqlen_q)
    check_max_seqlen("max_seqlen_q", max_seqlen_q)
    check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    return kern.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, None, return_lse)


def check_kvcache_call(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal,
                       softmax_scale, window_size, softcap, num_splits, return_lse):  # fmt: skip
    """Every check of a kv-cache call, the new tokens' included, each error naming the
    argument, before anything is written: (the kernel, the scale, the dtype, k and v)."""
    check_new_tokens(k, v)
    kern = dispatch.kvcache_kernel(q, k_cache, page_table, causal, window_size, softcap)
    if kern.config.window is not None and isinstance(num_splits, int) and num_splits > 1:
        raise ValueError(
            f"num_splits={num_splits} with a sliding window: the windowed kernel runs whole "
            "tiles (splits are not built with a window); leave num_splits None, 0 or 1"
        )
    return check_kvcache_kernel_call(kern, q, k_cache, v_cache, cache_seqlens, k, v, page_table,
                                     softmax_scale, num_splits, return_lse)  # fmt: skip


def check_new_tokens(k, v) -> None:
    if (k is None) != (v is None):
        raise ValueError("k and v: give the new tokens' keys and values both, or neither")


def check_kvcache_kernel_call(kern, q, k_cache, v_cache, cache_seqlens, k, v, page_table,
                              softmax_scale, num_splits, return_lse,
                              descales=(None, None, None)):  # fmt: skip
    """The chosen kernel's checks of a kv-cache call (an 8-bit kernel's ``descales`` too)
    and the new tokens': (the kernel, the scale, the dtype, k and v)."""
    scale, dtype = kern.check_kvcache_call(
        q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, num_splits, return_lse,
        descales,
    )  # fmt: skip
    if k is not None:  # (rows made contiguous where they were not)
        k, v = append.check_append(
            k_cache, v_cache, k, v, cache_seqlens, page_table, None, names=("k", "v")
        )
    return kern, scale, dtype, k, v


def kvcache_call(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, softmax_scale,
                 window_size, softcap, num_splits, return_lse: bool):  # fmt: skip
    """A kv-cache call: every argument checked, then the new tokens appended (lengths past
    a batch's capacity are not written, and that batch's rows come out NaN), then the
    attention over the caches."""
    checked = check_kvcache_call(
        q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, softmax_scale,
        window_size, softcap, num_splits, return_lse,
    )  # fmt: skip
    return append_and_attend(checked, q, k_cache, v_cache, cache_seqlens, page_table, num_splits,
                             return_lse)  # fmt: skip


def append_and_attend(checked, q, k_cache, v_cache, cache_seqlens, page_table, num_splits,
                      return_lse: bool, descales=None):  # fmt: skip
    """A checked kv-cache call's launches (``checked``: check_kvcache_kernel_call's): the new
    tokens appended, then the attention (an 8-bit kernel's with ``descales``)."""
    kern, scale, dtype, k, v = checked
    seqlens = cache_seqlens
    if k is not None and k.shape[0] and k.shape[1]:
        # the addresses too before the new tokens are written (run_kvcache checks them, with
        # out's, before the attention's launch)
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            check_base(name, t, kern.config.target)
        # the lengths after the new tokens (cache_seqlens + seqlen_new), written by the append
        seqlens = torch.empty_like(cache_seqlens)
        append.launch_append(k_cache, v_cache, k, v, cache_seqlens, page_table, seqlens)
    return kern.kvcache_forward(
        q, k_cache, v_cache, seqlens, page_table, scale, num_splits, None, return_lse, dtype=dtype,
        descales=descales,
    )  # fmt: skip


# ---------------------------------------------------------------- attention
@custom_op("fadsl::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
    with_lse: bool,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # (the forward is the same kernel either way: `deterministic` picks the backward's block)
    window = concrete(window_left, window_right)
    (cap,) = concrete(softcap)
    if with_lse:
        return attention_call(q, k, v, causal, softmax_scale, True, window, cap)
    return attention_call(q, k, v, causal, softmax_scale, False, window, cap), _empty_lse(q)


@attention.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, with_lse,
      deterministic=False):  # fmt: skip
    kern = dispatch.attention_kernel(
        q, causal, concrete(window_left, window_right), *concrete(softcap), deterministic
    )
    check_scale(softmax_scale, kern.config.head_dim)
    kern.check_inputs(q, k, v)
    return torch.empty_like(q), q.new_empty(
        lse_shape(q) if with_lse else _NO_LSE, dtype=torch.float32
    )


@custom_op("fadsl::attention_backward", mutates_args=())
def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kern = _with_backward(q, causal, window_left, window_right, softcap, deterministic)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    return kern.backward(q, k, v, out, lse, dout, dlse, scale)


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, dlse, causal, softmax_scale, window_left, window_right, softcap,
      deterministic=False):  # fmt: skip
    _with_backward(q, causal, window_left, window_right, softcap, deterministic)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _with_backward(q, causal: bool, window_left, window_right, softcap, deterministic=False):
    window = concrete(window_left, window_right)
    kern = dispatch.attention_kernel(q, causal, window, *concrete(softcap), deterministic)
    if not kern.has_backward:
        raise RuntimeError(
            f"fadsl.attention: the spec it runs here ({kern.config.name}) has no backward "
            "block, so gradients cannot flow through it; call it under torch.no_grad() or on "
            "detached q, k and v, or load a spec with a `backward {}` block"
        )
    return kern


def _save(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale, window_left, window_right, softcap, _, *deterministic = inputs
    out, lse = output
    ctx.deterministic = bool(deterministic and deterministic[0])
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.window, ctx.softcap = (window_left, window_right), softcap
    ctx.save_for_backward(q, k, v, out, lse)


def _attention_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    if lse.numel() == 0:  # the op called directly with with_lse=False: nothing to use
        raise RuntimeError(
            "fadsl::attention: its backward needs the forward's LSE; call the op with "
            "with_lse=True (fadsl.attention does whenever q, k or v requires grad)"
        )
    dq, dk, dv = attention_backward(
        q, k, v, out, lse, grad_out, grad_lse, ctx.causal, ctx.softmax_scale, *ctx.window,
        ctx.softcap, ctx.deterministic,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None


attention.register_autograd(_attention_grad, setup_context=_save)


# ---------------------------------------------------------------- varlen
@custom_op("fadsl::attention_varlen", mutates_args=())
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal)
    found = varlen_call(*args, softmax_scale, (window_left, window_right), softcap, return_lse)
    return found if return_lse else (found, _empty_lse(q))


@attention_varlen.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, left, right, softcap, lse):
    # max_seqlen_q picks the schedule only (both exact): the fake need not read a SymInt
    left, right, softcap = concrete(left, right, softcap)
    kern = dispatch.varlen_kernel(q, causal, (left, right), softcap, None)
    check_scale(softmax_scale, kern.config.head_dim)
    check_varlen(kern, q, k, v, cu_q, cu_k)
    shape = varlen_lse_shape(q) if lse else _NO_LSE
    return torch.empty_like(q), q.new_empty(shape, dtype=torch.float32)


# ---------------------------------------------------------------- kv cache
@custom_op("fadsl::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    page_table: Optional[torch.Tensor],
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: Optional[int],
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, softmax_scale)
    found = kvcache_call(*args, (window_left, window_right), softcap, num_splits, return_lse)
    return found if return_lse else (found, _empty_lse(q))


@attention_with_kvcache.register_fake
def _(q, k_cache, v_cache, seqlens, k, v, table, causal, scale, left, right, cap, splits, lse):
    left, right, cap, splits = concrete(left, right, cap, splits)
    check_kvcache_call(q, k_cache, v_cache, seqlens, k, v, table, causal, scale, (left, right),
                       cap, splits, lse)  # fmt: skip
    return torch.empty_like(q), q.new_empty(lse_shape(q) if lse else _NO_LSE, dtype=torch.float32)


@custom_op("fadsl::append_kv", mutates_args=("k_cache", "v_cache"))
def append_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache_seqlens: torch.Tensor,
    page_table: Optional[torch.Tensor],
) -> None:
    append.append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table)


@append_kv.register_fake
def _(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table):
    append.check_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, None)


def _no_gradient(why: str):
    def backward(ctx, *grads):
        raise RuntimeError(f"{why}; call it under torch.no_grad() or on detached inputs")

    return backward


@custom_op("fadsl::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int],
    causal: bool,
    softmax_scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kern = _varlen_with_backward(q, causal, window_left, window_right, softcap, max_seqlen_q)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    return kern.varlen_backward(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, scale)


@attention_varlen_backward.register_fake
def _(q, k, v, out, lse, dout, dlse, cu_q, cu_k, max_q, causal, scale, left, right, softcap):
    _varlen_with_backward(q, causal, left, right, softcap, None)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _varlen_with_backward(q, causal: bool, window_left, window_right, softcap, max_seqlen_q):
    window = concrete(window_left, window_right)
    kern = dispatch.varlen_kernel(q, causal, window, *concrete(softcap), max_seqlen_q)
    if not kern.has_backward:
        raise RuntimeError(
            f"fadsl.attention_varlen: the spec it runs here ({kern.config.name}) has no "
            "backward block, so gradients cannot flow through it; call it under "
            "torch.no_grad() or on detached q, k and v"
        )
    return kern


def _save_varlen(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, _, causal, scale, left, right, softcap, _ = inputs
    out, lse = output
    ctx.args = (max_q, causal, scale, left, right, softcap)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)


def _attention_varlen_grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if tuple(lse.shape) != varlen_lse_shape(q):  # the op called with return_lse=False
        raise RuntimeError(
            "fadsl::attention_varlen: its backward needs the forward's LSE; call the op with "
            "return_lse=True (fadsl.attention_varlen does whenever q, k or v requires grad)"
        )
    dq, dk, dv = attention_varlen_backward(
        q, k, v, out, lse, grad_out, grad_lse, cu_q, cu_k, *ctx.args
    )
    return (dq, dk, dv) + (None,) * 10


attention_varlen.register_autograd(_attention_varlen_grad, setup_context=_save_varlen)
