"""A rule of the backward's proof that the async model does not state: every byte of dS^T
(or head_dim 256's P) that a consumer's wgmma reads for m-block i was stored for m-block i
by some consumer warpgroup. The model orders each access against the others; it does not
ask whether a byte read was written at all, so a plan that dropped a warpgroup's dS^T store
would pass it, its dQ reading the buffer's bytes of m-block i - 2. `peel_dead on` (peel.py)
is where this matters: its peeled m-block stores the warpgroup's rows as zeros and nothing
else, and those stores are what dQ of that m-block reads.

Checked on verify.py's unrolled programs (each warpgroup peeled or not), so it holds for the
plan the header runs (tests/backward_walk.py reads the header against the plan)."""

from __future__ import annotations

from collections.abc import Callable

from .program import Item, Kind, Protocol, StagedTile
from .verify_tiles import tiles_unrolled

# the SMEM tiles the consumers hand each other within an m-block
_HANDED = (StagedTile.DS, StagedTile.P)


def unwritten_reads(
    proto: Protocol,
    m_count: int | tuple[int, ...],
    peeled: frozenset[int],
    spans: Callable,
    at: Callable,
) -> list[str]:
    """The reads of a handed tile that no store of the same m-block covers. ``spans`` and
    ``at`` are verify.py's (an operand's bytes at a place; a place)."""
    p = proto.params
    written: dict[int, list] = {}
    reads: list[tuple[Item, int, int, object]] = []
    for wg in range(p.consumers):
        for item, i, t in tiles_unrolled(proto.consumer, m_count, wg in peeled):
            if i is None:
                continue
            where = at(i, wg, t)
            if item.kind is Kind.ST_SHARED:
                for op in item.writes:
                    if op.buffer in _HANDED:
                        written.setdefault(i, []).extend(spans(proto, op, where))
            elif item.kind is Kind.WGMMA:
                reads += [
                    (item, i, wg, s)
                    for op in item.reads
                    if op.buffer in _HANDED
                    for s in spans(proto, op, where)
                ]
    problems = []
    for item, i, wg, span in reads:
        gaps = _uncovered(span, written.get(i, []))
        if gaps:
            problems.append(
                f"wg{wg}'s {item.name or item.kind.value} (m-block {i}) reads {span.name} "
                f"bytes {gaps[0][0] - span.lo}..{gaps[0][1] - span.lo} that no warpgroup "
                f"stored for m-block {i}"
            )
    return problems


def _uncovered(span, stores) -> list[tuple[int, int]]:
    """The byte ranges of ``span`` that no store's span covers."""
    gaps, at = [], span.lo
    for lo, hi in sorted((s.lo, s.hi) for s in stores if s.space == span.space):
        if hi <= at or lo >= span.hi:
            continue
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    if at < span.hi:
        gaps.append((at, span.hi))
    return gaps
