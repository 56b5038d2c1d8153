"""insert_syncs' transpose hop (sm_90a, 8-bit dtypes; research/fp8-forward.md §3.3).

FP8 wgmma reads P V's B operand K-major only, so the producer warpgroup's 4 warps transpose
each raw V slot (TMA-written, rows = keys) into a slot of the Vt ring (rows = head_dim, keys
contiguous), which the consumers' P V reads. The hazards, each ordered by an mbarrier of
its own (an mbarrier, not a named barrier of the producer warpgroup: warps 1-3 need not
wait for warp 0's TMA waits):

- RAW V, async proxy -> producer warps: the TMA load of V(i) before each warp's
  ldmatrix.trans of item i: the elected thread arms ``v_full`` (arrive.expect_tx with the
  tile's bytes), every producer warp waits on it (parity of item i's round);
- WAR V, producer warps -> the next TMA load into the slot (item i + stages): after its
  transpose, a ``__syncwarp`` (every lane's ldmatrix reads done) and lane 0 of each warp
  arrives on ``v_empty`` (count 4); the elected thread waits on it with the flipped parity
  before every V load, the first tile's included (the ring goes on from tile to tile). The
  same ``__syncwarp`` orders a warp's stmatrix into a Vt slot before its next round's, which
  other lanes of the warp may address (stmatrix: lane 8m + g gives the row, every lane
  data);
- RAW Vt, generic proxy -> async proxy (the consumers' P V wgmma): every producer thread
  fences its stmatrix writes (``fence.proxy.async``) and arrives on ``vt_full`` (count
  128); the consumers wait on it before P V (mbarrier.wait_full, as for a loaded ring);
- WAR Vt, consumers' P V(i) -> the transpose of item i + stages: the wgmma wait that
  retires P V(i) lets lane 0 of each consumer warp arrive on ``vt_empty`` (mbarrier.release,
  count 4 per consumer warpgroup); each producer warp waits on it, flipped parity, before
  writing the slot;
- WAR O over Vt (head_dim 256's plan: O lies over the dead Vt ring): the previous tile's O
  store before this tile's transposes: ``o_free`` (store.wait_free), waited by each
  producer warp before every transpose, with the previous tile's parity.

The raw V ring is read by no consumer, so mbarrier.py leaves its barriers to this module;
Vt's consumer side (its full wait and empty arrival) is mbarrier.py's, as for any ring.
"""

from __future__ import annotations

from ....ir import Hazard, HazardKind, Item, Kernel, Mode, Parity, Phase, Step, Sync, Threads
from ....ir.ops import Op
from ..caps import FENCE_PROXY_ASYNC, MBAR_ARRIVE, MBAR_EXPECT_TX, MBAR_WAIT, SYNCWARP, TMA_LOAD
from .state import hazard, init_barrier, transposed_from, transposed_into, unique_ops
from .store import wait_free

TO_WARPS = "producer thread -> producer warps"
FROM_WARPS = "producer warps -> producer thread"
WARPS_TO_CONSUMERS = "producer warps -> consumers"
CONSUMERS_TO_WARPS = "consumers -> producer warps"
PRODUCER_WARPS = 4
WARP_THREADS = 32


def transposes(kernel: Kernel) -> bool:
    return any(s.op is Op.TRANSPOSE_V for s in kernel.steps())


def init_transpose_barriers(kernel: Kernel) -> list[Sync]:
    """Raw V's full and empty barriers and Vt's, per ring slot."""
    if not transposes(kernel):
        return []
    consumer_warps = 4 * kernel.config.ext.consumers
    out = []
    for raw in sorted(transposed_from(kernel)):
        name = raw.lower()
        out.append(init_barrier(kernel, f"{name}_full", 1, "the producer's arrive.expect_tx"))
        out.append(
            init_barrier(kernel, f"{name}_empty", PRODUCER_WARPS, "lane 0 of each producer warp")
        )
    for vt in transposed_into(kernel):
        name = vt.name.lower()
        threads = PRODUCER_WARPS * WARP_THREADS
        out.append(
            init_barrier(
                kernel, f"{name}_full", threads, "every producer thread, after its proxy fence"
            )
        )
        out.append(
            init_barrier(kernel, f"{name}_empty", consumer_warps, "one arrival per consumer warp")
        )
    return out


def around_transposes(
    kernel: Kernel, program: list[Item], phase: Phase, freed: dict[str, list[str]]
) -> list[Item]:
    """The producer's program of a phase with the transpose hop's syncs: around each raw V
    load (the elected thread's) and each transpose (every producer warp's)."""
    raw = transposed_from(kernel)
    if not raw:
        return program
    (transpose,) = unique_ops([s for s in kernel.steps() if s.op is Op.TRANSPOSE_V])
    loads = {s.accesses[0].buffer: s for s in kernel.steps() if s.async_kind == TMA_LOAD}
    out: list[Item] = []
    for item in program:
        if isinstance(item, Step) and item.async_kind == TMA_LOAD:
            (access,) = item.accesses
            if access.buffer in raw:
                out += _around_load(kernel, item, phase, transpose)
        if isinstance(item, Step) and item.op is Op.TRANSPOSE_V:
            out += _before_transpose(kernel, item, phase, loads, freed)
            out.append(item)
            out += _after_transpose(kernel, item, phase, loads)
            continue
        out.append(item)
    return out


