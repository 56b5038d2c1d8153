"""Where an sm_90a kernel's time goes tile by tile: the marks of fadsl/sm90_trace.cuh, summed up.

A development build (``FADSL_TILE_TRACE``, scripts/tile_trace.py) stamps %globaltimer at eight
marks of each tile each consumer warpgroup runs: 0 the tile starts, 1 its first S is issued,
2 its first block's softmax is done, 3 its mainloop is done, 4 the last P V's turn is taken,
5 the last P V is in, 6 O is in SMEM, 7 its O store is issued. ``phases`` turns them into
the medians of each phase over every warpgroup's tiles, with the gap from one tile's store
to the next tile's start, and ``per_block`` into the mainloop's time per K/V block, the unit
in which a tile boundary's cost is easiest to read.
"""

from __future__ import annotations

import re
import statistics
import struct
from dataclasses import dataclass

from ..codegen.render import read_header

PHASES = (
    ("Q, K, turn", 0, 1),  # the waits before the first S = Q K^T, and its issue
    ("first softmax", 1, 2),  # the first S waited for, its softmax
    ("mainloop", 2, 3),  # blocks 1 .. n-1
    ("last turn", 3, 4),  # the last V, the previous store's read, the turn
    ("last P V", 4, 5),  # the epilogue's GEMM, waited for
    ("O to SMEM", 5, 6),  # the tile's coordinates, (split) the hand-over, LSE, normalise, stmatrix
    ("store issue", 6, 7),  # fence, the warpgroup's barrier, the TMA store
)
# the mark that ends a tile (its O store issued), from which the gap to the next tile runs
LAST_MARK = PHASES[-1][2]


def declared_ints(header: str, names: tuple[str, ...]) -> list[int]:
    """The values of ``constexpr int NAME = N;`` for each of ``names`` in ``header``."""
    text = read_header(header)
    return [int(re.search(rf"constexpr int {name} = (\d+);", text)[1]) for name in names]


@dataclass(frozen=True)
class TraceLayout:
    """fadsl_tile_trace's shape, [ctas][warpgroups][steps][marks], as the header declares it."""

    ctas: int
    warpgroups: int
    steps: int
    marks: int

    @classmethod
    def of_target(cls, target) -> "TraceLayout":
        """The layout ``target``'s trace header declares (a ``fadsl.targets.Target``)."""
        if target.trace_header is None:
            raise ValueError(f"target {target.name} records no tile timeline")
        names = ("kTraceCtas", "kTraceWgs", "kTraceSteps", "kTraceMarks")
        return cls(*declared_ints(target.trace_header, names))

    def unpack(self, raw: bytes) -> list[int]:
        """The stamps from the array's bytes (unsigned 64-bit, little-endian)."""
        return list(
            struct.unpack(f"<{self.ctas * self.warpgroups * self.steps * self.marks}Q", raw)
        )


@dataclass(frozen=True)
class Timeline:
    """The medians, in ns, over every consumer warpgroup's stamped tiles."""

    tiles: int  # tiles with every mark stamped
    phases: dict[str, float]
    gap: float  # a tile's last mark to mark 0 of the warpgroup's next tile
    tile: float  # mark 0 to the last mark

    def per_block(self, blocks: int) -> float:
        """The mainloop's ns per K/V block, for tiles of ``blocks`` blocks."""
        return self.phases["mainloop"] / max(1, blocks - 1)


def phases(trace: list[int], layout: TraceLayout) -> Timeline | None:
    """``trace``: the flat array [cta][warpgroup][step][mark] (0: not stamped). None if no
    tile has every mark."""
    ctas, warpgroups, steps, marks = layout.ctas, layout.warpgroups, layout.steps, layout.marks
    durations: dict[str, list[int]] = {name: [] for name, _, _ in PHASES}
    gaps: list[int] = []
    tiles: list[int] = []
    for cta in range(ctas):
        for wg in range(warpgroups):
            base = (cta * warpgroups + wg) * steps
            stamps = [trace[(base + s) * marks : (base + s + 1) * marks] for s in range(steps)]
            for step, stamp in enumerate(stamps):
                if not all(stamp):
                    continue
                for name, a, b in PHASES:
                    durations[name].append(stamp[b] - stamp[a])
                tiles.append(stamp[LAST_MARK] - stamp[0])
                after = stamps[step + 1] if step + 1 < steps else None
                if after and after[0]:
                    gaps.append(after[0] - stamp[LAST_MARK])
    if not tiles:
        return None
    return Timeline(
        tiles=len(tiles),
        phases={name: statistics.median(values) for name, values in durations.items()},
        gap=statistics.median(gaps) if gaps else 0.0,
        tile=statistics.median(tiles),
    )


def report(timeline: Timeline, blocks: int) -> str:
    """The medians in microseconds and in mainloop blocks."""
    block = timeline.per_block(blocks)
    rows = [*timeline.phases.items(), ("gap to the next tile", timeline.gap)]
    lines = [
        f"{timeline.tiles} tiles of {blocks} K/V blocks; a mainloop block takes {block / 1e3:.2f} us",
        f"{'phase':<22} {'us':>8} {'blocks':>7}",
    ]
    lines += [f"{name:<22} {ns / 1e3:>8.2f} {ns / block:>7.2f}" for name, ns in rows]
    overhead = timeline.tile + timeline.gap - blocks * block
    lines.append(
        f"{'tile + gap - blocks':<22} {overhead / 1e3:>8.2f} {overhead / block:>7.2f}"
        "   (what a tile costs beyond its blocks at the mainloop's rate)"
    )
    return "\n".join(lines)
