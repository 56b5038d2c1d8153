"""cluster_syncs for sm_90a: the syncs of `cluster 2`, over insert_syncs' plan for one CTA.

With `cluster 2` the K and V rings live in smem[cluster]: both CTAs of a cluster hold every
K/V block at the same offsets, and each CTA's producer loads half of its panels with a
multicast TMA (``.multicast::cluster``, mask 0b11) that writes both CTAs' slots and completes
its bytes on both CTAs' full barriers. So a slot is free again only when the consumers of
both CTAs have read it, and the CTAs must be alive whenever the other one reaches into them.
This pass adds what that takes, and nothing else (one pass per mechanism):

- each K/V ring's empty barrier counts the consumer warps of both CTAs (init count x 2);
  after each consumer arrival on it, the same warp arrives on the peer CTA's barrier of the
  same slot (``MBAR_ARRIVE_PEER``): the peer's producer multicasts into this CTA's slot;
- the full barriers stay as they are: each still expects the whole tile's bytes, half from
  this CTA's multicast and half from the peer's;
- the CTA barrier after mbarrier.init becomes a cluster barrier (arrive.relaxed, wait): the
  peer's multicasts and arrivals may reach this CTA's barriers only once they are
  initialised (``fence.mbarrier_init.release.cluster`` makes the inits visible);
- at exit, every thread of both CTAs meets at a cluster barrier (arrive with release, wait):
  no CTA exits while the other can still arrive on its barriers.

Which loads are multicast is the buffers' scope (Scope.CLUSTER); the emitter reads it too.
The runtime launches pairs only when a head's query blocks pair up (an even count, as
FlashAttention-3) and the K/V loop is long; other launches run the spec's cluster-free
variant (sm90/alone.py). The kernel also runs correctly as clusters of one CTA, where the
code loads whole tiles locally, a CTA is its own peer (its consumers arrive twice on its own
empty barriers, which the doubled count expects: no branch in the consumers' code), and the
cluster barriers meet the CTA's own threads.
verify (fadsl/targets/sm90/verify.py) proves the result over both CTAs of the cluster.
"""

from __future__ import annotations

from dataclasses import replace

from .... import targets
from ....errors import Loc
from ....ir import Item, Kernel, Phase, Scope, Sync, Threads
from ....ir.syncmodel import SyncKind
from ..caps import (
    CLUSTER_ARRIVE,
    CLUSTER_ARRIVE_RELAXED,
    CLUSTER_WAIT,
    MBAR_ARRIVE,
    MBAR_ARRIVE_PEER,
    MBAR_INIT,
    SYNCTHREADS,
)

TO_PEER = "consumers -> the peer CTA's producer"


def cluster_syncs(kernel: Kernel, target: targets.Target) -> Kernel:
    hw = kernel.config.ext
    assert hw is not None
    if hw.cluster == 1:
        return kernel
    shared = {b.name.lower() for b in kernel.buffers if b.scope is Scope.CLUSTER}
    empties = {f"{name}_empty" for name in shared}
    assert empties, "cluster > 1 with no smem[cluster] tile (validate refuses it)"

    def rewrite(items: tuple[Item, ...]) -> tuple[Item, ...]:
        out: list[Item] = []
        for item in items:
            if not isinstance(item, Sync):
                out.append(item)
            elif item.kind == MBAR_INIT and item.barrier in empties:
                out.append(
                    replace(
                        item,
                        count=hw.cluster * item.count,
                        note=item.note.removesuffix(")")
                        + f", of each of the {hw.cluster} CTAs of a cluster: both read the slot "
                        "that either CTA's multicast refills; a CTA launched alone arrives "
                        "for its peer too)",
                    )
                )
            elif item.kind == SYNCTHREADS and item.phase is Phase.SETUP:
                out += _cluster_barrier(
                    item.phase,
                    item.loc,
                    CLUSTER_ARRIVE_RELAXED,
                    "every CTA of the cluster has initialised its mbarriers (thread 0, "
                    "fence.mbarrier_init.release.cluster) before any thread uses them or the "
                    "peer's multicast or arrivals reach them",
                )
            elif item.kind == MBAR_ARRIVE and item.barrier in empties:
                out.append(item)
                out.append(
                    replace(
                        item,
                        kind=MBAR_ARRIVE_PEER,
                        serves=tuple(replace(h, across=TO_PEER) for h in item.serves),
                    )
                )
            else:
                out.append(item)
        return tuple(out)

    teardown = rewrite(kernel.teardown) + tuple(
        _cluster_barrier(
            Phase.TEARDOWN,
            kernel.config.loc,
            CLUSTER_ARRIVE,
            "no CTA of the cluster exits while the other can still arrive on its empty "
            "barriers (every thread of both CTAs; the release orders each thread's last "
            "arrivals before the peer's exit)",
        )
    )
    return replace(
        kernel,
        setup=rewrite(kernel.setup),
        prologue=rewrite(kernel.prologue),
        mainloop=rewrite(kernel.mainloop),
        epilogue=rewrite(kernel.epilogue),
        teardown=teardown,
    )


def _cluster_barrier(phase: Phase, loc: Loc, arrive: SyncKind, note: str) -> list[Sync]:
    """Every thread of the cluster arrives, then waits for the others."""
    common = dict(phase=phase, serves=(), loc=loc, who=Threads.ALL_WARPS)
    return [
        Sync(arrive, **common, note=note),
        Sync(CLUSTER_WAIT, **common, note="until every thread of the cluster has arrived"),
    ]
