"""sm_90a's emitter glue: the template's slots, computed from the planned, synced kernel.

The template (emit/sm90/kernel.cu.j2) holds the kernel's structure: setup, the
producer branch (its elected thread's prologue / loop / epilogue) and the consumer
branch (the loop twice: masked leading iterations, then unmasked ones). Each step is a
macro of emit/sm90/ops.cu.j2, each sync one of its sync macros, with a comment naming
the hazards it orders (or why it is there). Both roles run the IR's phases once per
non-empty tile: block items are C++ expressions of ``it`` (the tile's K/V block),
ring items add ``ring_base`` (the ring items of the CTA's earlier tiles), and the
per-tile barriers' parity comes from ``tile_count`` (the CTA's non-empty tiles so far).
"""

from __future__ import annotations

from typing import Any

from ...ir import Dtype, Kernel, Mask, Parity, Phase, Scope, Step, Sync, Threads
from ...ir.ops import Op
from .alone import alone_name
from .modifiers import context as modifier_context
from .caps import (
    BAR_ARRIVE,
    BAR_SYNC,
    BULK_COMMIT,
    BULK_WAIT,
    CLUSTER_ARRIVE,
    CLUSTER_ARRIVE_RELAXED,
    CLUSTER_WAIT,
    FENCE_MBAR_INIT,
    FENCE_PROXY_ASYNC,
    MBAR_ARRIVE,
    MBAR_ARRIVE_PEER,
    MBAR_EXPECT_TX,
    MBAR_INIT,
    MBAR_WAIT,
    SYNCTHREADS,
    SYNCWARP,
    TMA_LOAD,
    WGMMA_COMMIT,
    WGMMA_FENCE,
    WGMMA_WAIT,
    launch_registers,
)
from .syncs.insert import role_of
from .plan_smem import mbarrier_offset, o_over_rings
from .schedule import REGISTERS, ring_buffers

TEMPLATE = "sm90/kernel.cu.j2"

_SYNC_MACROS = {
    MBAR_INIT: "sync_mbar_init",
    FENCE_MBAR_INIT: "sync_fence_mbar_init",
    SYNCTHREADS: "sync_syncthreads",
    SYNCWARP: "sync_syncwarp",
    MBAR_EXPECT_TX: "sync_expect_tx",
    MBAR_ARRIVE: "sync_mbar_arrive",
    MBAR_ARRIVE_PEER: "sync_mbar_arrive_peer",
    CLUSTER_ARRIVE: "sync_cluster_arrive",
    CLUSTER_ARRIVE_RELAXED: "sync_cluster_arrive_relaxed",
    CLUSTER_WAIT: "sync_cluster_wait",
    MBAR_WAIT: "sync_mbar_wait",
    WGMMA_FENCE: "sync_wgmma_fence",
    WGMMA_COMMIT: "sync_wgmma_commit",
    WGMMA_WAIT: "sync_wgmma_wait",
    BAR_SYNC: "sync_bar_sync",
    BAR_ARRIVE: "sync_bar_arrive",
    FENCE_PROXY_ASYNC: "sync_fence_proxy_async",
    BULK_COMMIT: "sync_bulk_commit",
    BULK_WAIT: "sync_bulk_wait",
}
# Which threads of a role run a sync or step, as a C++ condition ('' = all of the role).
_GUARDS = {
    Threads.THREAD0: "threadIdx.x == 0",
    Threads.CONSUMER_FIRST: "wg == 0",
    Threads.CONSUMER_LAST: "wg == Cfg::kConsumerWGs - 1",
    Threads.CONSUMER_WARP_LANE0: "lane == 0",
    # the thread that issues the warpgroup's TMA store (bulk groups are per thread)
    Threads.CONSUMER_ELECTED: "warp == 0 && elect_one()",
    # the FP8 forward's producer warps (a transpose): lane 0 of each releases the raw V slot
    Threads.PRODUCER_WARP_LANE0: "lane == 0",
}
# With a transpose every producer thread runs the tile loop, and the producer thread's steps
# (TMA loads and their barriers) are the elected thread's of warp 0 (`leader`); without one,
# the loop is that thread's alone and needs no guard.
_TRANSPOSE_GUARDS = {**_GUARDS, Threads.PRODUCER_THREAD: "leader"}
_REG_ARRAYS = {"S": "s", "P": "p", "O": "o"}


