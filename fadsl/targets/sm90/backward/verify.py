"""The proof of the backward main kernel's sync plan (protocol.py: the steps with the syncs
the sync pass placed), in the async model of fadsl/passes/asyncmodel.

For each m-block count m of ``m_counts`` the protocol is unrolled into the model's agents
(the producer's elected thread, one agent per consumer warpgroup) and
``asyncmodel.prove.check`` proves, over every execution: each RAW, WAR and WAW on SMEM
(TMA and bulk loads, wgmma operands, st.shared / ld.shared, the bulk reduce-add's read)
and on a warpgroup's registers (wgmma accumulators and A operands against ordinary code)
is ordered end -> start, with a fence.proxy.async between a generic write and an
async-proxy access, and a bar.sync of the warpgroup between accesses of two of its threads;
every wait returns (no hang: counts and expected bytes match what arrives) and sees the
phase it means (parities); no bulk group still reads SMEM when its warpgroup ends. Three
rules outside the model's events are checked here: the setup (each mbarrier initialised,
fence.mbarrier_init, __syncthreads, before the roles split), PTX's wgmma.fence rule for
registers, and the deterministic semaphore's order within the CTA (below). With `dq_writer
on` the writer warps are agents too, and verify_writer.py has their rules (the lane-0 rule,
the writer's ordered add).

How the header's calls become model events (a faithful lowering, nothing added):
- ``bulk_load`` (LSE, D: cp.async.bulk global -> shared) is a TMA load: an async-proxy
  write whose bytes complete on the mbarrier;
- ``cp.reduce.async.bulk .add.f32`` is, for the CTA's SMEM, what a TMA store is: an
  async-proxy read of the staging until the issuing thread's
  ``cp.async.bulk.wait_group{.read}`` retires its bulk group (``wait_group 0`` without
  ``.read`` retires it too). Its write is to global memory: per-element atomic adds in the
  L2 that no agent of the CTA reads (the convert kernel reads the accumulator after the
  kernel boundary), so it is no SMEM event; dK's and dV's TMA stores the same (their
  global writes are read only by the kernels after this one);
- an item of the warpgroup's thread 0 alone (``if (tid == 0)``) is an event of the
  warpgroup's agent, which the model reads as the act of some of its threads: its bulk
  wait orders nothing for the other threads until a bar.sync of the warpgroup follows
  (hazards._across_threads), an arrive by it counts one arrival, and a proxy fence by it
  alone is dropped (it would order only its own writes, and the warpgroup's 128 threads
  write the staging); an mbarrier wait or a named barrier by it alone is refused (the
  model would let the other threads pass it too). Its semaphore spin blocks the whole
  agent: the other threads of its warp wait where the `if (tid == 0)` block reconverges,
  and the other warps reach at most the next wgmma, which starts only with every warp of
  the warpgroup, or a barrier that counts the leader; no SMEM access lies in between (in
  the overlapped consumer they pass wait_group 0, their q_empty arrivals, which cannot
  complete the phase without the leader's, and the next q_full wait, which cannot see a
  later phase of the slot before that one completes);
- ``fence.proxy.async.global`` and the semaphore's global accesses are not SMEM events.

With `peel_dead on` each count is proven with every subset of the consumer warpgroups
running their first m-block peeled (``peel_cases``: the PEELED items in place of the loop's
first pass, ``program.unrolled``); which warpgroups the mask leaves dead is the header's
test, so the proof does not depend on it, nor on peel.py's choice of items. Beside the
model, verify_written.py checks that every byte of dS^T (or P) a wgmma reads for an m-block
was stored for it by some warpgroup (the model orders accesses; it does not ask whether a
byte read was written).

Why m = 0 .. 2 stages + 2 covers every m-block count: after each m-block every wgmma group
of a warpgroup is retired (wait_group 0, the last wgmma wait of either consumer's
m-block), every named barrier generation is complete, at most one bulk group per
warpgroup (its last reduce-add) is in flight, and the next m-block depends on the past
only through the ring slot's barrier phase (i / stages, a parity, of slot i % stages),
dS^T's buffer (i % 2) and that bulk group. m = 2 stages + 2 uses every slot with both
parities, slots 0 and 1 a third time (a parity-1 wait of the producer on an
empty barrier that is no longer fresh) and both dS^T buffers in every such state; a hazard
spans at most stages m-blocks (a slot reused) or 2 (a dS^T buffer); m = 0 is the CTA that
visits no m-block (no load and no wait: dK = dV = 0).

The deterministic semaphore (``deterministic on``), and why only its order within the CTA
is checked in the model. Where the warpgroups' shares of dQ are disjoint (split by queries,
by head_dim panels or transposed), each share's reduce-adds are ordered by ticket t = place
through a counter per (batch, head, m-block, share); where every warpgroup adds into all of
it (split by keys, ``Params.dq_by_keys``) by t = place * consumers + wg through one counter
per (batch, head, m-block). Both zeroed by the preprocess kernel. Per share, a warpgroup
waits only on the same warpgroup of the CTA before it at the m-block, never on this CTA's
other warpgroups, so the model has no ticket event then; each such wait is one that the
single counter's order implies too (wg of n-block n after wg - 1 of n after ... after wg
of the n-block placed before n), so (1) below holds a fortiori. The leader of ticket t
spins (ld.acquire.gpu) until the counter reads t,
adds and commits; it then owes the release of t + 1 (release_dq_ticket: wait_group 0,
fence, st.release.gpu), which it pays in its next m-block once S^T and dP^T are issued,
before the first wgmma wait (Guard.OWED), or after the loop for its last m-block.

(1) No wait forever. Every n-block below n visits m too (m_begin is non-decreasing in n;
without a mask every n-block visits every m-block), so tickets 0 .. t - 1 all come; a lower
n-block is a lower blockIdx, dispatched first, so the CTA waited for is resident or done
(the launch-order assumption FlashAttention-3 makes too). The release is deferred, so a
CTA must never wait on another CTA or warpgroup while it owes a release that one may be
waiting for. Between the add of m-block i and its release, the owing warpgroup waits only
for q_full of m-block i + 1 (no ticket: the next acquire comes after the release; no
meeting: the release comes before the meeting at dS^T of i + 1, in both consumer orders).
q_full of i + 1 needs the q_empty arrivals of m-block i + 1 - stages, which is i - 1 or
earlier with stages >= 2: every warpgroup of the CTA arrives there before its add of i - 1
(the default order) or right after it (the overlapped order, after wait_group 0 only), and
every ticket of m-block i - 1 of the CTA was granted: a warpgroup holding ticket i has
released i - 1 (before its meeting of i), the warpgroups below it hold tickets of i, hence
released i - 1 too, and those above it wait at i - 1 only on warpgroups of this CTA at
i - 1, each of which releases i - 1 in its m-block i before any wait on another CTA. By
induction on the m-block index the owing warpgroup reaches its release without any other
CTA's progress. In particular warpgroup wg + 1, waiting at m-block m for warpgroup wg's
release of m, is never waited for by wg: wg reaches its deferred release before the
meeting of m + 1, and the ring does not block it. With one stage it would (q_full of i + 1
needs warpgroup wg + 1's q_empty of i, after its ticket in the overlapped order): BwdConfig
static_asserts stages >= 2 with deterministic on, and ``parameter_space`` has none.
Within the CTA (split by keys), ticket place C + w waits for warpgroup w - 1's release of the same m-block:
modelled here as an mbarrier (one per m-block and warpgroup boundary, arrived where the
deferred release runs) so that the model proves it cannot deadlock with the named barriers
and the ring; warpgroup 0's wait, on the CTA below, is left out (it returns, by the
argument above). ``semaphore_problems`` checks the argument's premise: no acquire and no
meeting of every consumer between an add and its release, and every ticket released
before the program ends.

(2) Order of the adds: ticket t's release follows its bulk group's ``wait_group 0`` (the
adds performed, not only the SMEM read) and a ``fence.proxy.async.global`` (the async
proxy's writes ordered before the generic release), by the thread that issued the adds;
ticket t + 1's acquire is followed by a ``fence.proxy.async.global`` before its adds.
Release -> acquire at GPU scope then orders ticket t's adds before ticket t + 1's, so the
sum is formed in the same order in every run. ``semaphore_problems`` checks (2)'s shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from ....passes.asyncmodel.model import (
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
from ....passes.asyncmodel.prove import AsyncVerifyError, check
from .program import (
    ROW_BYTES,
    WARPGROUP_THREADS,
    StagedTile,
    Guard,
    Index,
    Item,
    Kind,
    Mbar,
    Named,
    Operand,
    Params,
    WaitParity,
    Part,
    LoopPhase,
    Protocol,
    Reg,
    WarpRole,
    Who,
    bar_id,
    unrolled,
)
from .protocol import protocol
from .verify_tickets import Voice, ticket_problems
from .verify_tiles import tile_counts, tiles_unrolled  # noqa: F401
from .verify_written import unwritten_reads
from .verify_space import m_counts, parameter_space, persistent_space  # noqa: F401
from . import verify_writer

_INIT_KINDS = (Kind.MBAR_INIT, Kind.FENCE_MBAR_INIT, Kind.SYNCTHREADS)
_WARPGROUP_WIDE = (
    Kind.WGMMA,
    Kind.WGMMA_FENCE,
    Kind.WGMMA_COMMIT,
    Kind.WGMMA_WAIT,
    Kind.NAMED_BAR_SYNC,
    Kind.NAMED_BAR_ARRIVE,
)


# --- the unrolled program -----------------------------------------------------------------


@dataclass(frozen=True)
class _At:
    """Where an item runs: m-block i (None before or after the loop) of warpgroup wg (None:
    the producer)."""

    i: int | None
    wg: int | None
    t: int = 0  # `scheduler persistent`: the CTA's tiles with an m-block before this one

    def index(self, index: Index, p: Params) -> int:
        if index is Index.NONE:
            return 0
        assert self.i is not None, f"{index} outside the m-block loop"
        slots = {Index.RING: p.stages, Index.RING_DO: p.do_stages, Index.ALTERNATE: 2}
        return self.i % slots[index]

    def parity(self, parity: WaitParity, p: Params) -> int:
        if parity in (WaitParity.ZERO, WaitParity.ONE):
            return int(parity is WaitParity.ONE)
        if parity in (WaitParity.TILE, WaitParity.TILE_FLIP):
            return (self.t & 1) ^ int(parity is WaitParity.TILE_FLIP)
        assert self.i is not None, f"{parity} outside the m-block loop"
        if parity in (WaitParity.ALTERNATE, WaitParity.ALTERNATE_PREVIOUS):  # dS^T's uses
            return (self.i // 2 - int(parity is WaitParity.ALTERNATE_PREVIOUS)) & 1
        do_ring = parity in (WaitParity.RING_DO, WaitParity.RING_DO_FLIP)
        ring = (self.i // (p.do_stages if do_ring else p.stages)) & 1
        return ring if parity in (WaitParity.RING, WaitParity.RING_DO) else ring ^ 1

    def when(self) -> str:
        return f"m-block {self.i}" if self.i is not None else "outside the loop"


def mbar_name(mbar: Mbar, slot: int | None) -> str:
    return mbar.value if slot is None else f"{mbar.value}[{slot}]"


def ticket_name(wg: int, i: int) -> str:
    """The intra-CTA part of the deterministic semaphore: warpgroup wg's turn at m-block i."""
    return f"ticket of wg{wg}, m-block {i}"


