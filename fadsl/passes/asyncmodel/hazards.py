"""The proof, step 3: every hazard is ordered.

Each access has a start and an end: a synchronous access is one point; a TMA load ends when
its phase completes (a multicast load is a write in each CTA of its mask, each ending with
its own CTA's phase); a TMA store and a wgmma end at the agent's bulk / wgmma wait_group that
retires their group. An access that never ends is still in flight when its agent exits. Any
two accesses to overlapping bytes, one a write, must be ordered end -> start in
happens-before (order.py); a generic-proxy write followed by an async-proxy access
also needs a fence.proxy.async by the writer between the two.

Two accesses of one many-threaded agent are made by different threads, so program order is
not enough: a bar.sync of the agent must come between (with the writers' fence before it),
or an mbarrier hand-over that every thread of the agent takes part in: an arrival of all
its threads on a phase (each thread's release) that a later wait of the agent sees complete
(each thread's acquire), the writers' fence before the arrival. A thread passes that wait
only once every thread arrived, as it passes a bar.sync only once every thread reached it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .model import (
    Agent,
    Arrive,
    BarSync,
    BulkCommit,
    BulkWait,
    FenceProxyAsync,
    GenericAccess,
    Program,
    Span,
    TmaLoad,
    TmaMulticast,
    TmaStore,
    Wait,
    Wgmma,
    WgmmaCommit,
    WgmmaWait,
    where,
)
from .order import Order
from .run import Point, Run


def _located(program: Program, cta: int, span: Span) -> Span:
    """``span`` in CTA ``cta``: the same offsets of two CTAs' SMEM are different bytes."""
    if program.ctas == 1:
        return span
    return replace(span, cta=cta, name=f"{span.name} of cta{cta}")


@dataclass(frozen=True)
class AccessInterval:
    """One access to a span: issued at ``start``, done by ``end`` (None: never done)."""

    agent: int
    index: int
    span: Span
    write: bool
    generic: bool  # through the generic proxy (a plain load or store)
    start: object
    end: object | None
    is_wgmma: bool = False


def _retirements(agent: Agent, a: int, commit: type, wait: type) -> dict[int, Point]:
    """For each event of a group-committed kind, the wait that retires it."""
    open_ops: list[int] = []
    groups: list[list[int]] = []
    done: dict[int, Point] = {}
    kind = Wgmma if commit is WgmmaCommit else TmaStore
    for i, event in enumerate(agent.events):
        if isinstance(event, kind):
            open_ops.append(i)
        elif isinstance(event, commit):
            groups.append(open_ops)
            open_ops = []
        elif isinstance(event, wait):
            keep = len(groups) - event.pending
            for group in groups[: max(keep, 0)]:
                for op in group:
                    done[op] = (a, i)
            groups = groups[max(keep, 0) :]
    return done


def accesses(program: Program, run: Run) -> tuple[list[AccessInterval], list[str]]:
    """Every access the run made (to SMEM or registers) with its start and end, and a problem
    for each event whose access never ends."""
    ops, problems = [], []
    for a, agent in enumerate(program.agents):
        wgmma_done = _retirements(agent, a, WgmmaCommit, WgmmaWait)
        store_done = _retirements(agent, a, BulkCommit, BulkWait)
        mine = lambda span: _located(program, agent.cta, span)  # noqa: E731
        for i, event in enumerate(agent.events):
            here = (a, i)
            if here not in run.clock:
                continue  # after a hang: already reported
            new: list[AccessInterval] = []
            match event:
                case GenericAccess(span=span, write=write):
                    new.append(AccessInterval(a, i, mine(span), write, True, here, here))
                case TmaLoad(span=span):
                    phase = run.joined[here]
                    end = phase if phase in run.completed else None
                    new.append(AccessInterval(a, i, mine(span), True, False, here, end))
                case TmaMulticast(span=span):
                    for cta in event.ctas():  # a write in each CTA, done when its phase is
                        phase = run.landed[(here, cta)]
                        end = phase if phase in run.completed else None
                        new.append(
                            AccessInterval(
                                a, i, _located(program, cta, span), True, False, here, end
                            )
                        )
                case TmaStore(span=span):
                    new.append(
                        AccessInterval(a, i, mine(span), False, False, here, store_done.get(i))
                    )
                case Wgmma(reads=reads, writes=writes):
                    end = wgmma_done.get(i)
                    for span in reads:
                        new.append(AccessInterval(a, i, mine(span), False, False, here, end, True))
                    for span in writes:
                        new.append(AccessInterval(a, i, mine(span), True, False, here, end, True))
                case _:
                    continue
            ops += new
            if any(op.end is None for op in new):
                problems.append(f"{where(agent, i)} is still in flight when {agent.name} ends")
    return ops, problems


