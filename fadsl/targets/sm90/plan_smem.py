"""plan_smem for sm_90a: Q, the K and V rings (slots x stages), mbarriers; O over the dead V ring.

Tiles start 1024-byte aligned (the 128-byte swizzle repeats every 8 rows of 128 bytes):
Q | K ring | V ring | mbarriers. O is written only after every consumer's last wgmma
has read the rings, so it lies over the V ring (ending where the V ring ends, into the
dead K ring, when larger). Why that is safe is recorded from the generic liveness
(fadsl.passes.plan_smem.occupancy over the schedule, back edge included): O is never
live at a step where K or V is, within a tile; the next tile's loads into those bytes
wait for O's TMA store (insert_syncs' free barrier). The mbarrier array has a full and
an empty barrier per TMA-loaded tile or ring slot, and O's free barrier.
"""

from __future__ import annotations

from dataclasses import replace

from ... import targets
from ...errors import Diagnostic, SpecError
from ...ir import Buffer, Kernel, Mode, Region
from ...passes.plan_smem import flow, live_text, occupancy

TILE_ALIGN = 1024
BASE_SLACK = 1024  # dynamic SMEM is only 16-byte aligned: the kernel rounds its base up


def mbarrier_count(kernel: Kernel) -> int:
    """A full and an empty barrier per TMA-loaded tile or ring slot (Q's empty: the next
    tile may load it), and one free barrier for O, whose store frees the ring bytes under
    it for the next tile's loads."""
    loaded = {
        a.buffer for s in kernel.steps() if s.is_async for a in s.accesses if a.mode is Mode.WRITE
    }
    return sum(2 * buf.slots for buf in kernel.buffers if buf.name in loaded) + 1


def plan_smem(kernel: Kernel, target: targets.Target) -> Kernel:
    steps, _ = flow(kernel)
    occupied = occupancy(kernel)
    bufs = {b.name: b for b in kernel.buffers}
    placed: dict[str, Buffer] = {}
    regions: list[Region] = []
    offset = 0
    for index, name in enumerate(("Q", "K", "V")):
        buf = bufs[name]
        placed[name] = replace(buf, offset=offset, region=index)
        size = -(-buf.nbytes // TILE_ALIGN) * TILE_ALIGN
        regions.append(Region(index, offset, size, (name,), ()))
        offset += size
    rings_end = offset
    o = bufs["O"]
    for ring in ("K", "V"):
        if occupied["O"] & occupied[ring]:
            raise SpecError(
                [Diagnostic(o.loc, f"O is live while the {ring} ring is: O cannot lie over it")]
            )
    v = placed["V"]
    o_offset = v.offset if o.nbytes <= v.nbytes else rings_end - o.nbytes
    if o_offset < placed["K"].offset:
        raise SpecError(
            [
                Diagnostic(
                    o.loc,
                    f"O ({o.nbytes} bytes) is larger than the K and V rings together; "
                    "use more stages",
                )
            ]
        )
    placed["O"] = replace(o, offset=o_offset, region=2)
    why = [
        f"V (live {live_text(steps, occupied['V'])}) and O (live "
        f"{live_text(steps, occupied['O'])}) are never live at once; O is written after "
        "every consumer warpgroup's last wgmma of the tile has read the rings, and the next "
        "tile's V loads wait for O's TMA store"
    ]
    if o_offset < v.offset:
        why.append(
            f"O ({o.nbytes} bytes) is larger than the V ring: it ends where the V ring ends and "
            f"runs into the K ring (live {live_text(steps, occupied['K'])}), dead too"
        )
    regions[2] = replace(regions[2], members=("V", "O"), reasons=tuple(why))
    bars = mbarrier_count(kernel)
    total = rings_end + 8 * bars + BASE_SLACK
    limit = target.capabilities.smem_per_cta
    if total > limit:
        raise SpecError(
            [
                Diagnostic(
                    kernel.config.loc_of("tile"),
                    f"the SMEM plan needs {total} bytes per CTA, over {target.name}'s limit "
                    f"of {limit} bytes; use fewer stages or a smaller B_c",
                )
            ]
        )
    return replace(
        kernel,
        buffers=tuple(placed[b.name] for b in kernel.buffers),
        regions=tuple(regions),
        smem_bytes=total,
    )


def mbarrier_offset(kernel: Kernel) -> int:
    """Where the mbarrier array starts: after the rings."""
    return max(r.offset + r.nbytes for r in kernel.regions)
