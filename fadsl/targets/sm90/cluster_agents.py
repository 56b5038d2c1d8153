"""verify for sm_90a, `cluster 2`: how the two CTAs of a cluster read from the kernel IR.

verify.py unrolls each role of one CTA into agents of the async model (fadsl/passes/asyncmodel); with ``ext.cluster`` > 1
it builds them once per CTA of the cluster (``Agent.cta``, spans of ``Span.cta``, every
mbarrier of the plan in each CTA's SMEM) and reads the cluster's instructions here, as the
generated code runs them (emit/sm90/kernel.cu.j2, ops.cu.j2, include/fadsl/sm90.cuh's
``load_kv_multicast``, sm90_ptx.cuh):

- a TMA load of a buffer of ``Scope.CLUSTER`` (K, V) in CTA r issues the 64-column panels
  p of the tile with p % cluster == r, each a multicast (mask: every CTA) into the same
  slot of every CTA, completing its bytes on the load's mbarrier of each: every CTA's full
  barrier receives the whole tile, its own panels' and its peers';
- ``MBAR_ARRIVE_PEER`` is ``MBAR_ARRIVE``'s arrival (same threads, barrier, slot) on the
  peer CTA's (rank ^ 1) mbarrier: mapa + ``mbarrier.arrive.release.cta.shared::cluster``
  (see the scope note below);
- ``CLUSTER_ARRIVE`` / ``CLUSTER_ARRIVE_RELAXED`` / ``CLUSTER_WAIT`` of ``Threads.ALL_WARPS``
  are run by every thread of every CTA, outside the roles: those of the setup phase before
  any role's code, those of the teardown phase after it (the template's ``setup`` and
  ``exit`` items); so every agent begins with the setup ones and ends with the teardown
  ones;
- the mbarrier inits are per CTA (each CTA's thread 0 initialises its own), and the inits'
  ``fence.mbarrier_init`` (release at cluster scope) then a cluster barrier (a relaxed
  arrive is enough after that fence) order them before any peer's multicast or arrival.

Launches: the runtime runs a `cluster 2` kernel in pairs when a head's query blocks pair
up and alone otherwise (fadsl/targets/sm90/host/launch.py's launch_cluster); the code reads the launch's
CTAs per cluster (%cluster_nctarank). Alone, a K/V load is the whole tile into the CTA's
own SMEM (load_kv_multicast falls back to load_kv), a CTA is its own peer (its peer
arrivals land on its own barriers: rank ^ (CTAs - 1)), and the cluster barriers meet the
CTA's own threads. verify proves both launches (``launch_modes``);
``build_program(..., ctas=1)`` is that single CTA.

Both CTAs of a cluster run the same tile sequence: the scheduler hands CTA c tile
c + step x gridDim.x (or tile c alone), gridDim.x is a multiple of the cluster size and so
is every head's count of query blocks (num_m_blocks rounds it up to the launch's CTAs per
cluster; launch_cluster pairs only even counts), so the two CTAs of a
cluster take consecutive tiles of one (batch, head) at every step and run out of tiles at
the same step; without a mask and without split_kv (validate refuses both with a cluster)
every tile of a head visits the same K/V blocks. So the proof runs both CTAs over each of
verify's tile sequences, and verify's argument that those sequences cover the tile loop
carries over: the CTAs are coupled only through the K/V rings' barriers, whose state is
still a function of the ring item's slot and phase (the same item in both CTAs), and
through the cluster barriers before the first tile and after the last. Neither CTA runs a
ring ahead of the other: a slot is refilled once both CTAs' consumers have released it,
and a consumer's full barrier needs both CTAs' shares.

Scope: the async model's ``RemoteArrive`` is a release at cluster scope, while the generated
peer arrival releases at CTA scope (as CUTLASS's ClusterBarrier::arrive; a cluster-scope
release costs a MEMBAR per arrival). The proof orders three things through that edge, and
none needs the arriving thread's writes to be visible to the peer: the peer's wgmma reads
of a K/V slot (retired by wgmma.wait_group before the arrival) before the refill's
multicast overwrites it (a WAR on completed reads), the slot's previous multicast landing
(complete, observed through the full barrier, before the arrival) before the next one (a
WAW), and the refill's landing on the full barrier's next phase (causality of the mbarrier
operations). No RAW crosses the CTAs through it: the data reaches the peer by the multicast's
own complete_tx. So CTA scope is taken as enough, as in CUTLASS, although the PTX memory
model promises release/acquire ordering only where the release's scope holds the waiting
thread (here: the cluster).
"""

from __future__ import annotations

from ...ir import Buffer, Kernel, Scope, Sync, Threads
from ...passes.asyncmodel.model import (
    ClusterArrive,
    ClusterWait,
    Event,
    RemoteArrive,
    Span,
    TmaMulticast,
)
from . import caps
from .caps import PANEL_COLUMNS  # a TMA box: 64 columns of 16 bits

