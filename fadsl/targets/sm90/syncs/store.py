"""insert_syncs' O store (sm_90a): stmatrix into SMEM, then a TMA store of the tile.

- O over the dead rings (WAR across consumer warpgroups): a named barrier of every
  consumer thread before stmatrix; the store's SMEM reads complete (bulk commit and
  wait_group.read 0, at once) before the elected thread arrives on O's free barrier, on
  which the producer waits with the previous tile's parity before every load into O's
  bytes. In O's own bytes (WAR across tiles within a warpgroup: the previous tile's store
  read them), the elected thread waits for that store a tile late (wait_group.read 0
  before the tile's last ping-pong turn, a bar.sync of the whole warpgroup, or without
  ping-pong before the warpgroup's named barrier ahead of stmatrix), so the wait, long
  done by then, keeps no warp of the tile boundary waiting; once more before the CTA
  exits. stmatrix (generic proxy) before the TMA store (async proxy): fence.proxy.async,
  then the warpgroup's named barrier (the elected thread stores rows the others wrote).
"""

from __future__ import annotations

from collections.abc import Sequence

from ....ir import Hazard, HazardKind, Kernel, Mode, Parity, Phase, Step, Sync, Threads
from ..caps import (
    BAR_SYNC,
    BULK_COMMIT,
    BULK_WAIT,
    FENCE_PROXY_ASYNC,
    MBAR_ARRIVE,
    MBAR_WAIT,
    TMA_STORE,
)
from .state import (
    O_STORE_ID,
    RING_DEAD_ID,
    TO_NEXT_TILE,
    Consumers,
    before_refill,
    hazard,
    init_barrier,
    overlaps,
    tma_loaded,
    transposed_into,
    unique_ops,
    writes_to,
)


def freed_by_stores(kernel: Kernel) -> dict[str, list[str]]:
    """A TMA-stored tile over loaded bytes (O over the dead V ring, or over the Vt ring the
    producer warps write) -> the buffers under it: its store frees them."""
    loaded = tma_loaded(kernel) + transposed_into(kernel)
    stored = [kernel.buffer(a.buffer) for s in _stores(kernel) for a in s.accesses]
    return {
        out.name: [b.name for b in loaded if overlaps(out, b)]
        for out in stored
        if any(overlaps(out, b) for b in loaded)
    }


def init_free_barriers(kernel: Kernel, freed: dict[str, list[str]]) -> list[Sync]:
    why = "one arrival per consumer warpgroup: its TMA store has read the bytes"
    consumers = kernel.config.ext.consumers
    return [init_barrier(kernel, f"{name.lower()}_free", consumers, why) for name in freed]


def wait_free(
    kernel: Kernel,
    load: Step,
    phase: Phase,
    buffer: str,
    freed: dict[str, list[str]],
    who: Threads = Threads.PRODUCER_THREAD,
) -> list[Sync]:
    """The producer's waits (its elected thread's, or each transposing warp's), before a
    load or transpose into ``buffer``, for the previous tile's TMA store of a tile over it."""
    waits = []
    for out_name, under in freed.items():
        if buffer not in under:
            continue
        store = next(s for s in _stores(kernel) if s.accesses[0].buffer == out_name)
        waits.append(
            Sync(
                MBAR_WAIT,
                phase,
                (
                    hazard(
                        HazardKind.WAR,
                        store.op,
                        load.op,
                        out_name,
                        buffer,
                        across=TO_NEXT_TILE,
                    ),
                ),
                kernel.config.loc,
                who=who,
                barrier=f"{out_name.lower()}_free",
                parity=Parity.TILE_FLIP,
            )
        )
    return waits


def reused_by_next_tile(kernel: Kernel) -> list[Hazard]:
    """A TMA-stored tile written again by the next tile's consumers: the previous tile's
    store (waited for by one elected thread) before every thread's write."""
    hazards = []
    for store in _stores(kernel):
        for access in store.accesses:
            for writer in kernel.steps():
                if writes_to(writer, access.buffer) and writer.async_kind is None:
                    hazards.append(
                        hazard(
                            HazardKind.WAR,
                            store.op,
                            writer.op,
                            access.buffer,
                            across="within each warpgroup, previous tile",
                        )
                    )
    return hazards


def in_own_bytes(c: Consumers) -> list[Hazard]:
    """The reuse hazards of a stored tile in its own bytes (over the rings, the
    all-consumer barrier before stmatrix orders them)."""
    return [h for h in c.reused if h.later_buffer not in c.freed]


