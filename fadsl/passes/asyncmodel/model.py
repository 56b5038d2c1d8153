"""The program model in which verify proves a warp-specialised (Hopper) sync plan.

A pipeline is a few *agents*, each a sequential program: the elected producer thread
issuing TMA, each consumer warpgroup (or a representative pair of its threads) running
wgmma and softmax. They share SMEM and synchronise only through what the hardware gives:

- **mbarriers** with an arrival count fixed at init, a transaction count raised by
  ``expect_tx`` and lowered by the bytes a TMA copy lands, and a phase that completes when
  both reach zero; ``try_wait.parity p`` returns once the barrier's current phase has a
  parity other than ``p`` (so it cannot tell phase k from phase k + 2: the parity bug);
- **named barriers** (``bar.sync id, threads`` / ``bar.arrive``): a generation completes when
  ``threads`` threads have arrived;
- **asynchronous operations** that access memory after they are issued: a TMA load writes its
  tile and completes on an mbarrier phase; a TMA store reads SMEM until
  ``cp.async.bulk.wait_group.read``; a ``wgmma`` reads its SMEM operands (and register
  operands) and writes its accumulators until ``wgmma.wait_group`` retires its group;
- **proxies**: TMA and wgmma access SMEM through the async proxy, ordinary loads and stores
  through the generic proxy; a generic write becomes visible to the async proxy only through
  a ``fence.proxy.async`` executed by the writer after it.

- **clusters** (sm_90a): the agents may belong to several CTAs of a cluster. SMEM spans,
  mbarriers and named barriers are per CTA: the same offsets or name in two CTAs are two
  objects. A thread waits only on its own CTA's mbarriers, but it may arrive on a peer's
  (``RemoteArrive``), and a multicast TMA load (``TmaMulticast``) writes the same offsets in
  every CTA of its mask and completes its bytes on the same-named mbarrier of each.

These are shared data types: the sync pass that builds the plan and verify that checks it
both speak them, but they share no decisions.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Bytes [lo, hi) of a memory ``space``: "smem", or an agent's registers ("rf:<agent>"),
    of CTA ``cta`` of the cluster (two CTAs' SMEM at the same offsets are different bytes)."""

    space: str
    lo: int
    hi: int
    name: str  # the tile (for messages): "K[slot 1]", "S accumulators"
    cta: int = 0

    def overlaps(self, other: Span) -> bool:
        return (
            (self.space, self.cta) == (other.space, other.cta)
            and self.lo < other.hi
            and other.lo < self.hi
        )


# --- events -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GenericAccess:
    """A synchronous access through the generic proxy (ld/st.shared, ldmatrix, stmatrix, math)."""

    span: Span
    write: bool
    what: str


@dataclass(frozen=True)
class TmaLoad:
    """cp.async.bulk.tensor global -> shared: writes ``span``; its bytes complete on ``barrier``."""

    span: Span
    barrier: str
    nbytes: int
    what: str


@dataclass(frozen=True)
class TmaMulticast:
    """cp.async.bulk.tensor ... .multicast::cluster: writes ``span`` (the same CTA-relative
    offsets) in every CTA whose bit is set in ``mask``, and completes ``nbytes`` (each CTA's
    share: the span's size) on the mbarrier named ``barrier`` of each of those CTAs."""

    span: Span
    barrier: str
    nbytes: int
    mask: int
    what: str

    def ctas(self) -> tuple[int, ...]:
        return tuple(c for c in range(self.mask.bit_length()) if self.mask >> c & 1)


@dataclass(frozen=True)
class TmaStore:
    """cp.async.bulk.tensor shared -> global: reads ``span`` until its bulk group is waited for."""

    span: Span
    what: str


@dataclass(frozen=True)
class BulkCommit:
    """cp.async.bulk.commit_group: closes the agent's open group of TMA stores."""


@dataclass(frozen=True)
class BulkWait:
    """cp.async.bulk.wait_group.read N: all but the N newest bulk groups have read their SMEM."""

    pending: int


@dataclass(frozen=True)
class Wgmma:
    """wgmma.mma_async: reads ``reads`` (SMEM through the async proxy, or registers) and writes
    ``writes`` (accumulator registers) until a wgmma.wait_group retires its group."""

    reads: tuple[Span, ...]
    writes: tuple[Span, ...]
    what: str


@dataclass(frozen=True)
class WgmmaCommit:
    """wgmma.commit_group: closes the agent's open group of wgmma operations."""


@dataclass(frozen=True)
class WgmmaWait:
    """wgmma.wait_group N: all but the N newest wgmma groups have completed."""

    pending: int


@dataclass(frozen=True)
class Arrive:
    """mbarrier.arrive (release), ``count`` arrivals; ``tx`` > 0 makes it arrive.expect_tx."""

    barrier: str
    count: int = 1
    tx: int = 0
    why: str = ""


@dataclass(frozen=True)
class RemoteArrive:
    """mapa + mbarrier.arrive.release.cluster.shared::cluster: ``count`` arrivals on the
    mbarrier named ``barrier`` of CTA ``cta`` (release at cluster scope, so the arriving
    agent's earlier accesses happen before whatever waits on that phase)."""

    barrier: str
    cta: int
    count: int = 1
    why: str = ""


