"""Where the sm_90a backward's time goes m-block by m-block: the marks of a
target's backward trace header (sm_90a: fadsl/sm90_bwd_trace.cuh), summed up (scripts/backward_trace.py runs a development build with
``FADSL_BWD_TRACE``).

Each consumer warpgroup stamps %globaltimer at ten marks of each m-block: 0 the m-block
starts, 1 its Q, dO, LSE and D landed, 2 S^T in registers, 3 P computed, 4 dS computed and
packed, 5 dS^T stored, 6 the warpgroups met and dQ is issued, 7 dQ in registers, 8 dQ added,
9 the m-block's slot released. The producer stamps 0 before waiting for a free slot, 1 when
it is free, 2 when the loads are issued. Each CTA stamps its SM and 1 its start (the ring's
barriers initialised), 2 K and V landed, 3 its m-blocks done, 4 dK and dV stored (consumer
warpgroup 0's view).
"""

from __future__ import annotations

import statistics
import struct
from dataclasses import dataclass

from .tiletrace import declared_ints

CONSUMER_PHASES = (
    ("wait for Q, dO, LSE, D", 0, 1),
    ("S^T (dP^T issued)", 1, 2),
    ("P", 2, 3),
    ("dP^T waited, dS", 3, 4),
    ("dS^T stored", 4, 5),
    ("meeting, dQ issued", 5, 6),
    ("dQ waited", 6, 7),
    ("dQ added", 7, 8),
    ("dV, dK retired, slot freed", 8, 9),
)
# the mark that ends a consumer's m-block, from which the gap to its next m-block runs
LAST_MARK = CONSUMER_PHASES[-1][2]
PRODUCER_PHASES = (("wait for a free slot", 0, 1), ("loads issued", 1, 2))
CTA_PHASES = (("start to K, V landed", 1, 2), ("m-blocks", 2, 3), ("dK, dV stored", 3, 4))


@dataclass(frozen=True)
class BackwardTraceLayout:
    """The arrays' shapes as the header declares them."""

    ctas: int
    roles: int
    steps: int
    marks: int
    all_ctas: int
    cta_marks: int

    @classmethod
    def of_target(cls, target) -> "BackwardTraceLayout":
        """The layout ``target``'s backward trace header declares (a ``fadsl.targets.Target``)."""
        if target.backward_trace_header is None:
            raise ValueError(f"target {target.name} records no backward timeline")
        names = (
            "kBwdTraceCtas",
            "kBwdTraceRoles",
            "kBwdTraceSteps",
            "kBwdTraceMarks",
            "kBwdTraceAllCtas",
            "kBwdCtaMarks",
        )
        return cls(*declared_ints(target.backward_trace_header, names))

    def unpack_steps(self, raw: bytes) -> list[int]:
        return list(struct.unpack(f"<{self.ctas * self.roles * self.steps * self.marks}Q", raw))

    def unpack_ctas(self, raw: bytes) -> list[int]:
        return list(struct.unpack(f"<{self.all_ctas * self.cta_marks}Q", raw))


@dataclass(frozen=True)
class Budget:
    """Medians in ns: per consumer m-block phase, per producer phase, per CTA phase; the
    gap from a consumer's m-block to its next; the gap on an SM from one CTA's dK, dV store
    to the next CTA's start. Per consumer phase also the mean and the 90th percentile: a
    wait that stalls some m-blocks only (an ordered add's ticket) moves them, not the
    median."""

    m_blocks: int
    consumer: dict[str, float]
    consumer_mean: dict[str, float]
    consumer_p90: dict[str, float]
    m_block: float
    m_block_gap: float
    producer: dict[str, float]
    cta: dict[str, float]
    cta_gap: float
    ctas: int


def _median(values: list[int]) -> float:
    return statistics.median(values) if values else 0.0


def _mean(values: list[int]) -> float:
    return statistics.fmean(values) if values else 0.0


