"""A brute-force checker for warp-specialised pipelines, independent of verify_async.

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
  between.
Two wgmma of one agent never race (the tensor core runs them in order), nor do the accesses of
one event or two synchronous accesses of one agent.
"""

from __future__ import annotations

import sys

from fadsl.passes.async_model import (
    Access,
    Arrive,
    BarArrive,
    BarSync,
    BulkCommit,
    BulkWait,
    ExpectTx,
    FenceProxyAsync,
    Program,
    Span,
    TmaLoad,
    TmaStore,
    Wait,
    Wgmma,
    WgmmaCommit,
    WgmmaWait,
)


def _touches(event) -> tuple[tuple[Span, bool, bool], ...]:
    """(span, write, async proxy) for each access an event makes when it runs or is issued."""
    match event:
        case Access(span=span, write=write):
            return ((span, write, False),)
        case TmaLoad(span=span):
            return ((span, True, True),)
        case TmaStore(span=span):
            return ((span, False, True),)
        case Wgmma(reads=reads, writes=writes):
            return tuple((s, False, True) for s in reads) + tuple((s, True, True) for s in writes)
        case _:
            return ()


def _conflict(a, b) -> bool:
    return any(
        (wa or wb) and sa.overlaps(sb) for sa, wa, _ in _touches(a) for sb, wb, _ in _touches(b)
    )


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
        tuple((0, counts[n], 0) for n in names),
        (),
        (),
        frozenset(),
        tuple((0, 0) for _ in agents),  # (wgmma groups committed, bulk groups committed)
        frozenset(),
        frozenset(),  # own: (agent, index, synced, fenced, clean) of many-threaded agents
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
                if nxt[a] is not None and nxt[b] is not None and _conflict(nxt[a], nxt[b]):
                    if a not in dict(blocked) and b not in dict(blocked):
                        found.add("race")
        # an event against the operations in flight
        for a in range(len(agents)):
            if nxt[a] is None or a in dict(blocked):
                continue
            for fa, fi, _ in flight:
                other = agents[fa].events[fi]
                if fa == a and isinstance(other, Wgmma) and isinstance(nxt[a], Wgmma):
                    continue
                if _conflict(nxt[a], other):
                    found.add("race")
        moves = []
        for a in range(len(agents)):
            if nxt[a] is not None:
                moved = _move(program, state, a, nxt[a], found)
                if moved is not None:
                    moves.append(moved)
        for fa, fi, g in flight:
            event = agents[fa].events[fi]
            if isinstance(event, TmaLoad):
                moves.append(_land(program, state, (fa, fi, g), event))
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


def _complete(mbar: tuple[int, int, int], count: int) -> tuple[int, int, int]:
    phase, pending, tx = mbar
    if pending == 0 and tx == 0:
        return (phase + 1, count, 0)
    return mbar


def _check_own(program: Program, a: int, index: int, event, own: frozenset, found: set[str]):
    """Check ``event`` against the earlier accesses of its own many-threaded agent; record it."""
    if (
        not _touches(event)
        or isinstance(event, Wgmma | TmaLoad)
        and not any(s.space == "smem" for s, _, _ in _touches(event))
    ):
        return own
    is_async = isinstance(event, TmaLoad | TmaStore | Wgmma)
    for oa, oi, synced, _, clean in own:
        earlier = program.agents[oa].events[oi]
        if oa != a or oi == index or not _conflict(earlier, event):
            continue
        if not synced:
            found.add("race")
        elif is_async and isinstance(earlier, Access) and earlier.write and not clean:
            found.add("proxy race")
    if isinstance(event, Access) and event.span.space == "smem":
        own = own | {(a, index, False, False, False)}
    return own


def _land(program: Program, state, op, event: TmaLoad):
    pcs, mbars, named, blocked, flight, groups, unfenced, own = state
    names = [name for name, _ in program.mbarriers]
    i = names.index(event.barrier)
    phase, pending, tx = mbars[i]
    mbar = _complete((phase, pending, tx - event.nbytes), program.arrivals(event.barrier))
    mbars = mbars[:i] + (mbar,) + mbars[i + 1 :]
    return (pcs, mbars, named, blocked, flight - {op}, groups, unfenced, own)


def _move(program: Program, state, a: int, event, found: set[str]):
    """The state after agent a runs ``event``, or None if it cannot run now."""
    pcs, mbars, named, blocked, flight, groups, unfenced, own = state
    names = [name for name, _ in program.mbarriers]
    agent = program.agents[a]
    wg, bulk = groups[a]
    advance = True
    if agent.threads > 1:
        own = _check_own(program, a, pcs[a], event, own, found)
    match event:
        case Wait(barrier=name, parity=parity):
            if mbars[names.index(name)][0] % 2 == parity:
                return None
        case Arrive(barrier=name, count=count, tx=tx):
            i = names.index(name)
            phase, pending, cur = mbars[i]
            if count > pending:
                found.add("over-arrival")
                count = pending
            mbar = _complete((phase, pending - count, cur + tx), program.arrivals(name))
            mbars = mbars[:i] + (mbar,) + mbars[i + 1 :]
        case ExpectTx(barrier=name, nbytes=nbytes):
            i = names.index(name)
            phase, pending, cur = mbars[i]
            mbars = mbars[:i] + ((phase, pending, cur + nbytes),) + mbars[i + 1 :]
        case BarSync(barrier=bid, threads=threads) | BarArrive(barrier=bid, threads=threads):
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
                    (oa, oi, True, f, c or f) if oa == a else (oa, oi, s, f, c)
                    for oa, oi, s, f, c in own
                )
        case TmaLoad() | TmaStore() | Wgmma():
            for span, _, _ in _touches(event):
                for wa, wi in unfenced:
                    written = program.agents[wa].events[wi].span
                    if span.space == "smem" and written.overlaps(span):
                        found.add("proxy race")
            group = wg if isinstance(event, Wgmma) else bulk if isinstance(event, TmaStore) else -1
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
                own = own | {(fa, fi, False, False, False) for fa, fi, _ in retired}
        case Access(write=True, span=span) if span.space == "smem":
            unfenced = unfenced | {(a, pcs[a])}
        case FenceProxyAsync():
            unfenced = frozenset((wa, wi) for wa, wi in unfenced if wa != a)
            own = frozenset((oa, oi, s, f or oa == a, c) for oa, oi, s, f, c in own)
        case Access():
            pass
        case _:
            raise AssertionError(f"unknown event {event!r}")
    if advance:
        pcs = pcs[:a] + (pcs[a] + 1,) + pcs[a + 1 :]
        if pcs[a] == len(agent.events) and any(
            fa == a and not isinstance(program.agents[fa].events[fi], TmaLoad)
            for fa, fi, _ in flight
        ):
            found.add("in flight at exit")
    groups = groups[:a] + ((wg, bulk),) + groups[a + 1 :]
    return (pcs, mbars, named, blocked, flight, groups, unfenced, own)
