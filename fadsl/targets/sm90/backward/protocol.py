"""The backward main kernel's sync plan: the steps (schedule.py: ``schedule``, the work with no
sync) with every mbarrier, named barrier, fence, wgmma group and bulk group placed by the
sync pass (syncs/: ``insert_syncs``), each sync with a ``why`` naming the hazard it orders.

``protocol(p)`` is the one plan (with `peel_dead on` peel.py's peeled first m-block added): the header (emit/sm90/include/fadsl/sm90_bwd.cuh and the
kernel body of emit/sm90/backward.cu.j2) makes its calls in its
order (tests/test_verify_backward_header.py), verify.py proves it in the async model for every
m-block count, and `fadsl explain` prints its syncs with their whys. A plan written by hand
from the header stays beside the tests as an oracle (tests/backward_hand_plan.py):
tests/test_backward_syncs.py checks that the pass places exactly its syncs in every
configuration of verify.parameter_space.

The vocabulary (roles, kinds, buffers, ``Item``, ``Params``, ``Protocol`` ...) is
program.py's, re-exported here so that ``from .protocol import Item`` keeps working.
"""

from __future__ import annotations

from .program import (
    BAR_DQ,
    BAR_DS,
    BLOCK_M,
    F32,
    KEYS_PER_WARPGROUP,
    PANEL_COLUMNS,
    ROW_BYTES,
    SYNC_KINDS,
    WARPGROUP_THREADS,
    StagedTile,
    Guard,
    Index,
    Item,
    Kind,
    Layout,
    Mbar,
    Named,
    Operand,
    Params,
    WaitParity,
    Part,
    LoopPhase,
    Protocol,
    Reg,
    WarpRole,
    CodeSite,
    Who,
    bar_id,
    default_layout,
)
from .peel import peel_dead_first
from .schedule import build_schedule
from .syncs import insert_syncs

__all__ = [
    "BAR_DQ",
    "BAR_DS",
    "BLOCK_M",
    "F32",
    "KEYS_PER_WARPGROUP",
    "PANEL_COLUMNS",
    "ROW_BYTES",
    "SYNC_KINDS",
    "WARPGROUP_THREADS",
    "StagedTile",
    "Guard",
    "Index",
    "Item",
    "Kind",
    "Layout",
    "Mbar",
    "Named",
    "Operand",
    "Params",
    "WaitParity",
    "Part",
    "LoopPhase",
    "Protocol",
    "Reg",
    "WarpRole",
    "CodeSite",
    "Who",
    "bar_id",
    "default_layout",
    "insert_syncs",
    "protocol",
    "schedule",
]


def protocol(p: Params) -> Protocol:
    """The plan of ``p``: the sync pass's placement in the schedule's steps, then (`peel_dead
    on`) the consumer's dead first m-block peeled (peel.py)."""
    return peel_dead_first(insert_syncs(build_schedule(p)))
