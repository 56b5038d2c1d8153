"""verify for sm_90a: an independent proof that the sync plan of a warp-specialised kernel
orders every SMEM and register hazard, and never hangs, over a CTA's whole tile loop.

It reads the kernel as the generated code runs it, and shares no decision with
insert_syncs. A CTA runs a sequence of tiles (persistent: many per CTA; grid: one, the same
loop). For each tile sequence of ``tile_sequences`` each role's items are unrolled, tile after
tile (prologue at it = 0, the mainloop at it = 1 .. n - 1, the epilogue at it = n), into the
agents of ``fadsl.passes.asyncmodel.model``: the producer's elected thread, and one agent per
consumer warpgroup. ``fadsl.passes.asyncmodel.prove`` then proves the plan for that program (mbarrier phases
and parities, transaction bytes, named-barrier generations, wgmma and bulk groups, proxy
fences). Two rules live here because they concern instructions the program model leaves
out: every mbarrier is initialised (then ``fence.mbarrier_init`` and a CTA barrier, or a
cluster barrier with ``cluster 2``) before use, and a wgmma reads no register that ordinary
code wrote since the warpgroup's last ``wgmma.fence``. With ``cluster 2`` the program holds
the agents of both CTAs of a cluster (cluster_agents).

What the generated code does, as this module reads it:
- the setup phase (mbarrier inits, their fence, ``__syncthreads``, setmaxnreg, the first
  ping-pong turn's opening) runs once per CTA, before the tiles, and the teardown phase
  once after them; every other item runs once per tile (the consumers' init and the whole
  tail included);
- a tile of no K/V block touches no SMEM and no barrier in any role, so the non-empty tiles
  alone make the program; they are numbered t = 0, 1, ... in the order the CTA runs them;
- each role counts a tile done after its epilogue, the consumers before their tail (from
  normalise on): an item of the tail sees the next tile's count;
- the ring items go on across tiles: a ring item or sync at iteration it of tile t works on
  item base_t + it + lag, base_t being the K/V blocks of the earlier tiles; item i sits in
  slot i % stages and ``ir.Parity`` reads PHASE as (i // stages) & 1, PHASE_FLIP as its
  complement; a barrier of no ring is a ring of ``Sync.slots`` slots (usually one) whose
  items are the tiles: tile t uses slot t % slots, TILE is (t // slots) & 1, TILE_FLIP its
  complement, and ZERO is 0 in every tile; a tile-loaded buffer of several slots (Q's) is
  read and written in slot t % slots;
- a TMA load of tensor X completes on the mbarrier ``x_full`` of its ring item;
- per-warpgroup named barriers have id ``bar_id + (wg + peer) % W``;
- ``consumer_warp_lane0`` arrivals are one per consumer warp (4 per warpgroup),
  ``consumer_elected`` and ``producer_thread`` ones a single arrival;
- ``cluster 2`` (cluster_agents reads it): both CTAs of a cluster run the same tile
  sequence, each with its own mbarriers (the inits' counts are per CTA); a TMA load of a
  ``smem[cluster]`` buffer (K, V) issues CTA r's 64-column panels p (p % 2 == r), each a
  multicast into the same slot of both CTAs completing on both CTAs' ``x_full``; an
  ``MBAR_ARRIVE_PEER`` is its ``MBAR_ARRIVE`` on the peer's (rank ^ 1) barrier; the cluster
  barrier syncs (every thread) open each role's program in the setup, after the inits'
  fence (in place of ``__syncthreads``), and close it in the teardown.

The tile sequences (``tile_sequences``; S = stages), and why they cover a CTA's tile loop.
What the plan does at tile t depends on the tile's shape (no mainloop, one iteration, more;
n = 1 .. S + 2 also wraps its ring once inside the tile), on where its ring items start
(base_t mod 2S: the slot and the phase parity), on t & 1 (the per-tile barriers' parity),
and on the tiles before it that its roles can still overlap with:
- every single tile of 1 .. S + 2 blocks: each shape alone (the one-tile proof of old);
- every pair: a first tile of 1 .. max(S + 2, 2S) blocks, so the second starts at every
  slot and phase of the ring, times every shape of the second: each boundary between two
  tiles, the second tile's per-tile waits on a barrier that is no longer fresh (parity
  TILE / TILE_FLIP against ZERO, Q and O freed for the next tile, the producer running into
  the next tile while the consumers finish this one, the last ring slot released);
- triples whose middle tile is short (1 .. max(1, S - 1) blocks) and whose last has 1 .. S:
  a ring slot of the third tile last held a block of the first (the ring reaches across
  two boundaries), the producer two tiles ahead of a consumer if any barrier lets it be, and
  the per-tile barriers' third phase (t = 2, the same parity as t = 0 but no longer fresh).
- with Q in a ring of q > 1 tiles (``q_slots``): runs of 2q + 1 tiles, a first of 1 .. 2S
  blocks then tiles of one block, and a first of one block then every mix of 1 and 2: each
  Q slot in both phases and no longer fresh (tile 2q is slot 0's third use), at every offset
  of the K/V ring, the producer up to q tiles ahead of the consumers.
- with ``tail split_kv``: a pair of tiles of each order (1 and 2 blocks) with every set of
  warpgroups skipping each tile's tail (from normalise on), and a triple of each length
  with every set skipping the middle one's (``skip_patterns``), as a split piece that is
  not its tile's last does; the pieces' hand-over is global memory and a named barrier of
  their own (the header's combine_split), outside this SMEM plan.
A longer tile, or a later one, repeats one of these states: a ring item's barrier state
depends only on its slot and phase, every wgmma group is retired and every named barrier
generation completed by the end of each tile, at most one bulk group per warpgroup (the
tile's O store, waited for in the next tile or at exit) carries over a boundary, which the
pairs cover, and the per-tile barriers cycle with period 2 (2q for Q's ring of tiles).
"""

