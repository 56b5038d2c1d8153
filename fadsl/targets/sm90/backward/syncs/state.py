"""What the backward sync pass's mechanisms share: the consumer warpgroup's program being
built with what is in flight in it, and the questions every mechanism asks of a step
(through which proxy it touches which bytes and registers).

Every consumer warpgroup runs the same program on its own rows, registers and staging, so
the pass builds it once, as warpgroup wg sees it: ``Part.ROWS_OF_WG`` is its own share,
any other part of a buffer written by rows reaches the other warpgroups' rows too.

Each mechanism (mbarrier, wgmma, named, bulk) is a set of plain functions over
``Consumer``; none imports another's state, and ``place`` is the one way a sync enters the
program, so that what one mechanism places (a named barrier, a wgmma wait) is seen by the
others' bookkeeping.
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field

from ..program import (
    CodeSite,
    Guard,
    Item,
    Kind,
    LoopPhase,
    Mbar,
    Named,
    Operand,
    Params,
    Part,
    Reg,
    Who,
)

# steps whose SMEM accesses go through the async proxy (the rest are generic st/ld.shared)
ASYNC_PROXY = frozenset(
    {Kind.TMA_LOAD, Kind.BULK_LOAD, Kind.WGMMA, Kind.BULK_REDUCE_ADD, Kind.TMA_STORE}
)
LOADS = frozenset({Kind.TMA_LOAD, Kind.BULK_LOAD})


def sync(kind: Kind, who: Who, source: CodeSite, phase: LoopPhase, why: str, **fields) -> Item:
    """A sync item: ``why`` names the hazard it orders."""
    return Item(kind, who, source, phase, why=why, **fields)


def words(texts) -> str:
    """'a, b and c' (each once, in order) for a ``why``."""
    unique = list(dict.fromkeys(texts))
    if len(unique) < 2:
        return "".join(unique)
    return ", ".join(unique[:-1]) + " and " + unique[-1]


def names(steps) -> str:
    """The steps' names for a ``why``."""
    return words(x.name or x.kind.value for x in steps)


def same_bytes(a: Operand, b: Operand) -> bool:
    """Whether two operands of one m-block may share bytes (distinct panels do not)."""
    if a.buffer is not b.buffer or a.index is not b.index:
        return False
    panels = (Part.PANEL, Part.WG_PANEL)  # (of one warpgroup: the pass builds one's program)
    return not (a.part is b.part and a.part in panels and a.panel != b.panel)


def reaches_other_warpgroups(read: Operand) -> bool:
    """Whether a read of a buffer that each warpgroup writes by its own rows takes other
    warpgroups' rows too: every part but the warpgroup's own does."""
    return read.part is not Part.ROWS_OF_WG


def guard_of(steps) -> Guard:
    """The guard of a sync placed for ``steps``: theirs where they share one (a wgmma group of
    lagged dQ alone runs only where dQ does), else always."""
    guards = {x.guard for x in steps}
    return guards.pop() if len(guards) == 1 else Guard.ALWAYS


def registers(step: Item) -> frozenset[Reg]:
    return frozenset(step.reg_reads) | frozenset(step.reg_writes)


@dataclass
class WgmmaGroup:
    """wgmmas that one wgmma.commit_group closes, with their positions in the phase."""

    wgmmas: list[tuple[int, Item]] = field(default_factory=list)

    def reads(self) -> frozenset[Reg]:
        return frozenset(r for _, x in self.wgmmas for r in x.reg_reads)

    def writes(self) -> frozenset[Reg]:
        return frozenset(r for _, x in self.wgmmas for r in x.reg_writes)

    def smem_reads(self) -> tuple[Operand, ...]:
        return tuple(op for _, x in self.wgmmas for op in x.reads)

    def steps(self) -> list[Item]:
        return [x for _, x in self.wgmmas]


