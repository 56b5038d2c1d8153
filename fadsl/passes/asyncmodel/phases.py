"""The proof, step 2: the one execution of step 1 stands for all of them.

Happens-before (order.py) is program order plus contribution -> phase completion ->
the waits that saw it. The matching of step 1 (which phase each contribution joined, which
phase each wait saw) is the same in every execution, and no execution hangs, when

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
"""

from __future__ import annotations

from .model import Arrive, ExpectTx, Program, RemoteArrive, TmaLoad, TmaMulticast, Wait, where
from .order import Order
from .run import Completion, Point, Run, qualify


def phase_problems(program: Program, run: Run, order: Order) -> list[str]:
    """The conditions above over the run: each one that fails is a way in which another
    execution matches differently, returns a wait early, or hangs."""
    problems = []
    agents = program.agents

    def completion(node: Completion, k: int) -> Completion | None:
        other = (node[0], node[1], k)
        return other if other in run.completed else None

    contributions = list(run.joined.items()) + [
        (point, node) for (point, _), node in run.landed.items()
    ]
    for (a, i), node in contributions:
        prev = completion(node, node[2] - 1)
        if node[2] > 0 and prev is not None and not order.before(prev, (a, i)):
            if _after_own_completion(program, run, (a, i), prev):
                continue
            problems.append(
                f"{where(agents[a], i)} may count towards phase {node[2] - 1} of "
                f"{node[1]} instead of phase {node[2]}: nothing orders it after that phase "
                "completes"
            )
        event = agents[a].events[i]
        if isinstance(event, TmaLoad | TmaMulticast) and (
            node not in run.completed or not any(s == node for s in run.saw.values())
        ):
            problems.append(f"{where(agents[a], i)}: no wait sees its phase of {node[1]} complete")
    problems += _transactions(program, run)
    for (a, i), seen in run.saw.items():
        event = agents[a].events[i]
        assert isinstance(event, Wait)
        k = -1 if seen is None else seen[2]
        name = qualify(program, agents[a].cta, event.barrier)
        before = completion(("mbar", name, 0), k - 1) if k >= 1 else None
        if before is not None and not order.before_start(before, (a, i), seen):
            problems.append(
                f"{where(agents[a], i)} may return at once: phase {k - 1} of {name} "
                f"need not have completed when it starts, and its parity {event.parity} "
                f"already holds then (wrong parity or a missing wait before it)"
            )
        after = completion(("mbar", name, 0), k + 1)
        if after is not None and not order.before((a, i), after):
            problems.append(
                f"{where(agents[a], i)} may wait for the wrong phase: phase {k + 1} of "
                f"{name} can complete before it starts, and then parity "
                f"{event.parity} means phase {k + 2}"
            )
    return problems


def _after_own_completion(program: Program, run: Run, point: Point, prev: Completion) -> bool:
    """``point`` is an arrival made after (in program order) an arrival of the same agent on
    the same barrier, with the same count (the same threads), that completed phase ``prev``."""
    a, i = point
    event = program.agents[a].events[i]
    return isinstance(event, Arrive | RemoteArrive) and any(
        (a, j) in run.completed_by
        and run.completed_by[(a, j)] == prev
        and program.agents[a].events[j].count == event.count
        for j in range(i)
    )


def _transactions(program: Program, run: Run) -> list[str]:
    """Each phase must expect exactly the bytes its TMA copies land: fewer lets it complete
    before the data is there, more makes it hang."""
    expected: dict[Completion, int] = {}
    landed: dict[Completion, int] = {}
    for (a, i), node in run.joined.items():
        match program.agents[a].events[i]:
            case Arrive(tx=tx) | ExpectTx(nbytes=tx):
                expected[node] = expected.get(node, 0) + tx
            case TmaLoad(nbytes=nbytes):
                landed[node] = landed.get(node, 0) + nbytes
    for ((a, i), _), node in run.landed.items():
        landed[node] = landed.get(node, 0) + program.agents[a].events[i].nbytes
    return [
        f"phase {node[2]} of {node[1]} expects {expected.get(node, 0)} transaction bytes but "
        f"its TMA copies land {landed.get(node, 0)}"
        for node in sorted(set(expected) | set(landed), key=str)
        if expected.get(node, 0) != landed.get(node, 0)
    ]