CLUSTER_BARRIER = (caps.CLUSTER_ARRIVE, caps.CLUSTER_ARRIVE_RELAXED, caps.CLUSTER_WAIT)


def ctas(kernel: Kernel) -> int:
    """The CTAs of a cluster (1 without `cluster`)."""
    return kernel.config.ext.cluster


def launch_modes(kernel: Kernel) -> tuple[int, ...]:
    """The CTAs per cluster the kernel may be launched with: `cluster 2` kernels run in
    pairs when a head's query blocks pair up and alone otherwise (fadsl/targets/sm90/host/launch.py's
    launch_cluster; the generated code reads %cluster_nctarank), so both are proven."""
    return tuple(sorted({1, kernel.config.ext.cluster}))


def describe_mode(kernel: Kernel, ctas: int) -> str:
    """'' without `cluster`; else which launch a problem is in, for messages."""
    if kernel.config.ext.cluster == 1:
        return ""
    return "CTAs in pairs, " if ctas > 1 else "CTAs launched alone, "


def agent_name(role: str, cta: int, clustered: bool) -> str:
    """'wg0' in a one-CTA program, 'cta1.wg0' in a cluster."""
    return f"cta{cta}.{role}" if clustered else role


def multicast(buf: Buffer, span: Span, barrier: str, cta: int, n: int, what: str) -> list[Event]:
    """CTA ``cta``'s share of a cluster-scoped tile load at ``span`` (the whole slot): its
    panels, each multicast into every CTA of the ``n``-CTA cluster."""
    panels = buf.cols // PANEL_COLUMNS
    assert panels * PANEL_COLUMNS == buf.cols and panels % n == 0, (buf.name, buf.cols, n)
    panel_bytes = buf.rows * PANEL_COLUMNS * buf.elem_bytes
    assert panels * panel_bytes == span.hi - span.lo == buf.tile_bytes, (buf.name, span)
    events: list[Event] = []
    for panel in range(cta, panels, n):
        lo = span.lo + panel * panel_bytes
        piece = Span(span.space, lo, lo + panel_bytes, f"{span.name} panel {panel}", span.cta)
        events.append(
            TmaMulticast(piece, barrier, panel_bytes, (1 << n) - 1, f"{what}, panel {panel}")
        )
    return events


def is_cluster_load(buf: Buffer, ctas: int) -> bool:
    """Whether a load of ``buf`` is multicast in a launch of ``ctas`` CTAs per cluster (a
    cluster kernel launched alone loads whole tiles: load_kv_multicast's ``ctas == 1``)."""
    return buf.scope is Scope.CLUSTER and ctas > 1


def peer_arrive(barrier: str, cta: int, count: int, why: str) -> RemoteArrive:
    """MBAR_ARRIVE_PEER: the arrival on the peer CTA's (rank ^ 1) barrier."""
    return RemoteArrive(barrier, cta ^ 1, count, why)


def barrier_event(sync: Sync, why: str) -> Event:
    match sync.kind:
        case caps.CLUSTER_ARRIVE:
            return ClusterArrive(False, why)
        case caps.CLUSTER_ARRIVE_RELAXED:
            return ClusterArrive(True, why)
        case caps.CLUSTER_WAIT:
            return ClusterWait(why)
        case _:
            raise AssertionError(f"not a cluster barrier sync: {sync.kind.name}")


def everyone(items) -> list[Sync]:
    """The cluster barrier syncs of a phase that every thread runs, outside the roles."""
    return [
        i
        for i in items
        if isinstance(i, Sync) and i.kind in CLUSTER_BARRIER and i.who is Threads.ALL_WARPS
    ]


def setup_problems(kernel: Kernel, after_fence: list[Sync]) -> list[str]:
    """With a cluster, the mbarrier inits are ordered before the peer's first use (its
    multicast's complete_tx, its remote arrivals) by a cluster barrier after their
    fence.mbarrier_init: an arrive (release or relaxed) of every thread, then a wait."""
    kinds = [s.kind for s in after_fence if s.who is Threads.ALL_WARPS]
    arrives = [
        i for i, k in enumerate(kinds) if k in (caps.CLUSTER_ARRIVE, caps.CLUSTER_ARRIVE_RELAXED)
    ]
    if arrives and caps.CLUSTER_WAIT in kinds[arrives[0] + 1 :]:
        return []
    return [
        f"no cluster barrier (arrive, then wait, by every thread) between the mbarrier inits' "
        f"fence and their first use: a peer CTA of the {ctas(kernel)}-CTA cluster may "
        "multicast into, or arrive on, an mbarrier not yet initialised"
    ]
