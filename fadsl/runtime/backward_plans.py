"""Launch plans for padded backward calls (issues 44, 45; research/backward-launch-plan.md).

A backward call's signature is what its checks and its planning read, less the addresses:
q's, k's, v's, out's, the LSE's, dout's, dLSE's and the modifiers' inputs' shapes, strides,
dtypes and devices, the scale with its type, the current stream and device (plans.py says
why that suffices). A signature's second call keeps the target's plan (its three kernels'
params as packed, with the slots of every address: fadsl/targets/sm90/backward/launch_plan.py);
its later calls make dout, the LSE and dLSE as the checks would (contiguous; float32),
check that q, k, v, out and dout lie on 16 bytes, allocate dq, dk, dv and the workspace
as the checked path does, write the addresses that changed and launch, without the checks,
the packing, the TMA descriptors' encoding or the launch configs. The gradients are the
checked path's: the same kernels with the same params (tests/test_backward_plans.py holds the
launches byte-equal on a stand-in device).
"""

from __future__ import annotations

import torch

from .plans import Prepared, stream_and_device


def signature(q, k, v, out, lse, dout, dlse, scale: float, inputs: tuple) -> tuple | None:
    """A padded backward call's signature (``inputs``: the modifiers' tensors as the main
    kernel reads them, the spec's inputs then a keep's classes made ahead), or None where
    none can be formed (the checked path names the argument)."""
    try:
        tensors = tuple((t.shape, t.stride(), t.dtype, t.device) for t in (q, k, v, out, lse, dout))
        extra = tuple((t.shape, t.stride(), t.dtype, t.device) for t in inputs)
        lse_grad = None if dlse is None else (dlse.shape, dlse.stride(), dlse.dtype, dlse.device)
        return (*tensors, lse_grad, extra, type(scale), scale, *stream_and_device(q.device.index))
    except Exception:  # (not a tensor, an unhashable value)
        return None


class BackwardPlan:
    """One signature's launches (``BackwardCallPlan`` prepared: a ``Prepared`` per kernel on
    the signature's stream)."""

    def __init__(self, spec, modules: dict, addresses: tuple, inputs: int, stream: int, index: int):
        sources = spec.sources(inputs)
        self._steps = tuple(
            Prepared(step, sources, addresses, [modules[step.kernels[0].suffix]], stream, index)
            for step in spec.steps
        )
        self._make, self._finish = spec.make, spec.finish

    def __call__(self, q, k, v, out, lse, dout, dlse, inputs: tuple):
        """(dq, dk, dv), or None where an address is not on 16 bytes (the checked path says
        which)."""
        dout, lse = dout.contiguous(), lse.contiguous()
        if dlse is not None:
            dlse = dlse.to(torch.float32).contiguous()
        if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | dout.data_ptr()) % 16:
            return None
        made = self._make(q, k, v)
        addresses = tuple(t.data_ptr() for t in (q, k, v, out, lse, dout)) + (
            0 if dlse is None else dlse.data_ptr(),
        )
        addresses += tuple([t.data_ptr() for t in made]) + tuple([t.data_ptr() for t in inputs])
        for step in self._steps:
            step.launch(addresses)
        return self._finish(made)
