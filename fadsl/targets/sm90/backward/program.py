"""The vocabulary of the backward main kernel's sync plan: what emit/sm90/include/fadsl/sm90_bwd.cuh
(bwd_producer; bwd_consumer, in its default order or the overlapped one of `overlap on`;
meet_and_issue_dq, reduce_dq, ordered_reduce_add, release_dq_ticket) and the kernel body of emit/sm90/backward.cu.j2 do, call by call, for one CTA (one n-block of
keys), said as data.

Roles: the setup thread (thread 0: the mbarrier inits, before the roles split), the
producer (one elected thread of warp 0: TMA loads of K and V once, then Q, dO, LSE and D
into a ring of ``stages`` slots per m-block), and ``consumers`` warpgroups of 128 threads
(wgmma, the softmax gradient, dS^T through SMEM, dQ staged and reduce-added into global
memory by the warpgroup's thread 0, the "leader").

At head_dim 256 (``Params.split``: emit/sm90/include/fadsl/sm90_bwd_split.cuh,
bwd_producer_split and bwd_consumer_split) the two consumers split head_dim instead of the
keys: S and dP of each warpgroup's B_c / 2 keys, P and dS through SMEM, dV^T, dK^T and dQ^T
of its two head_dim panels; dO and D have a ring of their own (``do_stages`` slots, barriers
do_full / do_empty), and dQ is added from registers.

Each role's program is a tuple of ``Item`` in the header's order, each one call (a sync or
a step that accesses memory) tagged with the phase it runs in: once before the m-block
loop, once per m-block (``LoopPhase.LOOP``), or once after it. Loop items name their slot and
parity symbolically (``Index``, ``WaitParity``): ring slot i % stages and parity
(i / stages) & 1, dS^T's buffer i % 2.

Who builds what: schedule.py the steps (``build_schedule``: the work, no sync), syncs/ the syncs
(``insert_syncs``), protocol.py the plan (``protocol``: the two together), which verify.py
unrolls for a given m-block count and proves in the async model, and which
tests/test_verify_backward_header.py checks the header against, call for call.

Nothing here is a string that acts: kinds, buffers, barriers and registers are enums;
``name`` and ``why`` only label messages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from ....ir import WARPGROUP_THREADS
from ....ir.backward import Backward
from .plan_smem import SPLIT_DO_STAGES, split_head_dim

KEYS_PER_WARPGROUP = 64  # each consumer warpgroup owns 64 keys of the n-block
BLOCK_M = 64  # queries per m-block (B_r) by default; dS^T's rows hold 64-query panels
TRANSPOSED_BLOCK_M = 80  # B_r at head_dim 128 with dQ^T: dS's rows are queries (64-key panels)
SPLIT_BLOCK_NS = (80, 64)  # B_c at head_dim 256 (validate.py's)
ROW_BYTES = 128  # a 64-column panel row of 16-bit elements (the 128-byte swizzle)
PANEL_COLUMNS = 64
F32 = 4
BAR_DS = 1  # named barrier: every consumer thread, both halves of dS^T written (panels)
BAR_DQ = 2  # named barrier BAR_DQ + wg: one warpgroup (128 threads; dQ staging, dK / dV by TMA)
# `dq_writer on`: consumer wg and its writer warp (160 threads), the staging written (full)
# and read by the writer's bulk reduce-add (empty); ids 5-7 and 8-10 of the 16
BAR_DQ_FULL = 5
BAR_DQ_EMPTY = 8
WARP_THREADS = 32
WRITER_BAR_THREADS = WARPGROUP_THREADS + WARP_THREADS


class WarpRole(Enum):
    SETUP = "setup"
    PRODUCER = "producer"
    CONSUMER = "consumer"
    WRITER = "writer"  # `dq_writer on`: warp 1 + w of the producer warpgroup, per consumer w


class Who(Enum):
    """The threads that execute an item."""

    THREAD0 = "thread 0 of the CTA"
    CTA = "every thread of the CTA"
    ELECTED = "the producer's elected thread"
    WARPGROUP = "every thread of the consumer warpgroup"
    LEADER = "thread 0 of the consumer warpgroup"
    WRITER = "every lane of the dQ writer warp"
    WRITER_LANE0 = "lane 0 of the dQ writer warp"


class CodeSite(Enum):
    """Where the item's call is: the function of the header, or the kernel's body."""

    KERNEL = "the kernel body"
    LOAD_KV = "bwd_load_kv"  # both producers': K and V once
    LOAD_V_LATE = "bwd_load_v_late"  # `late_v on`: V in the first m-block
    PRODUCER = "bwd_producer"
    CONSUMER = "bwd_consumer"
    PRODUCER_SPLIT = "bwd_producer_split"  # head_dim 256
    CONSUMER_SPLIT = "bwd_consumer_split"
    MEET_AND_ISSUE_DQ = "meet_and_issue_dq"  # the overlapped consumer's helper
    # `dq_lag on` (sm90_bwd_lag.cuh): the consumer with dQ one m-block behind, its dQ helper
    CONSUMER_LAGGED = "bwd_consumer_lagged"
    ISSUE_DQ_LAGGED = "issue_dq_lagged"
    REDUCE_DQ = "reduce_dq"  # both consumers': dQ added into the accumulator
    ORDERED_REDUCE_ADD = "ordered_reduce_add"
    # deterministic: the ticket's release, deferred to the next m-block or the loop's end
    RELEASE_DQ_TICKET = "release_dq_ticket"
    DQ_WRITER = "bwd_dq_writer"  # `dq_writer on`: the writer warp's loop


class LoopPhase(Enum):
    BEFORE = "before the m-block loop"
    # `peel_dead on`: a warpgroup whose keys are all masked in the tile's first m-block runs
    # these in its place, before the loop, which then starts at m-block 1 (peel.py)
    PEELED = "the first m-block, peeled where the warpgroup's keys are all masked there"
    LOOP = "each m-block"
    AFTER = "after the m-block loop"


class Guard(Enum):
    ALWAYS = "always"
    HAS_WORK = "only when the CTA visits an m-block (m_count > 0)"
    # the release of the previous m-block's ticket: in m-block i > 0 for m-block i - 1, after
    # the loop (m_count > 0) for the last one
    OWED = "only when the leader owes the previous m-block's ticket"
    AFTER_FIRST = "from m-block 1 on (i > 0)"
    BEFORE_LAST = "except in the last m-block (i + 1 < m_count)"
    # `dq_lag on`: a step of the previous m-block (dQ and its adds), run in m-block i > 0 for
    # i - 1 and after the loop (m_count > 0) for the last one, as OWED
    LAGGED = "for the previous m-block: in m-block i > 0 for i - 1, after the loop for the last"
    # `dq_lag on` with `dq_writer on`: the lagged staging's wait for the writer's add of the
    # m-block before it (AFTER_FIRST of the m-block it acts for): in m-block i >= 2 for
    # i - 1, after the loop when m_count >= 2
    LAGGED_AFTER_FIRST = (
        "for the previous m-block but the first: in m-block i >= 2, after a loop of 2 or more"
    )
    # a dS^T buffer's reuse: from the CTA's running m-block index 2 on (run_i >= 2)
    REUSED = "from the running m-block 2 on (the buffer's previous use, i - 2)"
    # `late_v on`: the loop's first pass (the producer's m-block 0; a consumer warpgroup's
    # first m-block of the loop, 1 where `peel_dead on` peeled m-block 0)
    FIRST = "in the loop's first pass (i == i_first)"


class Kind(Enum):
    # syncs
    MBAR_INIT = "mbarrier.init"
    FENCE_MBAR_INIT = "fence.mbarrier_init"
    SYNCTHREADS = "__syncthreads"
    MBAR_WAIT = "mbarrier.try_wait.parity"
    MBAR_ARRIVE = "mbarrier.arrive"
    MBAR_ARRIVE_EXPECT_TX = "mbarrier.arrive.expect_tx"
    WGMMA_FENCE = "wgmma.fence"
    WGMMA_COMMIT = "wgmma.commit_group"
    WGMMA_WAIT = "wgmma.wait_group"
    FENCE_PROXY_ASYNC_SMEM = "fence.proxy.async.shared::cta"
    FENCE_PROXY_ASYNC_GLOBAL = "fence.proxy.async.global"
    NAMED_BAR_SYNC = "bar.sync"
    NAMED_BAR_ARRIVE = "bar.arrive"
    SYNCWARP = "__syncwarp"
    BULK_COMMIT = "cp.async.bulk.commit_group"
    BULK_WAIT_READ = "cp.async.bulk.wait_group.read"
    BULK_WAIT = "cp.async.bulk.wait_group"
    SEM_ACQUIRE = "ld.acquire.gpu spin"
    SEM_RELEASE = "st.release.gpu"
    # steps: calls that access memory or the registers a wgmma uses
    TMA_LOAD = "cp.async.bulk.tensor global -> shared"
    BULK_LOAD = "cp.async.bulk global -> shared"
    WGMMA = "wgmma.mma_async"
    PROBS = "P from S and LSE (ld.shared, or LSE ahead in registers and D's ld.shared)"
    GRAD_SCORES = "dS from P, dP and D (ld.shared, or D ahead in registers)"
    LOAD_ROWS = "LSE or D ld.shared into registers, ahead of their use"
    PACK = "16-bit pairs"
    ZERO = "accumulators zeroed"
    ST_SHARED = "st.shared"
    BULK_REDUCE_ADD = "cp.reduce.async.bulk .add.f32 shared -> global"
    RED_GLOBAL = "red.global.add.v4.f32 from registers"
    STORE_GLOBAL = "st.global from registers"
    TMA_STORE = "cp.async.bulk.tensor shared -> global"


# the kinds listed before the steps
SYNC_KINDS = frozenset(list(Kind)[: list(Kind).index(Kind.SEM_RELEASE) + 1])


class Mbar(Enum):
    KV_FULL = "kv_full"
    # `scheduler persistent`: every consumer thread's K and V reads of the tile retired
    KV_EMPTY = "kv_empty"
    Q_FULL = "q_full"
    Q_EMPTY = "q_empty"
    DO_FULL = "do_full"  # head_dim 256: the dO ring's own
    DO_EMPTY = "do_empty"
    # `dq_lag on`: dS^T handed from its writers to the lagged dQ per buffer (i % 2): every
    # consumer thread's part stored (full), every consumer thread's dQ read retired (empty)
    DS_FULL = "ds_full"
    DS_EMPTY = "ds_empty"
    # `late_v on`: V's bytes, loaded in the first m-block after its ring slot (K alone on
    # kv_full)
    V_FULL = "v_full"


class Named(Enum):
    """The named barriers: dS^T complete (all consumers), a warpgroup's own (dS^T rows by
    keys, dQ staging)."""

    DS = "kBarDS"
    DQ = "kBarDQ + wg"
    DQ_FULL = "kBarDqFull + wg"  # `dq_writer on`: consumer wg's staging written
    DQ_EMPTY = "kBarDqEmpty + wg"  # `dq_writer on`: its writer's add has read it


class StagedTile(Enum):
    """The SMEM tiles the main kernel's steps read and write (their bytes: plan_smem.py)."""

    K = "K"
    V = "V"
    Q = "Q"
    DO = "dO"
    LSE = "LSE"
    D = "D"
    P = "P"  # head_dim 256: rows = the B_c keys, as dS
    DS = "dS^T"
    DQ_STAGE = "dQ staging"


