"""Each compiled kernel as torch.library custom ops, so that torch.compile and autograd see it
(no `from __future__ import annotations` here: custom_op reads the annotations as types).

Two ops per spec (named after the kernel and the spec's hash):

- ``fadsl::<kernel>_<hash>(q, k, v, softmax_scale, return_lse) -> (out, lse)``, functional,
  with an autograd formula: ``fadsl::<kernel>_<hash>_backward`` (the spec's backward
  kernels) when the spec has a backward block, else one that raises, so that gradients are
  never dropped silently (``lse`` is an empty tensor unless asked for; with a backward the
  runtime always asks, and saves it);
- ``fadsl::<kernel>_<hash>_out(q, k, v, out, lse, softmax_scale) -> ()``, writing ``out``
  (and ``lse`` if given): ``mutates_args`` names them, as torch.compile requires.

Both have fake implementations (shapes only), so ``torch.compile(fullgraph=True)`` traces
through them with no graph break.
"""

from typing import Optional, Protocol

import torch
from torch.library import custom_op

from .arguments import check_lse, lse_shape


class Attention(Protocol):
    """What the ops call (fadsl.runtime.attention.FlashAttention)."""

    op_name: str

    def forward(self, q, k, v, scale, out, return_lse): ...

    def forward_into(self, q, k, v, out, lse, scale) -> None: ...

    def check_inputs(self, q, k, v): ...

    def check_out_meta(self, out, q) -> None: ...

    has_backward: bool

    def backward(self, q, k, v, out, lse, dout, dlse, scale): ...


# op name -> (functional op, out op); and the kernel object each name calls now. Two loads of
# one spec share its ops (an op name can be registered once per process).
_OPS: dict[str, tuple] = {}
_KERNELS: dict[str, Attention] = {}


def ops_for(kern: Attention) -> tuple:
    name = kern.op_name
    _KERNELS[name] = kern
    if name not in _OPS:
        _OPS[name] = _define(name)
    return _OPS[name]


def _define(name: str) -> tuple:
    @custom_op(f"fadsl::{name}", mutates_args=())
    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, return_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kern = _KERNELS[name]
        if return_lse:
            return kern.forward(q, k, v, softmax_scale, None, True)
        out = kern.forward(q, k, v, softmax_scale, None, False)
        return out, q.new_empty((0,), dtype=torch.float32)

    @forward.register_fake
    def _(q, k, v, softmax_scale, return_lse):
        _KERNELS[name].check_inputs(q, k, v)
        shape = lse_shape(q) if return_lse else (0,)
        return torch.empty_like(q), q.new_empty(shape, dtype=torch.float32)

    @custom_op(f"fadsl::{name}_backward", mutates_args=())
    def backward_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: Optional[torch.Tensor],
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _KERNELS[name].backward(q, k, v, out, lse, dout, dlse, softmax_scale)

    @backward_op.register_fake
    def _(q, k, v, out, lse, dout, dlse, softmax_scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, softmax_scale, _ = inputs
        out, lse = output
        ctx.softmax_scale = softmax_scale
        if _KERNELS[name].has_backward:
            ctx.save_for_backward(q, k, v, out, lse)

    def backward(ctx, grad_out, grad_lse):
        if not _KERNELS[name].has_backward:
            raise RuntimeError(
                f"fadsl kernel '{name}' is forward-only: its spec has no backward block, so "
                "gradients cannot flow through it. Add a `backward {}` block to the spec (where "
                "its target has a backward pass), or call it under torch.no_grad() or on "
                "detached q, k and v."
            )
        q, k, v, out, lse = ctx.saved_tensors
        if lse.numel() == 0:  # the op called directly with return_lse=False: nothing to use
            raise RuntimeError(
                f"fadsl kernel '{name}': its backward needs the forward's LSE; call the op "
                "with return_lse=True (the FlashAttention object always does)"
            )
        dq, dk, dv = backward_op(q, k, v, out, lse, grad_out, grad_lse, ctx.softmax_scale)
        return dq, dk, dv, None, None

    forward.register_autograd(backward, setup_context=setup_context)

    @custom_op(f"fadsl::{name}_out", mutates_args=("out", "lse"))
    def forward_out(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: Optional[torch.Tensor],
        softmax_scale: float,
    ) -> None:
        _KERNELS[name].forward_into(q, k, v, out, lse, softmax_scale)

    @forward_out.register_fake
    def _(q, k, v, out, lse, softmax_scale):
        kern = _KERNELS[name]
        kern.check_inputs(q, k, v)
        kern.check_out_meta(out, q)
        if lse is not None:
            check_lse(lse, q)

    return forward, forward_out


# `varlen on` specs: op name -> the varlen op (fadsl/runtime/varlen.py)
_VARLEN_OPS: dict[str, object] = {}


def varlen_op_for(kern) -> object:
    """``fadsl::<kernel>_<hash>_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale,
    return_lse) -> (out, lse)``: a varlen call as a functional op (torch.compile, CUDA
    graphs), with an autograd formula through ``fadsl::<kernel>_<hash>_varlen_backward``
    when the spec has a backward block (else one that raises)."""
    name = kern.op_name
    _KERNELS[name] = kern
    if name not in _VARLEN_OPS:
        _VARLEN_OPS[name] = _define_varlen(name)
    return _VARLEN_OPS[name]


def _define_varlen(name: str):
    from .varlen import check_varlen, varlen_lse_shape

    @custom_op(f"fadsl::{name}_varlen", mutates_args=())
    def varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        softmax_scale: float,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kern = _KERNELS[name]
        found = kern.varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, None, return_lse
        )
        if return_lse:
            return found
        return found, q.new_empty((0,), dtype=torch.float32)

    @varlen.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, return_lse):
        check_varlen(_KERNELS[name], q, k, v, cu_seqlens_q, cu_seqlens_k)
        shape = varlen_lse_shape(q) if return_lse else (0,)
        return torch.empty_like(q), q.new_empty(shape, dtype=torch.float32)

    @custom_op(f"fadsl::{name}_varlen_backward", mutates_args=())
    def varlen_backward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: Optional[torch.Tensor],
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        softmax_scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _KERNELS[name].varlen_backward(
            q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, softmax_scale
        )

    @varlen_backward.register_fake
    def _(q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, softmax_scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, _ = inputs
        out, lse = output
        ctx.softmax_scale = softmax_scale
        if _KERNELS[name].has_backward:
            ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)

    def backward(ctx, grad_out, grad_lse):
        if not _KERNELS[name].has_backward:
            raise RuntimeError(
                f"fadsl kernel '{name}' is forward-only: its spec has no backward block, so "
                "gradients cannot flow through its varlen calls. Add a `backward {}` block to "
                "the spec, or call it under torch.no_grad() or on detached q, k and v."
            )
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        if tuple(lse.shape) != varlen_lse_shape(q):  # the op called with return_lse=False
            raise RuntimeError(
                f"fadsl kernel '{name}': its varlen backward needs the forward's LSE; call the "
                "op with return_lse=True (the FlashAttention object always does)"
            )
        dq, dk, dv = varlen_backward(
            q, k, v, out, lse, grad_out, grad_lse, cu_q, cu_k, ctx.softmax_scale
        )
        return dq, dk, dv, None, None, None, None

    varlen.register_autograd(backward, setup_context=setup_context)
    return varlen