def spans(proto: Protocol, operand: Operand, at: _At) -> tuple[Span, ...]:
    """The SMEM bytes an operand names for the warpgroup and m-block of ``at``."""
    p = proto.params
    offset, size = proto.buffers().base(operand.buffer)
    copy = at.index(operand.index, p)
    if operand.buffer is StagedTile.DQ_STAGE:  # one staging buffer per warpgroup
        assert operand.part is Part.ROWS_OF_WG and at.wg is not None
        copy = at.wg
    base = offset + copy * size
    label = operand.buffer.value
    if operand.index in (Index.RING, Index.RING_DO):
        label += f"[slot {copy}]"
    elif operand.index is Index.ALTERNATE:
        label += f"[buffer {copy}]"
    # K and V hold B_c rows per 64-column panel, dS^T (and P) B_c rows per 64-query panel (dQ
    # transposed: B_r query rows per 64-key panel), Q and dO B_r rows per 64-column panel
    by_keys = (StagedTile.K, StagedTile.V, StagedTile.P)
    by_keys += () if p.dq_transposed else (StagedTile.DS,)
    panel_rows = p.block_n if operand.buffer in by_keys else p.block_m
    panel_bytes = panel_rows * ROW_BYTES
    rows = p.keys_per_warpgroup * ROW_BYTES  # a warpgroup's key rows of one panel
    match operand.part:
        case Part.WHOLE:
            return (Span("smem", base, base + size, label),)
        case Part.PANEL:
            lo = base + operand.panel * panel_bytes
            return (Span("smem", lo, lo + panel_bytes, f"{label} panel {operand.panel}"),)
        case Part.PANEL_OF_WG:
            lo = base + at.wg * panel_bytes
            return (Span("smem", lo, lo + panel_bytes, f"{label} panel {at.wg}"),)
        case Part.WG_PANEL:  # head_dim 256: panel 2 wg + n, the warpgroup's half
            n = 2 * at.wg + operand.panel
            lo = base + n * panel_bytes
            return (Span("smem", lo, lo + panel_bytes, f"{label} panel {n}"),)
        case Part.ROWS_OF_WG if operand.buffer is StagedTile.DQ_STAGE:
            return (Span("smem", base, base + size, f"{label} of wg{at.wg}"),)
        case Part.ROWS_OF_WG:  # K, V, dS^T, P: the warpgroup's rows of each panel
            return tuple(
                Span(
                    "smem",
                    base + panel * panel_bytes + at.wg * rows,
                    base + panel * panel_bytes + (at.wg + 1) * rows,
                    f"{label} panel {panel} rows of wg{at.wg}",
                )
                for panel in range(size // panel_bytes)
            )
    raise AssertionError(operand)


def _regs(regs: tuple[Reg, ...], wg: int | None) -> tuple[Span, ...]:
    order = list(Reg)
    return tuple(Span(f"rf:wg{wg}", order.index(r), order.index(r) + 1, r.value) for r in regs)


def _lower(proto: Protocol, item: Item, at: _At) -> list[Event]:
    """The model events of one item at one m-block of one role."""
    p = proto.params
    what = f"{item.name or item.kind.value} ({at.when()})"
    why = f"{item.why} ({at.when()})" if item.why else at.when()
    barrier = None
    if item.mbar is not None:
        slot = at.index(item.slot, p) if item.slot is not Index.NONE else None
        barrier = mbar_name(item.mbar, slot)
    leader = item.who is Who.LEADER
    match item.kind:
        case Kind.MBAR_WAIT:
            return [Wait(barrier, at.parity(item.parity, p), why)]
        case Kind.MBAR_ARRIVE:
            count = WARPGROUP_THREADS if item.who is Who.WARPGROUP else 1
            return [Arrive(barrier, count, 0, why)]
        case Kind.MBAR_ARRIVE_EXPECT_TX:
            return [Arrive(barrier, 1, item.tx, why)]
        case Kind.WGMMA_COMMIT:
            return [WgmmaCommit()]
        case Kind.WGMMA_WAIT:
            return [WgmmaWait(item.pending)]
        case Kind.FENCE_PROXY_ASYNC_SMEM:
            return [] if leader else [FenceProxyAsync()]
        case Kind.NAMED_BAR_SYNC:
            return [BarSync(bar_id(item.named, at.wg), item.threads, why)]
        case Kind.NAMED_BAR_ARRIVE:
            return [BarArrive(bar_id(item.named, at.wg), item.threads, why)]
        case Kind.SYNCWARP:
            return []  # the warp's own order: verify_writer.lane0_problems
        case Kind.BULK_COMMIT:
            return [BulkCommit()]
        case Kind.BULK_WAIT_READ | Kind.BULK_WAIT:
            return [BulkWait(item.pending)]
        case Kind.SEM_ACQUIRE if at.wg > 0 and p.dq_by_keys:  # this CTA's previous warpgroup
            return [Wait(ticket_name(at.wg, at.i), 0, why)]
        case Kind.SEM_RELEASE if at.wg < p.consumers - 1 and p.dq_by_keys:
            return [Arrive(ticket_name(at.wg + 1, at.i), 1, 0, why)]
        case Kind.SEM_ACQUIRE | Kind.SEM_RELEASE | Kind.WGMMA_FENCE:
            return []  # the CTA below or above; wgmma.fence: register_problems
        case Kind.FENCE_PROXY_ASYNC_GLOBAL:
            return []  # global memory: semaphore_problems
        case Kind.TMA_LOAD | Kind.BULK_LOAD:
            (operand,) = item.writes
            return [
                TmaLoad(span, barrier, span.hi - span.lo, what)
                for span in spans(proto, operand, at)
            ]
        case Kind.BULK_REDUCE_ADD | Kind.TMA_STORE:
            return [TmaStore(span, what) for op in item.reads for span in spans(proto, op, at)]
        case Kind.WGMMA:
            reads = tuple(s for op in item.reads for s in spans(proto, op, at))
            reads += _regs(item.reg_reads, at.wg)
            return [Wgmma(reads, _regs(item.reg_writes, at.wg), what)]
        case (
            Kind.PROBS
            | Kind.GRAD_SCORES
            | Kind.LOAD_ROWS
            | Kind.PACK
            | Kind.ZERO
            | Kind.ST_SHARED
            | Kind.STORE_GLOBAL
            | Kind.RED_GLOBAL
        ):
            events: list[Event] = []
            events += [
                GenericAccess(s, False, what) for op in item.reads for s in spans(proto, op, at)
            ]
            events += [
                GenericAccess(s, True, what) for op in item.writes for s in spans(proto, op, at)
            ]
            events += [GenericAccess(r, False, what) for r in _regs(item.reg_reads, at.wg)]
            events += [GenericAccess(r, True, what) for r in _regs(item.reg_writes, at.wg)]
            return events
    raise AssertionError(f"{item.kind} has no model event in {item.source.value}")


def build_program(
    proto: Protocol, m_count: int | tuple[int, ...], peeled: frozenset[int] = frozenset()
) -> Program:
    """The producer and the consumer warpgroups of one CTA that visits m_count m-blocks
    (`scheduler persistent`: a sequence of tiles, each's m-block count); the consumer
    warpgroups of ``peeled`` run their first m-block peeled (`peel_dead on`)."""
    p = proto.params
    roles = [("producer", WarpRole.PRODUCER, None, 1)]
    roles += [(f"wg{wg}", WarpRole.CONSUMER, wg, WARPGROUP_THREADS) for wg in range(p.consumers)]
    if p.dq_writer:  # writer w: warp 1 + w of the producer warpgroup
        threads = verify_writer.WRITER_THREADS
        roles += [
            (verify_writer.agent_name(w), WarpRole.WRITER, w, threads) for w in range(p.consumers)
        ]
    agents = []
    for name, role, wg, threads in roles:
        events = []
        peel = role is WarpRole.CONSUMER and wg in peeled
        for item, i, t in tiles_unrolled(proto.role(role), m_count, peel):
            events += _lower(proto, item, _At(i, wg, t))
        agents.append(Agent(name, threads, tuple(events)))
    counts: list[tuple[str, int]] = []
    for item in proto.setup:
        if item.kind is Kind.MBAR_INIT:
            rings = {Index.RING: range(p.stages), Index.RING_DO: range(p.do_stages)}
            rings[Index.ALTERNATE] = range(2)  # `dq_lag on`: dS^T's barriers per buffer
            slots = rings.get(item.slot, [None])
            counts += [(mbar_name(item.mbar, slot), item.count) for slot in slots]
    if p.deterministic and p.dq_by_keys:  # (not with `scheduler persistent`: one tile)
        counts += [(ticket_name(wg, i), 1) for wg in range(1, p.consumers) for i in range(m_count)]
    return Program(tuple(agents), tuple(counts))


# --- the rules outside the model's events -------------------------------------------------


def structural_problems(proto: Protocol) -> list[str]:
    """The setup, the phases' order, who runs what, and the semaphore's shape: problems that
    do not depend on the m-block count."""
    problems = _setup_problems(proto)
    for role in (WarpRole.PRODUCER, WarpRole.CONSUMER):
        phases = [list(LoopPhase).index(x.phase) for x in proto.role(role)]
        if phases != sorted(phases):
            problems.append(f"the {role.value}'s items are not in loop order")
        for n, x in enumerate(proto.role(role)):
            if x.kind in _INIT_KINDS:
                problems.append(f"{role.value} item {n}: {x.kind.value} after the roles split")
            if x.kind is Kind.MBAR_WAIT and x.who is Who.LEADER:
                problems.append(
                    f"{role.value} item {n}: an mbarrier wait by {x.who.value} alone orders "
                    "nothing for the warpgroup's other threads"
                )
            if x.kind in _WARPGROUP_WIDE and x.who is not Who.WARPGROUP:
                problems.append(
                    f"{role.value} item {n}: {x.kind.value} by {x.who.value}: it is executed "
                    "by the whole warpgroup (.sync.aligned, or a named barrier counting it)"
                )
    problems += verify_writer.structural_problems(proto)
    if proto.params.dq_writer:
        return problems + verify_writer.semaphore_problems(proto)
    return problems + semaphore_problems(proto)


def _setup_problems(proto: Protocol) -> list[str]:
    """Every mbarrier the roles use is initialised (a ring's per slot) by thread 0, then
    fence.mbarrier_init, then __syncthreads, all before the roles split."""
    setup = proto.setup
    inits = {(x.mbar, x.slot) for x in setup if x.kind is Kind.MBAR_INIT}
    used = {
        (x.mbar, x.slot)
        for role in (WarpRole.PRODUCER, WarpRole.CONSUMER)
        for x in proto.role(role)
        if x.mbar is not None
    }
    problems = [
        f"mbarrier {mbar.value} ({slot.value}) is used but never initialised"
        for mbar, slot in sorted(used - inits, key=str)
    ]
    kinds = [x.kind for x in setup]
    last_init = max((n for n, k in enumerate(kinds) if k is Kind.MBAR_INIT), default=-1)
    fence = next((n for n, k in enumerate(kinds) if k is Kind.FENCE_MBAR_INIT), None)
    if inits and (fence is None or fence < last_init):
        problems.append("no fence.mbarrier_init after the mbarrier inits (TMA's complete_tx)")
    elif inits and not any(
        x.kind is Kind.SYNCTHREADS and x.who is Who.CTA for x in setup[fence + 1 :]
    ):
        problems.append("no __syncthreads between the mbarrier inits and their first use")
    problems += [
        f"setup item {n}: {x.kind.value} by {x.who.value}, not thread 0"
        for n, x in enumerate(setup)
        if x.kind in (Kind.MBAR_INIT, Kind.FENCE_MBAR_INIT) and x.who is not Who.THREAD0
    ]
    return problems


def semaphore_problems(proto: Protocol) -> list[str]:
    """``deterministic on``: the leader, which issues each m-block's reduce-add, (a) acquires
    the m-block's ticket and fences the async proxy before the add, (b) after it commits
    its bulk group, waits for it to complete (wait_group 0, not only .read), fences the
    async proxy again and then releases the next ticket, (c) with no acquire and no meeting
    with the other warpgroups (bar.sync of every consumer thread) between the add and that
    release, and every ticket is released before the program ends. Checked on the unrolled
    program for 1-3 m-blocks: the release may be deferred into the next m-block or after
    the loop (Guard.OWED). Without it: no semaphore at all."""
    ops = [x for x in proto.consumer if x.kind in (Kind.SEM_ACQUIRE, Kind.SEM_RELEASE)]
    if not proto.params.deterministic:
        return ["a dQ semaphore without deterministic mode"] if ops else []
    loop = [x for x in proto.consumer if x.phase is LoopPhase.LOOP]
    reduces = [x for x in loop if x.kind is Kind.BULK_REDUCE_ADD]
    if len(reduces) != 1:
        return [f"{len(reduces)} dQ reduce-adds per m-block, expected 1"]
    if any(x.who is not Who.LEADER for x in ops + reduces):
        return ["the ticket's acquire, the reduce-add and the release are not one thread's"]
    for m_count in (1, 2, 3):
        problems = _ticket_problems(proto, m_count)
        if problems:
            return problems
    return []


# The consumers' leader as verify_tickets.py's agent
LEADER_VOICE = Voice(
    agent=Who.LEADER,
    blocks=lambda x: x.kind is Kind.SEM_ACQUIRE
    or (x.kind is Kind.NAMED_BAR_SYNC and x.named is Named.DS),
    no_acquire="deterministic: the reduce-add does not follow the ticket's acquire",
    no_acquire_fence="deterministic: no fence.proxy.async.global between the ticket's acquire "
    "and the reduce-add (the async proxy's adds could pass the previous ticket's)",
    no_release="deterministic: no release of the next ticket after the reduce-add of m-block "
    "{i} (of {m_count}): the CTAs and warpgroups after it wait forever",
    no_completion="deterministic: the ticket's release does not follow a committed "
    "cp.async.bulk.wait_group 0 of the reduce-add (its adds may not be performed)",
    no_release_fence="deterministic: no fence.proxy.async.global between the reduce-add's "
    "wait_group 0 and the ticket's release",
    blocked="deterministic: the ticket of m-block {i} is released after {what} ({source.value}): "
    "a wait on another warpgroup or CTA while owing a release that it may be waiting for "
    "(deadlock)",
)


def _ticket_problems(proto: Protocol, m_count: int) -> list[str]:
    return ticket_problems(unrolled(proto.consumer, m_count), m_count, LEADER_VOICE)


def register_problems(
    proto: Protocol, m_count: int | tuple[int, ...], peeled: bool = False
) -> list[str]:
    """PTX's rule for wgmma's registers: a wgmma.fence before the warpgroup's first wgmma,
    and between an ordinary access (read or write) of a register and a wgmma that reads or
    accumulates into it (``peeled``: the warpgroup's first m-block peeled)."""
    problems = []
    fenced = False
    touched: set[Reg] = set()
    for item, i, _ in tiles_unrolled(proto.consumer, m_count, peeled):
        where = f"{item.name or item.kind.value} ({_At(i, 0).when()})"
        if item.kind is Kind.WGMMA_FENCE:
            touched.clear()
            fenced = True
        elif item.kind is Kind.WGMMA:
            regs = set(item.reg_reads) | set(item.reg_writes)
            if not fenced:
                problems.append(f"{where}: the warpgroup's first wgmma, with no wgmma.fence")
                fenced = True
            stale = sorted(r.value for r in regs & touched)
            if stale:
                problems.append(
                    f"{where} uses register(s) {', '.join(stale)} accessed by ordinary code "
                    "since the warpgroup's last wgmma.fence"
                )
        else:
            touched |= set(item.reg_reads) | set(item.reg_writes)
    return problems


# --- the proof ----------------------------------------------------------------------------


def peel_cases(p: Params) -> tuple[frozenset[int], ...]:
    """The sets of consumer warpgroups whose first m-block is peeled that the plan is proven
    for: with `peel_dead on` every subset (which warpgroups the mask leaves dead is the
    header's test, bwd_first_block_dead: the proof does not depend on it), else none."""
    if not p.peel_dead:
        return (frozenset(),)
    wgs = range(p.consumers)
    return tuple(frozenset(w for w in wgs if mask >> w & 1) for mask in range(1 << p.consumers))


def problems_of(
    proto: Protocol, m_count: int | tuple[int, ...], peeled: frozenset[int] = frozenset()
) -> list[str]:
    """Every problem of the plan for a CTA visiting m_count m-blocks, the warpgroups of
    ``peeled`` with their first m-block peeled (empty: proven)."""
    found = structural_problems(proto)
    if found:
        return found
    program = build_program(proto, m_count, peeled)
    found = list(check(program))
    for peel in sorted({wg in peeled for wg in range(proto.params.consumers)}):
        found += register_problems(proto, m_count, peel)
    return found + unwritten_reads(proto, m_count, peeled, spans, _At)


def check_protocol(proto: Protocol) -> tuple[str, ...]:
    """The problems of the smallest failing m-block count, each prefixed with the case;
    empty when the plan is proven for every count of ``m_counts``."""
    where = proto.params.describe()
    found = structural_problems(proto)
    if found:
        return tuple(f"{where}: {problem}" for problem in found)
    for m_count in m_counts(proto.params):
        for peeled in peel_cases(proto.params):
            found = problems_of(proto, m_count, peeled)
            peel = f", warpgroup(s) {sorted(peeled)} peeled" if peeled else ""
            if found:
                return tuple(f"{where}, m_count {m_count}{peel}: {problem}" for problem in found)
    return ()


def prove(params: Params | Protocol) -> Protocol:
    """The protocol of ``params`` (or the given one) if it is proven, else AsyncVerifyError."""
    proto = params if isinstance(params, Protocol) else protocol(params)
    problems = check_protocol(proto)
    if problems:
        raise AsyncVerifyError(problems)
    return proto