class Part(Enum):
    WHOLE = "whole"
    PANEL = "one 64-column panel"  # Operand.panel says which
    ROWS_OF_WG = "the warpgroup's 64 key rows"  # of K, V, dS^T; the warpgroup's staging
    # K's B operand of dQ split by head_dim panels; dS^T's A operand of dQ split by queries
    PANEL_OF_WG = "panel wg, every key"
    # head_dim 256: panel 2 wg + Operand.panel of K, Q or dO (the warpgroup's half of head_dim)
    WG_PANEL = "one of the warpgroup's head_dim panels"


class Index(Enum):
    NONE = "one copy"
    RING = "ring slot i % stages"
    RING_DO = "dO ring slot i % do_stages"  # head_dim 256
    ALTERNATE = "buffer i % 2"


class WaitParity(Enum):
    ZERO = "0"
    ONE = "1"
    RING = "(i / stages) & 1"
    RING_FLIP = "((i / stages) & 1) ^ 1"
    RING_DO = "(i / do_stages) & 1"
    RING_DO_FLIP = "((i / do_stages) & 1) ^ 1"
    # `scheduler persistent`: K and V's barriers, by the CTA's tiles with work so far (t)
    TILE = "t & 1"
    TILE_FLIP = "(t & 1) ^ 1"
    # `dq_lag on`: a dS^T buffer's barriers, by its uses so far (buffer i % 2: use i / 2),
    # the empty one's of the buffer's previous use (i - 2)
    ALTERNATE = "(i / 2) & 1"
    ALTERNATE_PREVIOUS = "(i / 2 - 1) & 1"


