"""The backward main kernel's shared memory: each buffer's offset, size and lifetime.

The layout is fixed by the kernel's structure (emit/sm90/include/fadsl/sm90_bwd.cuh reads
the same offsets from its template slots): K and V for the CTA's n-block, the Q and dO rings
with their LSE and D rows, dS^T double-buffered (the dQ GEMM of one m-block reads it while
the next m-block's is written), dQ's fp32 staging for the bulk reduce-add, and the
mbarriers. Tiles are 1024-byte aligned (the 128-byte swizzle's atom).

At head_dim 256 (sm90_bwd_split.cuh: the consumers split head_dim) P goes through SMEM too,
double-buffered like dS, and dO with its D rows has a ring of its own of ``SPLIT_DO_STAGES``
slot: two dO slots, or one ring of two Q/dO slots, do not fit beside K, V, Q's slots, P and
dS (research/backward-hdim256.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ....ir.backward import Backward

ALIGN = 1024
SMEM_LIMIT = 227 * 1024  # sm_90a's dynamic SMEM per CTA
ELEM = 2  # bf16 / fp16
# An element is 16 bits; the fp32 LSE/D rows and dQ staging are 4 bytes.
F32 = 4
# head_dim 256: the consumer warpgroups split head_dim, not the keys (sm90_bwd.cuh's
# kSplitHeadDim), and dO has a ring of its own of one slot (kDoStages)
SPLIT_HEAD_DIM = 256
SPLIT_DO_STAGES = 1


@dataclass(frozen=True)
class SmemBuffer:
    name: str
    offset: int
    nbytes: int
    lifetime: str  # in explain's SMEM map

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BackwardSmem:
    buffers: tuple[SmemBuffer, ...]

    @property
    def total(self) -> int:
        return max(b.end for b in self.buffers)


def _round(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def split_head_dim(head_dim: int) -> bool:
    """Whether the consumer warpgroups split head_dim (each holds dK^T and dV^T of every key
    for its half of the columns) rather than the keys: at head_dim 256, where dK and dV of 64
    keys would take 256 registers a thread (sm90_bwd.cuh's kSplitHeadDim)."""
    return head_dim == SPLIT_HEAD_DIM


def do_stages(bwd: Backward, head_dim: int) -> int:
    """The dO ring's slots: its own ring of one slot at head_dim 256, else Q's (sm90_bwd.cuh's
    kDoStages)."""
    return SPLIT_DO_STAGES if split_head_dim(head_dim) else bwd.stages


def dq_by_queries(bwd: Backward) -> bool:
    """Whether the consumers split dQ = dS K by queries (each its own 64 of B_r, every
    column, over all B_c keys): B_r is 64 per consumer (sm90_bwd.cuh's kDqByQueries)."""
    return bwd.block_m == 128


def dq_transposed(bwd: Backward) -> bool:
    """Whether the consumers compute dQ^T = K^T dS^T (each one 64-column panel of head_dim
    for all B_r queries, over all B_c keys): B_r is not a multiple of wgmma's M of 64
    (sm90_bwd.cuh's kDqTransposed)."""
    return bwd.block_m % 64 != 0


def dq_by_keys(bwd: Backward, head_dim: int) -> bool:
    """Whether the consumers split dQ = dS K by keys (each all of head_dim over its own 64
    keys) rather than by queries or by whole 64-column panels of head_dim (sm90_bwd.cuh's
    kDqByKeys)."""
    whole_panels = (head_dim // bwd.consumers) % 64 == 0
    return not dq_by_queries(bwd) and not dq_transposed(bwd) and not whole_panels


def dq_staging_bytes(bwd: Backward, head_dim: int) -> int:
    """Each consumer warpgroup stages its share of dQ in fp32, 64 queries (transposed: 64
    columns of every query) (none where dQ is added from registers: `dQ: rf -red.add->
    gmem`)."""
    if bwd.dq_red:
        return 0
    if dq_transposed(bwd):
        return bwd.consumers * 64 * bwd.block_m * F32
    all_cols = dq_by_keys(bwd, head_dim) or dq_by_queries(bwd)
    cols = head_dim if all_cols else head_dim // bwd.consumers
    return bwd.consumers * 64 * cols * F32


def plan_smem(bwd: Backward, head_dim: int) -> BackwardSmem:
    """Offsets of the main kernel's buffers for ``bwd``'s tiles at ``head_dim``."""
    m, n, s = bwd.block_m, bwd.block_n, bwd.stages
    split, d = split_head_dim(head_dim), do_stages(bwd, head_dim)
    if split:
        do = (
            "dO",
            d * m * head_dim * ELEM,
            f"a ring of its own, {d} m-block (a second does not fit)",
        )
        bars = ((1 + 2 * s + 2 * d) * 8, "K/V full; Q full and empty per slot; dO's likewise")
        pds = (
            ("P", 2 * n * m * ELEM, "two m-blocks: each warpgroup's dV^T reads both's keys"),
            ("dS", 2 * n * m * ELEM, "two m-blocks: each warpgroup's dK^T and dQ^T read both's"),
        )
    else:
        do = ("dO", s * m * head_dim * ELEM, f"a ring of {s} m-blocks, with Q's slot")
        bars = ((1 + 2 * s) * 8, "K/V full; Q/dO full and empty per slot")
        if bwd.persistent:  # kv_empty: the tile's K and V freed for the next tile's
            bars = ((2 + 2 * s) * 8, "K/V full; Q/dO full and empty per slot; K/V empty")
        if bwd.dq_lag:  # dS^T's full and empty per buffer (sm90_bwd_lag.cuh)
            bars = (bars[0] + 4 * 8, bars[1] + "; dS^T full and empty per buffer")
        if bwd.late_v:  # V's own full barrier (sm90_bwd_producer.cuh, bwd_load_v_late)
            bars = (bars[0] + 8, bars[1] + "; V full")
        pds = (
            (
                "dS",
                2 * n * m * ELEM,
                "two m-blocks: the dQ GEMM reads one while the next is written",
            ),
        )
    kv = "the CTA's n-block (one TMA load)"
    staged = "; then each warpgroup's rows stage its {} for the TMA store" if bwd.dkv_tma else ""
    sizes = (
        ("K", n * head_dim * ELEM, kv + staged.format("dK")),
        ("V", n * head_dim * ELEM, kv + staged.format("dV")),
        ("Q", s * m * head_dim * ELEM, f"a ring of {s} m-blocks"),
        do,
        *pds,
        (
            "dQ",
            dq_staging_bytes(bwd, head_dim),
            "one m-block, until its bulk reduce-add has read it",
        ),
        ("LSE", s * m * F32, "with Q's slot"),
        ("D", d * m * F32, "with dO's slot"),
        ("mbarriers", *bars),
    )
    buffers, offset = [], 0
    for name, nbytes, lifetime in sizes:
        buffers.append(SmemBuffer(name, offset, nbytes, lifetime))
        offset = _round(offset + nbytes, ALIGN if nbytes >= ALIGN else 16)
    return BackwardSmem(tuple(buffers))