def _p90(values: list[int]) -> float:
    """The 90th percentile (nearest rank)."""
    if not values:
        return 0.0
    ranked = sorted(values)
    return float(ranked[max(0, -(-9 * len(ranked) // 10) - 1)])


def _durations(stamps: list[list[int]], phases) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {name: [] for name, _, _ in phases}
    for stamp in stamps:
        for name, a, b in phases:
            if stamp[a] and stamp[b]:
                found[name].append(stamp[b] - stamp[a])
    return found


def budget(
    steps: list[int], ctas: list[int], layout: BackwardTraceLayout, consumers: int
) -> Budget | None:
    """``steps``: fadsl_bwd_trace flat [cta][role][step][mark]; ``ctas``: fadsl_bwd_ctas flat
    [cta][mark] (0: not stamped). None if no consumer m-block has every mark."""
    marks = layout.marks
    consumer_stamps, producer_stamps, gaps, totals = [], [], [], []
    for cta in range(layout.ctas):
        for role in range(layout.roles):
            base = (cta * layout.roles + role) * layout.steps
            rows = [steps[(base + s) * marks : (base + s + 1) * marks] for s in range(layout.steps)]
            if role >= consumers:
                producer_stamps += [r for r in rows if r[0]]
                continue
            for s, row in enumerate(rows):
                if not all(row):
                    continue
                consumer_stamps.append(row)
                totals.append(row[LAST_MARK] - row[0])
                if s + 1 < layout.steps and rows[s + 1][0]:
                    gaps.append(rows[s + 1][0] - row[LAST_MARK])
    if not consumer_stamps:
        return None
    per_cta = [
        ctas[c * layout.cta_marks : (c + 1) * layout.cta_marks] for c in range(layout.all_ctas)
    ]
    stamped = [c for c in per_cta if all(c[1:])]
    by_sm: dict[int, list[list[int]]] = {}
    for c in stamped:
        by_sm.setdefault(c[0], []).append(c)
    cta_gaps = []
    for runs in by_sm.values():
        runs.sort(key=lambda c: c[1])
        cta_gaps += [b[1] - a[4] for a, b in zip(runs, runs[1:])]
    phases = _durations(consumer_stamps, CONSUMER_PHASES)
    return Budget(
        m_blocks=len(consumer_stamps),
        consumer={k: _median(v) for k, v in phases.items()},
        consumer_mean={k: _mean(v) for k, v in phases.items()},
        consumer_p90={k: _p90(v) for k, v in phases.items()},
        m_block=_median(totals),
        m_block_gap=_median(gaps),
        producer={k: _median(v) for k, v in _durations(producer_stamps, PRODUCER_PHASES).items()},
        cta={k: _median(v) for k, v in _durations(stamped, CTA_PHASES).items()},
        cta_gap=_median(cta_gaps),
        ctas=len(stamped),
    )


def report(b: Budget) -> str:
    """The medians in microseconds, each consumer phase also as a share of its m-block and
    with its mean and 90th percentile."""
    lines = [f"{b.m_blocks} consumer m-blocks; an m-block takes {b.m_block / 1e3:.2f} us"]
    lines.append(f"{'consumer phase':<28} {'us':>7} {'share':>6} {'mean':>7} {'p90':>7}")
    for name, ns in b.consumer.items():
        mean, p90 = b.consumer_mean[name] / 1e3, b.consumer_p90[name] / 1e3
        share = ns / max(b.m_block, 1)
        lines.append(f"{name:<28} {ns / 1e3:>7.3f} {share:>6.1%} {mean:>7.3f} {p90:>7.3f}")
    lines.append(f"{'gap to the next m-block':<28} {b.m_block_gap / 1e3:>7.3f}")
    lines += [f"producer: {name:<18} {ns / 1e3:>7.3f}" for name, ns in b.producer.items()]
    lines.append(f"{b.ctas} CTAs:")
    lines += [f"  {name:<26} {ns / 1e3:>7.2f} us" for name, ns in b.cta.items()]
    lines.append(f"  {'gap to the SM next CTA':<26} {b.cta_gap / 1e3:>7.2f} us")
    return "\n".join(lines)