def item_expr(lag: int) -> str:
    """The tile's K/V block item it + lag."""
    return "it" if lag == 0 else f"it - {-lag}" if lag < 0 else f"it + {lag}"


def ring_expr(lag: int) -> str:
    """The ring item of block item it + lag: the rings go on from the CTA's earlier tiles."""
    return f"ring_base + {item_expr(lag)}"


_PARITY = {
    Parity.ZERO: "0",
    Parity.PHASE: "ring_phase({ring})",
    Parity.PHASE_FLIP: "ring_phase({ring}) ^ 1u",
    Parity.TILE: "tile_phase({tile})",
    Parity.TILE_FLIP: "tile_phase({tile}) ^ 1u",
}


def tile_slot_expr(slots: int) -> str:
    """A ring of tiles' slot for this tile (tile_count: the CTA's non-empty tiles so far)."""
    return f"tile_count % {slots}"


def q_slot_bases(slots: int) -> list[str]:
    """The warpgroup's address of its rows in each slot of Q's ring (q_slots 2)."""
    return [f"smem_q_wg_slot{i}" for i in range(slots)] if slots > 1 else []


def q_slot_select(slots: int) -> str:
    """This tile's slot of Q's ring among ``q_slot_bases``: selected by the tile count's
    parity rather than computed from the slot number (ptxas then schedules the mainloop as
    with one slot)."""
    if slots == 1:
        return "smem_q_wg"
    assert slots == 2, "q_slots is 1 or 2 (validate)"
    first, second = q_slot_bases(slots)
    return f"(tile_count & 1) ? {second} : {first}"


def tile_round_expr(slots: int) -> str:
    """A ring of tiles' round for this tile, whose parity its barriers' waits pass on."""
    return "tile_count" if slots == 1 else f"tile_count / {slots}"


def _comment(sync: Sync) -> list[str]:
    lines = [f"hazard {h.describe()}" for h in sync.serves]
    if sync.note:
        lines.append(sync.note)
    return lines or [sync.kind.what]


class _Render:
    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.rings = {name.lower() for name in ring_buffers(kernel)}
        self.guards = _TRANSPOSE_GUARDS if has_transpose(kernel) else _GUARDS
        self.in_flight: list[Step] = []
        inits = [s for s in kernel.syncs() if s.kind == MBAR_INIT]
        # name -> (first index, K/V ring, slots of a ring of tiles): the per-tile barriers
        # (a ring of tiles takes consecutive indices), then the K/V ring ones interleaved
        self.barriers: dict[str, tuple[int, bool, int]] = {}
        index = 0
        for init in inits:
            if not self._ring(init.barrier):
                self.barriers[init.barrier] = (index, False, init.slots)
                index += init.slots
        self.per_tile_barriers = index
        ring = [s.barrier for s in inits if self._ring(s.barrier)]
        for j, name in enumerate(ring):
            self.barriers[name] = (index + j, True, 1)
        self.ring_barriers = len(ring)

    def _ring(self, barrier: str) -> bool:
        return barrier.split("_")[0] in self.rings  # k_full: K's ring; vt_empty: Vt's

    def bar(self, name: str, lag: int | None) -> str:
        index, ring, slots = self.barriers[name]
        if ring:
            return f"bar_{name}(ring_slot({ring_expr(lag)}))"
        return f"bar_{name}" if slots == 1 else f"bar_{name}({tile_slot_expr(slots)})"

    def sync(self, sync: Sync) -> dict[str, Any]:
        args: dict[str, Any] = {}
        if sync.barrier and sync.barrier in self.barriers:
            index, ring, slots = self.barriers[sync.barrier]
            args["ring"] = ring
            args["tile_slots"] = slots
            args["name"] = sync.barrier
            if sync.kind != MBAR_INIT:
                args["bar"] = self.bar(sync.barrier, sync.lag)
        if sync.parity is not None:
            args["parity"] = _PARITY[sync.parity].format(
                ring=ring_expr(sync.lag or 0), tile=tile_round_expr(sync.slots)
            )
        if sync.bar_id >= 0:
            if sync.peer is None:
                args["id"] = str(sync.bar_id)
            elif sync.peer == 0:
                args["id"] = f"{sync.bar_id} + wg"
            else:
                args["id"] = f"{sync.bar_id} + (wg + {sync.peer}) % Cfg::kConsumerWGs"
        args["count"] = sync.count
        args["tx"] = sync.tx
        args["groups"] = sync.groups
        fences = []
        if sync.kind == WGMMA_WAIT:
            keep = sync.groups
            retired = self.in_flight[: len(self.in_flight) - keep]
            self.in_flight = self.in_flight[len(self.in_flight) - keep :]
            regs = sorted({r for s in retired for r in REGISTERS[s.op][1] | REGISTERS[s.op][0]})
            fences = [_REG_ARRAYS[r] for r in regs]
        args["fences"] = fences
        return {
            "kind": "sync",
            "macro": _SYNC_MACROS[sync.kind],
            "args": args,
            "guard": self.guards.get(sync.who, ""),
            "elected": sync.who is Threads.CONSUMER_ELECTED,
            "comment": _comment(sync),
        }

    def step(self, step: Step, phase: Phase) -> dict[str, Any]:
        if step.op is Op.QK or step.op is Op.PV:
            self.in_flight.append(step)
        return {
            "kind": "step",
            "macro": step.op.spelling,
            "args": {
                "item": item_expr(step.lag) if step.lag is not None else "",
                "ring": ring_expr(step.lag) if step.lag is not None else "",
                "phase": phase.value,
                "role": role_of(step.who),
                "tensor": "" if step.op.tensor is None else step.op.tensor.value.lower(),
                # a load into smem[cluster] (`cluster 2`): this CTA's panels, multicast into
                # both CTAs (the buffers' scope decides, as for the sync pass and verify)
                "multicast": any(
                    self.kernel.buffer(a.buffer).scope is Scope.CLUSTER for a in step.accesses
                )
                and step.async_kind == TMA_LOAD,
            },
            "guard": self.guards.get(step.who, ""),
            "elected": step.who is Threads.CONSUMER_ELECTED,
            "comment": [step.title] if step.title else [],
        }


