"""The IR's vocabulary: enums that every stage shares (dtypes, masks, memory levels and
instructions, sharing scopes, roles, phases, threads, parities, hazard kinds)."""

from __future__ import annotations

from enum import Enum


class Dtype(Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    # FP8 (sm_90a, research/fp8-forward.md): Q, K and V in 8 bits, O written in 16
    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def is_8bit(self) -> bool:
        return self in (Dtype.E4M3, Dtype.E5M2)

    @property
    def nbytes(self) -> int:
        return 1 if self.is_8bit else 2

    @property
    def cuda_type(self) -> str:
        # 8-bit data stays raw bytes in a kernel: every conversion is PTX (no cuda_fp8.h)
        return {Dtype.BF16: "__nv_bfloat16", Dtype.FP16: "half"}.get(self, "uint8_t")

    @property
    def ptx_type(self) -> str:
        """The type as wgmma and cvt spell it."""
        return {Dtype.BF16: "bf16", Dtype.FP16: "f16"}.get(self, self.value)


class Mask(Enum):
    NONE = "none"
    CAUSAL = "causal"


class Level(Enum):
    GMEM = "gmem"
    SMEM = "smem"
    RF = "rf"


class Instr(Enum):
    CP_ASYNC = "cp.async"
    LDMATRIX = "ldmatrix"
    LDMATRIX_TRANS = "ldmatrix.trans"
    ST_SHARED = "st.shared"
    ST_GLOBAL = "st.global"
    TMA = "tma"  # sm_90a: cp.async.bulk.tensor (gmem <-> smem)
    WGMMA = "wgmma"  # sm_90a: wgmma.mma_async reads its SMEM operand through a descriptor
    STMATRIX = "stmatrix"  # sm_90a: rf -> smem, 8x8 16-bit matrices
    # sm_90a, 8-bit V: smem -> smem by the producer warps, V into Vt (keys contiguous), as
    # FP8 wgmma reads its B operand K-major only
    TRANSPOSE = "transpose"
    # The backward block's (no forward target offers them as a hop, so a forward path that
    # names one is refused with the instruction its target uses instead):
    BULK = "bulk"  # cp.async.bulk gmem -> smem: a plain span, no tensor map (LSE, D rows)
    LD_SHARED = "ld.shared"  # smem -> rf, a thread's own values (LSE, D of its rows)
    REDUCE_ADD = "reduce.add"  # cp.reduce.async.bulk .add.f32 smem -> gmem (dQ's accumulator)
    RED_ADD = "red.add"  # red.global.add.v4.f32 rf -> gmem: each thread's fp32 values, no staging


# The threads of a warpgroup (4 warps; `smem[warpgroup]`, the warp specialisation's roles)
WARPGROUP_THREADS = 128


class Scope(Enum):
    """Who shares an SMEM tile, and which barrier orders accesses to it."""

    WARP = "warp"
    WARPGROUP = "warpgroup"  # sm_90a: the 4 warps of one warpgroup (its 64 rows)
    CTA = "cta"
    # sm_90a, `cluster 2`: both CTAs of a cluster hold the tile at the same offset; each
    # loads a share of it and multicasts the share into both (K and V)
    CLUSTER = "cluster"


class RegLoad(Enum):
    """How an input tile reaches registers from SMEM (the bracket on its ``rf`` level)."""

    TILE = "tile"  # the whole tile, by a step of its own, before the mma that reads it
    FRAG = "frag"  # one k16 slice at a time, inside the mma loop (fewer live registers)


class Role(Enum):
    Q = "Q"
    K = "K"
    V = "V"
    O = "O"


class GradRole(Enum):
    """The backward block's tensors beyond Q, K and V (which keep their ``Role``): kept
    apart from ``Role`` because the forward's code iterates over Role as its four tensors."""

    DO = "dO"  # the output's gradient, the backward's input
    LSE = "LSE"  # the forward's log-sum-exp per query row (fp32)
    D = "D"  # rowsum(dO * O) per query row (fp32; FlashAttention's dPsum), by the preprocess
    # exp(S - LSE): dV's operand, in registers (RS), or at head_dim 256 16-bit through SMEM
    P = "P"
    DS = "dS"  # P (dP - D): dK's and dQ's operand, 16-bit through SMEM
    DQ = "dQ"  # Q's gradient, reduce-added into an fp32 accumulator over the n-blocks
    DK = "dK"  # K's gradient, accumulated in registers over the m-blocks
    DV = "dV"  # V's gradient, likewise


class AliasPolicy(Enum):
    SCOPED = "scoped"  # share a region only between tiles of the same scope
    ANY = "any"  # share whenever live ranges are disjoint
    OFF = "off"  # every buffer gets its own region


class Rescale(Enum):
    """How a consumer keeps O, l and P referred to a row's max (sm_90a, `rescale`)."""

    EVERY = "every"  # rescaled to the new row max after each block (FlashAttention-2/3)
    LAZY = "lazy"  # the reference moves only when the max grows past 2^8 of it
    # LAZY without the row max after a tile's first block: P against the kept reference,
    # checked by the partial row sums (fadsl/sm90_guard.cuh)
    GUARDED = "guarded"


class Phase(Enum):
    # sm_90a runs prologue, mainloop and epilogue once per tile of a CTA's tile loop, its
    # setup once before the first tile and its teardown once after the last (sm_80 has a
    # tile per CTA and neither).
    SETUP = "setup"
    PROLOGUE = "prologue"
    MAINLOOP = "mainloop"
    EPILOGUE = "epilogue"
    TEARDOWN = "teardown"


class Partition(Enum):
    SLICE = "slice"
    WHOLE = "whole"


class Mode(Enum):
    READ = "read"
    WRITE = "write"


class HazardKind(Enum):
    RAW = "RAW"
    WAR = "WAR"
    WAW = "WAW"


class Threads(Enum):
    """Which threads run a step or a sync.

    sm_80: every warp. sm_90a (warp specialisation): warpgroup 0 is the producer, of
    which one elected thread issues every TMA load; warpgroups 1..W are consumers, each
    on its own 64 query rows (``wg`` = warpgroup - 1 in expressions).
    """

    ALL_WARPS = "all_warps"  # every thread of the CTA
    THREAD0 = "thread0"  # threadIdx.x == 0 (mbarrier init)
    PRODUCER = "producer"  # warpgroup 0 as a whole (setmaxnreg)
    PRODUCER_THREAD = "producer_thread"  # the elected thread of warp 0 of warpgroup 0
    CONSUMERS = "consumers"  # every consumer warpgroup, each on its own rows
    CONSUMER_FIRST = "consumer_first"  # consumer warpgroup 0 only
    CONSUMER_LAST = "consumer_last"  # consumer warpgroup W - 1 only
    CONSUMER_WARP_LANE0 = "consumer_warp_lane0"  # lane 0 of each consumer warp
    CONSUMER_ELECTED = "consumer_elected"  # one elected thread per consumer warpgroup
    # 8-bit kernels: the producer warpgroup's 4 warps transpose V, each into its own Vt rows
    PRODUCER_WARPS = "producer_warps"  # every thread of the producer warpgroup
    PRODUCER_WARP_LANE0 = "producer_warp_lane0"  # lane 0 of each producer warp


class Parity(Enum):
    """sm_90a: the parity an mbarrier wait passes on, from the ring position of its item.

    Item i of a ring of S slots sits in slot i % S, round i // S; phase = round & 1.
    """

    ZERO = "0"  # a one-shot barrier's first phase
    PHASE = "phase"  # consumers wait for the full barrier's phase of this round
    PHASE_FLIP = "phase^1"  # the producer waits for the empty barrier of the previous round
    # (a fresh barrier passes parity 1 at once: the first round waits for nothing)
    # A per-tile barrier (no ring item: Q's, O's) is a ring of Sync.slots slots whose items
    # are the CTA's non-empty tiles t = 0, 1, ... in the order it runs them: tile t uses
    # slot t % slots, phase (t // slots) & 1 (one slot: phase t & 1).
    TILE = "tile"  # wait for this tile's phase (Q loaded)
    TILE_FLIP = "tile^1"  # wait for the slot's previous tile's phase (Q no longer read, O stored)
