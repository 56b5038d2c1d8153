"""plan_smem for sm_90a: Q, the K and V rings (slots x stages), O, mbarriers.

Tiles start 1024-byte aligned (the 128-byte swizzle repeats every 8 rows of 128 bytes):
Q | K ring | V ring | O | mbarriers when O's bytes fit, so that the next tile's V loads
need not wait for this tile's O store (nor each consumer warpgroup for the others
before stmatrix). When they do not fit, O lies over the V ring (ending where the V ring
ends, into the dead K ring, when larger): it is written only after every consumer's last
wgmma of the tile has read the rings. Why that is safe is recorded from the generic
liveness (fadsl.passes.plan_smem.occupancy over the schedule, back edge included): O is
never live at a step where K or V is, within a tile; the next tile's loads into those
bytes wait for O's TMA store (insert_syncs' free barrier). The mbarrier array has a full
and an empty barrier per TMA-loaded tile or ring slot, and O's free barrier when O lies
over the rings.

8-bit kernels (research/fp8-forward.md §3.2): Q | K ring | V ring | Vt ring | O; the ring the
tile's last wgmma reads is Vt, so O, when it does not fit, lies over Vt: the next tile's raw
V loads need not wait for O's store, only its first transpose does. Vt has a full and an
empty barrier per slot like the loaded rings.
"""

from __future__ import annotations

from dataclasses import replace

from ... import targets
from ...errors import Diagnostic, SpecError
from ...ir import Buffer, Kernel, Mode, Region
from ...ir.ops import Op
from ...passes.plan_smem import flow, live_text, occupancy
from .caps import smem_limit

TILE_ALIGN = 1024
BASE_SLACK = 1024  # dynamic SMEM is only 16-byte aligned: the kernel rounds its base up


def mbarrier_count(kernel: Kernel, o_aliased: bool | None = None) -> int:
    """A full and an empty barrier per TMA-loaded tile or ring slot (Q's empty: the next
    tile may load it), and, when O lies over the V ring, a free barrier for O, whose store
    frees those bytes for the next tile's loads (``o_aliased`` None: as planned)."""
    if o_aliased is None:
        o_aliased = o_over_rings(kernel)
    loaded = {
        a.buffer
        for s in kernel.steps()
        if s.is_async or s.op is Op.TRANSPOSE_V  # Vt: written by the producer warps
        for a in s.accesses
        if a.mode is Mode.WRITE
    }
    return sum(2 * buf.slots for buf in kernel.buffers if buf.name in loaded) + o_aliased


