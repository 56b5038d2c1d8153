"""What insert_syncs' mechanisms share: the consumer program being built, and the helpers
that name roles, hazards and the steps a barrier's hazards point at.

Each mechanism (mbarrier, wgmma, pingpong, store) is a set of plain
functions over ``Consumers``; none of them imports insert_syncs, which calls them in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ....ir import Buffer, Hazard, HazardKind, Item, Kernel, Mode, Phase, Scope, Step, Sync, Threads
from ....ir.ops import Op
from ..caps import MBAR_INIT, TMA_LOAD

# Named barrier ids (0 is __syncthreads); per-warpgroup ones take consumers ids from the base.
RING_DEAD_ID = 1
O_STORE_ID = 2  # + wg (up to 3 consumer warpgroups: 2..4)
TURN_ID = 5  # + wg

PRODUCER_ROLES = (
    Threads.PRODUCER,
    Threads.PRODUCER_THREAD,
    Threads.PRODUCER_WARPS,
    Threads.PRODUCER_WARP_LANE0,
)
TO_CONSUMERS = "producer -> consumers"
TO_PRODUCER = "consumers -> producer"
TO_NEXT_TILE = "consumers -> producer, next tile"


def role_of(who: Threads) -> str:
    """'setup', 'producer' or 'consumers': the program a step or sync belongs to."""
    if who in (Threads.ALL_WARPS, Threads.THREAD0):
        return "setup"
    return "producer" if who in PRODUCER_ROLES else "consumers"


def hazard(kind, earlier, later, buf, later_buf=None, back=False, async_write=False, across=""):
    return Hazard(
        kind=kind,
        earlier=earlier,
        later=later,
        earlier_buffer=buf,
        later_buffer=later_buf or buf,
        scope=Scope.CTA if across else Scope.WARPGROUP,
        back_edge=back,
        async_write=async_write,
        across=across,
    )


@dataclass
class CommittedWgmma:
    """A wgmma step in its own commit group (issue_wgmma commits each alone), in flight in
    each consumer warpgroup; the backward's groups close several (its WgmmaGroup)."""

    step: Step
    reads: frozenset[str]
    writes: frozenset[str]


@dataclass
class Consumers:
    """The consumer program being built, with what is in flight."""

    kernel: Kernel
    readers: dict[str, list[Step]]  # buffer -> the consumer steps that read it
    rings: frozenset[str]  # the tiles loaded per K/V block (schedule.ring_buffers)
    # a TMA-stored tile over loaded bytes (O over the dead V ring) -> the buffers under it
    # (store.freed_by_stores)
    freed: dict[str, list[str]]
    in_flight: list[CommittedWgmma] = field(default_factory=list)
    in_turn: bool = False
    # ordinary code wrote registers since the last wgmma.fence (PTX: a wgmma after such
    # writes, and the first wgmma, need a wgmma.fence before them)
    registers_written: bool = True
    q_waited: set[str] = field(default_factory=set)
    # WAR of the previous tile's TMA store against this tile's writes of the same bytes
    # (store.reused_by_next_tile), and those of them the tile's first turn (a bar.sync
    # of every thread of the warpgroup) orders on its way
    reused: list[Hazard] = field(default_factory=list)
    carried: list[Hazard] = field(default_factory=list)
    # the phase's reads of each ring item (mbarrier.ring_reads) and how many are done:
    # the slot's empty arrival follows the last
    ring_reads: dict[tuple[str, int], list[Step]] = field(default_factory=dict)
    released: dict[tuple[str, int], int] = field(default_factory=dict)
    out: list[Item] = field(default_factory=list)

    @property
    def hw(self):
        return self.kernel.config.ext

    def sync(self, kind, phase, serves=(), who=Threads.CONSUMERS, **args) -> None:
        self.out.append(Sync(kind, phase, tuple(serves), self.kernel.config.loc, who=who, **args))


def writes_to(step: Step, buffer: str, kind=None) -> bool:
    return any(a.buffer == buffer and a.mode is Mode.WRITE for a in step.accesses) and (
        kind is None or step.async_kind == kind
    )


def overlaps(a, b) -> bool:
    return a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


def first_load(kernel: Kernel, buffer: str) -> Step:
    """The TMA load that fills ``buffer``, or the producer warps' transpose that writes Vt
    (the step the hazards of its barriers name)."""
    return next(
        s
        for s in kernel.steps()
        if writes_to(s, buffer, TMA_LOAD) or (s.op is Op.TRANSPOSE_V and writes_to(s, buffer))
    )


def transposed_from(kernel: Kernel) -> frozenset[str]:
    """The TMA-loaded buffers the producer warps transpose (8-bit kernels: the raw V ring),
    whose barriers are syncs/transpose.py's, not the consumers' (mbarrier.py)."""
    return frozenset(
        a.buffer
        for s in kernel.steps()
        if s.op is Op.TRANSPOSE_V
        for a in s.accesses
        if a.mode is Mode.READ
    )


def transposed_into(kernel: Kernel) -> list[Buffer]:
    """The buffers the producer warps' transpose writes (Vt)."""
    names = {
        a.buffer
        for s in kernel.steps()
        if s.op is Op.TRANSPOSE_V
        for a in s.accesses
        if a.mode is Mode.WRITE
    }
    return [b for b in kernel.buffers if b.name in names]


def before_refill(kernel: Kernel, reader: Step, loaded: str, buf: str = "", **args) -> Hazard:
    """WAR: ``reader``'s use of ``buf`` (by default ``loaded`` itself) before the next TMA
    load into ``loaded``'s bytes."""
    later = first_load(kernel, loaded).op
    return hazard(HazardKind.WAR, reader.op, later, buf or loaded, loaded, **args)


def unique_ops(steps: list[Step]) -> list[Step]:
    seen: dict[Op, Step] = {}
    for s in steps:
        seen.setdefault(s.op, s)
    return list(seen.values())


def tma_loaded(kernel: Kernel) -> list[Buffer]:
    """The buffers a TMA load fills (each has a full and an empty mbarrier)."""
    steps = kernel.steps()
    return [b for b in kernel.buffers if any(writes_to(s, b.name, TMA_LOAD) for s in steps)]


def init_barrier(kernel: Kernel, barrier: str, count: int, why: str, slots: int = 1) -> Sync:
    """Thread 0's mbarrier.init in the setup; ``why``: who arrives on it, and how often."""
    return Sync(
        MBAR_INIT,
        Phase.SETUP,
        (),
        kernel.config.loc,
        who=Threads.THREAD0,
        barrier=barrier,
        count=count,
        slots=slots,
        note=f"mbarrier.init before any arrive, wait or complete_tx ({why})",
    )
