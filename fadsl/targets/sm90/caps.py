"""sm_90a's capabilities and sync model, as data.

TMA (cp.async.bulk.tensor) moves whole tiles between gmem and smem and completes on an
mbarrier phase (transaction bytes); wgmma.mma_async reads its SMEM operands through
descriptors and completes by commit groups; warpgroups meet on named barriers; a generic
SMEM write reaches the async proxy (TMA store) only after fence.proxy.async.
"""

from __future__ import annotations

from ...ir import WARPGROUP_THREADS, Dtype, Instr, Level, Scope
from ...ir.syncmodel import AsyncKind, Signal, SyncKind, SyncModel, WaitRule
from .. import Capabilities
from ..archs import SM_LIMITS
from ..common_syncs import SYNCTHREADS

CAPABILITIES = Capabilities(
    mma="wgmma.mma_async m64nNk16",
    smem_per_cta=227 * 1024,
    smem_per_sm=SM_LIMITS["sm_90a"]["smem"],
    registers_per_thread=255,
    registers_per_sm=SM_LIMITS["sm_90a"]["regs"],
    hop_instrs={
        (Level.GMEM, Level.SMEM): (Instr.TMA,),
        (Level.SMEM, Level.RF): (Instr.WGMMA,),
        (Level.RF, Level.SMEM): (Instr.STMATRIX,),
        (Level.SMEM, Level.GMEM): (Instr.TMA,),
        (Level.SMEM, Level.SMEM): (Instr.TRANSPOSE,),  # 8-bit V into Vt (FP8 wgmma's B)
    },
    archs=(("sm_90a", "H100/H200"),),
    devices=((9, 0), True),  # the "a" instructions: sm_90 only
    alignment="TMA descriptors need every stride but the last a multiple of 16 bytes and a "
    "16-byte aligned base",
    scopes=(Scope.WARPGROUP, Scope.CTA, Scope.CLUSTER),
    # e4m3 and e5m2: the FP8 forward (research/fp8-forward.md), whose kernel is not built yet
    dtypes=(Dtype.BF16, Dtype.FP16, Dtype.E4M3, Dtype.E5M2),
)

REGISTERS_PER_SM = CAPABILITIES.registers_per_sm
# shared memory the hardware keeps for each resident CTA, beside its dynamic SMEM (1 KB)
SMEM_RESERVED_PER_CTA = SM_LIMITS["sm_90a"]["reserved"]
SETMAXNREG_RANGE = (24, 256)  # multiples of 8
REGISTER_UNIT = 8  # a warp's registers are allocated 256 at a time: 8 a thread
HEAD_DIMS = (64, 128, 256)
MAX_CONSUMERS = 3
ROWS_PER_CONSUMER = 64  # wgmma's M
PANEL_COLUMNS = 64  # a TMA box's columns: 128 bytes of 16-bit elements, the swizzle's span
SWIZZLE_BYTES = 128  # the widest swizzle's span: a tile's rows are panels of at most this


