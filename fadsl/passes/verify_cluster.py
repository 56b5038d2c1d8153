"""The cluster-specific parts of verify_async: the cluster barrier and the exit check.

``barrier.cluster`` is modelled as one barrier for the whole cluster: a generation completes
once every agent of the program (each counting as all of its threads) has arrived, and a
``barrier.cluster.wait`` returns once the generation its agent's last arrive joined has
completed. Each agent alternates arrive and wait (a wait with no arrive of its own before it
would wait for a generation it never joined; a second arrive before the wait is undefined in
PTX), so an agent's k-th arrive joins generation k in every execution: the matching of the
one execution is the same in all of them, and needs no robustness condition of its own.
Happens-before: a release arrive -> the completion -> each wait that saw it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .async_model import ClusterArrive, ClusterWait, Program, RemoteArrive, TmaMulticast, where

if TYPE_CHECKING:
    from .verify_async_order import Order
    from .verify_async_run import Run

Point = tuple[int, int]  # (agent index, event index)
BARRIER = "barrier.cluster"  # the name of its completions: ("cluster", BARRIER, generation)


@dataclass
class ClusterBarrier:
    """The state of the cluster barrier in the one execution."""

    generation: int = 0
    arrived: set[int] = field(default_factory=set)  # agents arrived in the current generation
    joined: dict[int, int] = field(default_factory=dict)  # agent -> generation it awaits

    def arrive(self, a: int, agents: int) -> bool:
        """Agent a arrives; True when that completes the generation (then it has moved on)."""
        self.arrived.add(a)
        self.joined[a] = self.generation
        if len(self.arrived) < agents:
            return False
        self.generation += 1
        self.arrived = set()
        return True

    def open(self, a: int) -> bool:
        """Agent a's wait can return: its generation has completed."""
        return self.generation > self.joined[a]

    def why_blocked(self, program: Program) -> str:
        missing = [x.name for n, x in enumerate(program.agents) if n not in self.arrived]
        return (
            f"generation {self.generation} of the cluster barrier waits for "
            f"{', '.join(missing)} to arrive"
        )


def completion(generation: int) -> tuple[str, str, int]:
    return ("cluster", BARRIER, generation)


def malformed(program: Program) -> list[str]:
    """CTA indices outside the cluster, and cluster barrier uses out of order."""
    problems = []
    for agent in program.agents:
        if not 0 <= agent.cta < program.ctas:
            problems.append(f"{agent.name} is in cta{agent.cta} of a {program.ctas}-CTA cluster")
        arrived = False  # an arrive not yet waited for
        for i, event in enumerate(agent.events):
            match event:
                case RemoteArrive(cta=cta) if not 0 <= cta < program.ctas:
                    problems.append(f"{where(agent, i)}: there is no cta{cta} in the cluster")
                case TmaMulticast(mask=mask) if mask <= 0 or mask >> program.ctas:
                    problems.append(
                        f"{where(agent, i)}: mask {mask:#b} names no CTA or one outside the "
                        f"{program.ctas}-CTA cluster"
                    )
                case ClusterArrive() if arrived:
                    problems.append(
                        f"{where(agent, i)}: {agent.name} arrives at the cluster barrier again "
                        "before its barrier.cluster.wait"
                    )
                case ClusterWait() if not arrived:
                    problems.append(
                        f"{where(agent, i)}: {agent.name} waits at the cluster barrier without a "
                        "barrier.cluster.arrive before it (it would wait for a generation it "
                        "never joined)"
                    )
            if isinstance(event, ClusterArrive | ClusterWait):
                arrived = isinstance(event, ClusterArrive)
    return problems


def exit_problems(program: Program, run: Run, order: Order) -> list[str]:
    """No CTA may exit while a peer can still write its SMEM or arrive on its mbarriers (the
    'cluster target block not present' fault): each remote arrival on CTA d, and each multicast
    landing in d issued from another CTA, must happen before the last event of some agent of d,
    which then cannot have finished. A cluster barrier met before exit gives that order through
    happens-before (release arrive -> completion -> wait); a relaxed arrive gives none."""
    if program.ctas == 1:
        return []
    agents = program.agents
    lasts: dict[int, list[Point]] = {}
    for a, agent in enumerate(agents):
        if agent.events:
            lasts.setdefault(agent.cta, []).append((a, len(agent.events) - 1))
    reaching: list[tuple[Point, object, int]] = []  # (event, when it reaches d, d)
    for a, i in run.joined:
        event = agents[a].events[i]
        if isinstance(event, RemoteArrive) and event.cta != agents[a].cta:
            reaching.append(((a, i), (a, i), event.cta))
    for ((a, i), cta), node in run.landed.items():
        if cta != agents[a].cta and node in run.clock:  # the data is there by its completion
            reaching.append(((a, i), node, cta))
    return [
        f"{where(agents[a], i)} may reach cta{cta} after every agent of cta{cta} has finished "
        f"(a CTA must not exit while a peer can still write its SMEM or arrive on its "
        f"mbarriers: drain the ring or meet at a cluster barrier before exit)"
        for (a, i), reach, cta in reaching
        if not any(last in run.clock and order.before(reach, last) for last in lasts.get(cta, []))
    ]
