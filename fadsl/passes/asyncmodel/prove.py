"""verify for warp-specialised pipelines: a proof that a Program's syncs are enough.

It shares no logic with the pass that places the syncs (nor imports it). Three steps, one
module each; this module checks the names first, runs them in order and gathers the problems:

1. **One execution** (run.py). Run the agents with a fixed scheduler under the
   hardware's rules for mbarriers and named barriers: a hang there is reported; otherwise the
   run tells which phase each arrival, transaction and TMA copy joined and each wait saw.
2. **That execution stands for all of them** (phases.py). Over happens-before
   (order.py), every contribution joins its phase and every wait sees its phase in
   every execution, parities included, and each phase expects exactly the bytes it lands.
3. **Every hazard is ordered** (hazards.py). Any two accesses to overlapping bytes,
   one a write, are ordered end -> start, and fenced where the proxy changes.

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

from .model import Arrive, ExpectTx, Program, RemoteArrive, TmaLoad, TmaMulticast, Wait, where
from .hazards import accesses, hazard_problems
from .order import Order
from .phases import phase_problems
from .run import Run, execute
from .exit import exit_problems
from .cluster import malformed as cluster_malformed


class AsyncVerifyError(Exception):
    """The plan hangs, depends on timing, or leaves hazards unordered; ``failures`` says how."""

    def __init__(self, failures: tuple[str, ...]) -> None:
        self.failures = tuple(failures)
        lines = "\n".join(f"  {f}" for f in self.failures)
        super().__init__(f"{len(self.failures)} problem(s) in the sync plan:\n{lines}")


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
    ops, problems = accesses(program, run)
    problems += phase_problems(program, run, order)
    problems += exit_problems(program, run, order)
    problems += hazard_problems(program, ops, order, run.clock, run)
    return tuple(dict.fromkeys(problems))


def verify_program(program: Program) -> Program:
    """Return ``program`` if its sync plan is proven, else raise AsyncVerifyError."""
    problems = check(program)
    if problems:
        raise AsyncVerifyError(problems)
    return program
