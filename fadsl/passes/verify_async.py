"""verify for warp-specialised pipelines: a proof that a Program's syncs are enough.

It shares no logic with the pass that places the syncs. Three parts:

1. **One execution.** Run the agents with a fixed scheduler (the first agent that can move
   moves; a TMA copy lands as soon as it is issued) under the hardware's rules for mbarriers
   and named barriers. If every agent cannot finish, the plan hangs in this execution, and the
   blocked waits are reported. Otherwise the run tells which phase of which barrier each
   arrival, transaction and TMA copy joined, and which phase each wait saw complete.

2. **That execution stands for all of them.** Happens-before is program order plus
   contribution -> phase completion -> the waits that saw it. The matching of step 1 is the
   same in every execution, and no execution hangs, when
   - every contribution to phase k of a barrier happens after phase k - 1 completed (else it
     could be counted in an earlier phase; an arrival of the same agent, threads and barrier
     that came after the arrival completing phase k - 1 does: the phase flips within that
     atomic arrive), and
   - a wait that saw phase k starts after phase k - 1 completed (else its parity already
     holds and it returns at once: the wrong-parity bug) and happens before phase k + 1
     completes (else the barrier is two phases on, the parity matches again and the wait
     blocks for a phase it was not meant for).
   Each phase must expect exactly the bytes its TMA copies land, and some wait must see the
   phase of each copy complete (a copy nobody waits for is in flight at exit).

3. **Every hazard is ordered.** Each access has a start and an end: a synchronous access is
   one point; a TMA load ends when its phase completes; a TMA store and a wgmma end at the
   agent's bulk / wgmma wait_group that retires their group. Any two accesses to overlapping
   bytes, one a write, must be ordered end -> start; a generic-proxy write followed by an
   async-proxy access also needs a fence.proxy.async by the writer between the two.

Clusters: SMEM, mbarriers and named barriers are per CTA: a span carries its CTA
(``Span.cta``), and a barrier is keyed ``name@ctaN`` (a one-CTA program keeps the bare names,
which its messages print). A multicast TMA load is one issue with
a landing in each CTA of its mask: each landing joins that CTA's barrier phase and ends its
write there. A remote arrive is an arrival on the peer's barrier, with release at cluster
scope. One more condition: no CTA exits while a peer can still reach it, so every remote
arrival on CTA d and every multicast landing in d from another CTA must happen before the
last event of some agent of d. The cluster barrier (``barrier.cluster``) and that exit check
live in verify_cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .async_model import (
    Access,
    Agent,
    Arrive,
    BarSync,
    BulkCommit,
    BulkWait,
    ExpectTx,
    FenceProxyAsync,
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
    where,
)
from .verify_async_order import Order
from .verify_async_phases import phase_problems
from .verify_async_run import Point, Run, execute
from .verify_cluster import exit_problems
from .verify_cluster import malformed as cluster_malformed


class AsyncVerifyError(Exception):
    """The plan hangs, depends on timing, or leaves hazards unordered; ``failures`` says how."""

    def __init__(self, failures: tuple[str, ...]) -> None:
        self.failures = tuple(failures)
        lines = "\n".join(f"  {f}" for f in self.failures)
        super().__init__(f"{len(self.failures)} problem(s) in the sync plan:\n{lines}")


def _located(program: Program, cta: int, span: Span) -> Span:
    """``span`` in CTA ``cta``: the same offsets of two CTAs' SMEM are different bytes."""
    if program.ctas == 1:
        return span
    return replace(span, cta=cta, name=f"{span.name} of cta{cta}")


@dataclass(frozen=True)
class _Op:
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


