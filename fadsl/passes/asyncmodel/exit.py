"""The cluster's exit check, over the one execution (run) and its happens-before (order)."""

from __future__ import annotations

from .cluster import Point
from .model import Program, RemoteArrive, where
from .order import Order
from .run import Run


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