from __future__ import annotations

from dataclasses import replace
from itertools import product

from ...ir import Buffer, Kernel, Mode, Partition, Phase, Parity, Step, Sync, Threads
from ...ir.ops import Op
from ...passes.asyncmodel.model import (
    Agent,
    Arrive,
    BarArrive,
    BarSync,
    BulkCommit,
    BulkWait,
    Event,
    FenceProxyAsync,
    GenericAccess,
    Program,
    Span,
    TmaLoad,
    TmaStore,
    Wait,
    Wgmma,
    WgmmaCommit,
    WgmmaWait,
)
from ...passes.asyncmodel.prove import AsyncVerifyError, check
from . import caps, cluster_agents, transpose_agents
from .wgmma_fence_rule import WGMMA_FENCE as _WGMMA_FENCE
from .wgmma_fence_rule import WgmmaFence as _WgmmaFence
from .wgmma_fence_rule import wgmma_fence_problems as _wgmma_fence_problems

WARPS_PER_WARPGROUP = 4
# per tile of a sequence: the consumer warpgroups that skip its tail (tail split_kv)
Skips = tuple[frozenset[int], ...]
ROWS_PER_WARPGROUP = 64

# The registers each op reads and writes (S: scores, P: 16-bit probabilities, O: output).
_REG_READS: dict[Op, tuple[str, ...]] = {
    Op.SOFTMAX: ("S",),
    Op.CONVERT_P: ("S",),
    Op.RESCALE_O: ("O",),
    Op.PV: ("P", "O"),
    Op.NORMALIZE: ("O",),
    Op.O_R2S: ("O",),
}
_REG_WRITES: dict[Op, tuple[str, ...]] = {
    Op.INIT: ("O",),
    Op.QK: ("S",),
    Op.SOFTMAX: ("S",),
    Op.CONVERT_P: ("P",),
    Op.RESCALE_O: ("O",),
    Op.PV: ("O",),
    Op.NORMALIZE: ("O",),
}
_REG_INDEX = {"S": 0, "P": 1, "O": 2}


def block_counts(kernel: Kernel) -> range:
    """The K/V block counts of each tile the plan is proven for: 1 .. stages + 2 (an empty
    tile runs nothing the proof could see)."""
    hopper = kernel.config.ext
    assert hopper is not None, "the sm_90a verify needs an sm_90a kernel"
    return range(1, hopper.stages + 3)


