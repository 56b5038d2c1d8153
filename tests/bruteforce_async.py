"""A brute-force checker for warp-specialised pipelines, independent of the async model's proof (fadsl/passes/asyncmodel).

It explores every interleaving of the agents (depth-first over states, each state visited once)
under the hardware's rules, with the landing of each TMA load a move of its own that may come
at any time after the copy is issued. It reports
- a hang: a reachable state where some agent has not finished and nothing can move;
- a race: two conflicting accesses that can run at the same moment (both the next event of
  their agents), or an access that can run while a conflicting asynchronous operation is in
  flight (a TMA load not yet landed, a TMA store or a wgmma whose group no wait has retired);
- a proxy race: an async-proxy operation issued while a generic write to its bytes has not
  been followed by a fence.proxy.async of the writer;
- an operation still in flight when every agent has finished, and arrivals beyond a phase's
  count;
- within an agent of many threads (a warpgroup): an SMEM access that conflicts with an earlier
  generic access of the same agent (or a TMA store it issued) with no bar.sync of the agent
  since (different threads make them), and an async operation reading or writing bytes the
  agent wrote through the generic proxy unless a fence.proxy.async and then a bar.sync came
  between. An mbarrier hand-over of the agent's own threads serves as the bar.sync: every
  thread of the agent arrives (one arrive of the agent's thread count, no tx) after the
  access, on phase k of an mbarrier, and a later wait of the agent returns for phase k. In
  this explorer's terms: a wait returns when the barrier's phase counter is some P of the
  other parity, so it returned for phase P - 1 (the phase whose completion it observed); an
  arrival the explored interleaving joined to phase P - 1 took part in that completion, so
  every thread's arrival (its release, after its access) came before the completion, and
  the completion before every thread's return from the wait (its acquire). Only that phase's
  arrivals count (the PTX ISA states a wait's acquire for the phase it observed complete; an
  arrival of an earlier phase is not counted, which can only report more). For a generic
  write that an async operation then accesses, the writers' fence.proxy.async must come
  before that arrival, as before a bar.sync.
Two wgmma of one agent never race (the tensor core runs them in order), nor do the accesses of
one event or two synchronous accesses of one agent.

Clusters: SMEM and mbarriers are per CTA (a span's space and a barrier's slot carry the CTA).
A multicast TMA load is in flight once per CTA of its mask, and each of those lands on its own.
A remote arrive, or a multicast landing, in a CTA whose agents have all finished is an 'exit
race' (the CTA may have exited).

The cluster barrier: a generation completes once every agent has arrived; a wait returns once
the generation its agent arrived at has completed (a wait with no arrive before it is a 'cluster
wait without arrive'). A relaxed arrive orders nothing before it, so it may take effect early:
at any moment after the agent's previous cluster barrier event, ahead of the events between
(its remote arrives may then reach a peer after the barrier).
"""

from __future__ import annotations

import sys
from dataclasses import replace

from fadsl.passes.asyncmodel.model import (
    Arrive,
    BarArrive,
    BarSync,
    BulkCommit,
    BulkWait,
    ClusterArrive,
    ClusterWait,
    ExpectTx,
    FenceProxyAsync,
    GenericAccess,
    Program,
    RemoteArrive,
    Span,
    TmaLoad,
    TmaMulticast,
    TmaStore,
    Wait,
    Wgmma,
    WgmmaCommit,
    WgmmaWait,
)


def _at(span: Span, cta: int) -> Span:
    return replace(span, cta=cta)


def _touches(
    program: Program, a: int, event, dest: int = -1
) -> tuple[tuple[Span, bool, bool], ...]:
    """(span in its CTA, write, async proxy) for each access an event of agent a makes when it
    runs or is issued; for a multicast, in CTA ``dest`` only, or in all of its mask."""
    cta = program.agents[a].cta
    match event:
        case GenericAccess(span=span, write=write):
            return ((_at(span, cta), write, False),)
        case TmaLoad(span=span):
            return ((_at(span, cta), True, True),)
        case TmaMulticast(span=span):
            return tuple((_at(span, c), True, True) for c in event.ctas() if dest in (-1, c))
        case TmaStore(span=span):
            return ((_at(span, cta), False, True),)
        case Wgmma(reads=reads, writes=writes):
            return tuple((_at(s, cta), False, True) for s in reads) + tuple(
                (_at(s, cta), True, True) for s in writes
            )
        case _:
            return ()


def _conflict(program: Program, a: int, x, b: int, y, dest: int = -1) -> bool:
    """Event x of agent a and event y of agent b (in CTA ``dest`` only, for a multicast y)."""
    return any(
        (wa or wb) and sa.overlaps(sb)
        for sa, wa, _ in _touches(program, a, x)
        for sb, wb, _ in _touches(program, b, y, dest)
    )


