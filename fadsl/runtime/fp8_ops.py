"""The 8-bit (FP8) forward as torch.library custom ops (issue 42), so that torch.compile
(fullgraph, dynamic shapes) traces it (no `from __future__ import annotations` here:
custom_op reads the annotations as types):

- ``fadsl::<kernel>_<hash>(q, k, v, q_descale, k_descale, v_descale, softmax_scale,
  return_lse) -> (out, lse)`` for each loaded 8-bit spec (fadsl/runtime/fp8_calls.py), in
  place of the 16-bit kernels' ops (fadsl/runtime/custom_op.py);
- fadsl.attention's op on 8-bit inputs, ``fadsl::attention_fp8``, is in
  fadsl/runtime/fp8_public_ops.py (it chooses its kernel through fadsl/runtime/dispatch.py,
  which loads specs: this module stays below attention.py, which imports it).

Neither has an autograd formula: the FP8 forward has no backward, and the calls refuse
inputs that require grad before they reach an op (naming the argument). The fake
implementations run the kernel's checks on the fake tensors (shapes, strides, dtypes,
devices), so that a bad argument is named at trace time, and return O in the output type.
"""

from typing import Optional

import torch
from torch.library import custom_op

from .arguments import lse_shape
from .varlen import varlen_lse_shape

NO_LSE = (0,)
_OPS: dict = {}  # op name -> op; a spec loaded twice shares its op (registered once)
_KERNELS: dict = {}  # op name -> the kernel object it calls now


def fp8_op_for(kern):
    """The op of an 8-bit kernel (registered on first load of its spec)."""
    return _registered(kern, _OPS, _define)


def _registered(kern, ops: dict, define):
    """``kern``'s op in ``ops`` (made by ``define(name)`` the first time its spec loads; a
    spec loaded again shares it, calling the newest kernel object)."""
    name = kern.op_name
    _KERNELS[name] = kern
    if name not in ops:
        ops[name] = define(name)
    return ops[name]


def _define(name: str):
    @custom_op(f"fadsl::{name}", mutates_args=())
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_descale: Optional[torch.Tensor],
        k_descale: Optional[torch.Tensor],
        v_descale: Optional[torch.Tensor],
        softmax_scale: float,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kern = _KERNELS[name]
        descales = (q_descale, k_descale, v_descale)
        found = kern.fp8_forward(q, k, v, softmax_scale, descales, None, return_lse)
        return found if return_lse else (found, q.new_empty(NO_LSE, dtype=torch.float32))

    @forward.register_fake
    def _(q, k, v, q_descale, k_descale, v_descale, softmax_scale, return_lse):
        kern = _KERNELS[name]
        kern.check_fp8_call(q, k, v, (q_descale, k_descale, v_descale))
        return fp8_outputs(q, kern.out_torch_dtype, return_lse)

    return forward


_VARLEN_OPS: dict = {}  # op name -> the varlen op of a `varlen on` 8-bit spec


def fp8_varlen_op_for(kern):
    """``fadsl::<kernel>_<hash>_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale,
    k_descale, v_descale, softmax_scale, return_lse) -> (out, lse)``: a varlen call of an
    8-bit spec as a functional op (torch.compile), no autograd formula."""
    return _registered(kern, _VARLEN_OPS, _define_varlen)


def _define_varlen(name: str):
    @custom_op(f"fadsl::{name}_varlen", mutates_args=())
    def varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        q_descale: Optional[torch.Tensor],
        k_descale: Optional[torch.Tensor],
        v_descale: Optional[torch.Tensor],
        softmax_scale: float,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        descales = (q_descale, k_descale, v_descale)
        found = _KERNELS[name].varlen_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, None, return_lse,
            descales=descales,
        )  # fmt: skip
        return found if return_lse else (found, q.new_empty(NO_LSE, dtype=torch.float32))

    @varlen.register_fake
    def _(q, k, v, cu_q, cu_k, q_descale, k_descale, v_descale, softmax_scale, return_lse):
        kern = _KERNELS[name]
        kern.check_varlen_call(q, k, v, cu_q, cu_k, (q_descale, k_descale, v_descale))
        return fp8_varlen_outputs(q, kern.out_torch_dtype, return_lse)

    return varlen


def fp8_varlen_outputs(q, out_dtype, with_lse: bool):
    """Empty O of the output type with q's strides and the varlen LSE (heads, tokens), or
    the placeholder of shape (0,)."""
    shape = varlen_lse_shape(q) if with_lse else NO_LSE
    return torch.empty_like(q, dtype=out_dtype), q.new_empty(shape, dtype=torch.float32)


def fp8_outputs(q, out_dtype, with_lse: bool):
    """Empty O of the output type and the LSE (a placeholder of shape (0,) without it)."""
    shape = lse_shape(q) if with_lse else NO_LSE
    return q.new_empty(q.shape, dtype=out_dtype), q.new_empty(shape, dtype=torch.float32)
