"""The 8-bit kernel's second parameter (issue 42, research/fp8-forward.md §3.5 and §7 step
4): ``Fp8Descales`` (emit/sm90/include/fadsl/sm90_fp8.cuh), the float32 descales of Q, K and
V, each (batch, heads_kv) at its own (batch, head) strides in elements, nullptr for a
descale of 1; and the slots a launch plan rewrites in it.

FwdParamsSm90, its packing and its slots stay the 16-bit kernels' (host/launch.py): an 8-bit
kernel's Q, K and V maps differ only in their box, 128 one-byte columns (one 128-byte panel,
as load_q and load_kv read it by the Cfg's kInPanelCols; 64 at head_dim 64, with the 64-byte swizzle: caps.py's
panel_columns) instead of 64 two-byte ones; O is 16-bit and keeps its 64 x 64 boxes. tests/test_fp8_host.py checks the layout against the C++ struct.
"""

from __future__ import annotations

import functools
import struct

from ...launch import AddressSlot, Args, second_offset

# struct Fp8Descales { const float* q, *k, *v; int q_batch_stride, q_head_stride,
# k_batch_stride, k_head_stride, v_batch_stride, v_head_stride; }: 48 bytes, no padding
DESCALES = struct.Struct("<3Q6i")
DESCALES_FIELDS = (
    *("q", "k", "v"),
    *(f"{t}_{d}_stride" for t in "qkv" for d in ("batch", "head")),
)
DESCALE_SOURCES = ("q_descale", "k_descale", "v_descale")  # a plan's names for their addresses
_NONE = (None, None, None)


def descale_strides(t) -> tuple[int, int]:
    """A descale's (batch, head) strides in elements (0 for a dimension of size 1, which the
    kernel never steps along; an expanded scalar has 0 for both)."""
    return tuple(st if n > 1 else 0 for n, st in zip(t.shape, t.stride()))


def pack_descales(a: Args) -> bytes:
    """Fp8Descales for the call's descales (``a.descales``: three tensors or None)."""
    q, k, v = a.descales or _NONE
    pointers, strides = [], []
    for t in (q, k, v):
        pointers.append(0 if t is None else t.data_ptr())
        strides.extend((0, 0) if t is None else descale_strides(t))
    return DESCALES.pack(*pointers, *strides)


@functools.cache
def descale_slots(params_bytes: int, present: tuple[bool, bool, bool]) -> tuple[AddressSlot, ...]:
    """The slots of the descales' pointers that a call gives (``present``), in a plan whose
    first parameter is ``params_bytes`` long (the second starts at second_offset)."""
    base = second_offset(params_bytes)
    return tuple(
        AddressSlot(base + 8 * i, name)
        for i, (name, given) in enumerate(zip(DESCALE_SOURCES, present))
        if given
    )