@dataclass
class Consumer:
    """One consumer warpgroup's program being built, and what is in flight in it."""

    params: Params
    home: CodeSite  # the function that runs the m-block loop (helpers are called from it)
    economical: bool  # leave out what another mechanism's sync already orders
    out: list[Item] = field(default_factory=list)
    # wgmma: the open (uncommitted) group, the committed groups in flight (oldest first),
    # the registers ordinary code accessed since the last wgmma.fence (-> by which steps)
    open_group: WgmmaGroup = field(default_factory=WgmmaGroup)
    in_flight: list[WgmmaGroup] = field(default_factory=list)
    touched: dict[Reg, tuple[str, ...]] = field(default_factory=dict)
    fenced: bool = False
    # per ring's empty barrier: the m-block's readers of its slot (positions) not yet done
    # (an ordinary read once placed, a wgmma once retired); the slot is released once none
    ring_readers: dict[Mbar, set[int]] = field(default_factory=dict)
    released: set[Mbar] = field(default_factory=set)
    waited: set = field(default_factory=set)  # the full barriers waited for this m-block
    # named: generic SMEM writes not yet fenced for the async proxy, and not yet met at a
    # barrier of the warpgroup / of every consumer thread
    unfenced: list[tuple[Item, Operand]] = field(default_factory=list)
    unmet_in_warpgroup: list[tuple[Item, Operand]] = field(default_factory=list)
    unmet_in_consumers: list[tuple[Item, Operand]] = field(default_factory=list)
    # bulk: the issued bulk async reads not yet in a group, the groups whose SMEM read may
    # still run (oldest first), and the reads its issuer retired that the other threads
    # have not yet met it after
    bulk_open: list[Item] = field(default_factory=list)
    bulk_in_flight: list[tuple[Item, ...]] = field(default_factory=list)
    bulk_retired_unmet: list[Item] = field(default_factory=list)
    # deterministic: the ordered adds whose ticket the leader has not released yet, and
    # those of them due in this m-block (owed since the previous one)
    owed: list[Item] = field(default_factory=list)
    due: list[Item] = field(default_factory=list)
    # handover: the lagged readers of a handed-over buffer waited for and not yet retired;
    # the writes whose fence and arrival wait for the run of wgmmas issued after them
    handed_reading: list[Item] = field(default_factory=list)
    handover_due: list[Item] = field(default_factory=list)

    def place(self, item: Item) -> None:
        """Append a sync or step; a named barrier publishes what the warpgroup did before it
        to every thread it counts."""
        # the deadlock argument of bulk.py: no meeting with other warpgroups while owing
        assert not (self.due and item.named is Named.DS), "a meeting while a ticket is owed"
        self.out.append(item)
        if item.kind is Kind.NAMED_BAR_SYNC:
            self.unmet_in_warpgroup.clear()
            self.bulk_retired_unmet.clear()
            if item.named is Named.DS:  # counts every consumer thread
                self.unmet_in_consumers.clear()

    def snapshot(self) -> Consumer:
        return deepcopy(self)


def join(a: Consumer, b: Consumer) -> Consumer:
    """The state at the loop's head, entered from before the loop (a) and from the end of
    an m-block (b): every access of either path may be pending, fenced only if both are."""
    assert not a.in_flight and not b.in_flight and not a.open_group.wgmmas, "groups cross"

    def union(x: list, y: list) -> list:
        return list(dict.fromkeys(x + y))

    touched = dict(a.touched)
    for reg, by in b.touched.items():
        touched[reg] = tuple(dict.fromkeys(touched.get(reg, ()) + by))
    joined = a.snapshot()
    joined.touched = {reg: touched[reg] for reg in sorted(touched, key=list(Reg).index)}
    joined.fenced = a.fenced and b.fenced
    joined.unfenced = union(a.unfenced, b.unfenced)
    joined.unmet_in_warpgroup = union(a.unmet_in_warpgroup, b.unmet_in_warpgroup)
    joined.unmet_in_consumers = union(a.unmet_in_consumers, b.unmet_in_consumers)
    # a group of the same reads issued again is one more of the same: bounded by its steps
    joined.bulk_in_flight = union(a.bulk_in_flight, b.bulk_in_flight)
    joined.bulk_retired_unmet = union(a.bulk_retired_unmet, b.bulk_retired_unmet)
    joined.owed = union(a.owed, b.owed)  # owed after m-block i - 1, not before the loop
    return joined


def loop_entry_equal(a: Consumer, b: Consumer) -> bool:
    keys = ("touched", "fenced", "unfenced", "unmet_in_warpgroup", "unmet_in_consumers")
    keys += ("bulk_in_flight", "bulk_retired_unmet", "owed")
    return all(getattr(a, k) == getattr(b, k) for k in keys)