def plan_smem(kernel: Kernel, target: targets.Target) -> Kernel:
    steps, _ = flow(kernel)
    occupied = occupancy(kernel)
    bufs = {b.name: b for b in kernel.buffers}
    placed: dict[str, Buffer] = {}
    regions: list[Region] = []
    offset = 0
    rings = ring_names(kernel)
    for index, name in enumerate(("Q", *rings)):
        buf = bufs[name]
        placed[name] = replace(buf, offset=offset, region=index)
        size = _aligned(buf.nbytes)
        regions.append(Region(index, offset, size, (name,), ()))
        offset += size
    o = bufs["O"]
    ctas = kernel.config.ext.ctas_per_sm
    limit = smem_limit(ctas)  # `ctas_per_sm 2`: the plan fits the SM twice
    bars = mbarrier_count(kernel, o_aliased=False)
    if offset + _aligned(o.nbytes) + 8 * bars + BASE_SLACK <= limit:
        # Room for O's own bytes: the next tile's V loads need not wait for this tile's O
        # store, nor every consumer warpgroup for the others before stmatrix.
        placed["O"] = replace(o, offset=offset, region=len(regions))
        why = "O has bytes of its own (they fit): the next tile loads V while this one stores O"
        regions.append(Region(len(regions), offset, _aligned(o.nbytes), ("O",), (why,)))
        offset += _aligned(o.nbytes)
    else:
        last, before = rings[-1], rings[-2]  # V and K; 8-bit: Vt and the raw V
        placed["O"] = _o_over_v(o, placed, steps, occupied, offset, rings)
        writes = f"transposes into {last}" if last == "Vt" else f"{last} loads"
        why = [
            f"{last} (live {live_text(steps, occupied[last])}) and O (live "
            f"{live_text(steps, occupied['O'])}) are never live at once; O is written after "
            "every consumer warpgroup's last wgmma of the tile has read the rings, and the "
            f"next tile's {writes} wait for O's TMA store (no room for O's own bytes)"
        ]
        if placed["O"].offset < placed[last].offset:
            why.append(
                f"O ({o.nbytes} bytes) is larger than the {last} ring: it ends where the "
                f"{last} ring ends and runs into the {before} ring (live "
                f"{live_text(steps, occupied[before])}), dead too"
            )
        index = len(rings)
        regions[index] = replace(regions[index], members=(last, "O"), reasons=tuple(why))
        bars = mbarrier_count(kernel, o_aliased=True)
        if kernel.config.ext.cluster > 1:
            # The peer's multicast into the V ring would need a cluster-wide "O stored"
            # barrier before every next tile's first V load: not built.
            raise SpecError(
                [
                    Diagnostic(
                        kernel.config.loc_of("cluster_value"),
                        f"cluster {kernel.config.ext.cluster} needs O in its own SMEM "
                        "bytes (the peer CTA multicasts into the K/V rings); here O lies "
                        "over the dead V ring: use a smaller B_c or fewer stages",
                    )
                ]
            )
        if kernel.config.ext.split_kv:
            # A piece that is not its tile's last skips the tail, so the tail may hold no
            # barrier of every consumer warpgroup (O over the rings needs two).
            raise SpecError(
                [
                    Diagnostic(
                        kernel.config.loc_of("tail_value"),
                        "tail split_kv needs O in its own SMEM bytes (a piece may skip the "
                        "tile's store); here O lies over the dead V ring: use a smaller B_c "
                        "or fewer stages",
                    )
                ]
            )
    total = offset + 8 * bars + BASE_SLACK
    if total > limit:
        shared = f" with ctas_per_sm {ctas} ({ctas} CTAs an SM)" if ctas > 1 else ""
        raise SpecError(
            [
                Diagnostic(
                    kernel.config.loc_of("ctas_per_sm_value" if ctas > 1 else "tile"),
                    f"the SMEM plan needs {total} bytes per CTA, over {target.name}'s limit "
                    f"of {limit} bytes{shared}; use fewer stages or a smaller B_c",
                )
            ]
        )
    return replace(
        kernel,
        buffers=tuple(placed[b.name] for b in kernel.buffers),
        regions=tuple(regions),
        smem_bytes=total,
    )


def o_over_rings(kernel: Kernel) -> bool:
    """Whether the planned O lies over the K/V rings' bytes."""
    o = kernel.buffer("O")
    assert o.offset is not None, "run plan_smem first"
    return any(
        b.name != "O" and b.offset < o.offset + o.nbytes and o.offset < b.offset + b.nbytes
        for b in kernel.buffers
    )


def _aligned(nbytes: int) -> int:
    return -(-nbytes // TILE_ALIGN) * TILE_ALIGN


def ring_names(kernel: Kernel) -> tuple[str, ...]:
    """The rings in SMEM order: K, V and, for 8-bit kernels, Vt (the schedule's order)."""
    return tuple(b.name for b in kernel.buffers if b.name not in ("Q", "O"))


def _o_over_v(o, placed: dict[str, Buffer], steps, occupied, rings_end: int, rings) -> Buffer:
    """O over the dead last ring (V, or Vt), ending where it ends, into the ring before it
    when larger."""
    last, before = rings[-1], rings[-2]
    for ring in (before, last):
        if occupied["O"] & occupied[ring]:
            raise SpecError(
                [Diagnostic(o.loc, f"O is live while the {ring} ring is: O cannot lie over it")]
            )
    v = placed[last]
    o_offset = v.offset if o.nbytes <= v.nbytes else rings_end - o.nbytes
    if o_offset < placed[before].offset:
        raise SpecError(
            [
                Diagnostic(
                    o.loc,
                    f"O ({o.nbytes} bytes) is larger than the {before} and {last} rings "
                    "together; use more stages",
                )
            ]
        )
    return replace(o, offset=o_offset, region=len(rings))


def mbarrier_offset(kernel: Kernel) -> int:
    """Where the mbarrier array starts: after the tiles."""
    return max(r.offset + r.nbytes for r in kernel.regions)