def _sync(kernel, kind, phase, serves, who, barrier, lag, **args) -> Sync:
    return Sync(
        kind, phase, tuple(serves), kernel.config.loc, who=who, barrier=barrier, lag=lag, **args
    )


def _around_load(kernel: Kernel, load: Step, phase: Phase, transpose: Step) -> list[Sync]:
    """The elected thread, before loading raw V(i): the slot read by every warp's transpose
    of item i - stages, then the full barrier armed with the tile's bytes."""
    (access,) = load.accesses
    name, buf = access.buffer, kernel.buffer(access.buffer)
    war = hazard(HazardKind.WAR, transpose.op, load.op, name, back=True, across=FROM_WARPS)
    raw = hazard(HazardKind.RAW, load.op, transpose.op, name, async_write=True, across=TO_WARPS)
    thread = Threads.PRODUCER_THREAD
    return [
        _sync(
            kernel,
            MBAR_WAIT,
            phase,
            [war],
            thread,
            f"{name.lower()}_empty",
            load.lag,
            parity=Parity.PHASE_FLIP,
        ),
        _sync(
            kernel,
            MBAR_EXPECT_TX,
            phase,
            [raw],
            thread,
            f"{name.lower()}_full",
            load.lag,
            tx=buf.tile_bytes,
        ),
    ]


def _reads_writes(step: Step) -> tuple[str, str]:
    (read,) = [a.buffer for a in step.accesses if a.mode is Mode.READ]
    (write,) = [a.buffer for a in step.accesses if a.mode is Mode.WRITE]
    return read, write


def _vt_readers(kernel: Kernel, vt: str) -> list[Step]:
    return unique_ops(
        [
            s
            for s in kernel.steps()
            if any(a.buffer == vt and a.mode is Mode.READ for a in s.accesses)
        ]
    )


def _before_transpose(kernel, step: Step, phase, loads, freed) -> list[Sync]:
    """Each producer warp, before transposing item i: raw V(i) loaded, Vt's slot read by the
    consumers' P V of item i - stages, and (O over Vt) the previous tile's O stored."""
    raw, vt = _reads_writes(step)
    warps = Threads.PRODUCER_WARPS
    loaded = hazard(HazardKind.RAW, loads[raw].op, step.op, raw, async_write=True, across=TO_WARPS)
    wars = [
        hazard(HazardKind.WAR, r.op, step.op, vt, back=True, across=CONSUMERS_TO_WARPS)
        for r in _vt_readers(kernel, vt)
    ]
    return [
        _sync(
            kernel,
            MBAR_WAIT,
            phase,
            [loaded],
            warps,
            f"{raw.lower()}_full",
            step.lag,
            parity=Parity.PHASE,
        ),
        _sync(
            kernel,
            MBAR_WAIT,
            phase,
            wars,
            warps,
            f"{vt.lower()}_empty",
            step.lag,
            parity=Parity.PHASE_FLIP,
        ),
        *wait_free(kernel, step, phase, vt, freed, who=warps),
    ]


def _after_transpose(kernel, step: Step, phase, loads) -> list[Sync]:
    """Each producer warp, after transposing item i: lane 0 frees the raw slot (its warp's
    ldmatrix reads done), every thread fences its Vt writes for the async proxy and arrives
    on Vt's full barrier."""
    raw, vt = _reads_writes(step)
    war: list[Hazard] = [
        hazard(HazardKind.WAR, step.op, loads[raw].op, raw, back=True, across=FROM_WARPS)
    ]
    ready = [
        hazard(HazardKind.RAW, step.op, r.op, vt, across="generic proxy -> async proxy")
        for r in _vt_readers(kernel, vt)
    ]
    full = [
        hazard(HazardKind.RAW, step.op, r.op, vt, across=WARPS_TO_CONSUMERS)
        for r in _vt_readers(kernel, vt)
    ]
    across = [
        hazard(
            HazardKind.WAW, step.op, step.op, vt, back=True, across="lanes of each producer warp"
        )
    ]
    return [
        Sync(
            SYNCWARP,
            phase,
            tuple(war + across),
            kernel.config.loc,
            who=Threads.PRODUCER_WARPS,
            note="every lane's ldmatrix reads and stmatrix writes done before lane 0 arrives",
        ),
        _sync(
            kernel,
            MBAR_ARRIVE,
            phase,
            war,
            Threads.PRODUCER_WARP_LANE0,
            f"{raw.lower()}_empty",
            step.lag,
        ),
        _sync(kernel, FENCE_PROXY_ASYNC, phase, ready, Threads.PRODUCER_WARPS, "", None),
        _sync(
            kernel,
            MBAR_ARRIVE,
            phase,
            full,
            Threads.PRODUCER_WARPS,
            f"{vt.lower()}_full",
            step.lag,
        ),
    ]
