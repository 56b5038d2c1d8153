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

Ops (``fadsl.ir.ops.Op``) and sync kinds (``fadsl.ir.syncmodel``) are types; which ones
exist and what they mean is the target's business (``fadsl.targets``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import Loc
from .backward import Backward
from .expr import Modifiers
from .hop import Hop
from .ops import Op
from .syncmodel import AsyncKind, SyncKind
from .types import (
    Dtype,
    Mask,
    Level,
    Instr,
    Scope,
    RegLoad,
    Role,
    AliasPolicy,
    Phase,
    Partition,
    Mode,
    HazardKind,
    Threads,
    Parity,
)


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
class Window:
    """A sliding window (`mask window(LEFT, RIGHT)`, or `mask causal, window(LEFT)` with
    right 0): query i sees key j iff i + d - left <= j <= i + d + right, d = seqlen_k -
    seqlen_q (FlashAttention's window_size, the diagonal aligned bottom-right)."""

    left: int
    right: int

    def spelling(self, mask: Mask) -> str:
        """The `mask` line's value, as a spec writes it."""
        if mask is Mask.CAUSAL:
            return f"causal, window({self.left})"
        return f"window({self.left}, {self.right})"


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


class TargetConfig:
    """A target's settings beyond the common ones (``Config.ext``), as the target defines
    them (sm_90a: fadsl.targets.sm90.config.Sm90Config); the IR only prints them.

    The attributes below are what the runtime, the CLI and the tools ask of any target's
    settings, typed, with the values of a plain forward kernel; a target whose kernels do
    more sets them (as its own fields). ``Config.features`` gives them for any Config, a
    target without settings of its own included."""

    varlen: bool = False  # packed batches of sequences (a call takes cu_seqlens)
    kv_cache: int = -1  # K/V from a cache: -1 none, 0 contiguous, N pages of N rows
    pack_gqa: bool = False  # a K/V head's query heads share a tile's rows
    split_all: bool = False  # a kv-cache call may split each tile over its K/V blocks
    softcap: int = 0  # scores capped by N tanh(s / N); 0 none

    def text(self) -> str:
        """One line of the IR's text form (fadsl.ir.printer; the target reads it back)."""
        raise NotImplementedError


PLAIN_FORWARD = TargetConfig()  # the features of a target without settings of its own


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
    ext: TargetConfig | None = None  # the target's settings (sm_90a: Sm90Config)
    window: Window | None = None  # `mask window(...)`: a sliding window beside the mask
    # `input`, `score` and `keep` lines (issue 41), through the modifier passes; None: none
    modifiers: Modifiers | None = None
    # `output` (8-bit dtypes): the type O is written in; None: the inputs' own
    out_dtype: Dtype | None = None

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def features(self) -> TargetConfig:
        """What the runtime asks of the target's settings (varlen, the KV cache, splits,
        softcap), typed: ``ext``, or a plain forward kernel's where the target has none."""
        return self.ext if self.ext is not None else PLAIN_FORWARD

    @property
    def mask_text(self) -> str:
        """The `mask` line's value: 'none', 'causal', 'window(L, R)', 'causal, window(L)'."""
        return self.mask.value if self.window is None else self.window.spelling(self.mask)

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
    # The spec's `backward { ... }` block, validated by the target; None: forward-only.
    backward: Backward | None = None

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
