"""A kernel with score and mask modifiers (issue 41) as a torch custom op with autograd (no
`from __future__ import annotations` here: custom_op reads the annotations as types).

The spec's ``input`` tensors are arguments of the op (a list, in declared order), so that
torch.compile sees them as graph inputs and autograd saves them for the backward:

- ``fadsl::<kernel>_<hash>_modified(q, k, v, inputs, softmax_scale, return_lse) -> (out,
  lse)``, functional, with an autograd formula: ``fadsl::<kernel>_<hash>_modified_backward``
  (the spec's backward kernels, which read the same inputs: the modified score, its
  derivative and keep's mask are recomputed there) where the spec has a backward block,
  else one that raises (gradients are never dropped silently). An input that requires grad
  gets its gradient: the backward op returns them in one fp32 buffer (the learnable inputs'
  elements end to end, fadsl/runtime/learnable.py), which the formula splits; the others
  get None. FlashAttention refuses, by name, an input that requires grad and cannot have one
  before the op runs (fadsl/runtime/attention.py, ``_call_modified``).

Both have fake implementations (shapes only), so ``torch.compile(fullgraph=True)`` traces
through them with no graph break. FlashAttention checks the inputs by name, dtype, shape,
device and layout before calling the op (fadsl/runtime/arguments.py, modifier_inputs); the
op's own implementation takes them as they come.
"""

from typing import List, Optional, Protocol

import torch
from torch.library import custom_op

from .arguments import lse_shape
from .learnable import split_buffer


class ModifiedAttention(Protocol):
    """What the ops call (fadsl.runtime.attention.FlashAttention)."""

    op_name: str
    has_backward: bool

    def forward(self, q, k, v, scale, out, return_lse, inputs, dtype=None): ...

    def check_inputs(self, q, k, v): ...

    def backward(self, q, k, v, out, lse, dout, dlse, scale, inputs): ...

    def backward_learnable(self, q, k, v, out, lse, dout, dlse, scale, inputs, learn): ...


# op name -> the functional op; and the kernel object each name calls now (two loads of one
# spec share its op: an op name can be registered once per process)
_OPS: dict = {}
_KERNELS: dict = {}


def modified_op_for(kern: ModifiedAttention):
    name = kern.op_name
    _KERNELS[name] = kern
    if name not in _OPS:
        _OPS[name] = _define(name)
    return _OPS[name]


def _define(name: str):
    @custom_op(f"fadsl::{name}_modified", mutates_args=())
    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        inputs: List[torch.Tensor],
        softmax_scale: float,
        return_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kern = _KERNELS[name]
        if return_lse:
            return kern.forward(q, k, v, softmax_scale, None, True, tuple(inputs))
        out = kern.forward(q, k, v, softmax_scale, None, False, tuple(inputs))
        return out, q.new_empty((0,), dtype=torch.float32)

    @forward.register_fake
    def _(q, k, v, inputs, softmax_scale, return_lse):
        _KERNELS[name].check_inputs(q, k, v)
        shape = lse_shape(q) if return_lse else (0,)
        return torch.empty_like(q), q.new_empty(shape, dtype=torch.float32)

    @custom_op(f"fadsl::{name}_modified_backward", mutates_args=())
    def backward_op(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: Optional[torch.Tensor],
        inputs: List[torch.Tensor],
        softmax_scale: float,
        learn: List[bool],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        kern = _KERNELS[name]
        if any(learn):
            return kern.backward_learnable(
                q, k, v, out, lse, dout, dlse, softmax_scale, tuple(inputs), tuple(learn)
            )
        dq, dk, dv = kern.backward(q, k, v, out, lse, dout, dlse, softmax_scale, tuple(inputs))
        return dq, dk, dv, q.new_zeros((0,), dtype=torch.float32)

    @backward_op.register_fake
    def _(q, k, v, out, lse, dout, dlse, inputs, softmax_scale, learn):
        size = sum(t.numel() for t, wants in zip(inputs, learn) if wants)
        flat = q.new_empty((size,), dtype=torch.float32)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), flat

    def setup_context(ctx, inputs, output) -> None:
        q, k, v, tensors, softmax_scale, _ = inputs
        out, lse = output
        ctx.softmax_scale = softmax_scale
        ctx.inputs = len(tensors)
        ctx.learn = [bool(t.requires_grad) for t in tensors]  # (the inputs that get gradients)
        if _KERNELS[name].has_backward:
            ctx.save_for_backward(q, k, v, out, lse, *tensors)

    def backward(ctx, grad_out, grad_lse):
        if not _KERNELS[name].has_backward:
            raise RuntimeError(
                f"fadsl kernel '{name}' is forward-only: its spec has no backward block, so "
                "gradients cannot flow through it. Add a `backward {}` block to the spec, or "
                "call it under torch.no_grad() or on detached q, k and v."
            )
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        if lse.numel() == 0:  # the op called directly with return_lse=False: nothing to use
            raise RuntimeError(
                f"fadsl kernel '{name}': its backward needs the forward's LSE; call the op "
                "with return_lse=True (the FlashAttention object always does)"
            )
        dq, dk, dv, flat = backward_op(
            q, k, v, out, lse, grad_out, grad_lse, list(tensors), ctx.softmax_scale, ctx.learn
        )
        grads = split_buffer(flat, tensors, ctx.learn)
        return dq, dk, dv, grads, None, None

    forward.register_autograd(backward, setup_context=setup_context)
    return forward
