"""The backward's bulk async groups: the reduce-add of dQ's staging into global memory, and
the deterministic mode's ordered add.

- the reduce-add reads the staging through the async proxy until its issuer (the
  warpgroup's leader) retires its bulk group: cp.async.bulk.commit_group after it, so that
  a wait can name it; before the staging is written again (the next m-block's st.shared,
  WAR), the leader's cp.async.bulk.wait_group.read N (N: groups committed after the newest
  that reads those bytes), then a bar.sync of the warpgroup, as the writers are its other
  threads too;
- before the CTA exits, cp.async.bulk.wait_group 0: the last reduce-add's read done before
  the CTA's SMEM goes away; after dK's and dV's TMA stores (the epilogue's, after the loop
  and after that wait) cp.async.bulk.wait_group.read 0: their SMEM read done (their global
  writes need no wait: the kernels after this one are stream-ordered);
- ``deterministic on``: the reduce-adds into one m-block's accumulator (WAW in global
  memory, across warpgroups and CTAs) go in ticket order: the leader acquires its ticket
  (ld.acquire.gpu spin) and fences the async proxy before the add, then commits it and owes
  the release: it waits for the adds to be performed (wait_group 0, not only .read),
  fences the async proxy again and releases the next ticket (st.release.gpu) in the next
  m-block, before its first wgmma wait (so the completion's latency runs under S^T and
  dP^T instead of holding the warpgroup, 2026-11-30), or after the loop. That is before
  anything that waits on another warpgroup or CTA (the meeting at dS^T, the next acquire):
  verify.py's docstring has the deadlock argument, within the CTA and across CTAs.

The ordered add's wait_group 0 retires the staging's read too, and the next m-block's dS^T
meeting (a barrier of the whole warpgroup) orders it before the staging writes: the
staging's own wait_group.read, the barrier after it and the exit's wait_group 0 are then
redundant (tests/backward_cases.py UNNEEDED). The header keeps one staging path for
both modes, and so does this pass unless ``economical``, which counts the ordered add's
wait as retiring the read.
"""

from __future__ import annotations

from ..program import WARPGROUP_THREADS, CodeSite, Guard, Item, Kind, Named, LoopPhase, Who
from .state import Consumer, names, same_bytes, sync

# bulk async copies out of SMEM: dQ's reduce-add, dK's and dV's TMA stores
BULK_READS = frozenset({Kind.BULK_REDUCE_ADD, Kind.TMA_STORE})


def before_write(c: Consumer, step: Item, phase: LoopPhase) -> None:
    """Before a generic write of bytes an in-flight bulk group reads: the issuer's
    wait_group.read, then the warpgroup's barrier."""
    if step.kind in BULK_READS or not step.writes:
        return
    hit = [
        n
        for n, group in enumerate(c.bulk_in_flight)
        if any(same_bytes(w, r) for w in step.writes for x in group for r in x.reads)
    ]
    if hit:
        newest = hit[-1]
        retired = c.bulk_in_flight[: newest + 1]
        c.bulk_in_flight = c.bulk_in_flight[newest + 1 :]
        readers = [x for group in retired for x in group]
        why = f"WAR: {names(readers)} (an m-block ago) read the bytes {step.name} writes"
        pending = len(c.bulk_in_flight)
        c.place(
            sync(Kind.BULK_WAIT_READ, readers[-1].who, step.source, phase, why, pending=pending)
        )
        c.bulk_retired_unmet += readers
    waited = [
        x
        for x in c.bulk_retired_unmet
        if any(same_bytes(w, r) for w in step.writes for r in x.reads)
    ]
    if waited and any(x.who is not step.who for x in waited):
        why = f"WAR: the leader's wait for {names(waited)} before every thread's {step.name}"
        own = dict(named=Named.DQ, threads=WARPGROUP_THREADS)
        c.place(sync(Kind.NAMED_BAR_SYNC, Who.WARPGROUP, step.source, phase, why, **own))