# `kv_cache` specs: op name -> the kv-cache op (fadsl/runtime/kvcache.py)
_KVCACHE_OPS: dict[str, object] = {}


def kvcache_op_for(kern) -> object:
    """``fadsl::<kernel>_<hash>_kvcache(q, k_cache, v_cache, cache_seqlens, page_table,
    softmax_scale, num_splits, return_lse, q_descale, k_descale, v_descale) -> (out, lse)``:
    a kv-cache call as a functional op (torch.compile; a CUDA graph captures a decode step;
    the descales an 8-bit spec's, None for a 16-bit one); gradients raise."""
    name = kern.op_name
    _KERNELS[name] = kern
    if name not in _KVCACHE_OPS:
        _KVCACHE_OPS[name] = _define_kvcache(name)
    return _KVCACHE_OPS[name]


def _define_kvcache(name: str):
    @custom_op(f"fadsl::{name}_kvcache", mutates_args=())
    def kvcache(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cache_seqlens: torch.Tensor,
        page_table: Optional[torch.Tensor],
        softmax_scale: float,
        num_splits: int,
        return_lse: bool,
        q_descale: Optional[torch.Tensor],
        k_descale: Optional[torch.Tensor],
        v_descale: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kern = _KERNELS[name]
        found = kern.kvcache_forward(
            q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, num_splits, None,
            return_lse, descales=(q_descale, k_descale, v_descale),
        )  # fmt: skip
        if return_lse:
            return found
        return found, q.new_empty((0,), dtype=torch.float32)

    @kvcache.register_fake
    def _(q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, num_splits, return_lse,
          q_descale, k_descale, v_descale):  # fmt: skip
        kern = _KERNELS[name]
        kern.check_kvcache_call(
            q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, num_splits or None,
            return_lse, (q_descale, k_descale, v_descale),
        )  # fmt: skip
        shape = lse_shape(q) if return_lse else (0,)
        return torch.empty_like(q, dtype=kern.out_torch_dtype), q.new_empty(
            shape, dtype=torch.float32
        )

    _without_backward(kvcache, f"fadsl kernel '{name}': kv-cache calls have no backward")
    return kvcache


def _without_backward(op, why: str) -> None:
    """An autograd formula for ``op`` that raises ``why``: gradients are never dropped."""

    def backward(ctx, grad_out, grad_lse):
        raise RuntimeError(f"{why}; call it under torch.no_grad() or on detached inputs")

    op.register_autograd(backward, setup_context=lambda ctx, inputs, output: None)