# a ring's index -> its barriers' parity (the consumers'; the producer's flipped)
RING_PARITY = {
    Index.RING: (WaitParity.RING, WaitParity.RING_FLIP),
    Index.RING_DO: (WaitParity.RING_DO, WaitParity.RING_DO_FLIP),
}


class Reg(Enum):
    S = "S^T"  # then P^T in place, fp32
    DP = "dP^T"  # then dS^T in place, fp32
    P16 = "P^T (16-bit)"
    DS16 = "dS^T (16-bit)"
    DK = "dK acc"
    DV = "dV acc"
    DQ = "dQ acc"
    LSE = "LSE (loaded ahead)"  # the lagged consumer's row values in registers (RowPairs)
    D = "D (loaded ahead)"
    ZEROS = "zeros (a peeled m-block's dS^T rows)"


@dataclass(frozen=True)
class Operand:
    buffer: StagedTile
    index: Index = Index.NONE
    part: Part = Part.WHOLE
    panel: int = 0  # with Part.PANEL


@dataclass(frozen=True)
class Item:
    """One call of a role's program. Fields that do not apply to the kind stay empty."""

    kind: Kind
    who: Who
    source: CodeSite
    phase: LoopPhase
    name: str = ""  # for messages: what the step computes
    why: str = ""  # for messages: what the sync orders
    guard: Guard = Guard.ALWAYS
    mbar: Mbar | None = None
    slot: Index = Index.NONE  # of the mbarrier (a ring's: one per slot)
    parity: WaitParity | None = None
    count: int = 0  # an init's arrival count
    tx: int = 0  # arrive.expect_tx's bytes
    pending: int = 0  # wait_group N
    named: Named | None = None
    threads: int = 0  # a named barrier's thread count
    reads: tuple[Operand, ...] = ()
    writes: tuple[Operand, ...] = ()
    reg_reads: tuple[Reg, ...] = ()
    reg_writes: tuple[Reg, ...] = ()

    @property
    def is_sync(self) -> bool:
        return self.kind in SYNC_KINDS