def tile_sequences(kernel: Kernel) -> tuple[tuple[int, ...], ...]:
    """The sequences of non-empty tiles (K/V blocks of each) the plan is proven for, shortest
    and smallest first, so that the first failure is the smallest; see the module docstring
    for why these cover the tile loop."""
    stages = kernel.config.ext.stages
    shapes = block_counts(kernel)  # 1 .. S + 2
    singles = [(n,) for n in shapes]
    pairs = [(a, b) for a in range(1, max(stages + 2, 2 * stages) + 1) for b in shapes]
    triples = [
        (a, b, c)
        for a in shapes
        for b in range(1, max(1, stages - 1) + 1)
        for c in range(1, stages + 1)
    ]
    # Q in a ring of q_slots > 1 tiles: its barriers cycle with period 2 x q_slots, and the
    # producer may run up to q_slots tiles ahead. Runs of 2 x q_slots + 1 tiles reach every
    # Q slot in both phases, no longer fresh: after a first tile of 1 .. 2S blocks (every
    # offset of the K/V ring) tiles of one block; after one of one block, every mix of
    # tiles of 1 and 2 blocks (without and with a mainloop).
    q_slots = kernel.config.ext.q_slots
    runs = []
    if q_slots > 1:
        runs = [(first,) + (1,) * (2 * q_slots) for first in range(1, 2 * stages + 1)]
        runs += [
            (1, *rest) for rest in product((1, 2), repeat=2 * q_slots) if any(n > 1 for n in rest)
        ]
    return tuple(
        sorted(singles + pairs + triples + runs, key=lambda seq: (len(seq), sum(seq), seq))
    )


def max_tiles(kernel: Kernel) -> int:
    """The longest sequence of tiles the plan is proven for."""
    return max(len(tiles) for tiles in tile_sequences(kernel))


def describe_tiles(tiles: tuple[int, ...]) -> str:
    """'tiles of 2, 1 K/V blocks' (the non-empty ones) for messages."""
    shown = [n for n in tiles if n > 0]
    if len(shown) == 1:
        return f"one tile of {shown[0]} K/V block{'s' if shown[0] != 1 else ''}"
    return f"tiles of {', '.join(map(str, shown))} K/V blocks"


def skip_patterns(kernel: Kernel) -> tuple[tuple[tuple[int, ...], Skips], ...]:
    """``tail split_kv``: a piece that is not its tile's last skips the tile's tail (from
    normalise on) in its warpgroup, each warpgroup on its own count, and a CTA may run two
    pieces in a row. The tail holds no ring item and no ring barrier, so the K/V ring's
    offset does not change what a skipped tail meets; tiles of 1 and 2 blocks (without and
    with a mainloop) make the shapes: a pair of each order with every set of warpgroups
    skipping each tile's tail, and a triple of each with every set skipping the middle
    one's (a skipped tail between two that run). Empty without split_kv."""
    hopper = kernel.config.ext
    if not hopper.split_kv:
        return ()
    groups = [
        frozenset(wg for wg in range(hopper.consumers) if mask >> wg & 1)
        for mask in range(1 << hopper.consumers)
    ]
    none = frozenset()
    patterns = []
    for tiles in ((1, 2), (2, 1)):
        patterns += [(tiles, (a, b)) for a in groups for b in groups if a or b]
    for tiles in ((1, 1, 1), (2, 2, 2)):
        patterns += [(tiles, (none, g, none)) for g in groups if g]
    return tuple(patterns)


def verify(kernel: Kernel, target=None) -> Kernel:
    """Return ``kernel`` if its sync plan is proven for every tile sequence, else raise."""
    hopper = kernel.config.ext
    assert hopper is not None, "the sm_90a verify needs an sm_90a kernel"
    problems = list(_setup_problems(kernel))
    peer = sorted({s.barrier for s in kernel.syncs() if s.kind is caps.MBAR_ARRIVE_PEER})
    if peer and hopper.cluster == 1:
        problems.append(
            f"arrivals on a peer CTA's mbarriers ({', '.join(peer)}) in a kernel without "
            "'cluster'"
        )
    if problems:
        raise AsyncVerifyError(tuple(problems))
    for ctas in cluster_agents.launch_modes(kernel):
        mode = cluster_agents.describe_mode(kernel, ctas)
        for tiles in tile_sequences(kernel):
            found = problems_of(kernel, tiles, ctas=ctas)
            if found:  # the smallest failing sequence says enough
                where = mode + describe_tiles(tiles)
                raise AsyncVerifyError(tuple(f"with {where}: {p}" for p in found))
        for tiles, skips in skip_patterns(kernel):
            found = problems_of(kernel, tiles, skips, ctas)
            if found:
                where = f"{mode}{describe_tiles(tiles)}, {describe_skips(skips)}"
                raise AsyncVerifyError(tuple(f"with {where}: {p}" for p in found))
    return kernel


