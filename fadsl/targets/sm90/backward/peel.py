"""`peel_dead on`: the lagged consumer's first m-block, peeled for a warpgroup whose keys it
masks entirely (a pass on the placed plan, after the sync pass).

Where every key of a consumer warpgroup's 64 lies past the keys or past the right edge of
the tile's first m-block's last query (causal at B_r 64, B_c 128: the diagonal n-block's
second warpgroup), its P and dS of that m-block are zeros: its S^T, dP^T, dV and dK products
add nothing, and the row values it loads feed only them. What the m-block still owes the
others is its part of the m-block's hand-overs:

- every mbarrier sync a tile's first m-block runs (the slot's q_full wait, which orders the
  slot's release after the loads landed; dS^T's full and the slot's empty arrivals, which
  the other warpgroup's dQ and the producer count); not the lagged dQ's, nor dS^T's empty
  wait, which runs from the CTA's m-block 2 on (one tile per CTA);
- dS^T's store into the warpgroup's rows, of zeros (both warpgroups' dQ of the m-block read
  the whole buffer, lagged: in m-block 1 or after the loop);
- the proxy fence that orders that store before the full arrival hands it to the async
  proxy.

Everything else of the m-block (the wgmmas, their fences, groups and waits, the probabilities
and the softmax gradient, the row loads, the packing) is dropped. The loop then starts at
m-block 1, whose lagged items act for m-block 0 as before. The result is the loop's items so
chosen, as ``LoopPhase.PEELED`` items (``program.unrolled`` runs them in place of the first
pass); verify.py proves the plan with each warpgroup peeled or not, independently of this
choice, and tests/backward_walk.py reads the header's peeled branch against them.
"""

from __future__ import annotations

from dataclasses import replace

from .program import Guard, Item, Kind, LoopPhase, Mbar, Protocol, Reg, StagedTile, WarpRole

# an m-block's syncs on these mbarriers: the ring's and dS^T's hand-over (not K and V's)
_HAND_OVER_SYNCS = (Kind.MBAR_WAIT, Kind.MBAR_ARRIVE)
# guards of the items that run in a tile's first m-block, one tile per CTA (the others act
# for an earlier m-block, or run from a later one: REUSED from the running m-block 2 on)
_FIRST_BLOCK_GUARDS = (Guard.ALWAYS,)


def peel_dead_first(plan: Protocol) -> Protocol:
    """The plan with the consumer's peeled first m-block (its PEELED items) added, where
    ``plan.params.peel_dead``; else the plan."""
    if not plan.params.peel_dead:
        return plan
    loop = [x for x in plan.consumer if x.phase is LoopPhase.LOOP]
    peeled = tuple(_peeled(x) for x in loop if _kept(x))
    items = [x for x in plan.consumer if x.phase is LoopPhase.BEFORE]
    items += peeled + tuple(x for x in plan.consumer if x.phase is not LoopPhase.BEFORE)
    return plan.with_role(WarpRole.CONSUMER, tuple(items))


def _writes_ds(item: Item) -> bool:
    return item.kind is Kind.ST_SHARED and any(op.buffer is StagedTile.DS for op in item.writes)


def _kept(item: Item) -> bool:
    """Whether a loop item is part of the dead m-block's hand-over."""
    if item.guard not in _FIRST_BLOCK_GUARDS:
        return False
    return item.kind in _HAND_OVER_SYNCS or _writes_ds(item) or _fences_ds(item)


def _fences_ds(item: Item) -> bool:
    """The proxy fence between dS^T's generic store and the full arrival (the loop's only
    one: dQ's staging is not the lagged consumer's)."""
    return item.kind is Kind.FENCE_PROXY_ASYNC_SMEM


# what each kept sync orders in the peeled m-block (the loop's whys name its products)
_WHYS = {
    (Kind.MBAR_WAIT, Mbar.Q_FULL): "RAW before WAR: the slot's loads landed before its "
    "release below lets the producer load it again",
    (Kind.FENCE_PROXY_ASYNC_SMEM, None): "RAW: the zeros' st.shared (generic proxy) before "
    "every warpgroup's lagged dQ reads them (async proxy)",
    (Kind.MBAR_ARRIVE, Mbar.DS_FULL): "RAW: this thread's zeros of dS^T stored and fenced, "
    "for every warpgroup's lagged dQ",
    (Kind.MBAR_ARRIVE, Mbar.Q_EMPTY): "WAR: the slot is free (none of it read: no product)",
}


def _peeled(item: Item) -> Item:
    """The item as the peeled m-block runs it: dS^T's store of zeros, not of dS^T's
    registers; each sync with what it orders there."""
    peeled = replace(item, phase=LoopPhase.PEELED)
    if _writes_ds(item):
        return replace(peeled, reg_reads=(Reg.ZEROS,), name="dS^T rows of zeros -> smem")
    return replace(peeled, why=_WHYS[item.kind, item.mbar])
