"""insert_syncs' wgmma commit groups and waits (sm_90a).

wgmma results and operands in registers (RAW/WAR within a warpgroup): each wgmma is
preceded by wgmma.fence and followed by its own commit group; before a step that
touches registers an in-flight group writes (or reads), wgmma.wait_group N keeps the
N newer groups in flight. With ``overlap off`` every GEMM is waited for at once. A wait
ends the warpgroup's ping-pong turn (pingpong.hand_over) and, for each group it
retires, frees the ring slots the group read (mbarrier.release).
"""

from __future__ import annotations

from ....ir import HazardKind, Phase, Step
from ..caps import WGMMA_COMMIT, WGMMA_FENCE, WGMMA_WAIT
from .mbarrier import release
from .pingpong import hand_over
from ..schedule import REGISTERS
from .state import Consumers, CommittedWgmma, hazard


def issue_wgmma(c: Consumers, step: Step, phase: Phase) -> None:
    """The wgmma ``step`` in its own commit group, after a wgmma.fence where ordinary code
    wrote registers since the last one."""
    if c.registers_written:
        c.sync(
            WGMMA_FENCE,
            phase,
            note="registers written by ordinary code (O rescaled, P converted) "
            "before wgmma reads them",
        )
        c.registers_written = False
    c.out.append(step)
    c.sync(WGMMA_COMMIT, phase, note=f"closes {step.op.spelling}'s wgmma group")
    reads, writes = REGISTERS[step.op]
    c.in_flight.append(CommittedWgmma(step, reads, writes))
    if not c.hw.overlap:
        wait_groups(c, None, phase, force=True)


def track_register_writes(c: Consumers, step: Step) -> None:
    """After an ordinary step: the next wgmma needs a wgmma.fence if it wrote registers."""
    c.registers_written |= bool(REGISTERS.get(step.op, ((), ()))[1])


def wait_groups(c: Consumers, step: Step | None, phase: Phase, force: bool = False) -> None:
    """wgmma.wait_group N before ``step`` if it touches registers an in-flight group uses."""
    reads, writes = REGISTERS.get(step.op, (frozenset(), frozenset())) if step else ((), ())
    newest = -1
    served = []
    for index, group in enumerate(c.in_flight):
        raw = group.writes & (set(reads) | set(writes))
        war = group.reads & set(writes)
        for reg in sorted(raw):
            served.append(
                hazard(HazardKind.RAW, group.step.op, step.op, f"{reg} (rf)", async_write=True)
            )
        for reg in sorted(war - raw):
            served.append(hazard(HazardKind.WAR, group.step.op, step.op, f"{reg} (rf)"))
        if raw or war or force:
            newest = index
    if newest < 0:
        return
    hand_over(c, phase)
    retired, c.in_flight = c.in_flight[: newest + 1], c.in_flight[newest + 1 :]
    note = "" if served else "overlap off: one GEMM in flight at a time"
    c.sync(WGMMA_WAIT, phase, served, groups=len(c.in_flight), note=note)
    for group in retired:
        release(c, group.step, phase)