def by_pass_classes(cfg) -> bool:
    """Whether a pass classes the tiles before the kernel (a keep that reads inputs per
    token: TileRule.by_pass), whose list of kept blocks the tiles visit (kv_block)."""
    m = cfg.modifiers
    return m is not None and m.rule is not None and m.rule.by_pass


def has_transpose(kernel: Kernel) -> bool:
    """Whether the producer warps transpose V (the FP8 forward's Vt ring)."""
    return any(s.op is Op.TRANSPOSE_V for s in kernel.steps())


def uniform_warpgroup(cfg, dtype: Dtype) -> bool:
    """The warpgroup index made warp-uniform by a shuffle from lane 0: ptxas then keeps what
    derives from it (wgmma descriptors, SMEM addresses) in uniform registers. Measured on an
    H200 (research/probes/probe_forward.py, PROBE_DEFINES over the same tensors, hidden 2048,
    2026-11-30): head_dim 256 causal +5-13 % and +3-8 % in two runs at 1k-16k; elsewhere mixed
    (head_dim 128 +2-4 % at 1k, -2-3 % from 2k; head_dim 256 without a mask within -3..+4
    %), so only the measured kernel takes it: head_dim 256, causal without a window, 16-bit,
    no softcap or modifiers, no packed sequences, cache or split (their register
    allocation was not measured)."""
    hw = cfg.ext
    return (
        cfg.head_dim == 256
        and cfg.mask is Mask.CAUSAL
        and cfg.window is None
        and not dtype.is_8bit
        and not (hw.softcap or cfg.modifiers is not None)
        and not (hw.varlen or hw.split_kv or hw.kv_cache >= 0)
    )