def before_add(c: Consumer, step: Item, phase: LoopPhase) -> None:
    """The ordered add's acquire of its ticket, fenced before the async proxy's adds."""
    if step.kind is not Kind.BULK_REDUCE_ADD or not c.params.deterministic:
        return  # (dK's and dV's TMA stores are no ordered add)
    release_due(c, phase, "before the next ticket's wait")  # never wait while owing
    why = "WAW on dQ's accumulator: the lower tickets' reduce-adds before this one"
    c.place(sync(Kind.SEM_ACQUIRE, step.who, step.source, phase, why))
    why = "the acquire (generic) before the adds (async proxy)"
    c.place(sync(Kind.FENCE_PROXY_ASYNC_GLOBAL, step.who, step.source, phase, why))


def after_add(c: Consumer, step: Item, phase: LoopPhase) -> None:
    """The reduce-add's commit; with deterministic on, the ticket's release is then owed."""
    if step.kind not in BULK_READS:
        return
    named = "the staging's" if step.kind is Kind.BULK_REDUCE_ADD else "the exit's"
    why = f"closes {step.name}'s bulk group: {named} later wait names it"
    c.place(sync(Kind.BULK_COMMIT, step.who, step.source, phase, why))
    c.bulk_in_flight.append((step,))
    if c.params.deterministic and step.kind is Kind.BULK_REDUCE_ADD:
        c.owed.append(step)


def start_m_block(c: Consumer) -> None:
    """The releases owed from the previous m-block fall due in this one."""
    c.due = list(c.owed)


def release_due(c: Consumer, phase: LoopPhase, when: str) -> None:
    """The owed ticket's release (release_dq_ticket, by the leader that added): its adds
    performed, the async proxy fenced, the next ticket released. Guard.OWED: it runs from
    m-block 1 on (for m-block i - 1), and after the loop of a CTA with work."""
    if not c.due:
        return
    adds = c.due
    who, site = adds[-1].who, CodeSite.RELEASE_DQ_TICKET
    owed = dict(guard=Guard.OWED)
    why = f"{names(adds)}'s adds performed (not only their SMEM read) before the release, {when}"
    c.place(sync(Kind.BULK_WAIT, who, site, phase, why, pending=0, **owed))
    if c.economical:  # the wait retires the staging's read too (module docstring)
        c.bulk_retired_unmet += [x for group in c.bulk_in_flight for x in group]
        c.bulk_in_flight = []
    why = "the adds (async proxy) before the release (generic)"
    c.place(sync(Kind.FENCE_PROXY_ASYNC_GLOBAL, who, site, phase, why, **owed))
    why = "WAW on dQ's accumulator: the next ticket may add"
    c.place(sync(Kind.SEM_RELEASE, who, site, phase, why, **owed))
    c.owed = [x for x in c.owed if x not in adds]
    c.due = []


def wait_at_exit(c: Consumer, with_stores: bool = True) -> None:
    """After the loop, and again after the epilogue's TMA stores: the last ticket released,
    and no bulk group still reads SMEM when the CTA exits (the stores' by .read: only their
    SMEM must outlive them). ``with_stores=False`` (after the loop): TMA stores alone in flight
    (`dv_out_first on`'s dV) are left to the exit's wait."""
    c.due = list(c.owed)
    release_due(c, LoopPhase.AFTER, "before the CTA exits")
    readers = [x for group in c.bulk_in_flight for x in group]
    stores = all(x.kind is Kind.TMA_STORE for x in readers)
    if readers and (with_stores or not stores):
        kind = Kind.BULK_WAIT_READ if stores else Kind.BULK_WAIT
        what = "their tiles" if stores else "the staging"
        why = f"the last {names(readers)} read {what} before the CTA exits"
        c.place(sync(kind, readers[-1].who, c.home, LoopPhase.AFTER, why, pending=0))
        c.bulk_in_flight = []
