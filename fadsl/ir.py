"""The IR: a handful of frozen dataclasses, each carrying its source location.

A ``Kernel`` is the validated configuration, the tensors' paths, the SMEM
buffers and a schedule (prologue, a mainloop over KV blocks, epilogue) of
``Step``s and ``Sync``s. Passes return new kernels via ``dataclasses.replace``.

Thread model: a CTA of ``warps`` warps. Each step says which threads run it
(``Step.who``; on sm_80 always ``Threads.ALL_WARPS``). Every SMEM access of a step
is made by those warps at once, each over either its own row slice of the buffer
(``Partition.SLICE``: warp w touches rows [w*rows/warps, (w+1)*rows/warps)) or the
whole buffer (``Partition.WHOLE``). Lanes of one warp may touch each other's bytes
(cp.async, ldmatrix and 16-byte stores all move data between lanes), so even a
one-warp hazard needs a warp barrier.

Ops (``fadsl.ops.Op``) and sync kinds (``fadsl.syncmodel``) are types; which ones
exist and what they mean is the target's business (``fadsl.targets``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from .errors import Loc

if TYPE_CHECKING:
    from .ops import Op
    from .syncmodel import AsyncKind, SyncKind


class Dtype(Enum):
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def nbytes(self) -> int:
        return 2

    @property
    def cuda_type(self) -> str:
        return {Dtype.BF16: "__nv_bfloat16", Dtype.FP16: "half"}[self]


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


@dataclass(frozen=True)
class Swizzle:
    """The seeds' swizzle<B, M, S>: element address a -> a ^ ((a >> S) & ((2^B - 1) << M))."""

    bits: int
    base: int
    shift: int
    loc: Loc

    def __str__(self) -> str:
        return f"xor({self.bits}, {self.base}, {self.shift})"


@dataclass(frozen=True)
class Hop:
    src: Level
    dst: Level
    instr: Instr
    loc: Loc


@dataclass(frozen=True)
class Tensor:
    role: Role
    hops: tuple[Hop, ...]
    smem_scope: Scope
    loc: Loc
    reg_load: RegLoad = RegLoad.TILE  # inputs only: O is accumulated in registers

    def path_text(self) -> str:
        parts = [self.hops[0].src.value]
        for hop in self.hops:
            level = hop.dst.value
            if hop.dst is Level.SMEM:
                level += f"[{self.smem_scope.value}]"
            elif hop.dst is Level.RF and self.reg_load is RegLoad.FRAG:
                level += f"[{self.reg_load.value}]"
            parts.append(f"-{hop.instr.value}-> {level}")
        return " ".join(parts)


@dataclass(frozen=True)
class Hopper:
    """sm_90a's warp specialisation and pipeline (None on sm_80)."""

    consumers: int  # consumer warpgroups, 64 query rows each
    stages: int  # K/V ring slots
    producer_regs: int  # setmaxnreg.dec of the producer warpgroup
    consumer_regs: int  # setmaxnreg.inc of each consumer warpgroup
    swizzle_bytes: int  # TMA/wgmma swizzle span: 128
    pingpong: bool  # named-barrier turns between consumer warpgroups
    overlap: bool  # S(j+1) in flight during softmax(j)
    # The CTA runs a sequence of tiles either way; persistent: about one CTA per SM, each
    # looping over many tiles; off ("scheduler grid"): one CTA per tile.
    persistent: bool = True
    # Lazy ("rescale lazy"): a row keeps the max its P is scaled by until the max grows past
    # 2^8 of it, so O's rescale (a multiply per O register) is skipped in most blocks;
    # every ("rescale every"): rescaled after each block, as FlashAttention-2/3; guarded:
    # lazy, and no row max after the first block while the row sums show none is needed.
    rescale_mode: Rescale = Rescale.LAZY
    # Q slots: tile t's Q in slot t % q_slots; with 2 the producer loads the next tile's Q
    # while this tile's runs (its barriers a ring of tiles, Parity.TILE).
    q_slots: int = 1
    # `tail split_kv`: the launch's last, part-full round of tiles is split over the K/V
    # blocks into pieces for the idle CTAs; each piece's warpgroup writes its partial O, m
    # and l to a workspace, and the last to finish a tile combines them and stores it.
    split_kv: bool = False
    # `cluster 2`: pairs of CTAs on q-tiles of one (batch, head), each loading half of
    # every K/V block and multicasting it into both (TMA .multicast::cluster)
    cluster: int = 1
    # The `cluster N` kernel this cluster-free variant runs for where a launch does not use
    # its clusters (fadsl/targets/sm90/alone.py); None for a spec's own kernel.
    alone_of: str | None = None

    @property
    def scheduler(self) -> str:
        """The `scheduler` setting as a spec spells it."""
        return "persistent" if self.persistent else "grid"

    @property
    def rescale(self) -> str:
        """The `rescale` setting as a spec spells it."""
        return self.rescale_mode.value

    @property
    def lazy_rescale(self) -> bool:
        """O is multiplied only in blocks where some row's reference moved."""
        return self.rescale_mode is not Rescale.EVERY

    @property
    def guarded(self) -> bool:
        """Blocks after a tile's first skip the row max (`rescale guarded`)."""
        return self.rescale_mode is Rescale.GUARDED

    def text(self) -> str:
        on = {True: "on", False: "off"}
        return (
            f"sm90 consumers={self.consumers} stages={self.stages} "
            f"regs={self.producer_regs}/{self.consumer_regs} swizzle={self.swizzle_bytes}B "
            f"pingpong={on[self.pingpong]} overlap={on[self.overlap]} "
            f"scheduler={self.scheduler} rescale={self.rescale}"
            + (f" q_slots={self.q_slots}" if self.q_slots > 1 else "")
            + (" tail=split_kv" if self.split_kv else "")
            + (f" cluster={self.cluster}" if self.cluster > 1 else "")
            + (f" alone_of={self.alone_of}" if self.alone_of else "")
        )