def _slot(program: Program, cta: int, name: str) -> int:
    """The index of CTA ``cta``'s mbarrier ``name`` in a state's tuple of mbarriers."""
    names = [n for n, _ in program.mbarriers]
    return cta * len(names) + names.index(name)


def _finished(program: Program, pcs: tuple[int, ...], cta: int) -> bool:
    ours = [a for a, agent in enumerate(program.agents) if agent.cta == cta]
    return bool(ours) and all(pcs[a] == len(program.agents[a].events) for a in ours)


def explore(program: Program, limit: int = 400_000, all_kinds: bool = False) -> set[str]:
    """The kinds of problem found ('hang', 'race', ...): the first one, or all of them."""
    agents = program.agents
    names = [name for name, _ in program.mbarriers]
    counts = dict(program.mbarriers)
    found: set[str] = set()
    # state: pcs, mbarriers (phase, pending, tx), named barriers {id: (gen, arrived, agents)},
    # agents waiting in bar.sync {agent: gen}, in-flight ops (agent, index, group id or -1),
    # open group numbers per agent, unfenced generic writes (agent, index)
    start = (
        (0,) * len(agents),
        tuple((0, counts[n], 0) for _ in range(program.ctas) for n in names),
        (),
        (),
        frozenset(),
        tuple((0, 0) for _ in agents),  # (wgmma groups committed, bulk groups committed)
        frozenset(),
        # own, of many-threaded agents: (agent, index, synced, fenced, clean, arrivals), the
        # arrivals (slot, phase, fenced then) of all the agent's threads since the access
        frozenset(),
    )
    seen = {start}
    stack = [start]
    sys.setrecursionlimit(10000)
    while stack:
        if len(seen) > limit:
            raise RuntimeError("state space too large for the brute-force checker")
        if found and not all_kinds:
            break
        state = stack.pop()
        pcs, mbars, named, blocked, flight, groups, unfenced, own = state
        nxt = [
            agents[a].events[pcs[a]] if pcs[a] < len(agents[a].events) else None
            for a in range(len(agents))
        ]
        # races between the next events of two agents
        for a in range(len(agents)):
            for b in range(a + 1, len(agents)):
                if (
                    nxt[a] is not None
                    and nxt[b] is not None
                    and _conflict(program, a, nxt[a], b, nxt[b])
                ):
                    if a not in dict(blocked) and b not in dict(blocked):
                        found.add("race")
        # an event against the operations in flight
        for a in range(len(agents)):
            if nxt[a] is None or a in dict(blocked):
                continue
            for fa, fi, g in flight:
                other = agents[fa].events[fi]
                if fa == a and isinstance(other, Wgmma) and isinstance(nxt[a], Wgmma):
                    continue
                if _conflict(program, a, nxt[a], fa, other, _dest(g)):
                    found.add("race")
        moves = []
        for a in range(len(agents)):
            if nxt[a] is not None:
                moved = _move(program, state, a, nxt[a], found)
                if moved is not None:
                    moves.append(moved)
                floated = _floated(program, state, a)
                if floated is not None:
                    moves.append(floated)
        for fa, fi, g in flight:
            event = agents[fa].events[fi]
            if isinstance(event, TmaLoad | TmaMulticast):
                moves.append(_land(program, state, (fa, fi, g), event, found))
        if not moves:
            if any(p < len(agents[a].events) for a, p in enumerate(pcs)):
                found.add("hang")
            elif flight:
                found.add("in flight at exit")
            elif any(arrived for _, (_, arrived, _) in named):
                found.add("unmatched arrive")
            continue
        for moved in moves:
            if moved not in seen:
                seen.add(moved)
                stack.append(moved)
    return found


CLUSTER = (-1, "cluster")  # the cluster barrier's key among the named barriers


def _pending(a: int) -> int:
    """Agent a's key among the waiting agents once it has arrived at the cluster barrier."""
    return -1 - a


def _cluster_arrive(program: Program, named: tuple, blocked: tuple, a: int) -> tuple:
    """(named, blocked) after agent a arrives at the cluster barrier."""
    table, waiting = dict(named), dict(blocked)
    gen, arrived, who = table.get(CLUSTER, (0, 0, ()))
    who = tuple(sorted(who + (a,)))
    if len(who) == len(program.agents):
        table[CLUSTER] = (gen + 1, 0, ())
    else:
        table[CLUSTER] = (gen, arrived + program.agents[a].threads, who)
    waiting[_pending(a)] = gen
    return tuple(sorted(table.items())), tuple(sorted(waiting.items()))


