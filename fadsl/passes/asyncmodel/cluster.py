"""The cluster-specific parts of the proof (prove.py): the cluster barrier and the checks of a
cluster program's shape (the exit check, over a run and its order, is exit.py).

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

from .model import ClusterArrive, ClusterWait, Program, RemoteArrive, TmaMulticast, where

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
