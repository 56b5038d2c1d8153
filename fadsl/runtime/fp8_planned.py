"""fadsl.attention on 8-bit q, k and v (issue 42), eager and without gradients, through
launch plans (fadsl/runtime/plans.py) as the 16-bit calls' (fadsl/runtime/planned.py).

A signature adds the descales to the 16-bit one's: each None, or its shape, strides, dtype
and device (the checks read those and the kernel's Fp8Descales holds the strides), and
out_dtype with its type. The descales' addresses are a call's own, as q's: a plan writes
them into the kernel's second parameter (host/fp8.py's slots) on every call that moves
them. The values are never read on the host (fadsl/runtime/fp8_calls.py).
"""

from __future__ import annotations

import torch

from . import dispatch
from .arguments import check_bases, check_scale, lse_shape
from .plans import PlanCache, stream_and_device

_FP8 = PlanCache()
_FLOAT32 = torch.float32


def clear() -> None:
    """Forget every 8-bit plan and signature (as planned.clear)."""
    _FP8.clear()


def _tensor(t):
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def signature(q, k, v, descales, causal, softmax_scale, out_dtype, window_size, softcap,
              return_lse):  # fmt: skip
    device = q.device
    window = tuple(window_size)
    return (
        *(q.shape, q.stride(), q.dtype, device),
        *(k.shape, k.stride(), k.dtype, k.device),
        *(v.shape, v.stride(), v.dtype, v.device),
        *(_tensor(t) for t in descales),
        *(type(out_dtype), out_dtype),
        *(type(causal), causal, type(softmax_scale), softmax_scale, type(return_lse), return_lse),
        *(type(window_size), window, type(window[0]), type(window[1])),
        *(type(softcap), softcap, *stream_and_device(device.index)),
    )


class Fp8AttentionPlan:
    """An 8-bit call's plan: O (of the output type) and the LSE allocated, q's, k's and v's
    addresses checked, every address written, one launch."""

    def __init__(self, prepared, target: str, out_dtype, return_lse: bool, lse_shape_, device):
        self.launch, self.target, self.out_dtype = prepared.launch, target, out_dtype
        self.return_lse, self.lse_shape, self.device = return_lse, lse_shape_, device

    def __call__(self, q, k, v, descales):
        out = torch.empty(q.shape, dtype=self.out_dtype, device=self.device)
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        if (addresses[0] | addresses[1] | addresses[2]) % 16:
            check_bases(q, k, v, self.target)
        lse = None
        if self.return_lse:
            lse = torch.empty(self.lse_shape, dtype=_FLOAT32, device=self.device)
        scales = tuple(0 if t is None else t.data_ptr() for t in descales)
        self.launch((*addresses, 0 if lse is None else lse.data_ptr(), *scales))
        return (out, lse) if self.return_lse else out


def lookup(q, k, v, descales, causal, softmax_scale, out_dtype, window_size, softcap,
           return_lse):  # fmt: skip
    """(signature, its plan or None); (None, None) where an argument requires grad or no
    signature can hold one (the checked path names it)."""
    try:
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, *descales)
        ):
            return None, None
        key = signature(q, k, v, descales, causal, softmax_scale, out_dtype, window_size,
                        softcap, return_lse)  # fmt: skip
        return key, _FP8.get(key)
    except Exception:  # (not a tensor, an unhashable or odd value: the checks say what)
        return None, None


def call(key, q, k, v, descales, causal, softmax_scale, out_dtype, return_lse):
    """The checked path (fadsl.attention has checked its own arguments): the kernel's checks
    and launch; a plan kept at the second call of the signature ``key``."""
    kern = dispatch.fp8_attention_kernel(q, causal, out_dtype)
    scale = check_scale(softmax_scale, kern.config.head_dim)
    dtype = kern.check_fp8_call(q, k, v, descales)
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        check_bases(q, k, v, kern.config.target)
    out = torch.empty(q.shape, dtype=kern.out_torch_dtype, device=q.device)
    lse = torch.empty(lse_shape(q), dtype=_FLOAT32, device=q.device) if return_lse else None
    prepared = None
    if _FP8.worth_planning(key):
        prepared = kern.prepare(dtype, q, k, v, out, lse, scale, key[-2], descales)
    if prepared is None:  # a first call
        kern.launch(dtype, q, k, v, out, lse, scale, (), descales)
    else:
        tensors = (q, k, v, out, lse, *descales)
        prepared.launch(tuple(0 if t is None else t.data_ptr() for t in tensors))
        plan = Fp8AttentionPlan(
            prepared, kern.config.target, kern.out_torch_dtype, return_lse, lse_shape(q), q.device
        )
        _FP8.put(key, plan)
    return (out, lse) if return_lse else out