def describe_skips(skips: Skips) -> str:
    """'tile 1's tail skipped by wg0, wg2' for messages."""
    return "; ".join(
        f"tile {t}'s tail skipped by {', '.join(f'wg{wg}' for wg in sorted(group))}"
        for t, group in enumerate(skips)
        if group
    )


def problems_of(
    kernel: Kernel, tiles: tuple[int, ...], skips: Skips = (), ctas: int | None = None
) -> list[str]:
    """Every problem of the plan for one sequence of tiles (empty when it is proven); with
    ``skips``, the warpgroups of each tile that skip its tail (tail split_kv); ``ctas``: the
    launch's CTAs per cluster (default the spec's)."""
    marked = build_program(kernel, tiles, fences=True, skips=skips, ctas=ctas)
    program = _without_fences(marked)
    problems = list(check(program)) + _wgmma_fence_problems(marked)
    return problems + transpose_agents.lane0_problems(program)


def _setup_problems(kernel: Kernel) -> list[str]:
    """Every mbarrier a sync uses is initialised, then fenced for the async proxy, then a
    CTA barrier orders the inits before every other thread's use."""
    inits = {s.barrier for s in kernel.setup if isinstance(s, Sync) and s.kind is caps.MBAR_INIT}
    used = {s.barrier for s in kernel.syncs() if s.kind in _MBARRIER_USES}
    problems = [f"mbarrier {name} is used but never initialised" for name in sorted(used - inits)]
    syncs = [s for s in kernel.setup if isinstance(s, Sync)]
    order = [s.kind for s in syncs]
    last_init = max((i for i, k in enumerate(order) if k is caps.MBAR_INIT), default=-1)
    fences = [i for i, k in enumerate(order) if k is caps.FENCE_MBAR_INIT and i > last_init]
    if inits and not fences:
        problems.append("no fence.mbarrier_init after the mbarrier inits (TMA's complete_tx)")
    elif inits and cluster_agents.ctas(kernel) > 1:  # the peer uses them too
        problems += cluster_agents.setup_problems(kernel, syncs[fences[0] :])
    elif inits and not any(k is caps.SYNCTHREADS for k in order[fences[0] :]):
        problems.append("no CTA barrier between the mbarrier inits and their first use")
    return problems


_MBARRIER_USES = (caps.MBAR_WAIT, caps.MBAR_ARRIVE, caps.MBAR_ARRIVE_PEER, caps.MBAR_EXPECT_TX)


def build_program(
    kernel: Kernel,
    tiles: int | tuple[int, ...],
    fences: bool = False,
    skips: Skips = (),
    ctas: int | None = None,
) -> Program:
    """The kernel's roles as agents, for a CTA running tiles of ``tiles`` K/V blocks in turn
    (an int: one tile), or each CTA of a cluster running them (cluster_agents); ``ctas``:
    the launch's CTAs per cluster (default the spec's `cluster`; 1 runs a cluster kernel
    alone); with ``fences``, also the wgmma.fence markers, which are not async model
    events."""
    hopper = kernel.config.ext
    assert hopper is not None
    tiles = (tiles,) if isinstance(tiles, int) else tuple(tiles)
    assert all(n >= 0 for n in tiles), tiles
    consumers = hopper.consumers
    rings = {s.barrier for s in kernel.syncs() if s.lag is not None}
    counts: list[tuple[str, int]] = []
    for sync in kernel.setup:
        if isinstance(sync, Sync) and sync.kind is caps.MBAR_INIT:
            slots = hopper.stages if sync.barrier in rings else sync.slots
            names = (
                [f"{sync.barrier}[{slot}]" for slot in range(slots)]
                if sync.barrier in rings or slots > 1
                else [sync.barrier]
            )
            counts += [(name, sync.count) for name in names]
    # the producer: its elected thread, or (8-bit kernels) its 4 transposing warps
    roles = transpose_agents.producer_roles(kernel)
    roles += [(f"wg{wg}", wg, 128, None) for wg in range(consumers)]
    ctas = ctas or hopper.cluster
    named = [
        (cluster_agents.agent_name(role, cta, ctas > 1), wg, threads, cta, warp)
        for cta in range(ctas)
        for role, wg, threads, warp in roles
    ]
    agents = tuple(
        Agent(
            name,
            threads,
            tuple(_Agent(kernel, name, wg, cta, ctas, warp).events(tiles, skips)),
            cta,
        )
        for name, wg, threads, cta, warp in named
    )
    program = Program(agents, tuple(counts), ctas)
    return program if fences else _without_fences(program)


