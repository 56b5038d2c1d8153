"""sm_80's launch: one CTA per B_r query rows of one (batch, head), ``fadsl::FwdParams``."""

from __future__ import annotations

from ...ir import Kernel
from ..launch import AddressSlot, Args, Launch, fwd_pointer_slots, pack_fwd_params


def row_block_grid(kernel: Kernel, a: Args) -> tuple[int, int, int]:
    """One CTA per block_r query rows of one (batch, head): (q_block, head, batch)."""
    batch, seqlen_q, heads_q = a.q.shape[0], a.q.shape[1], a.q.shape[2]
    return (-(-seqlen_q // kernel.config.block_r), heads_q, batch)


def address_slots(kernel: Kernel, a: Args) -> tuple[AddressSlot, ...]:
    """FwdParams' pointers, the struct's only addresses."""
    return fwd_pointer_slots(0, ("q", "k", "v", "out", None if a.lse is None else "lse"))


LAUNCH = Launch(pack=pack_fwd_params, grid=row_block_grid, slots=address_slots)