@dataclass(frozen=True)
class Config:
    name: str
    target: str  # the spec's spelling, a key of fadsl.targets
    dtypes: tuple[Dtype, ...]
    head_dim: int
    block_r: int
    block_c: int
    warps: int
    mask: Mask
    swizzle: Swizzle | None
    smem_alias: AliasPolicy
    loc: Loc
    key_locs: tuple[tuple[str, Loc], ...] = ()
    allow_spills: bool = False  # `spills allow`: an experiment that may spill registers
    hopper: Hopper | None = None

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def loc_of(self, key: str) -> Loc:
        return dict(self.key_locs).get(key, self.loc)


@dataclass(frozen=True)
class Buffer:
    """One SMEM tile. ``offset`` and ``region`` are filled in by plan_smem."""

    name: str
    rows: int
    cols: int
    elem_bytes: int
    scope: Scope
    swizzle: Swizzle | None
    loc: Loc
    offset: int | None = None
    region: int | None = None
    slots: int = 1  # sm_90a: a ring of this many tiles (the K/V stages)

    @property
    def tile_bytes(self) -> int:
        return self.rows * self.cols * self.elem_bytes

    @property
    def nbytes(self) -> int:
        return self.tile_bytes * self.slots


@dataclass(frozen=True)
class Access:
    buffer: str
    mode: Mode
    partition: Partition


@dataclass(frozen=True)
class Step:
    """One schedule step. A step with an ``async_kind`` issues writes of that kind that
    complete later (sm_80: cp.async, one commit group per step)."""

    op: Op
    phase: Phase
    accesses: tuple[Access, ...]
    async_kind: AsyncKind | None
    title: str
    loc: Loc
    who: Threads = Threads.ALL_WARPS
    # sm_90a: the K/V block a ring step works on is item ``it + lag`` of its ring, where
    # the prologue runs at it = 0, the mainloop at it = 1 .. n_blocks - 1 and the
    # epilogue at it = n_blocks (so K(it) has lag 0 and V(it - 1) lag -1). None: no ring.
    lag: int | None = None

    @property
    def is_async(self) -> bool:
        return self.async_kind is not None


@dataclass(frozen=True)
class Hazard:
    """Two accesses to overlapping SMEM bytes, at least one a write, that a sync must order."""

    kind: HazardKind
    earlier: Op  # op of the earlier step
    later: Op  # op of the later step
    earlier_buffer: str
    later_buffer: str
    scope: Scope  # WARP: only same-warp pairs conflict; CTA: warps cross
    back_edge: bool  # the earlier access is in the previous mainloop iteration
    async_write: bool  # the earlier access is an async write that must be waited for
    # sm_90a: the roles on each side ("producer -> consumers"); '' when one role
    across: str = ""

    def describe(self) -> str:
        bufs = self.earlier_buffer
        if self.later_buffer != self.earlier_buffer:
            bufs = f"{self.earlier_buffer}/{self.later_buffer} (aliased)"
        edge = " across the loop back edge" if self.back_edge else ""
        if self.across:
            who = self.across
        elif self.scope is Scope.WARPGROUP:
            who = "within each warpgroup"
        else:
            who = "warps cross" if self.scope is Scope.CTA else "within each warp"
        return (
            f"{self.kind.value} on {bufs}: {self.earlier.spelling} -> {self.later.spelling}"
            f"{edge} ({who})"
        )


