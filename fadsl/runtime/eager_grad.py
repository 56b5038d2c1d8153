"""Eager calls that need gradients, without the dispatcher.

torch.compile traces the kernels through torch.library custom ops (custom_op.py,
public_ops.py), whose autograd formula runs the spec's backward. In eager mode those ops'
layers (the dispatcher, custom_op's autograd wrapper, its aliasing checks, the backward op's
own dispatch) cost more host time than the kernels they launch: on the H200 machine
(2026-11-30, research/probes/backward_host.py examples/fa3_causal.fa, 16 x 1024 x 16 x 128)
a backward through autograd took 406 us of host time per call against 166 us for
FlashAttention.backward called directly, while the GPU's backward took 517 us, so calls at
1k tokens were as slow as the host. Here the same kernels run through one
torch.autograd.Function: the forward and backward of FlashAttention (the same arguments as
the ops pass, so the same launches and the same bits), the LSE's gradient None where the LSE
is not used (the ops' zero tensor adds 0 to D: the same bits either way).

Packed sequences (a loaded `varlen on` spec's varlen call, fadsl.attention_varlen) go
through an autograd.Function of their own, calling the varlen kernels with the same
cu_seqlens as their ops do (never a padded kernel: that would attend across sequences).

Only specs with a backward block come here: the ops' formula raises the forward-only message
at backward time, and keeps doing so.
"""

import torch

from .driver import ensure_context


class _Attention(torch.autograd.Function):
    """(out, lse) of ``kern`` (a FlashAttention with a backward block) at ``scale``; the
    backward is the spec's."""

    @staticmethod
    def forward(ctx, kern, scale, q, k, v):
        ensure_context(q.device.index)  # (a recomputation may run on autograd's thread)
        out, lse = kern.forward(q, k, v, scale, None, True)
        ctx.kern, ctx.scale = kern, scale
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # (an unused LSE's gradient stays None)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        ensure_context(q.device.index)  # (autograd's worker thread: driver.ensure_context)
        if dout is None:  # only the LSE reaches the loss
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.kern.backward(q, k, v, out, lse, dout, dlse, ctx.scale)
        return None, None, dq, dk, dv


def attention(kern, scale: float, q, k, v):
    """(out, lse) with gradients through q, k, v and the LSE, eagerly: ``kern`` has a backward
    block and ``scale`` is checked."""
    return _Attention.apply(kern, scale, q, k, v)


class _Varlen(torch.autograd.Function):
    """(out, lse) of ``kern``'s varlen call (a `varlen on` spec with a backward block) over
    the sequences cu_q, cu_k at ``scale``; the backward is the spec's varlen backward."""

    @staticmethod
    def forward(ctx, kern, scale, q, k, v, cu_q, cu_k):
        ensure_context(q.device.index)  # (a recomputation may run on autograd's thread)
        out, lse = kern.varlen_forward(q, k, v, cu_q, cu_k, scale, None, True)
        ctx.kern, ctx.scale = kern, scale
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.set_materialize_grads(False)  # (an unused LSE's gradient stays None)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 7
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        ensure_context(q.device.index)  # (autograd's worker thread: driver.ensure_context)
        if dout is None:  # only the LSE reaches the loss
            dout = torch.zeros_like(out)
        dq, dk, dv = ctx.kern.varlen_backward(q, k, v, out, lse, dout, dlse, cu_q, cu_k, ctx.scale)
        return None, None, dq, dk, dv, None, None


def varlen(kern, scale: float, q, k, v, cu_q, cu_k):
    """(out, lse) of a packed call with gradients through q, k, v and the LSE, eagerly:
    ``kern`` is a `varlen on` spec with a backward block and ``scale`` is checked."""
    return _Varlen.apply(kern, scale, q, k, v, cu_q, cu_k)