def hazard_problems(
    program: Program, ops: list[AccessInterval], order: Order, clock: dict, run: Run | None = None
) -> list[str]:
    """One problem for each pair of overlapping accesses, one a write, that is not ordered (or
    not fenced); ``clock`` names them in the order they ran; ``run`` (the phases the
    agents' arrivals joined and their waits saw) lets an agent-wide mbarrier hand-over order
    its threads' accesses (module docstring)."""
    agents = program.agents
    found: list[tuple[int, int, list[str]]] = []
    fences = _indices(program, FenceProxyAsync)
    barriers = _indices(program, BarSync)
    handed = _handovers(program, run) if run is not None else {}
    for n, m in _overlapping_pairs(ops):
        x, y = ops[n], ops[m]
        same = x.agent == y.agent
        if same and (x.index == y.index or (x.is_wgmma and y.is_wgmma)):
            continue  # one event's own accesses; the tensor core runs wgmma in order
        if same and x.generic and y.generic:
            first, second = (x, y) if x.index < y.index else (y, x)  # program order
        else:
            first, second = _ordered(x, y, order)
        if first is None or second is None:
            a, b = (y, x) if clock[y.start] < clock[x.start] else (x, y)  # as they ran
            kind = "WAW" if a.write and b.write else ("RAW" if a.write else "WAR")
            found.append(
                (
                    n,
                    m,
                    [
                        f"{kind} on {a.span.name}: {where(agents[a.agent], a.index)} and "
                        f"{where(agents[b.agent], b.index)} are not ordered"
                    ],
                )
            )
        elif same and agents[x.agent].threads > 1 and x.span.space == "smem":
            syncs = (fences, barriers, handed.get(x.agent, []))
            found.append((n, m, _across_threads(program, first, second, *syncs)))
        elif first.generic and first.write and not second.generic and second.span.space == "smem":
            if not any(
                f > first.index and order.before((first.agent, f), second.start)
                for f in fences[first.agent]
            ):
                found.append((n, m, [_unfenced(program, first, second)]))
    return [problem for _, _, some in sorted(found, key=lambda f: f[:2]) for problem in some]


def _overlapping_pairs(ops: list[AccessInterval]) -> list[tuple[int, int]]:
    """(n, m), n < m, for every two ops on overlapping bytes, at least one a write: ops are
    grouped by span, so only groups that overlap are compared."""
    groups: dict[tuple[tuple[str, int], int, int], list[int]] = {}
    for n, op in enumerate(ops):
        groups.setdefault(((op.span.space, op.span.cta), op.span.lo, op.span.hi), []).append(n)
    keys = list(groups)
    pairs = []
    for i, (space, lo, hi) in enumerate(keys):
        for other in keys[i:]:
            if other[0] != space or not (lo < other[2] and other[1] < hi):
                continue
            mine, theirs = groups[(space, lo, hi)], groups[other]
            for n in mine:
                for m in theirs:
                    if (n < m or (other != keys[i] and m < n)) and (ops[n].write or ops[m].write):
                        pairs.append((n, m) if n < m else (m, n))
    return pairs


def _indices(program: Program, kind: type) -> dict[int, list[int]]:
    return {
        a: [i for i, e in enumerate(agent.events) if isinstance(e, kind)]
        for a, agent in enumerate(program.agents)
    }


def _handovers(program: Program, run: Run) -> dict[int, list[tuple[int, int]]]:
    """Per many-threaded agent, its (arrival, wait) pairs of an mbarrier hand-over: an
    arrival of every thread of the agent on a phase that a later wait of the agent saw."""
    found: dict[int, list[tuple[int, int]]] = {}
    for a, agent in enumerate(program.agents):
        events = list(enumerate(agent.events))
        arrivals = [
            (j, run.joined.get((a, j)))
            for j, e in events
            if isinstance(e, Arrive) and e.count == agent.threads > 1 and not e.tx
        ]
        waits = [(w, run.saw.get((a, w))) for w, e in events if isinstance(e, Wait)]
        found[a] = [
            (j, w)
            for j, phase in arrivals
            for w, seen in waits
            if phase and seen == phase and j < w
        ]
    return found


def _across_threads(
    program: Program,
    first: AccessInterval,
    second: AccessInterval,
    fences: dict[int, list[int]],
    barriers: dict[int, list[int]],
    handed: list[tuple[int, int]] = (),
) -> list[str]:
    """Two accesses of one many-threaded agent to the same SMEM bytes: different threads make
    them (a thread's share of a tile, an elected thread's TMA), so a bar.sync of the agent must
    come between; a generic write that an async operation reads also needs the writers'
    fence.proxy.async before that bar.sync. A TMA load's completion and a wgmma's retirement
    are seen by every thread (all of them wait), so those need nothing more."""
    if isinstance(first.start, tuple) and not first.generic:
        event = program.agents[first.agent].events[first.index]
        if isinstance(event, TmaLoad | TmaMulticast) or first.is_wgmma:
            return []
    agent = program.agents[first.agent]
    done = first.index if first.generic else first.end[1]
    between = [b for b in barriers[first.agent] if done < b < second.index]
    # an agent-wide hand-over: every thread's arrival after the access, the wait before
    between += [arrive for arrive, wait in handed if done < arrive and wait < second.index]
    if not between:
        return [
            f"{where(agent, first.index)} and {where(agent, second.index)} touch "
            f"{first.span.name} from different threads of {agent.name} with no bar.sync of "
            f"{agent.name} in between"
        ]
    if first.generic and first.write and not second.generic:
        if not any(first.index < f < max(between) for f in fences[first.agent]):
            return [_unfenced(program, first, second) + " before its bar.sync"]
    return []


def _unfenced(program: Program, first: AccessInterval, second: AccessInterval) -> str:
    agents = program.agents
    return (
        f"{where(agents[first.agent], first.index)} writes {first.span.name} through the "
        f"generic proxy and {where(agents[second.agent], second.index)} reads or writes it "
        f"through the async proxy with no fence.proxy.async by {agents[first.agent].name} "
        "in between"
    )


def _ordered(
    x: AccessInterval, y: AccessInterval, order: Order
) -> tuple[AccessInterval | None, AccessInterval | None]:
    if x.end is not None and order.before(x.end, y.start):
        return x, y
    if y.end is not None and order.before(y.end, x.start):
        return y, x
    return None, None