@dataclass(frozen=True)
class Sync:
    kind: SyncKind
    phase: Phase
    serves: tuple[Hazard, ...]
    loc: Loc
    groups: int = 0  # for a counted wait: the groups that may stay in flight
    # sm_90a (defaults elsewhere): who runs it, and what it operates on
    who: Threads = Threads.ALL_WARPS
    barrier: str = ""  # an mbarrier ("k_full") or a named barrier ("turn", "ring_dead")
    lag: int | None = None  # a ring barrier: the slot of item it + lag (see Step.lag)
    slots: int = 1  # a per-tile barrier: its ring of tiles (Parity.TILE); init: how many
    parity: Parity | None = None  # an mbarrier wait
    count: int = 0  # init: arrivals per phase; named barrier: threads
    tx: int = 0  # arrive.expect_tx: transaction bytes
    bar_id: int = -1  # a named barrier's id (its first id when per warpgroup)
    peer: int | None = None  # per warpgroup: id = bar_id + (wg + peer) % W; None: bar_id
    note: str = ""  # why, when the sync orders no SMEM hazard (ping-pong turns)

    def text(self) -> str:
        head = f"{self.kind.name} {self.groups}" if self.kind.counted else self.kind.name
        args = []
        if self.barrier:
            ring = "" if self.lag is None else f"[it{self.lag:+d}]" if self.lag else "[it]"
            ring = f"[t%{self.slots}]" if self.slots > 1 else ring
            args.append(f"bar={self.barrier}{ring}")
        if self.bar_id >= 0:
            args.append(f"id={self.bar_id_text()}")
        if self.parity is not None:
            args.append(f"parity={self.parity.value}")
        if self.count:
            args.append(f"count={self.count}")
        if self.tx:
            args.append(f"tx={self.tx}")
        if self.who is not Threads.ALL_WARPS:
            args.append(f"by {self.who.value}")
        return " ".join([head, *args])

    def bar_id_text(self) -> str:
        if self.peer is None:
            return str(self.bar_id)
        return f"{self.bar_id}+wg" if self.peer == 0 else f"{self.bar_id}+(wg+{self.peer})%W"


Item = Step | Sync


@dataclass(frozen=True)
class Region:
    """A span of SMEM that buffers with disjoint live ranges share."""

    index: int
    offset: int
    nbytes: int
    members: tuple[str, ...]
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class Kernel:
    config: Config
    tensors: tuple[Tensor, ...]
    buffers: tuple[Buffer, ...]
    prologue: tuple[Item, ...]
    mainloop: tuple[Item, ...]
    epilogue: tuple[Item, ...]
    regions: tuple[Region, ...] = ()
    smem_bytes: int | None = None
    # The mainloop may run zero times (a causal Q block above every key): then the
    # epilogue follows the prologue directly, and the syncs must order that too.
    loop_may_be_empty: bool = False
    setup: tuple[Item, ...] = ()  # sm_90a: once per CTA, before its first tile
    teardown: tuple[Item, ...] = ()  # sm_90a: once per CTA, after its last tile

    def buffer(self, name: str) -> Buffer:
        for buf in self.buffers:
            if buf.name == name:
                return buf
        raise KeyError(name)

    def tensor(self, role: Role) -> Tensor:
        for tensor in self.tensors:
            if tensor.role is role:
                return tensor
        raise KeyError(role)

    def phases(self) -> tuple[tuple[Phase, tuple[Item, ...]], ...]:
        """The phases in program order; setup and teardown only when they hold items."""
        return tuple(
            (phase, items)
            for phase, items in (
                (Phase.SETUP, self.setup),
                (Phase.PROLOGUE, self.prologue),
                (Phase.MAINLOOP, self.mainloop),
                (Phase.EPILOGUE, self.epilogue),
                (Phase.TEARDOWN, self.teardown),
            )
            if items or phase in (Phase.PROLOGUE, Phase.MAINLOOP, Phase.EPILOGUE)
        )

    def steps(self) -> tuple[Step, ...]:
        return tuple(i for _, items in self.phases() for i in items if isinstance(i, Step))

    def syncs(self) -> tuple[Sync, ...]:
        return tuple(i for _, items in self.phases() for i in items if isinstance(i, Sync))