def _without_fences(program: Program) -> Program:
    """The program without the wgmma.fence markers (not async model events)."""
    return replace(
        program,
        agents=tuple(
            replace(a, events=tuple(e for e in a.events if not isinstance(e, _WgmmaFence)))
            for a in program.agents
        ),
    )


class _Agent:
    """One role's unrolled program: the producer thread (wg None), producer warp ``warp``
    (8-bit kernels: warp 0 runs the elected thread's items too) or consumer warpgroup wg,
    of CTA ``cta`` of the cluster."""

    def __init__(
        self,
        kernel: Kernel,
        name: str,
        wg: int | None,
        cta: int = 0,
        ctas: int = 1,
        warp: int | None = None,
    ) -> None:
        self.kernel = kernel
        self.ext = kernel.config.ext
        self.name = name
        self.wg = wg
        self.warp = warp
        self.cta = cta
        self.ctas = ctas  # the launch's CTAs per cluster
        self.rings = {s.barrier for s in kernel.syncs() if s.lag is not None}
        # buffers loaded once per tile (no ring item): a ring of tiles when of several slots
        self.per_tile = {
            a.buffer
            for s in kernel.steps()
            if s.async_kind == caps.TMA_LOAD and s.lag is None
            for a in s.accesses
        }
        # the barriers of a ring of tiles (Q's when q_slots > 1): their slots, as initialised
        self.tile_slots = {
            s.barrier: s.slots for s in kernel.setup if isinstance(s, Sync) and s.slots > 1
        }
        self.tile = 0  # t: the non-empty tiles run so far
        self.running = 0  # the tile being run, for messages
        self.base = 0  # base_t: the K/V blocks of the earlier tiles
        # the items this role runs in each tile, and why each sync is there (for messages)
        self.plan = {
            phase: [i for i in items if self.runs(i.who)] for phase, items in kernel.phases()
        }
        # the cluster barrier: every thread, before the roles split and after they end
        for phase, items in kernel.phases():
            if phase is Phase.SETUP:
                self.plan[phase] = cluster_agents.everyone(items) + self.plan[phase]
            elif phase is Phase.TEARDOWN:
                self.plan[phase] = self.plan[phase] + cluster_agents.everyone(items)
        # The generated code counts a tile done (tile_count, ring_base) where the consumers'
        # tail starts, at their normalise step; the items after it see the next tile's count.
        epilogue = self.plan.get(Phase.EPILOGUE, [])
        self.tail_start = next(
            (i for i, x in enumerate(epilogue) if isinstance(x, Step) and x.op is Op.NORMALIZE),
            len(epilogue),
        )
        self.why = {
            id(i): "; ".join(h.describe() for h in i.serves) or i.note
            for items in self.plan.values()
            for i in items
            if isinstance(i, Sync)
        }

    def runs(self, who: Threads) -> bool:
        last = self.ext.consumers - 1
        match who:
            case Threads.PRODUCER_THREAD:
                return self.wg is None and self.warp in (None, 0)
            case Threads.PRODUCER_WARPS | Threads.PRODUCER_WARP_LANE0:
                return self.wg is None and self.warp is not None
            case Threads.CONSUMERS | Threads.CONSUMER_WARP_LANE0 | Threads.CONSUMER_ELECTED:
                return self.wg is not None
            case Threads.CONSUMER_FIRST:
                return self.wg == 0
            case Threads.CONSUMER_LAST:
                return self.wg == last
            case Threads.PRODUCER | Threads.THREAD0 | Threads.ALL_WARPS:
                return False  # setmaxnreg and the setup: once, no SMEM, no pipeline sync
            case _:
                raise AssertionError(f"unknown threads {who}")

    def events(self, tiles: tuple[int, ...], skips: Skips = ()) -> list[Event]:
        out: list[Event] = []
        for item in self.plan.get(Phase.SETUP, []):  # once, before the first tile
            out += self.item(item, 0)
        for index, blocks in enumerate(tiles):
            if blocks == 0:
                continue  # an empty tile: no SMEM, no barrier, not counted
            trace = [(Phase.PROLOGUE, 0)]
            trace += [(Phase.MAINLOOP, it) for it in range(1, blocks)]
            trace += [(Phase.EPILOGUE, blocks)]
            skipped = index < len(skips) and self.wg in skips[index]
            self.running = self.tile  # the tile being run (its tail sees the next count)
            counted = False
            for phase, it in trace:
                items = self.plan[phase]
                if skipped and phase is Phase.EPILOGUE:
                    items = items[: self.tail_start]  # the tail, from normalise on, skipped
                for position, item in enumerate(items):
                    if phase is Phase.EPILOGUE and position == self.tail_start:
                        self.tile, self.base, counted = self.tile + 1, self.base + blocks, True
                    out += self.item(item, it)
            if not counted:  # no tail (the producer), or the tail skipped
                self.tile, self.base = self.tile + 1, self.base + blocks
        for item in self.plan.get(Phase.TEARDOWN, []):  # once, after the last tile
            out += self.item(item, 0)
        return out

    # --- items -> events ---------------------------------------------------------------

    def item(self, item: Step | Sync, it: int) -> list[Event]:
        match item:
            case Step():
                return self.step(item, it)
            case Sync():
                return self.sync(item, it)
            case _:
                raise AssertionError(f"not an item: {item!r}")

    def slot(self, lag: int | None, it: int) -> int:
        return 0 if lag is None else (self.base + it + lag) % self.ext.stages

    def barrier(self, sync: Sync, it: int) -> str:
        if sync.lag is None:
            return sync.barrier if sync.slots == 1 else f"{sync.barrier}[{self.tile % sync.slots}]"
        return f"{sync.barrier}[{self.slot(sync.lag, it)}]"

    def span(self, buf: Buffer, partition: Partition, slot: int) -> Span:
        assert buf.offset is not None
        if buf.name in self.per_tile:
            slot = self.tile % buf.slots  # a ring of tiles (Q): tile t in slot t % slots
        slot = slot if buf.slots > 1 else 0  # a step's ring item names the slot of its ring
        base = buf.offset + slot * buf.tile_bytes
        label = buf.name if buf.slots == 1 else f"{buf.name}[slot {slot}]"
        if partition is Partition.WHOLE or self.wg is None:
            return Span("smem", base, base + buf.tile_bytes, label, self.cta)
        rows = buf.tile_bytes // buf.rows * ROWS_PER_WARPGROUP
        lo = base + self.wg * rows
        return Span("smem", lo, lo + rows, f"{label} rows of wg{self.wg}", self.cta)

    def regs(self, names: tuple[str, ...]) -> tuple[Span, ...]:
        space = f"rf:{self.name}"
        return tuple(Span(space, _REG_INDEX[n], _REG_INDEX[n] + 1, n, self.cta) for n in names)

    def step(self, step: Step, it: int) -> list[Event]:
        slot = self.slot(step.lag, it)
        if step.op is Op.TRANSPOSE_V:  # this warp's reads of raw V, writes of its Vt rows
            what = f"{step.op.spelling} by warp {self.warp} (tile {self.running}, it={it})"
            return transpose_agents.transpose_events(self, step, slot, what)
        smem = [
            (self.span(self.kernel.buffer(a.buffer), a.partition, slot), a.mode)
            for a in step.accesses
        ]
        what = f"{step.op.spelling} (tile {self.running}, it={it})"
        reads = self.regs(_REG_READS.get(step.op, ()))
        writes = self.regs(_REG_WRITES.get(step.op, ()))
        match step.async_kind:
            case caps.TMA_LOAD:
                ((span, mode),) = smem
                assert mode is Mode.WRITE and step.op.tensor is not None
                full = f"{step.op.tensor.value.lower()}_full"
                tile_slots = self.tile_slots.get(full, 1)
                if full in self.rings:
                    barrier = f"{full}[{slot}]"
                elif tile_slots > 1:  # a ring of tiles: the tile's barrier
                    barrier = f"{full}[{self.tile % tile_slots}]"
                else:
                    barrier = full
                (access,) = step.accesses
                buf = self.kernel.buffer(access.buffer)
                if cluster_agents.is_cluster_load(buf, self.ctas):  # this CTA's panels
                    return cluster_agents.multicast(buf, span, barrier, self.cta, self.ctas, what)
                return [TmaLoad(span, barrier, span.hi - span.lo, what)]
            case caps.TMA_STORE:
                return [TmaStore(span, what) for span, _ in smem]
            case caps.WGMMA:
                return [Wgmma(tuple(s for s, _ in smem) + reads, writes, what)]
            case None:
                events: list[Event] = [GenericAccess(s, m is Mode.WRITE, what) for s, m in smem]
                events += [GenericAccess(r, False, what) for r in reads if r not in writes]
                events += [GenericAccess(w, True, what) for w in writes]
                return events
            case _:
                raise AssertionError(f"unknown async kind {step.async_kind}")

    def sync(self, sync: Sync, it: int) -> list[Event]:
        why = self.why[id(sync)]
        match sync.kind:
            case caps.MBAR_EXPECT_TX:
                return [Arrive(self.barrier(sync, it), 1, sync.tx, why)]
            case caps.MBAR_ARRIVE:
                return [Arrive(self.barrier(sync, it), self.arrivals(sync), 0, why)]
            case caps.MBAR_ARRIVE_PEER:  # the same arrival on the peer CTA's barrier
                bar, count = self.barrier(sync, it), self.arrivals(sync)
                if self.ctas == 1:  # launched alone, the CTA is its own peer
                    return [Arrive(bar, count, 0, why)]
                return [cluster_agents.peer_arrive(bar, self.cta, count, why)]
            case caps.MBAR_WAIT:
                return [Wait(self.barrier(sync, it), self.parity(sync, it), why)]
            case caps.BAR_SYNC | caps.BAR_ARRIVE:
                bar_id = sync.bar_id
                if sync.peer is not None:
                    assert self.wg is not None
                    bar_id += (self.wg + sync.peer) % self.ext.consumers
                kind = BarSync if sync.kind is caps.BAR_SYNC else BarArrive
                return [kind(bar_id, sync.count, why)]
            case caps.SYNCWARP:  # a producer warp's lanes meet: a bar.sync of its agent
                return [BarSync(transpose_agents.warp_barrier(self.warp), 32, why)]
            case caps.WGMMA_COMMIT:
                return [WgmmaCommit()]
            case caps.WGMMA_WAIT:
                return [WgmmaWait(sync.groups)]
            case caps.WGMMA_FENCE:
                return [_WGMMA_FENCE]
            case caps.FENCE_PROXY_ASYNC:
                return [FenceProxyAsync()]
            case caps.BULK_COMMIT:
                return [BulkCommit()]
            case caps.BULK_WAIT:
                return [BulkWait(sync.groups)]
            case caps.CLUSTER_ARRIVE | caps.CLUSTER_ARRIVE_RELAXED | caps.CLUSTER_WAIT:
                return [cluster_agents.barrier_event(sync, why)]
            case caps.MBAR_INIT | caps.FENCE_MBAR_INIT | caps.SYNCTHREADS:
                raise AssertionError("setup syncs run before the roles split")
            case _:
                raise AssertionError(f"unknown sync kind {sync.kind.name}")

    def arrivals(self, sync: Sync) -> int:
        """An arrive's count: one per consumer warp (lane 0 of each), each thread of a
        producer warp's, else one thread's (a producer warp's lane 0 included)."""
        if sync.who is Threads.CONSUMER_WARP_LANE0:
            return WARPS_PER_WARPGROUP
        return transpose_agents.WARP_THREADS if sync.who is Threads.PRODUCER_WARPS else 1

    def parity(self, sync: Sync, it: int) -> int:
        if sync.lag is None:
            tile_phase = (self.tile // sync.slots) & 1  # tile t: slot t % slots
            match sync.parity:
                case Parity.ZERO:
                    return 0
                case Parity.TILE:
                    return tile_phase
                case Parity.TILE_FLIP:
                    return tile_phase ^ 1
                case _:
                    raise AssertionError(
                        f"a per-tile barrier's wait needs a tile parity: {sync.parity}"
                    )
        phase = ((self.base + it + sync.lag) // self.ext.stages) & 1
        match sync.parity:
            case Parity.ZERO:
                return 0
            case Parity.PHASE:
                return phase
            case Parity.PHASE_FLIP:
                return phase ^ 1
            case _:
                raise AssertionError(f"a ring barrier's wait needs a ring parity: {sync.parity}")
