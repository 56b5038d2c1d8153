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
through the same Function with their cu_seqlens, which calls the varlen kernels as their ops
do (never a padded kernel: that would attend across sequences).

Calls of a spec with score and mask modifiers (issue 41) go through _Modified, the modified
op's formula (modified_op.py) without the op: the inputs after q, k and v (a KeepClasses'
tensors after the spec's), their gradients where they require grad (the learnable variant's
buffer, split as the op splits it).

Only specs with a backward block come here: the ops' formula raises the forward-only message
at backward time, and keeps doing so.
"""

import torch

from .driver import ensure_context
from .learnable import split_buffer


class _Attention(torch.autograd.Function):
    """(out, lse) of ``kern`` (a FlashAttention with a backward block) at ``scale``; the
    backward is the spec's. ``packed``: (cu_q, cu_k) of a packed call, whose varlen forward
    and backward it calls instead (empty: a padded call)."""

    @staticmethod
    def forward(ctx, kern, scale, q, k, v, *packed):
        ensure_context(q.device.index)  # (a recomputation may run on autograd's thread)
        if packed:
            out, lse = kern.varlen_forward(q, k, v, *packed, scale, None, True)
        else:
            out, lse = kern.forward(q, k, v, scale, None, True)
        ctx.kern, ctx.scale = kern, scale
        ctx.save_for_backward(q, k, v, out, lse, *packed)
        ctx.set_materialize_grads(False)  # (an unused LSE's gradient stays None)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *packed = ctx.saved_tensors
        unused = (None,) * len(packed)  # (cu_seqlens take no gradient)
        if dout is None and dlse is None:
            return None, None, None, None, None, *unused
        ensure_context(q.device.index)  # (autograd's worker thread: driver.ensure_context)
        if dout is None:  # only the LSE reaches the loss
            dout = torch.zeros_like(out)
        if packed:
            grads = ctx.kern.varlen_backward(q, k, v, out, lse, dout, dlse, *packed, ctx.scale)
        else:
            grads = ctx.kern.backward(q, k, v, out, lse, dout, dlse, ctx.scale)
        return None, None, *grads, *unused


class _Modified(torch.autograd.Function):
    """(out, lse) of ``kern`` (a FlashAttention with modifiers and a backward block) at
    ``scale`` on ``inputs``; the backward is the spec's, the inputs that require grad
    getting theirs."""

    @staticmethod
    def forward(ctx, kern, scale, q, k, v, *inputs):
        ensure_context(q.device.index)
        out, lse = kern.forward(q, k, v, scale, None, True, inputs)
        ctx.kern, ctx.scale = kern, scale
        ctx.learn = tuple(bool(t.requires_grad) for t in inputs)
        ctx.save_for_backward(q, k, v, out, lse, *inputs)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *inputs = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None, None, *(None,) * len(inputs)
        ensure_context(q.device.index)
        if dout is None:
            dout = torch.zeros_like(out)
        kern, scale = ctx.kern, ctx.scale
        if any(ctx.learn):
            *grads, flat = kern.backward_learnable(
                q, k, v, out, lse, dout, dlse, scale, tuple(inputs), ctx.learn
            )
            return None, None, *grads, *split_buffer(flat, inputs, ctx.learn)
        grads = kern.backward(q, k, v, out, lse, dout, dlse, scale, tuple(inputs))
        return None, None, *grads, *(None,) * len(inputs)


def modified(kern, scale: float, q, k, v, inputs: tuple):
    """(out, lse) of a spec with modifiers, with gradients through q, k, v, the LSE and the
    inputs that require grad, eagerly (``inputs`` checked; ``kern`` has a backward block)."""
    return _Modified.apply(kern, scale, q, k, v, *inputs)


def attention(kern, scale: float, q, k, v):
    """(out, lse) with gradients through q, k, v and the LSE, eagerly: ``kern`` has a backward
    block and ``scale`` is checked."""
    return _Attention.apply(kern, scale, q, k, v)


def varlen(kern, scale: float, q, k, v, cu_q, cu_k):
    """(out, lse) of a packed call with gradients through q, k, v and the LSE, eagerly:
    ``kern`` is a `varlen on` spec with a backward block and ``scale`` is checked."""
    return _Attention.apply(kern, scale, q, k, v, cu_q, cu_k)
