"""The host side of a launch, shared by every target: grid, block, SMEM and the kernel's
argument bytes.

Each target registers a ``Launch``: how its params struct is packed (the one kernel
argument, passed by value) and its grid. The sm_80 kernels take ``fadsl::FwdParams``
(emit/common/include/fadsl/params.cuh); a Hopper target would pack ``CUtensorMap`` TMA
descriptors into a ``__grid_constant__`` struct through the same hook.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from .ir import Kernel


class Args(NamedTuple):
    """The tensors and scalars of one call, checked by the runtime (a NamedTuple: built on
    every call, and cheaper than a frozen dataclass)."""

    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any  # a float32 tensor (batch, heads_q, seqlen_q), or None
    softmax_scale: float


@dataclass(frozen=True)
class Launch:
    """A target's launch: ``pack`` returns the params struct's bytes, ``grid`` the grid."""

    pack: Callable[[Kernel, Args], bytes]
    grid: Callable[[Kernel, Args], tuple[int, int, int]]

    def block(self, kernel: Kernel) -> tuple[int, int, int]:
        return (kernel.config.threads, 1, 1)


# fadsl::FwdParams: 5 pointers, 14 int64 strides, 5 int sizes, the float scale; 176 bytes
# with no padding (tests/test_params.py checks every offset against the C++ struct).
FWD_PARAMS = struct.Struct("<5Q14q5if")
FWD_PARAMS_FIELDS = (
    *("q", "k", "v", "o", "lse"),
    *(f"{t}_{d}_stride" for t in "qkvo" for d in ("batch", "seq", "head")),
    *("lse_batch_stride", "lse_head_stride"),
    *("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "softmax_scale"),
)


def pack_fwd_params(kernel: Kernel, a: Args) -> bytes:
    q, k, v, o, lse = a.q, a.k, a.v, a.out, a.lse
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    return FWD_PARAMS.pack(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        o.data_ptr(),
        0 if lse is None else lse.data_ptr(),
        *qs[:3],
        *ks[:3],
        *vs[:3],
        *os_[:3],
        0 if lse is None else lse.stride(0),
        0 if lse is None else lse.stride(1),
        q.shape[0],
        q.shape[2],
        k.shape[2],
        q.shape[1],
        k.shape[1],
        a.softmax_scale,
    )


def row_block_grid(kernel: Kernel, a: Args) -> tuple[int, int, int]:
    """One CTA per block_r query rows of one (batch, head): (q_block, head, batch)."""
    batch, seqlen_q, heads_q = a.q.shape[0], a.q.shape[1], a.q.shape[2]
    return (-(-seqlen_q // kernel.config.block_r), heads_q, batch)


# target (as a spec spells it) -> its launch
LAUNCHES: dict[str, Launch] = {
    "sm_80": Launch(pack=pack_fwd_params, grid=row_block_grid),
}


def launch_for(target: str) -> Launch:
    try:
        return LAUNCHES[target]
    except KeyError:
        raise NotImplementedError(f"fadsl has no launcher for target {target} yet") from None