def _ops(program: Program, run: Run) -> tuple[list[_Op], list[str]]:
    ops, problems = [], []
    for a, agent in enumerate(program.agents):
        wgmma_done = _retirements(agent, a, WgmmaCommit, WgmmaWait)
        store_done = _retirements(agent, a, BulkCommit, BulkWait)
        mine = lambda span: _located(program, agent.cta, span)  # noqa: E731
        for i, event in enumerate(agent.events):
            here = (a, i)
            if here not in run.clock:
                continue  # after a hang: already reported
            new: list[_Op] = []
            match event:
                case Access(span=span, write=write):
                    new.append(_Op(a, i, mine(span), write, True, here, here))
                case TmaLoad(span=span):
                    phase = run.joined[here]
                    end = phase if phase in run.completed else None
                    new.append(_Op(a, i, mine(span), True, False, here, end))
                case TmaMulticast(span=span):
                    for cta in event.ctas():  # a write in each CTA, done when its phase is
                        phase = run.landed[(here, cta)]
                        end = phase if phase in run.completed else None
                        new.append(_Op(a, i, _located(program, cta, span), True, False, here, end))
                case TmaStore(span=span):
                    new.append(_Op(a, i, mine(span), False, False, here, store_done.get(i)))
                case Wgmma(reads=reads, writes=writes):
                    end = wgmma_done.get(i)
                    for span in reads:
                        new.append(_Op(a, i, mine(span), False, False, here, end, True))
                    for span in writes:
                        new.append(_Op(a, i, mine(span), True, False, here, end, True))
                case _:
                    continue
            ops += new
            if any(op.end is None for op in new):
                problems.append(f"{where(agent, i)} is still in flight when {agent.name} ends")
    return ops, problems


def _hazards(program: Program, ops: list[_Op], order: Order, clock: dict) -> list[str]:
    agents = program.agents
    found: list[tuple[int, int, list[str]]] = []
    fences = _indices(program, FenceProxyAsync)
    barriers = _indices(program, BarSync)
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
            found.append((n, m, _across_threads(program, first, second, fences, barriers)))
        elif first.generic and first.write and not second.generic and second.span.space == "smem":
            if not any(
                f > first.index and order.before((first.agent, f), second.start)
                for f in fences[first.agent]
            ):
                found.append((n, m, [_unfenced(program, first, second)]))
    return [problem for _, _, some in sorted(found, key=lambda f: f[:2]) for problem in some]


def _overlapping_pairs(ops: list[_Op]) -> list[tuple[int, int]]:
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


def _across_threads(
    program: Program,
    first: _Op,
    second: _Op,
    fences: dict[int, list[int]],
    barriers: dict[int, list[int]],
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


def _unfenced(program: Program, first: _Op, second: _Op) -> str:
    agents = program.agents
    return (
        f"{where(agents[first.agent], first.index)} writes {first.span.name} through the "
        f"generic proxy and {where(agents[second.agent], second.index)} reads or writes it "
        f"through the async proxy with no fence.proxy.async by {agents[first.agent].name} "
        "in between"
    )


def _ordered(x: _Op, y: _Op, order: Order) -> tuple[_Op | None, _Op | None]:
    if x.end is not None and order.before(x.end, y.start):
        return x, y
    if y.end is not None and order.before(y.end, x.start):
        return y, x
    return None, None


def _malformed(program: Program) -> list[str]:
    """Names and CTA indices that refer to nothing, and cluster barriers out of order: checked
    before anything runs."""
    known = {name for name, _ in program.mbarriers}
    problems = [
        f"{where(agent, i)}: mbarrier {event.barrier} is never initialised"
        for agent in program.agents
        for i, event in enumerate(agent.events)
        if isinstance(event, Arrive | ExpectTx | Wait | TmaLoad | TmaMulticast | RemoteArrive)
        and event.barrier not in known
    ]
    return problems + cluster_malformed(program)


def check(program: Program) -> tuple[str, ...]:
    """Every problem with the program's sync plan; empty when it is proven."""
    malformed = _malformed(program)
    if malformed:
        return tuple(malformed)
    run = execute(program)
    if not run.problems:
        return _proof_problems(program, run)
    # A hang in the eager run (the first agent runs as far as it can): a producer that ran
    # ahead often hangs a consumer whose real problem is an unordered hazard or a wait that
    # returns early. A patient run (the consumers, listed last, first) may finish; then its
    # problems name the cause, and some there must be, since that run would otherwise prove
    # the plan, hangs included.
    patient = execute(program, patient=True)
    if patient.problems:
        return tuple(run.problems)
    return tuple(dict.fromkeys(list(_proof_problems(program, patient)) + run.problems))


def _proof_problems(program: Program, run: Run) -> tuple[str, ...]:
    """Steps 2 and 3 over a run that finished."""
    order = Order(program, run)
    ops, problems = _ops(program, run)
    problems += phase_problems(program, run, order)
    problems += exit_problems(program, run, order)
    problems += _hazards(program, ops, order, run.clock)
    return tuple(dict.fromkeys(problems))


def verify_program(program: Program) -> Program:
    """Return ``program`` if its sync plan is proven, else raise AsyncVerifyError."""
    problems = check(program)
    if problems:
        raise AsyncVerifyError(problems)
    return program
