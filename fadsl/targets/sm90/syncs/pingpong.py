"""insert_syncs' ping-pong turns (sm_90a, ``pingpong on``): named barriers, no hazard.

Performance only: each warpgroup's run of wgmma issues is a turn: bar.sync on its own
named barrier before, bar.arrive on the next warpgroup's after; the turns go on from tile
to tile: in the setup the last warpgroup opens warpgroup 0's first turn, in the teardown
warpgroup 0 takes the last hand-over, so every arrive is matched. A tile's last turn also
carries the elected thread's wait for the previous tile's TMA store of O in its own bytes
(store.py): the turn's bar.sync of the whole warpgroup orders it before every write.
"""

from __future__ import annotations

from collections.abc import Sequence

from ....ir import Hazard, Phase, Threads
from ....ir.syncmodel import SyncKind
from ..caps import BAR_ARRIVE, BAR_SYNC
from .store import wait_store
from .state import TURN_ID, Consumers

TURN_THREADS = 256  # the warpgroup waiting for its turn + the one handing over


def open_turn(c: Consumers, phase: Phase) -> None:
    """In the setup, before the first tile."""
    note = "ping-pong: the last warpgroup opens warpgroup 0's first turn"
    _turn(c, BAR_ARRIVE, phase, note, who=Threads.CONSUMER_LAST)


def take_turn(c: Consumers, phase: Phase) -> None:
    """Before a wgmma issue outside a turn."""
    if c.hw.pingpong and not c.in_turn:
        if c.carried:
            wait_store(c, phase, c.carried)
        note = "ping-pong: wait for this warpgroup's turn on the tensor cores"
        _turn(c, BAR_SYNC, phase, note, c.carried, peer=0)
        c.in_turn = True
        c.carried = []


def hand_over(c: Consumers, phase: Phase) -> None:
    """Before a wgmma wait: the warpgroup's issues are done for now."""
    if c.in_turn:
        note = "ping-pong: hand the tensor cores to the next warpgroup"
        _turn(c, BAR_ARRIVE, phase, note, peer=1)
        c.in_turn = False


def close_turns(c: Consumers, phase: Phase) -> None:
    """In the teardown, after the last tile. The turns go on from tile to tile (the last
    warpgroup's final hand-over of a tile opens warpgroup 0's first turn of the next):
    opened once before the first tile, closed once after the last."""
    note = (
        "ping-pong: warpgroup 0 takes the last warpgroup's final hand-over, so "
        "every bar.arrive is matched"
    )
    _turn(c, BAR_SYNC, phase, note, who=Threads.CONSUMER_FIRST)


def _turn(
    c: Consumers,
    kind: SyncKind,
    phase: Phase,
    note: str,
    serves: Sequence[Hazard] = (),
    who: Threads = Threads.CONSUMERS,
    peer: int | None = None,
) -> None:
    c.sync(
        kind,
        phase,
        serves,
        who=who,
        barrier="turn",
        bar_id=TURN_ID,
        peer=peer,
        count=TURN_THREADS,
        note=note,
    )