@dataclass(frozen=True)
class ExpectTx:
    """mbarrier.expect_tx without an arrival: raises the current phase's transaction count."""

    barrier: str
    nbytes: int


@dataclass(frozen=True)
class Wait:
    """mbarrier.try_wait.parity loop (acquire): returns once the current phase's parity != p."""

    barrier: str
    parity: int
    why: str = ""


@dataclass(frozen=True)
class BarSync:
    """bar.sync id, threads: arrive with the agent's threads, then wait for the generation."""

    barrier: int
    threads: int
    why: str = ""


@dataclass(frozen=True)
class BarArrive:
    """bar.arrive id, threads: arrive with the agent's threads and go on."""

    barrier: int
    threads: int
    why: str = ""


@dataclass(frozen=True)
class ClusterArrive:
    """barrier.cluster.arrive (.release by default, or ``relaxed``): the agent's threads arrive at
    the cluster-wide barrier, whose generation completes once every agent of every CTA has
    arrived. A release arrive orders the agent's earlier accesses (remote arrives and SMEM writes
    into peers included) before the waits that see that generation; a relaxed one orders
    nothing (the start-up form, where fence.mbarrier_init orders the inits)."""

    relaxed: bool = False
    why: str = ""


@dataclass(frozen=True)
class ClusterWait:
    """barrier.cluster.wait (acquire): returns once the generation the agent's last
    barrier.cluster.arrive joined has completed."""

    why: str = ""


@dataclass(frozen=True)
class FenceProxyAsync:
    """fence.proxy.async.shared::cta: the agent's earlier generic SMEM writes become visible to
    async-proxy operations that are ordered after the fence."""


Event = (
    GenericAccess
    | TmaLoad
    | TmaMulticast
    | TmaStore
    | BulkCommit
    | BulkWait
    | Wgmma
    | WgmmaCommit
    | WgmmaWait
    | Arrive
    | RemoteArrive
    | ExpectTx
    | Wait
    | BarSync
    | BarArrive
    | ClusterArrive
    | ClusterWait
    | FenceProxyAsync
)


@dataclass(frozen=True)
class Agent:
    """A sequential program run by ``threads`` threads in step (1 for an elected thread) of
    CTA ``cta`` of the cluster."""

    name: str
    threads: int
    events: tuple[Event, ...]
    cta: int = 0


@dataclass(frozen=True)
class Program:
    """Agents sharing SMEM; ``mbarriers`` maps each mbarrier to the arrival count of its init.
    With ``ctas`` > 1 the agents are spread over a cluster of that many CTAs, and every CTA
    initialises each of ``mbarriers`` in its own SMEM."""

    agents: tuple[Agent, ...]
    mbarriers: tuple[tuple[str, int], ...]
    ctas: int = 1

    def arrivals(self, barrier: str) -> int:
        return dict(self.mbarriers)[barrier]


def where(agent: Agent, index: int) -> str:
    """'agent #index (event)' for messages."""
    event = agent.events[index]
    return f"{agent.name} #{index} ({describe(event)})"


def describe(event: Event) -> str:
    match event:
        case GenericAccess(span=span, write=write, what=what):
            return f"{what}: {'write' if write else 'read'} {span.name}"
        case TmaLoad(span=span, barrier=bar, nbytes=n, what=what):
            return f"{what}: TMA load into {span.name}, {n} bytes on {bar}"
        case TmaMulticast(span=span, barrier=bar, nbytes=n, mask=mask, what=what):
            return f"{what}: TMA multicast into {span.name}, mask {mask:#b}, {n} bytes on {bar}"
        case TmaStore(span=span, what=what):
            return f"{what}: TMA store from {span.name}"
        case BulkCommit():
            return "cp.async.bulk.commit_group"
        case BulkWait(pending=n):
            return f"cp.async.bulk.wait_group.read {n}"
        case Wgmma(what=what):
            return f"{what}: wgmma"
        case WgmmaCommit():
            return "wgmma.commit_group"
        case WgmmaWait(pending=n):
            return f"wgmma.wait_group {n}"
        case Arrive(barrier=bar, count=c, tx=tx):
            return (
                f"arrive on {bar}"
                + (f" x{c}" if c != 1 else "")
                + (f", expect {tx} B" if tx else "")
            )
        case RemoteArrive(barrier=bar, cta=cta, count=c):
            return f"remote arrive on {bar} of cta{cta}" + (f" x{c}" if c != 1 else "")
        case ExpectTx(barrier=bar, nbytes=n):
            return f"expect_tx {n} B on {bar}"
        case Wait(barrier=bar, parity=p):
            return f"wait on {bar}, parity {p}"
        case BarSync(barrier=b, threads=t):
            return f"bar.sync {b}, {t}"
        case BarArrive(barrier=b, threads=t):
            return f"bar.arrive {b}, {t}"
        case ClusterArrive(relaxed=relaxed):
            return "barrier.cluster.arrive" + (".relaxed" if relaxed else "")
        case ClusterWait():
            return "barrier.cluster.wait"
        case FenceProxyAsync():
            return "fence.proxy.async"
        case _:
            raise AssertionError(f"not an event: {event!r}")
