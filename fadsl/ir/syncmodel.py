"""Sync models: which asynchronous writes a target has, and the syncs that order SMEM.

A target describes its syncs as data. The generic passes read that data and never
name an instruction: insert_barriers asks for the cheapest barrier that covers a
scope and the wait that completes an async write; verify interprets each sync
kind by its fields (the threads a barrier orders, the writes a wait completes and
the rule by which it completes them), independently of how insert_barriers chose it.

sm_80 has one async write kind (cp.async commit groups, completed by
``cp.async.wait_group N``) and two barriers (``__syncwarp()``, ``__syncthreads()``).
sm_90 adds kinds to this data: TMA writes completed by an mbarrier phase
(``WaitRule.PHASE_PARITY``), wgmma commit groups (``WaitRule.NEWEST_PENDING``, as
cp.async), named barriers (a scope of some warpgroups) and proxy fences.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .types import Scope

# Scopes from narrowest to widest: a barrier of a scope orders the threads of any
# narrower one too.
_WIDTH = {Scope.WARP: 0, Scope.WARPGROUP: 1, Scope.CTA: 2, Scope.CLUSTER: 3}
WARPS_PER_WARPGROUP = 4


def covers(wide: Scope, narrow: Scope) -> bool:
    """Whether a barrier over ``wide`` orders accesses that conflict within ``narrow``."""
    return _WIDTH[wide] >= _WIDTH[narrow]


def same_group(scope: Scope, warp_a: int, warp_b: int) -> bool:
    """Whether two warps belong to one group of ``scope`` (and a barrier of it meets both)."""
    match scope:
        case Scope.WARP:
            return warp_a == warp_b
        case Scope.WARPGROUP:
            return warp_a // WARPS_PER_WARPGROUP == warp_b // WARPS_PER_WARPGROUP
        case Scope.CTA | Scope.CLUSTER:  # warps of one CTA: the cluster holds them all
            return True
        case _:
            raise AssertionError(f"unknown scope {scope}")


def narrowest(warp_a: int, warp_b: int) -> Scope:
    """The narrowest scope whose groups hold both warps."""
    return min((s for s in _WIDTH if same_group(s, warp_a, warp_b)), key=_WIDTH.__getitem__)


class WaitRule(Enum):
    """How a wait decides which earlier async writes have completed."""

    # ``wait N`` completes every write of this kind except those of the N most recently
    # committed groups (cp.async.wait_group, wgmma.wait_group).
    NEWEST_PENDING = "all but the N newest groups"
    # mbarrier.try_wait.parity: the writes that completed the barrier's phase of the
    # waited item's round (ir.Parity) have landed (TMA complete_tx).
    PHASE_PARITY = "the phase of the item's round"


class Signal(Enum):
    """What an sm_90a sync does, beyond a barrier's meeting or a wait's completing."""

    INIT = "init"  # mbarrier.init (arrival count)
    ARRIVE = "arrive"  # mbarrier.arrive (one arrival)
    EXPECT_TX = "arrive.expect_tx"  # one arrival + the transaction bytes the phase waits for
    TURN_SYNC = "bar.sync"  # named barrier: arrive and wait for the generation
    TURN_ARRIVE = "bar.arrive"  # named barrier: arrive and go on
    FENCE = "fence"  # orders this thread's accesses (init / proxies / wgmma registers)
    COMMIT = "commit"  # closes this thread's (warpgroup's) open group of async ops


@dataclass(frozen=True)
class AsyncKind:
    """A kind of asynchronous SMEM write: an issuing step does not complete it."""

    name: str  # in messages: "cp.async"
    flag: str  # on a printed step: "async"


@dataclass(frozen=True)
class SyncKind:
    """One kind of sync: a barrier (``scope`` set) or a wait (``completes`` set)."""

    name: str  # as printed in the IR: "__syncthreads()", "cp.async.wait_group"
    what: str  # in messages: "a CTA barrier"
    scope: Scope | None = None  # a barrier: the threads it meets
    completes: AsyncKind | None = None  # a wait: the async writes it completes
    rule: WaitRule | None = None
    cost: int = 0  # relative; the passes prefer the cheaper of two that both suffice
    signal: Signal | None = None  # sm_90a: what it does besides meeting/completing

    @property
    def counted(self) -> bool:
        """A wait takes a count (the groups that may stay in flight)."""
        return self.rule is WaitRule.NEWEST_PENDING


@dataclass(frozen=True)
class SyncModel:
    async_kinds: tuple[AsyncKind, ...]
    barriers: tuple[SyncKind, ...]  # cheapest first
    waits: tuple[SyncKind, ...]
    others: tuple[SyncKind, ...] = ()  # sm_90a: inits, arrivals, fences, commits

    def barrier_for(self, scope: Scope) -> SyncKind:
        """The cheapest barrier that orders accesses conflicting within ``scope``."""
        for kind in self.barriers:
            assert kind.scope is not None
            if covers(kind.scope, scope):
                return kind
        raise AssertionError(f"no barrier covers scope {scope}")

    def weaker_barrier(self, kind: SyncKind) -> SyncKind | None:
        """The next cheaper barrier, if any."""
        index = self.barriers.index(kind)
        return self.barriers[index - 1] if index > 0 else None

    def wait_for(self, async_kind: AsyncKind) -> SyncKind:
        for kind in self.waits:
            if kind.completes == async_kind:
                return kind
        raise AssertionError(f"no wait completes {async_kind.name}")

    def kinds(self) -> tuple[SyncKind, ...]:
        return self.barriers + self.waits + self.others

    def kind_named(self, name: str) -> SyncKind:
        for kind in self.kinds():
            if kind.name == name:
                return kind
        raise KeyError(name)

    def async_kind_flagged(self, flag: str) -> AsyncKind:
        for kind in self.async_kinds:
            if kind.flag == flag:
                return kind
        raise KeyError(flag)