def context(kernel: Kernel, dtype: Dtype) -> dict[str, Any]:
    cfg = kernel.config
    hw = cfg.ext
    assert hw is not None and kernel.smem_bytes is not None
    render = _Render(kernel)
    roles: dict[str, dict[str, list]] = {
        r: {p.value: [] for p in Phase} for r in ("setup", "producer", "consumers")
    }
    for phase, items in kernel.phases():
        for item in items:
            role = role_of(item.who)
            rendered = render.sync(item) if isinstance(item, Sync) else render.step(item, phase)
            roles[role][phase.value].append(rendered)
    # The consumers' epilogue runs its GEMM part only when there are blocks (inside the
    # `if (n_blocks > 0)`), its tail (normalise, store) always.
    epi = roles["consumers"]["epilogue"]
    cut = next(i for i, x in enumerate(epi) if x["macro"] == Op.NORMALIZE.spelling)
    pro = roles["consumers"]["prologue"]
    init = [x for x in pro if x["macro"] == Op.INIT.spelling]
    bufs = {b.name: b for b in kernel.buffers}
    # the tile timeline's marks inside the rendered steps (fadsl/sm90_trace.cuh)
    prologue = _with_mark(
        [x for x in pro if x not in init], ("sync_wgmma_wait", 0), 1, "the first S is issued"
    )
    epilogue = _with_mark(epi[:cut], ("sync_wgmma_fence", 0), 4, "the last P V's turn is taken")
    # `score` and `keep` (issue 41): the SpecModifiers struct's slots; a score that is the
    # built-in softcap written out compiles as `softcap N`
    modifiers = modifier_context(cfg)
    # The tail's items for every thread, then the elected thread's (the TMA store and its
    # bulk group) in the template's block of that thread, in the plan's order: an elected
    # item before the last shared one (the wait for the previous tile's store before O's
    # bytes are written again, where the plan puts it without ping-pong) stays in place,
    # under its guard. (Until 2026-11-30 every elected item moved into the block, and that
    # wait followed O's stmatrix: a WAR the proof orders and the kernel did not.)
    rest = epi[cut:]
    shared = max((i for i, x in enumerate(rest) if not x["elected"]), default=-1)
    tail = _with_mark(
        rest[: shared + 1] + [x for x in rest[shared + 1 :] if not x["elected"]],
        (Op.O_R2S.spelling, 1),
        6,
        "O is in SMEM",
    )
    return {
        "head_dim": cfg.head_dim,
        "block_r": cfg.block_r,
        "block_c": cfg.block_c,
        "consumers": hw.consumers,
        "stages": hw.stages,
        "producer_regs": hw.producer_regs,
        "consumer_regs": hw.consumer_regs,
        "launch_regs": launch_registers(cfg.threads, hw.ctas_per_sm),
        "ctas_per_sm": hw.ctas_per_sm,  # __launch_bounds__' minimum CTAs an SM
        "pingpong": hw.pingpong,
        "persistent": hw.persistent,
        "overlap": hw.overlap,
        "lazy_rescale": hw.lazy_rescale,
        "softcap": hw.softcap or modifiers["modifier_softcap"],
        **modifiers,
        "guarded": hw.guarded,
        "uniform_warpgroup": uniform_warpgroup(cfg, dtype),
        "scheduler": hw.scheduler,
        "rescale": hw.rescale,
        "mask": cfg.mask.value,
        "mask_text": cfg.mask_text,  # the mask line's value, window included
        # `mask window(...)`: its sizes, compile-time constants of the kernel's Cfg
        "window": cfg.window,
        # 8-bit (research/fp8-forward.md §3.6): the inputs' tag (fadsl/sm90_wgmma8.cuh), and
        # T is O's 16-bit type
        "fp8": dtype.is_8bit,
        "fp8_in": dtype.ptx_type if dtype.is_8bit else "",
        "cuda_type": (cfg.out_dtype or dtype).cuda_type if dtype.is_8bit else dtype.cuda_type,
        "smem_bytes": kernel.smem_bytes,
        "offsets": {name: b.offset for name, b in bufs.items()},
        "o_aliased": o_over_rings(kernel),
        "off_bar": mbarrier_offset(kernel),
        "barriers": {
            name: {"index": index, "ring": ring, "slots": slots}
            for name, (index, ring, slots) in render.barriers.items()
        },
        "ring_barriers": render.ring_barriers,
        "num_barriers": render.per_tile_barriers + render.ring_barriers * hw.stages,
        # Q's ring of tiles: this tile's slot and full barrier (Q's load, the consumers' Q)
        "q_slots": bufs["Q"].slots,
        "q_slot": tile_slot_expr(bufs["Q"].slots),
        "q_slot_bases": q_slot_bases(bufs["Q"].slots),
        "q_slot_select": q_slot_select(bufs["Q"].slots),
        "q_full": render.bar("q_full", None),
        # tail split_kv: the scheduler of work items (whole tiles, then pieces of the last
        # round's), and the end of a piece's K/V blocks
        "split_kv": hw.split_kv,
        "tile_index": (
            "split_tile_index<Cfg>(P, step)"
            if hw.split_kv
            else "varlen_tile_index<Cfg>(P, step)" if hw.varlen else "tile_index<Cfg>(P.base, step)"
        ),
        "tile_work": (
            "split_tile_work<Cfg>(P, tile)"
            if hw.split_kv
            else (
                "varlen_tile_work<Cfg>(P, tile)"
                if hw.varlen
                else "tile_work<Cfg>(P, tile_coords<Cfg>(P, tile))"
            )
        ),
        # `varlen on`: packed sequences, a tile list written by <kernel>_varlen_tiles first
        "varlen": hw.varlen,
        # Q's wgmma descriptors rebuilt each block (issue_qk): varlen at head_dim 64 with
        # rescale guarded spills them otherwise (48 bytes, 2026-11-27); other kernels keep
        # them in registers, their SASS unchanged. Keyed on the shape the spill was seen in,
        # not on register pressure: such a spec that would not spill pays a few integer
        # instructions a block too.
        "q_desc_per_block": hw.varlen and cfg.head_dim == 64 and hw.guarded,
        # `kv_cache`: -1 none, 0 contiguous, N rows a page; `pack_gqa on`; `splits auto`
        # (every tile split, <kernel>_combine after)
        "kv_cache": hw.kv_cache,
        "pack_gqa": hw.pack_gqa,
        "split_all": hw.split_all,
        # `tail split_kv` on 8-bit inputs: pieces in the 16-bit pieces' units
        # (fp8_piece_partial), the last one merging at scale 1 and finishing merged rows as
        # 16-bit ones (the normalize step's branch)
        "merged_8bit_pieces": dtype.is_8bit and hw.split_kv and not hw.split_all,
        # the K/V block of iteration @ (a window's tile starts at its window's first block,
        # not at block 0; keep's, past the EMPTY blocks keep_work trimmed; with a pass's
        # classes, the it-th block of its list: kv_block)
        "kv_block": (
            "kv_block<Cfg>(P, w, @)"
            if by_pass_classes(cfg)
            else (
                "w.block_end - 1 - (@)"
                if hw.split_kv or cfg.window or modifiers["keep"] is not None
                else "w.n_blocks - 1 - (@)"
            )
        ),
        # `cluster 2`: K/V loads multicast into both CTAs, arrivals on the peer's barriers
        "cluster": hw.cluster,
        # the cluster-free variant that the launches which do not pair run (sm90/alone.py)
        "alone_kernel": f"{alone_name(kernel.config.name)}_{dtype.value}",
        "alone_of": hw.alone_of and f"{hw.alone_of}_{dtype.value}",
        "setup": roles["setup"]["setup"],
        # every thread, after both roles (the cluster barrier at exit)
        "exit": roles["setup"]["teardown"],
        "producer": roles["producer"],
        "consumer_head": roles["consumers"]["setup"],
        "consumer_init": init,
        "consumer_prologue": prologue,
        "consumer_teardown": roles["consumers"]["teardown"],
        "consumer_loop": roles["consumers"]["mainloop"],
        "consumer_epilogue": epilogue,
        "consumer_tail": tail,
        # in the template's block of the elected thread: unguarded there
        "consumer_store": [{**x, "guard": ""} for x in rest[shared + 1 :] if x["elected"]],
    }


def _with_mark(items: list[dict], at: tuple[str, int], mark: int, what: str) -> list[dict]:
    """``items`` with an item that stamps the tile timeline (FADSL_TILE_TRACE builds only),
    placed by ``at`` = (macro, offset): before (0) or after (1) the first item that macro
    renders."""
    macro, offset = at
    i = next(i for i, x in enumerate(items) if x["macro"] == macro) + offset
    stamp = {
        "kind": "mark",
        "macro": "tile_mark",
        "args": {"mark": mark, "what": what},
        "guard": "",
        "elected": False,
        "comment": [],
    }
    return [*items[:i], stamp, *items[i:]]
