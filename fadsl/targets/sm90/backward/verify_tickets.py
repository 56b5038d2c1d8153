"""The ordered dQ add's ticket discipline (``deterministic on``), one check for whichever agent
issues the adds: the consumers' leader thread (verify.py) or a writer warp's lane 0
(verify_writer.py). Checked on the agent's program unrolled for some m-blocks: before each
reduce-add the agent acquires the m-block's ticket and fences the async proxy; after it, it
commits the bulk group, waits for it to complete (wait_group 0, not only .read), fences
again and releases the next ticket, with nothing between the add and the release that waits
on another warpgroup or CTA (the design's deadlock argument). The two agents differ in who
they are, what counts as such a wait, and how the messages name them (``Voice``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .program import Item, Kind, Who


@dataclass(frozen=True)
class Voice:
    """An agent of the ordered adds and how the problems name it."""

    agent: Who
    blocks: Callable[[Item], bool]  # an item between the add and the release that waits
    no_acquire: str
    no_acquire_fence: str
    no_release: str  # .format(i=m-block, m_count=...)
    no_completion: str
    no_release_fence: str
    blocked: str  # .format(i=m-block, what=the blocking item's description)


def ticket_problems(run: list[tuple[Item, int]], m_count: int, voice: Voice) -> list[str]:
    """The problems of one unrolled program ``run`` (items with their m-block)."""
    problems = []
    mine = [x.who is voice.agent for x, _ in run]
    adds = [n for n, (x, _) in enumerate(run) if x.kind is Kind.BULK_REDUCE_ADD]
    for previous, add in zip([-1] + adds, adds):
        i = run[add][1]
        before = [x.kind for (x, _), m in zip(run[previous + 1 : add], mine[previous + 1 :]) if m]
        acquires = [n for n, k in enumerate(before) if k is Kind.SEM_ACQUIRE]
        if not acquires:
            problems.append(voice.no_acquire)
        elif Kind.FENCE_PROXY_ASYNC_GLOBAL not in before[acquires[-1] :]:
            problems.append(voice.no_acquire_fence)
        rest = run[add + 1 :]
        release = next(
            (n for n, (x, j) in enumerate(rest) if x.kind is Kind.SEM_RELEASE and j == i), None
        )
        if release is None:
            problems.append(voice.no_release.format(i=i, m_count=m_count))
            continue
        between = [x for x, _ in rest[:release]]
        after = [(x.kind, x.pending) for x in between if x.who is voice.agent]
        kinds = [k for k, _ in after]
        commit = kinds.index(Kind.BULK_COMMIT) if Kind.BULK_COMMIT in kinds else None
        done = [
            n
            for n, (k, pending) in enumerate(after)
            if k is Kind.BULK_WAIT and pending == 0 and commit is not None and n > commit
        ]
        if not done:
            problems.append(voice.no_completion)
        elif Kind.FENCE_PROXY_ASYNC_GLOBAL not in kinds[done[-1] :]:
            problems.append(voice.no_release_fence)
        blocking = [x for x in between if voice.blocks(x)]
        if blocking:
            what = blocking[0].kind.value
            problems.append(voice.blocked.format(i=i, what=what, source=blocking[0].source))
    return problems
