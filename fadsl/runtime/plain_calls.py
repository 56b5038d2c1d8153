"""A loaded kernel's plain calls through launch plans (issue 45): ``PlainCalls`` is
FlashAttention's part for them (fadsl/runtime/attention.py). An eager ``kern(q, k, v)``
without gradients, modifiers or ``out=`` forms its signature (what the checks and the
planning read: q's, k's and v's shapes, strides, dtypes and devices, the scale, return_lse,
the current stream and device; fadsl/runtime/plans.py says why that suffices) and, from the
signature's second call on, launches its plan: out and the LSE allocated, the addresses'
alignment checked, the addresses written, one launch, as fadsl.attention's planned calls
(``AttentionPlan``). Other calls, and a signature's first, take the checked path
(``forward``).
"""

from __future__ import annotations

import torch

from . import keep_classes
from .arguments import check_bases, lse_shape
from .plans import AttentionPlan, stream_and_device


class PlainCalls:
    """The planned plain calls of FlashAttention (which provides check_inputs, prepare,
    launch, forward, config and _plans, a PlanCache)."""

    def _call_planned(self, q, k, v, scale: float, return_lse: bool):
        try:
            key = (
                *(q.shape, q.stride(), q.dtype, q.device),
                *(k.shape, k.stride(), k.dtype, k.device),
                *(v.shape, v.stride(), v.dtype, v.device),
                *(type(scale), scale, return_lse, *stream_and_device(q.device.index)),
            )
        except Exception:  # (not tensors, a CPU tensor: the checked path names the argument)
            return self.forward(q, k, v, scale, None, return_lse)
        plan = self._plans.get(key)
        if plan is not None:
            return plan(q, k, v)
        return self._launch_planning(self._plans, key, q, k, v, scale, return_lse)

    def _launch_planning(self, plans, key, q, k, v, scale: float, return_lse: bool, tensors=()):
        """A call's checked launch (q, k and v checked here; ``tensors``, the modifiers'
        inputs and classes made ahead, by the caller), keeping a plan in ``plans`` for its
        signature ``key`` at the signature's second call where the kernel takes one
        (``prepare``: None for a split workspace, a varlen kernel's padded call, a keep's
        classes made by the call; the signature is then refused, and not tried again)."""
        planning = plans.worth_planning(key)
        dtype = self.check_inputs(q, k, v)
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
            check_bases(q, k, v, self.config.target)
        out = torch.empty_like(q)
        lse = None
        if return_lse:
            lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
        prepared = None
        if planning:
            read = tensors  # (P.inputs: the spec's inputs, then the forward's classes)
            if self.config.modifiers is not None:
                spec_inputs, made, _ = keep_classes.split(self, tensors)
                read = spec_inputs + (made or ())
            prepared = self.prepare(dtype, q, k, v, out, lse, scale, key[-2], inputs=read)
        if prepared is None:
            if planning:
                plans.refuse(key)  # (the signature's later calls launch unplanned)
            self.launch(dtype, q, k, v, out, lse, scale, tensors)
            return (out, lse) if return_lse else out
        addresses = tuple(0 if t is None else t.data_ptr() for t in (q, k, v, out, lse))
        prepared.launch(addresses + tuple(t.data_ptr() for t in read))
        plans.put(
            key, AttentionPlan(prepared, self.config.target, return_lse, lse_shape(q), q.device)
        )
        return (out, lse) if return_lse else out
