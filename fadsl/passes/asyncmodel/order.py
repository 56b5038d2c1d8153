"""The proof's happens-before over the one execution of step 1 (run.py).

The nodes are the run's points (an agent's event) and completions (an mbarrier phase, a named
barrier generation, a cluster barrier generation); the edges:

- program order within each agent;
- each contribution (an arrival, an expect_tx, a TMA copy's landing, a bar.sync or bar.arrive)
  -> the completion it joined, and a bar.sync's completion -> the agent's next event (the
  bar.sync's own point is its arrival; it returns only once its generation completes);
- a completion -> each mbarrier wait that saw it;
- a release cluster arrive -> its generation's completion -> each barrier.cluster.wait that
  met it.

Every edge points forward in the run's clock, so the clock order is a topological order, and
one pass in it builds each node's ancestors as a bit set.
"""

from __future__ import annotations

from .model import BarSync, Program
from .run import Point, Run


class Order:
    """Happens-before over the points and completions of the one execution."""

    def __init__(self, program: Program, run: Run) -> None:
        preds: dict[object, list[object]] = {node: [] for node in run.clock}
        for a, agent in enumerate(program.agents):
            for i in range(1, len(agent.events)):
                if (a, i) in preds and (a, i - 1) in preds:
                    preds[(a, i)].append((a, i - 1))
        for (point, _), node in run.landed.items():
            if node in preds:
                preds[node].append(point)
        for point, node in run.joined.items():
            if node in preds:
                preds[node].append(point)
                after = (point[0], point[1] + 1)
                event = program.agents[point[0]].events[point[1]]
                if isinstance(event, BarSync) and after in preds:
                    preds[after].append(node)  # bar.sync returns once its generation completes
        for point, node in run.saw.items():
            if node is not None:
                preds[point].append(node)
        for point, node in run.released.items():
            preds[node].append(point)
        for point, node in run.met.items():
            preds[point].append(node)
        self.preds = preds
        self.ancestors: dict[object, int] = {}
        self.bit = {node: 1 << n for n, node in enumerate(sorted(run.clock, key=run.clock.get))}
        for node in sorted(run.clock, key=run.clock.get):
            mask = 0
            for p in preds[node]:
                mask |= self.ancestors[p] | self.bit[p]
            self.ancestors[node] = mask

    def before(self, x: object, y: object) -> bool:
        """x happens before y (or is y)."""
        return x == y or bool(self.ancestors[y] & self.bit[x])

    def before_start(self, x: object, wait: Point, seen: object) -> bool:
        """x happens before ``wait`` starts: before one of its predecessors other than the
        completion it waits for (a wait's node is the moment it returns)."""
        return any(self.before(x, p) for p in self.preds[wait] if p != seen)