def panel_columns(head_dim: int, elem_bytes: int) -> int:
    """The columns of a Q, K or V panel (a TMA box, a K-major wgmma operand): 128 bytes of
    elements, or the whole row where it is shorter (8-bit head_dim 64: 64 bytes, which take the
    64-byte swizzle; fadsl/sm90_fp8.cuh's kInPanelCols, host/tma.py's _swizzle)."""
    return min(SWIZZLE_BYTES // elem_bytes, head_dim)


NAMED_BARRIERS = 16  # ids 0..15; 0 is __syncthreads

# Asynchronous operations: what they access after the issuing instruction returns.
TMA_LOAD = AsyncKind(name="TMA load (complete_tx on an mbarrier)", flag="tma")
WGMMA = AsyncKind(name="wgmma.mma_async (commit groups)", flag="wgmma")
TMA_STORE = AsyncKind(name="TMA store (bulk groups)", flag="tma_store")

MBAR_INIT = SyncKind("mbarrier.init", "an mbarrier init", signal=Signal.INIT)
FENCE_MBAR_INIT = SyncKind("fence.mbarrier_init", "an init fence", signal=Signal.FENCE)
MBAR_EXPECT_TX = SyncKind(
    "mbarrier.arrive.expect_tx", "an arrival with transaction bytes", signal=Signal.EXPECT_TX
)
MBAR_ARRIVE = SyncKind("mbarrier.arrive", "an mbarrier arrival", signal=Signal.ARRIVE)
MBAR_WAIT = SyncKind(
    "mbarrier.try_wait.parity",
    "an mbarrier wait",
    completes=TMA_LOAD,
    rule=WaitRule.PHASE_PARITY,
    cost=2,
)
# `cluster 2`: a consumer's arrival on the peer CTA's empty barrier (mapa, then
# mbarrier.arrive.release.cta.shared::cluster), and the cluster barrier (every thread of both
# CTAs).
MBAR_ARRIVE_PEER = SyncKind(
    "mbarrier.arrive.shared::cluster", "an arrival on the peer CTA's mbarrier", signal=Signal.ARRIVE
)
CLUSTER_ARRIVE = SyncKind(
    "barrier.cluster.arrive", "a cluster barrier arrival (release)", signal=Signal.TURN_ARRIVE
)
CLUSTER_ARRIVE_RELAXED = SyncKind(
    "barrier.cluster.arrive.relaxed",
    "a cluster barrier arrival (relaxed: orders no memory)",
    signal=Signal.TURN_ARRIVE,
)
CLUSTER_WAIT = SyncKind(
    "barrier.cluster.wait", "a cluster barrier wait", cost=10, signal=Signal.TURN_SYNC
)
WGMMA_FENCE = SyncKind("wgmma.fence", "a wgmma register fence", signal=Signal.FENCE)
WGMMA_COMMIT = SyncKind("wgmma.commit_group", "a wgmma commit", signal=Signal.COMMIT)
WGMMA_WAIT = SyncKind(
    "wgmma.wait_group", "a wgmma wait", completes=WGMMA, rule=WaitRule.NEWEST_PENDING, cost=2
)
BAR_SYNC = SyncKind(
    "bar.sync", "a named barrier", scope=Scope.WARPGROUP, cost=5, signal=Signal.TURN_SYNC
)
BAR_ARRIVE = SyncKind("bar.arrive", "a named-barrier arrival", signal=Signal.TURN_ARRIVE)
# 8-bit kernels: a producer warp's lanes meet after their transpose (their ldmatrix reads of
# the raw V slot and stmatrix writes of Vt done) before lane 0 arrives for the whole warp
SYNCWARP = SyncKind(
    "__syncwarp()", "a warp barrier", scope=Scope.WARP, cost=1, signal=Signal.TURN_SYNC
)
FENCE_PROXY_ASYNC = SyncKind("fence.proxy.async", "a proxy fence", signal=Signal.FENCE)
BULK_COMMIT = SyncKind("cp.async.bulk.commit_group", "a bulk commit", signal=Signal.COMMIT)
BULK_WAIT = SyncKind(
    "cp.async.bulk.wait_group.read",
    "a bulk wait",
    completes=TMA_STORE,
    rule=WaitRule.NEWEST_PENDING,
    cost=2,
)

SYNC_MODEL = SyncModel(
    async_kinds=(TMA_LOAD, WGMMA, TMA_STORE),
    barriers=(BAR_SYNC, SYNCTHREADS, SYNCWARP),
    waits=(MBAR_WAIT, WGMMA_WAIT, BULK_WAIT),
    others=(
        MBAR_INIT,
        FENCE_MBAR_INIT,
        MBAR_EXPECT_TX,
        MBAR_ARRIVE,
        MBAR_ARRIVE_PEER,
        CLUSTER_ARRIVE,
        CLUSTER_ARRIVE_RELAXED,
        CLUSTER_WAIT,
        WGMMA_FENCE,
        WGMMA_COMMIT,
        BAR_ARRIVE,
        FENCE_PROXY_ASYNC,
        BULK_COMMIT,
    ),
)


def launch_registers(threads: int, ctas_per_sm: int = 1) -> int:
    """Registers each thread of a CTA of ``threads`` holds at launch under
    ``__launch_bounds__(threads, ctas_per_sm)``: the most that fit the SM ``ctas_per_sm``
    times, in whole allocation units (ptxas's count for a kernel with setmaxnreg; 384
    threads: 168, not 170; 256 threads, two CTAs: 128)."""
    fit = min(SETMAXNREG_RANGE[1], REGISTERS_PER_SM // (threads * ctas_per_sm))
    return fit - fit % REGISTER_UNIT


def registers_asked(producer_regs: int, consumers: int, consumer_regs: int) -> int:
    """The registers a setmaxnreg split holds once every warpgroup has run its setmaxnreg:
    one producer warpgroup and ``consumers`` consumer warpgroups."""
    return WARPGROUP_THREADS * (producer_regs + consumers * consumer_regs)


def smem_limit(ctas_per_sm: int = 1) -> int:
    """The dynamic SMEM a CTA may use when ``ctas_per_sm`` of them share an SM (each with
    the hardware's reserved kilobyte): sm_90a's 227 KB for one."""
    share = CAPABILITIES.smem_per_sm // ctas_per_sm - SMEM_RESERVED_PER_CTA
    return min(CAPABILITIES.smem_per_cta, share)


def register_pool(threads: int, ctas_per_sm: int = 1) -> int:
    """The CTA's register pool: setmaxnreg.dec returns registers to it and setmaxnreg.inc
    waits until it holds what it asks for, so the roles' counts must fit it, not the SM."""
    return threads * launch_registers(threads, ctas_per_sm)


def default_registers(consumers: int, ctas_per_sm: int = 1) -> tuple[int, int]:
    """FlashAttention-3's setmaxnreg split (producer, consumer) for 1..3 consumer warpgroups;
    at two CTAs an SM the split that fills the halved pool (launch allocation 128 / 80 / 64 a
    thread), the producer under it and the consumers over it."""
    if ctas_per_sm == 2:
        return {1: (40, 216), 2: (24, 104), 3: (40, 72)}[consumers]
    return {1: (56, 256), 2: (24, 240), 3: (32, 160)}[consumers]


# The header of the tile timeline's marks (a FADSL_TILE_TRACE build; fadsl/tools/tiletrace.py
# reads the layout it declares).
TRACE_HEADER = "fadsl/sm90_trace.cuh"
# The backward's m-block timeline (a FADSL_BWD_TRACE build; fadsl/tools/bwdtrace.py).
BACKWARD_TRACE_HEADER = "fadsl/sm90_bwd_trace.cuh"