@dataclass(frozen=True)
class Params:
    consumers: int
    stages: int
    head_dim: int
    deterministic: bool = False
    overlap: bool = False  # bwd_consumer's overlapped order: dQ's group first, staged under dV, dK
    block_m: int = BLOCK_M  # B_r: 64, 64 per consumer (dQ split by queries), or 80 (dQ^T)
    early_dv: bool = False  # with overlap: dV issued once P^T is packed, before dS
    dq_red: bool = False  # dQ added from registers (red_add_dq), no staging
    # with overlap: dV issued after the dS^T store, before the meeting
    dv_before_meeting: bool = False
    # B_c: 64 per consumer (0 here: that default); at head_dim 256 80 or 64 for both
    block_n: int = 0
    # `dq_writer on`: warp 1 + w of the producer warpgroup reduce-adds consumer w's staging
    # (bwd_dq_writer), with the ticket's acquire and release in deterministic mode
    dq_writer: bool = False
    # `dS: rf -stmatrix-> smem[cta]` (store_ds_stmatrix): the same bytes as st.shared's, a
    # generic-proxy store too, so the same step and syncs (not where dS^T is transposed)
    ds_stmatrix: bool = False
    # `scheduler persistent`: the CTA runs the program once per tile, its m-block index i
    # running on over the tiles (ring slots, parities and dS^T buffers continue), K and V
    # freed per tile on kv_empty and their barriers' phase that of the tile's round t
    persistent: bool = False
    # `dq_lag on` (bwd_consumer_lagged, sm90_bwd_lag.cuh): with overlap and dq_red, dQ of
    # m-block i - 1 issued in m-block i after dV(i); no meeting: dS^T handed over through
    # ds_full / ds_empty mbarriers per dS^T buffer, the last dQ issued after the loop
    dq_lag: bool = False
    # `dq_first on` (with dq_lag): dQ(i - 1) issued before dV(i), its adds under dV and dK
    dq_first: bool = False
    # dK and dV `rf -stmatrix-> smem[warpgroup] -tma-> gmem` (with dq_lag, one tile per CTA):
    # each warpgroup's rows staged in the dead V, then K tile, stored by its leader's TMA
    dkv_tma: bool = False
    # `prefetch_kv on`: the producer's L2 prefetch of a later CTA's K and V with its last
    # loads; no item (a hint orders nothing), so the plan is the block's without it, and the
    # header reader walks that branch to show it makes none of the plan's calls
    prefetch_kv: bool = False
    # `dv_out_first on` (with dkv_tma): dV's staging in its V rows and its TMA store before
    # the last m-block's dQ and adds, dK's after them
    dv_out_first: bool = False
    # `peel_dead on` (with dq_lag, one tile per CTA, dS^T's rows keys): a warpgroup whose
    # keys are all masked in the first m-block runs the PEELED items in its place (peel.py);
    # the proof covers every warpgroup peeled or not
    peel_dead: bool = False
    # `late_v on` (with dq_lag, one tile per CTA): V loaded in the first m-block after the
    # ring slot's loads, on v_full (K alone on kv_full)
    late_v: bool = False

    @classmethod
    def of(cls, bwd: Backward, head_dim: int) -> Params:
        """The plan's parameters of a spec's backward block at the kernel's head_dim."""
        return cls(
            consumers=bwd.consumers,
            stages=bwd.stages,
            head_dim=head_dim,
            deterministic=bwd.deterministic,
            overlap=bwd.overlap,
            block_m=bwd.block_m,
            early_dv=bwd.early_dv,
            dq_red=bwd.dq_red,
            dv_before_meeting=bwd.dv_before_meeting,
            block_n=bwd.block_n,
            dq_writer=bwd.dq_writer,
            ds_stmatrix=bwd.ds_stmatrix,
            persistent=bwd.persistent,
            dq_lag=bwd.dq_lag,
            dq_first=bwd.dq_first,
            dkv_tma=bwd.dkv_tma,
            prefetch_kv=bwd.prefetch_kv,
            dv_out_first=bwd.dv_out_first,
            peel_dead=bwd.peel_dead,
            late_v=bwd.late_v,
        )

    def __post_init__(self) -> None:
        if not self.block_n:
            object.__setattr__(self, "block_n", KEYS_PER_WARPGROUP * self.consumers)
        assert 1 <= self.consumers <= 3, self
        assert self.stages >= 1, self
        assert self.head_dim in (64, 128, 256), self  # the header's static_asserts
        assert not self.early_dv or self.overlap, self
        assert not self.dv_before_meeting or (self.overlap and not self.early_dv), self
        assert not self.dq_red or not self.deterministic, self  # the ordered adds are staged
        # the writer reduce-adds a staging share of its own consumer alone
        assert not self.dq_writer or not (self.dq_red or self.split or self.dq_by_keys), self
        assert not self.ds_stmatrix or not (self.split or self.dq_transposed), self
        # validate.py's _persistent: no state but K, V and dK, dV carried per tile
        assert not self.persistent or not (self.deterministic or self.dq_writer or self.split)
        # knobs.py's _dq_lag: the overlapped order, dV first, meeting-free; dQ added from
        # registers or handed to the writer warps (then deterministic too)
        assert not self.dq_lag or (
            self.overlap
            and (self.dq_red or self.dq_writer)
            and not (self.early_dv or self.dv_before_meeting)
            and not (self.split or self.dq_by_keys)
        ), self
        assert not self.dq_first or self.dq_lag, self
        # knobs.py's _dkv_tma: the lagged consumer's epilogue, one tile per CTA
        assert not self.dkv_tma or (self.dq_lag and not self.persistent), self
        assert not (self.prefetch_kv and self.persistent), self  # knobs.py: one tile per CTA
        assert not self.dv_out_first or self.dkv_tma, self  # knobs.py: it moves dV's TMA store
        # knobs.py's _peel_dead: the lagged consumer's first m-block, one tile per CTA
        assert not self.peel_dead or (
            self.dq_lag and not self.persistent and self.block_m % BLOCK_M == 0
        ), self
        assert not self.late_v or (self.dq_lag and not self.persistent), self  # knobs.py
        if self.split:  # sm90_bwd_split.cuh's one order, dQ from registers
            assert self.consumers == 2 and self.block_m == BLOCK_M, self
            # (overlap off: so neither early_dv nor dv_before_meeting, which need it)
            assert self.block_n in SPLIT_BLOCK_NS and self.dq_red and not self.overlap, self
            return
        assert self.block_n == KEYS_PER_WARPGROUP * self.consumers, self
        wide = self.block_m == 2 * BLOCK_M and self.consumers == 2 and self.head_dim == 64
        transposed = self.block_m == TRANSPOSED_BLOCK_M and (self.consumers, self.head_dim) == (
            2,
            128,
        )
        assert self.block_m == BLOCK_M or wide or transposed, self

    @property
    def split(self) -> bool:
        """The consumers split head_dim, not the keys (head_dim 256: sm90_bwd_split.cuh)."""
        return split_head_dim(self.head_dim)

    @property
    def do_stages(self) -> int:
        """The dO ring's slots: a ring of its own at head_dim 256, else Q's ring."""
        return SPLIT_DO_STAGES if self.split else self.stages

    @property
    def keys_per_warpgroup(self) -> int:
        """The keys of S^T and dP^T (S and dP at head_dim 256) of one consumer warpgroup."""
        return self.block_n // self.consumers

    @property
    def panels(self) -> int:
        return self.head_dim // PANEL_COLUMNS

    @property
    def dq_by_queries(self) -> bool:
        """dQ = dS K split by queries (each warpgroup: its 64 queries, every column, over
        all B_c keys) where B_r has 64 per warpgroup (kDqByQueries)."""
        return self.block_m == 2 * BLOCK_M

    @property
    def dq_transposed(self) -> bool:
        """dQ^T = K^T dS^T (each warpgroup: its 64-column panel of head_dim for every query,
        over all B_c keys) where B_r is not a multiple of wgmma's M (kDqTransposed); dS then
        lies with the queries as rows, one 64-key panel per warpgroup."""
        return self.block_m % BLOCK_M != 0

    @property
    def dq_by_keys(self) -> bool:
        """dQ = dS K split by keys (each warpgroup: every column over its own 64 keys) where
        it is not split by queries and a warpgroup's share of head_dim is not whole
        64-column panels (kDqByKeys)."""
        by_panels = (self.head_dim // self.consumers) % PANEL_COLUMNS == 0
        return not self.dq_by_queries and not self.dq_transposed and not by_panels

    @property
    def consumer_threads(self) -> int:
        return WARPGROUP_THREADS * self.consumers

    @property
    def q_bytes(self) -> int:  # one ring slot of Q or of dO
        return self.block_m * self.head_dim * 2

    @property
    def kv_bytes(self) -> int:
        return self.block_n * self.head_dim * 2

    @property
    def ds_bytes(self) -> int:  # one dS^T buffer: B_c key rows of B_r queries
        return self.block_n * self.block_m * 2

    @property
    def p_bytes(self) -> int:  # one P buffer (head_dim 256; none otherwise): as dS's
        return self.ds_bytes if self.split else 0

    @property
    def row_floats_bytes(self) -> int:  # one slot of LSE or of D
        return self.block_m * F32

    @property
    def dq_floats(self) -> int:  # one warpgroup's staged share of an m-block: 64 queries
        if self.dq_transposed or self.split:  # 64 columns of every query
            return PANEL_COLUMNS * self.block_m
        all_cols = self.dq_by_keys or self.dq_by_queries
        cols = self.head_dim if all_cols else self.head_dim // self.consumers
        return BLOCK_M * cols

    def describe(self) -> str:
        if self.split:
            return (
                f"{self.consumers} consumer(s), {self.stages} stage(s) (dO {self.do_stages}), "
                f"head_dim {self.head_dim} split, B_r {self.block_m}, B_c {self.block_n}, "
                "dQ^T by panels, dQ by red.add"
            )
        if self.dq_by_queries:
            split = "dQ by queries"
        elif self.dq_transposed:
            split = "dQ transposed"
        else:
            split = "dQ by keys" if self.dq_by_keys else "dQ by head_dim panels"
        det = ", deterministic" if self.deterministic else ""
        det += ", overlap" if self.overlap else ""
        det += ", early dV" if self.early_dv else ""
        det += ", dV before the meeting" if self.dv_before_meeting else ""
        det += ", dQ one m-block behind" if self.dq_lag else ""
        det += " (before dV)" if self.dq_first else ""
        det += ", dQ by red.add" if self.dq_red else ""
        det += ", dQ writer" if self.dq_writer else ""
        det += ", dS by stmatrix" if self.ds_stmatrix else ""
        det += ", persistent" if self.persistent else ""
        det += ", dK and dV by TMA" if self.dkv_tma else ""
        det += " (dV before the last dQ)" if self.dv_out_first else ""
        det += ", a dead first m-block peeled" if self.peel_dead else ""
        det += ", V after the first m-block's loads" if self.late_v else ""
        det += ", a later CTA's K and V prefetched" if self.prefetch_kv else ""
        return (
            f"{self.consumers} consumer(s), {self.stages} stage(s), head_dim {self.head_dim}, "
            f"B_r {self.block_m} ({split}){det}"
        )


def bar_id(named: Named, wg: int) -> int:
    bases = {Named.DQ: BAR_DQ, Named.DQ_FULL: BAR_DQ_FULL, Named.DQ_EMPTY: BAR_DQ_EMPTY}
    return BAR_DS if named is Named.DS else bases[named] + wg


@dataclass(frozen=True)
class Layout:
    """Each buffer's first byte and the bytes of one slot: the header's default plan
    (BwdConfig's kOff*), every buffer in bytes of its own."""

    offsets: tuple[tuple[StagedTile, int, int], ...]  # (buffer, offset, bytes of one slot)

    def base(self, buffer: StagedTile) -> tuple[int, int]:
        for name, offset, size in self.offsets:
            if name is buffer:
                return offset, size
        raise KeyError(buffer)


def default_layout(p: Params) -> Layout:
    sizes = (
        (StagedTile.K, p.kv_bytes, 1),
        (StagedTile.V, p.kv_bytes, 1),
        (StagedTile.Q, p.q_bytes, p.stages),
        (StagedTile.DO, p.q_bytes, p.do_stages),
        (StagedTile.P, p.p_bytes, 2),
        (StagedTile.DS, p.ds_bytes, 2),
        (StagedTile.DQ_STAGE, 0 if p.dq_red else p.dq_floats * F32, p.consumers),
        (StagedTile.LSE, p.row_floats_bytes, p.stages),
        (StagedTile.D, p.row_floats_bytes, p.do_stages),
    )
    offsets, at = [], 0
    for buffer, size, copies in sizes:
        offsets.append((buffer, at, size))
        at += size * copies
    return Layout(tuple(offsets))


@dataclass(frozen=True)
class Protocol:
    params: Params
    setup: tuple[Item, ...]
    producer: tuple[Item, ...]
    consumer: tuple[Item, ...]
    layout: Layout | None = None  # None: the header's default plan (default_layout)
    writer: tuple[Item, ...] = ()  # `dq_writer on`: one writer warp's program (each's)

    def buffers(self) -> Layout:
        return self.layout or default_layout(self.params)

    def role(self, role: WarpRole) -> tuple[Item, ...]:
        return getattr(self, _ROLE_FIELDS[role])

    def with_role(self, role: WarpRole, items: tuple[Item, ...]) -> Protocol:
        key = _ROLE_FIELDS[role]
        return replace(self, **{key: tuple(items)})


_ROLE_FIELDS = {
    WarpRole.SETUP: "setup",
    WarpRole.PRODUCER: "producer",
    WarpRole.CONSUMER: "consumer",
    WarpRole.WRITER: "writer",
}


def unrolled(
    items: tuple[Item, ...], m_count: int, m0: int = 0, peeled: bool = False
) -> list[tuple[Item, int | None]]:
    """(item, m-block) in the order one thread runs them: the items before the loop, the
    loop's m_count times, those after; HAS_WORK items only when m_count > 0. ``peeled``
    (`peel_dead on`, a warpgroup whose keys the first m-block masks, m_count > 0): the
    PEELED items as m-block 0 in place of the loop's first pass, the loop from m-block 1
    (its items that act for the previous m-block acting for 0 there). An OWED item
    (the deferred release of a ticket) or a LAGGED one (`dq_lag on`'s dQ) acts for the
    previous m-block: in m-block i for i - 1 (none in m-block 0), after the loop for the
    last one (none when m_count = 0); a LAGGED_AFTER_FIRST one likewise, but never for
    m-block 0 (in m-block i >= 2, after the loop when m_count >= 2). A REUSED item runs
    from the running index m0 + i = 2 on (m0: the m-blocks of the CTA's earlier tiles); a
    FIRST one in the loop's first pass only (m-block 1 after a peeled m-block 0)."""
    out = []
    behind = (Guard.OWED, Guard.LAGGED, Guard.LAGGED_AFTER_FIRST)
    live = [x for x in items if x.guard is Guard.ALWAYS or m_count > 0]
    live = [x for x in live if x.guard is not Guard.LAGGED_AFTER_FIRST or m_count > 1]
    out += [(x, None) for x in live if x.phase is LoopPhase.BEFORE]
    peel = peeled and m_count > 0
    if peel:
        out += [(x, 0) for x in live if x.phase is LoopPhase.PEELED and _runs(x, 0, m0)]
    skipped = {Guard.AFTER_FIRST: 0, Guard.BEFORE_LAST: m_count - 1} | dict.fromkeys(behind, 0)
    for i in range(int(peel), m_count):
        for x in live:
            if x.phase is not LoopPhase.LOOP or skipped.get(x.guard) == i:
                continue
            if x.guard is Guard.LAGGED_AFTER_FIRST and i < 2:
                continue
            if not _runs(x, i, m0) or (x.guard is Guard.FIRST and i != int(peel)):
                continue
            out.append((x, i - 1 if x.guard in behind else i))
    after = [x for x in live if x.phase is LoopPhase.AFTER]
    out += [(x, m_count - 1 if x.guard in behind else None) for x in after]
    return out


def _runs(item: Item, i: int, m0: int) -> bool:
    """A REUSED item's test: from the running m-block m0 + i = 2 on."""
    return item.guard is not Guard.REUSED or m0 + i >= 2