def wait_store(c: Consumers, phase: Phase, serves: list[Hazard]) -> None:
    """The elected thread waits for the previous tile's TMA store to have read O's SMEM,
    a tile after issuing it (long done by then): every thread of the warpgroup passes a
    bar.sync of it (a turn, or the O store barrier) before writing O again."""
    _store_read(
        c,
        phase,
        "the previous tile's TMA store has read O's SMEM (waited a tile late: long done by now)",
        serves,
    )


def wait_last_store(c: Consumers, phase: Phase) -> None:
    """In the teardown: O's SMEM is the CTA's until its last store has read it."""
    if in_own_bytes(c):
        _store_read(c, phase, "the last tile's TMA store has read O's SMEM before the CTA exits")


def before_smem(c: Consumers, step: Step, phase: Phase) -> None:
    """Named barriers and the proxy fence before a consumer's generic SMEM write or TMA store."""
    kernel = c.kernel
    for access in step.accesses:
        buf = kernel.buffer(access.buffer)
        if access.mode is Mode.WRITE and step.async_kind is None:
            # WAR against every consumer warpgroup's wgmma reads of the bytes it overwrites
            served = []
            for other in kernel.buffers:
                if other.name == buf.name or not overlaps(other, buf):
                    continue
                for reader in unique_ops(c.readers.get(other.name, [])):
                    served.append(
                        hazard(
                            HazardKind.WAR,
                            reader.op,
                            step.op,
                            other.name,
                            buf.name,
                            across="consumer warpgroups cross",
                        )
                    )
            # WAR against the previous tile's TMA store of these bytes, whose SMEM reads
            # the elected thread waits for (right after the store when O lies over loaded
            # bytes, else a tile later): every thread of its warpgroup after it (in O's
            # own bytes with ping-pong, the tile's last turn, a bar.sync of the
            # warpgroup, orders it)
            previous = c.reused if served or not c.hw.pingpong else []
            if served:
                c.sync(
                    BAR_SYNC,
                    phase,
                    served + previous,
                    barrier="ring_dead",
                    bar_id=RING_DEAD_ID,
                    count=128 * c.hw.consumers,
                )
            elif previous:
                wait_store(c, phase, previous)
                _store_barrier(c, phase, previous)
        if access.mode is Mode.READ and step.async_kind == TMA_STORE:
            writers = [s for s in kernel.steps() if writes_to(s, buf.name) and s.async_kind is None]
            for w in writers:
                c.sync(
                    FENCE_PROXY_ASYNC,
                    phase,
                    [
                        hazard(
                            HazardKind.RAW,
                            w.op,
                            step.op,
                            buf.name,
                            across="generic proxy -> async proxy",
                        )
                    ],
                )
            _store_barrier(
                c, phase, [hazard(HazardKind.RAW, w.op, step.op, buf.name) for w in writers]
            )


def after_store(c: Consumers, step: Step, phase: Phase) -> None:
    """Close the TMA store's bulk group; over loaded bytes, free them for the producer."""
    c.sync(
        BULK_COMMIT,
        phase,
        who=Threads.CONSUMER_ELECTED,
        note="closes the TMA store's bulk group",
    )
    (access,) = step.accesses
    if access.buffer not in c.freed:
        return
    # O over loaded bytes: the producer waits for them, so at once
    _store_read(c, phase, "the TMA store has read O's SMEM: the bytes under it may be loaded again")
    c.sync(
        MBAR_ARRIVE,
        phase,
        [
            before_refill(c.kernel, step, under, access.buffer, across=TO_NEXT_TILE)
            for under in c.freed[access.buffer]
        ],
        who=Threads.CONSUMER_ELECTED,
        barrier=f"{access.buffer.lower()}_free",
    )


def _store_read(c: Consumers, phase: Phase, note: str, serves: Sequence[Hazard] = ()) -> None:
    """bulk wait_group.read 0 by the elected thread: its TMA stores have read their SMEM."""
    c.sync(BULK_WAIT, phase, serves, who=Threads.CONSUMER_ELECTED, groups=0, note=note)


def _store_barrier(c: Consumers, phase: Phase, serves: list[Hazard]) -> None:
    """The warpgroup's named barrier ahead of O's stmatrix or of its TMA store."""
    c.sync(BAR_SYNC, phase, serves, barrier="o_store", bar_id=O_STORE_ID, peer=0, count=128)


def _stores(kernel: Kernel) -> list[Step]:
    return [s for s in kernel.steps() if s.async_kind == TMA_STORE]
