"""Each compiled kernel as torch.library custom ops, so that torch.compile and autograd see it
(no `from __future__ import annotations` here: custom_op reads the annotations as types).

Two ops per spec (named after the kernel and the spec's hash):

- ``fadsl::<kernel>_<hash>(q, k, v, softmax_scale, return_lse) -> (out, lse)``, functional,
  with a backward that raises: the kernels are forward-only, and gradients must never be
  dropped silently (``lse`` is an empty tensor unless asked for);
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

    def setup_context(ctx, inputs, output) -> None:
        pass

    def backward(ctx, grad_out, grad_lse):
        raise RuntimeError(
            f"fadsl kernel '{name}' is forward-only: it has no backward pass, so gradients "
            "cannot flow through it. Call it under torch.no_grad(), or on detached q, k and v."
        )

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
