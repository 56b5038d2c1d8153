"""A loaded kernel's backward (``BackwardCalls``, FlashAttention's part for it,
fadsl/runtime/attention.py): the spec's backward kernels (fadsl/runtime/backward.py) called
with the forward's tensors and the output's gradient, checked on a signature's first calls
and launched through the signature's launch plan after (fadsl/runtime/backward_plans.py).
The autograd Function (eager_grad.py) and the backward ops (custom_op.py, modified_op.py,
public_ops.py) call it.
"""

from __future__ import annotations

from ..ir import Dtype
from . import keep_classes, learnable
from .arguments import backward_operands, check_base, lse_shape
from .backward_plans import signature as backward_signature


class BackwardCalls:
    """The backward of FlashAttention (which provides compiled, verbose, cubin_dirs,
    is_varlen, check_inputs, config, arch, backward_padded_as_varlen and _backward)."""

    @property
    def has_backward(self) -> bool:
        """Whether the spec has a ``backward { ... }`` block (gradients flow through it)."""
        return self.compiled.kernel.backward is not None

    def backward_source(self, dtype: str) -> str:
        return self._backward_kernels().source(Dtype(dtype))

    def _backward_kernels(self):
        if self._backward is None:
            from .backward import BackwardKernels

            self._backward = BackwardKernels(self.compiled, self.verbose, self.cubin_dirs)
        return self._backward

    def backward_learnable(self, q, k, v, out, lse, dout, dlse, scale: float, inputs, learn):
        """backward's (dq, dk, dv) and the fp32 gradients of the inputs ``learn`` marks, end
        to end in one buffer (fadsl/runtime/learnable.py)."""
        arch = self.arch(q.device.index)
        return learnable.backward(self, arch, q, k, v, out, lse, dout, dlse, scale, inputs, learn)

    def backward(self, q, k, v, out, lse, dout, dlse, scale: float, inputs=()):
        """(dq, dk, dv) of the loss whose gradient on the output is ``dout`` (and on the
        LSE ``dlse``, or None), from the forward's q, k, v, out and lse; ``inputs``: the
        score and mask modifiers' tensors, checked, in declared order."""
        if self.is_varlen:  # the kernels read cu_seqlens: the batch packed end to end
            return self.backward_padded_as_varlen(q, k, v, out, lse, dout, dlse, scale)
        kernels = self._backward_kernels()
        inputs, _, classes = keep_classes.split(self, inputs)
        read = inputs if classes is None else inputs + tuple(classes[2:])
        key = backward_signature(q, k, v, out, lse, dout, dlse, scale, read)
        plan = None if key is None else kernels.plans.get(key)
        if plan is not None:  # (a signature's later calls: its launch plan)
            grads = plan(q, k, v, out, lse, dout, dlse, read)
            if grads is not None:
                return grads
        dtype = self.check_inputs(q, k, v)
        dout, lse, dlse = backward_operands(out, lse, dout, dlse, lse_shape(q), q.device)
        if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | dout.data_ptr()) % 16:
            target = self.config.target
            for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
                check_base(name, t, target)
        arch = self.arch(q.device.index)
        return kernels(
            dtype, arch, q, k, v, out, lse, dout, dlse, scale, inputs, classes=classes, key=key
        )