def _floated(program: Program, state, a: int):
    """The state after agent a's next relaxed cluster arrive takes effect early, or None."""
    pcs, mbars, named, blocked, flight, groups, unfenced, own = state
    if _pending(a) in dict(blocked):
        return None
    for event in program.agents[a].events[pcs[a] + 1 :]:
        if isinstance(event, ClusterWait) or isinstance(event, ClusterArrive) and not event.relaxed:
            return None
        if isinstance(event, ClusterArrive):
            named, blocked = _cluster_arrive(program, named, blocked, a)
            return (pcs, mbars, named, blocked, flight, groups, unfenced, own)
    return None


def _dest(group: int) -> int:
    """The CTA of an in-flight multicast landing (its group is -2 - cta), or -1."""
    return -2 - group if group <= -2 else -1


def _complete(mbar: tuple[int, int, int], count: int) -> tuple[int, int, int]:
    phase, pending, tx = mbar
    if pending == 0 and tx == 0:
        return (phase + 1, count, 0)
    return mbar


def _check_own(program: Program, a: int, index: int, event, own: frozenset, found: set[str]):
    """Check ``event`` against the earlier accesses of its own many-threaded agent; record it."""
    touched = _touches(program, a, event)
    if (
        not touched
        or isinstance(event, Wgmma | TmaLoad | TmaMulticast)
        and not any(s.space == "smem" for s, _, _ in touched)
    ):
        return own
    is_async = isinstance(event, TmaLoad | TmaMulticast | TmaStore | Wgmma)
    for oa, oi, synced, _, clean, _ in own:
        earlier = program.agents[oa].events[oi]
        if oa != a or oi == index or not _conflict(program, oa, earlier, a, event):
            continue
        if not synced:
            found.add("race")
        elif is_async and isinstance(earlier, GenericAccess) and earlier.write and not clean:
            found.add("proxy race")
    if isinstance(event, GenericAccess) and event.span.space == "smem":
        own = own | {(a, index, False, False, False, ())}
    return own


def _arrived(own: frozenset, a: int, slot: int, phase: int) -> frozenset:
    """Every thread of agent a arrives on ``phase`` of mbarrier ``slot`` (each thread's
    release): noted on a's own accesses so far, with whether the writer had fenced them."""
    out = set()
    for oa, oi, s, f, c, h in own:
        if oa == a:
            h = tuple(sorted(set(h) | {(slot, phase, f)}))
        out.add((oa, oi, s, f, c, h))
    return frozenset(out)


def _waited(own: frozenset, a: int, slot: int, phase: int) -> frozenset:
    """Agent a's wait on mbarrier ``slot`` returned for ``phase`` (each thread's acquire): a's
    accesses whose threads all arrived on that phase are ordered before all that follows, as
    by a bar.sync (and clean for the async proxy if fenced before the arrival)."""
    out = set()
    for oa, oi, s, f, c, h in own:
        seen = [fenced for sl, ph, fenced in h if (sl, ph) == (slot, phase)]
        if oa == a and seen:
            s, c = True, c or any(seen)
        out.add((oa, oi, s, f, c, h))
    return frozenset(out)


def _land(program: Program, state, op, event: TmaLoad | TmaMulticast, found: set[str]):
    pcs, mbars, named, blocked, flight, groups, unfenced, own = state
    cta = _dest(op[2]) if isinstance(event, TmaMulticast) else program.agents[op[0]].cta
    if _finished(program, pcs, cta):
        found.add("exit race")  # the copy lands in a CTA that may have exited
    i = _slot(program, cta, event.barrier)
    phase, pending, tx = mbars[i]
    mbar = _complete((phase, pending, tx - event.nbytes), program.arrivals(event.barrier))
    mbars = mbars[:i] + (mbar,) + mbars[i + 1 :]
    return (pcs, mbars, named, blocked, flight - {op}, groups, unfenced, own)


