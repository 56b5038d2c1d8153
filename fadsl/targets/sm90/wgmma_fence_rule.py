"""verify's rule for wgmma's register operands (sm_90a), which the async model leaves out:
wgmma.fence is no SMEM event, so verify marks it in the agents' events (``WGMMA_FENCE``),
checks this rule on them, and drops the markers before the proof."""

from __future__ import annotations

from dataclasses import dataclass

from ...passes.asyncmodel.model import GenericAccess, Program, Span, Wgmma


@dataclass(frozen=True)
class WgmmaFence:
    """wgmma.fence: no effect on SMEM, so it is not an async model event; the register rule
    below reads it from the unfiltered events."""


WGMMA_FENCE = WgmmaFence()


def wgmma_fence_problems(program: Program) -> list[str]:
    """PTX's rule for wgmma's register operands: a wgmma.fence before a warpgroup's first wgmma,
    and between ordinary code writing registers and a wgmma that reads or accumulates into
    them."""
    problems = []
    for agent in program.agents:
        dirty: set[Span] = set()
        fenced = False  # the first wgmma of a warpgroup needs a wgmma.fence before it
        for index, event in enumerate(agent.events):
            match event:
                case GenericAccess(span=span, write=True) if span.space.startswith("rf:"):
                    dirty.add(span)
                case WgmmaFence():
                    dirty.clear()
                    fenced = True
                case Wgmma(what=what) if not fenced:
                    problems.append(f"{agent.name} #{index} ({what}): no wgmma.fence before it")
                    fenced = True
                case Wgmma(reads=reads, writes=writes, what=what):
                    stale = sorted(s.name for s in dirty & set(reads + writes))
                    if stale:
                        problems.append(
                            f"{agent.name} #{index} ({what}) uses register(s) "
                            f"{', '.join(stale)} written since its last wgmma.fence"
                        )
    return problems
