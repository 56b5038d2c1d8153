"""The proof, step 1: one execution of the program, and the hangs it finds.

Run the agents with a fixed scheduler (the first agent that can move moves; a TMA copy lands
as soon as it is issued) under the hardware's rules for mbarriers and named barriers. If every
agent cannot finish, the plan hangs in this execution, and the blocked waits are reported
(and, once every agent has finished, a named barrier or the cluster barrier left with arrivals
that nobody completes). Otherwise the run tells which phase of which barrier each arrival,
transaction and TMA copy joined, and which phase each wait saw complete: steps 2 and 3
(phases.py, hazards.py) prove that this matching, and the order it gives,
hold in every execution.

Per-CTA state is keyed by ``qualify``: a barrier is ``name@ctaN`` in a cluster, and its bare
name in a one-CTA program. A multicast TMA load lands at once in every CTA of its mask, and a
remote arrive is an arrival on the peer's barrier. The cluster barrier's state is
verify_cluster's ``ClusterBarrier``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .model import (
    Agent,
    Arrive,
    BarArrive,
    BarSync,
    ClusterArrive,
    ClusterWait,
    Event,
    ExpectTx,
    Program,
    RemoteArrive,
    TmaLoad,
    TmaMulticast,
    Wait,
    where,
)
from .cluster import ClusterBarrier, completion

Point = tuple[int, int]  # (agent index, event index)
# ("mbar", name, phase), ("bar", id, generation) or ("cluster", "barrier.cluster", generation)
Completion = tuple[str, object, int]
Landing = tuple[Point, int]  # a multicast TMA load and one CTA of its mask


@dataclass
class _MBarrier:
    arrivals: int  # the init count
    phase: int = 0
    pending: int = 0
    tx: int = 0

    def __post_init__(self) -> None:
        self.pending = self.arrivals


@dataclass
class _Named:
    generation: int = 0
    arrived: int = 0
    threads: int | None = None
    agents: set[int] = field(default_factory=set)


@dataclass
class Run:
    """What the one execution of step 1 found."""

    clock: dict[object, int] = field(default_factory=dict)  # node -> time it happened
    joined: dict[Point, Completion] = field(default_factory=dict)  # contribution -> its phase
    landed: dict[Landing, Completion] = field(default_factory=dict)  # multicast -> phase, per CTA
    saw: dict[Point, Completion | None] = field(default_factory=dict)  # wait -> phase it saw
    # an arrival that completed its phase (the phase flips within that atomic arrive)
    completed_by: dict[Point, Completion] = field(default_factory=dict)
    completed: set[Completion] = field(default_factory=set)
    # cluster barrier: a release arrive -> the generation it joined; a wait -> the one it saw
    released: dict[Point, Completion] = field(default_factory=dict)
    met: dict[Point, Completion] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def qualify(program: Program, cta: int, name: object) -> object:
    """The key of a per-CTA object (an mbarrier name, a named barrier id): the name itself in a
    one-CTA program, so that its messages read as they always did; 'name@ctaN' in a cluster."""
    return name if program.ctas == 1 else f"{name}@cta{cta}"


def execute(program: Program, patient: bool = False) -> Run:
    agents = program.agents
    mbars = {
        qualify(program, cta, name): _MBarrier(count)
        for cta in range(program.ctas)
        for name, count in program.mbarriers
    }
    named: dict[object, _Named] = {}
    pcs = [0] * len(agents)
    arrived_gen: dict[int, int] = {}  # agent -> generation it arrived at in a pending bar.sync
    cluster = ClusterBarrier()
    run = Run()
    time = 0

    def tick(node: object) -> None:
        nonlocal time
        run.clock[node] = time
        time += 1

    def complete_if_done(name: str) -> None:
        bar = mbars[name]
        if bar.pending == 0 and bar.tx == 0:
            node = ("mbar", name, bar.phase)
            tick(node)
            run.completed.add(node)
            bar.phase += 1
            bar.pending = bar.arrivals

    def arrive(here: Point, name: str, count: int, tx: int) -> None:
        bar = mbars[name]
        if count > bar.pending:
            run.problems.append(
                f"{where(agents[here[0]], here[1])}: {count} arrival(s) where phase "
                f"{bar.phase} of {name} expects {bar.pending} more"
            )
            count = bar.pending
        tick(here)
        run.joined[here] = ("mbar", name, bar.phase)
        bar.tx += tx
        bar.pending -= count
        complete_if_done(name)
        if mbars[name].phase > run.joined[here][2]:
            run.completed_by[here] = run.joined[here]

    def step(a: int) -> bool:
        """Run agent a's next event if it can; False if it is blocked."""
        event = agents[a].events[pcs[a]]
        here = (a, pcs[a])

        def local(name: object) -> object:
            return qualify(program, agents[a].cta, name)

        match event:
            case Wait(barrier=name, parity=parity):
                name = local(name)  # a thread waits on its own CTA's mbarriers only
                bar = mbars[name]
                if bar.phase % 2 == parity:
                    return False
                tick(here)
                run.saw[here] = ("mbar", name, bar.phase - 1) if bar.phase else None
            case Arrive(barrier=name, count=count, tx=tx):
                arrive(here, local(name), count, tx)
            case RemoteArrive(barrier=name, cta=cta, count=count):
                arrive(here, qualify(program, cta, name), count, 0)
            case ExpectTx(barrier=name, nbytes=nbytes):
                name = local(name)
                tick(here)
                run.joined[here] = ("mbar", name, mbars[name].phase)
                mbars[name].tx += nbytes
            case TmaLoad(barrier=name, nbytes=nbytes):
                name = local(name)
                tick(here)
                run.joined[here] = ("mbar", name, mbars[name].phase)  # lands at once
                mbars[name].tx -= nbytes
                complete_if_done(name)
            case TmaMulticast(barrier=name, nbytes=nbytes):
                tick(here)
                for cta in event.ctas():  # lands at once in every CTA of the mask
                    name_there = qualify(program, cta, name)
                    run.landed[(here, cta)] = ("mbar", name_there, mbars[name_there].phase)
                    mbars[name_there].tx -= nbytes
                    complete_if_done(name_there)
            case BarSync(barrier=bid, threads=threads) | BarArrive(barrier=bid, threads=threads):
                bid = local(bid)  # bar.sync ids are CTA-local
                bar = named.setdefault(bid, _Named())
                if a not in arrived_gen:
                    if bar.threads is not None and bar.threads != threads:
                        run.problems.append(
                            f"{where(agents[a], pcs[a])}: named barrier {bid} counts {threads} "
                            f"threads here but {bar.threads} in the same generation elsewhere"
                        )
                    bar.threads = threads
                    if a in bar.agents:
                        run.problems.append(
                            f"{where(agents[a], pcs[a])}: {agents[a].name} arrives twice in "
                            f"generation {bar.generation} of named barrier {bid}"
                        )
                    bar.agents.add(a)
                    tick(here)
                    run.joined[here] = ("bar", bid, bar.generation)
                    arrived_gen[a] = bar.generation
                    bar.arrived += agents[a].threads
                    if bar.arrived >= threads:
                        if bar.arrived > threads:
                            run.problems.append(
                                f"named barrier {bid}: {bar.arrived} threads arrive in "
                                f"generation {bar.generation}, which counts {threads}"
                            )
                        node = ("bar", bid, bar.generation)
                        tick(node)
                        run.completed.add(node)
                        bar.generation += 1
                        bar.arrived, bar.threads, bar.agents = 0, None, set()
                if isinstance(event, BarSync) and named[bid].generation <= arrived_gen[a]:
                    return False
                del arrived_gen[a]
            case ClusterArrive(relaxed=relaxed):
                tick(here)
                if not relaxed:  # a relaxed arrive orders nothing before the completion
                    run.released[here] = completion(cluster.generation)
                if cluster.arrive(a, len(agents)):
                    node = completion(cluster.generation - 1)
                    tick(node)
                    run.completed.add(node)
            case ClusterWait():
                if not cluster.open(a):
                    return False
                tick(here)
                run.met[here] = completion(cluster.joined.pop(a))
            case _:
                tick(here)
        pcs[a] += 1
        return True

    if patient:  # one event at a time, the last agent that can move first
        while any(pcs[a] < len(agents[a].events) and step(a) for a in reversed(range(len(agents)))):
            pass
    while True:
        moved = False
        for a, agent in enumerate(agents):
            while pcs[a] < len(agent.events) and step(a):
                moved = True
        if not moved:
            break
    for a, agent in enumerate(agents):
        if pcs[a] < len(agent.events):
            event = agent.events[pcs[a]]
            why = (
                cluster.why_blocked(program)
                if isinstance(event, ClusterWait)
                else _why_blocked(program, agent, event, mbars, named)
            )
            run.problems.append(f"hang: {where(agent, pcs[a])} never returns ({why})")
    for bid, bar in sorted(named.items()):
        if bar.arrived and not run.problems:
            run.problems.append(
                f"named barrier {bid}: {bar.arrived} thread(s) arrive in generation "
                f"{bar.generation}, which never completes (an unmatched bar.arrive)"
            )
    if cluster.arrived and not run.problems:
        run.problems.append(cluster.why_blocked(program) + ", and nobody waits for it")
    return run


def _why_blocked(
    program: Program,
    agent: Agent,
    event: Event,
    mbars: dict[object, _MBarrier],
    named: dict[object, _Named],
) -> str:
    match event:
        case Wait(barrier=name):
            name = qualify(program, agent.cta, name)
            bar = mbars[name]
            # tx-count may dip below zero while an expect_tx is still to come, but not for good
            overshoot = ", more bytes landed than expected: an expect_tx too small" * (bar.tx < 0)
            return (
                f"{name} stays in phase {bar.phase} with {bar.pending} arrival(s) and "
                f"{bar.tx} transaction byte(s) outstanding{overshoot}"
            )
        case BarSync(barrier=bid, threads=threads):
            bid = qualify(program, agent.cta, bid)
            return f"named barrier {bid} gets {named[bid].arrived} of {threads} threads"
        case _:
            raise AssertionError(f"{event!r} cannot block")