def _move(program: Program, state, a: int, event, found: set[str]):
    """The state after agent a runs ``event``, or None if it cannot run now."""
    pcs, mbars, named, blocked, flight, groups, unfenced, own = state
    agent = program.agents[a]
    wg, bulk = groups[a]
    advance = True
    if agent.threads > 1:
        own = _check_own(program, a, pcs[a], event, own, found)
    match event:
        case Wait(barrier=name, parity=parity):
            slot = _slot(program, agent.cta, name)
            if mbars[slot][0] % 2 == parity:
                return None
            if agent.threads > 1:  # it returned for the phase before the current one
                own = _waited(own, a, slot, mbars[slot][0] - 1)
        case Arrive(barrier=name, count=count) | RemoteArrive(barrier=name, count=count):
            tx = event.tx if isinstance(event, Arrive) else 0
            cta = event.cta if isinstance(event, RemoteArrive) else agent.cta
            if _finished(program, pcs, cta):
                found.add("exit race")  # an arrive on a CTA that may have exited
            i = _slot(program, cta, name)
            phase, pending, cur = mbars[i]
            if isinstance(event, Arrive) and not tx and count == agent.threads > 1:
                own = _arrived(own, a, i, phase)
            if count > pending:
                found.add("over-arrival")
                count = pending
            mbar = _complete((phase, pending - count, cur + tx), program.arrivals(name))
            mbars = mbars[:i] + (mbar,) + mbars[i + 1 :]
        case ExpectTx(barrier=name, nbytes=nbytes):
            i = _slot(program, agent.cta, name)
            phase, pending, cur = mbars[i]
            mbars = mbars[:i] + ((phase, pending, cur + nbytes),) + mbars[i + 1 :]
        case BarSync(barrier=bid, threads=threads) | BarArrive(barrier=bid, threads=threads):
            bid = (agent.cta, bid)  # bar.sync ids are CTA-local
            table = dict(named)
            waiting = dict(blocked)
            if a in waiting:  # arrived earlier: go on once the generation has completed
                if table.get(bid, (0, 0, ()))[0] <= waiting[a]:
                    return None
                del waiting[a]
            else:
                gen, arrived, who = table.get(bid, (0, 0, ()))
                if a in who:
                    found.add("double arrive")  # an agent's threads twice in one generation
                who = tuple(sorted(who + (a,)))
                arrived += agent.threads
                if arrived > threads:
                    found.add("over-arrival")
                if arrived >= threads:
                    table[bid] = (gen + 1, 0, ())
                else:
                    table[bid] = (gen, arrived, who)
                if isinstance(event, BarSync):
                    waiting[a] = gen
                    advance = table[bid][0] > gen
                    if advance:
                        del waiting[a]
            named = tuple(sorted(table.items()))
            blocked = tuple(sorted(waiting.items()))
            if isinstance(event, BarSync) and advance:  # every thread of the agent has met
                own = frozenset(
                    (oa, oi, True, f, c or f, h) if oa == a else (oa, oi, s, f, c, h)
                    for oa, oi, s, f, c, h in own
                )
        case ClusterArrive(relaxed=relaxed):
            if _pending(a) in dict(blocked) and not relaxed:
                found.add("double arrive")
            elif _pending(a) not in dict(blocked):  # else it has taken effect early
                named, blocked = _cluster_arrive(program, named, blocked, a)
        case ClusterWait():
            waiting = dict(blocked)
            if _pending(a) not in waiting:
                found.add("cluster wait without arrive")
                return None
            if dict(named)[CLUSTER][0] <= waiting[_pending(a)]:
                return None
            del waiting[_pending(a)]
            blocked = tuple(sorted(waiting.items()))
        case TmaLoad() | TmaMulticast() | TmaStore() | Wgmma():
            for span, _, _ in _touches(program, a, event):
                for wa, wi in unfenced:
                    written = _at(program.agents[wa].events[wi].span, program.agents[wa].cta)
                    if span.space == "smem" and written.overlaps(span):
                        found.add("proxy race")
            if isinstance(event, TmaMulticast):  # in flight once per CTA, each lands alone
                flight = flight | {(a, pcs[a], -2 - c) for c in event.ctas()}
            else:
                group = (
                    wg if isinstance(event, Wgmma) else bulk if isinstance(event, TmaStore) else -1
                )
                flight = flight | {(a, pcs[a], group)}
        case WgmmaCommit():
            wg += 1
        case BulkCommit():
            bulk += 1
        case WgmmaWait(pending=n) | BulkWait(pending=n):
            kind = Wgmma if isinstance(event, WgmmaWait) else TmaStore
            committed = wg if kind is Wgmma else bulk
            retired = {
                (fa, fi, g)
                for fa, fi, g in flight
                if fa == a and isinstance(program.agents[fa].events[fi], kind) and g < committed - n
            }
            flight = flight - retired
            if kind is TmaStore and agent.threads > 1:  # only the issuing thread waited
                own = own | {(fa, fi, False, False, False, ()) for fa, fi, _ in retired}
        case GenericAccess(write=True, span=span) if span.space == "smem":
            unfenced = unfenced | {(a, pcs[a])}
        case FenceProxyAsync():
            unfenced = frozenset((wa, wi) for wa, wi in unfenced if wa != a)
            own = frozenset((oa, oi, s, f or oa == a, c, h) for oa, oi, s, f, c, h in own)
        case GenericAccess():
            pass
        case _:
            raise AssertionError(f"unknown event {event!r}")
    if advance:
        pcs = pcs[:a] + (pcs[a] + 1,) + pcs[a + 1 :]
        if pcs[a] == len(agent.events) and any(
            fa == a and not isinstance(program.agents[fa].events[fi], TmaLoad | TmaMulticast)
            for fa, fi, _ in flight
        ):
            found.add("in flight at exit")
    groups = groups[:a] + ((wg, bulk),) + groups[a + 1 :]
    return (pcs, mbars, named, blocked, flight, groups, unfenced, own)
