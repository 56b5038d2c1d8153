"""sm_90a's backward knobs for `fadsl tune --backward` (``Target.backward_tune_space``).

The tile's B_r (64, or 128 or 80 where validate admits it: 128 at head_dim 64, 80 at 128; at
80 dS's path becomes `rf -stmatrix-> smem`, since dQ^T reads dS with the queries as rows,
stored transposed), the consumer's order (`overlap`, `early_dv`, `dv_before_meeting`,
`dq_lag`), dQ's
path (staged, or `rf -red.add-> gmem`), dS's store where B_r is not 80 (st.shared, or
`rf -stmatrix-> smem`: the same bytes, a quarter of the store instructions; not yet timed on a
GPU, 2026-11-30) and the Q / dO ring's `stages`; under the causal
mask, the input's block with `longest_first` flipped (the CTA order); the input's block on the
other `scheduler` (persistent CTAs or a CTA per tile) where it admits persistent ones; the input's
block with `fused_convert` flipped where dQ goes by red.add; the input's block with
`prefetch_kv` flipped where it runs a tile per CTA, with `dv_out_first` flipped where dK
and dV go by TMA, and with `peel_dead` flipped in the lagged orders (kept on, where the input
has it, in every candidate that admits it). With `deterministic on`
dQ has a third path: staged and reduce-added by writer warps (`dq_writer on`: 1.26-1.30x
the ordered adds without them at head_dim 128 on an H200, 2026-11-30; without
`deterministic` it times below red.add, so it is not tried there), with the registers as the
block has them and at setmaxnreg 32/232 (head_dim 64's writer spills at 24), in the lagged
orders too (`dq_lag` with the writer: 1.02-1.08x the meeting's order under the causal mask,
0.93-1.00x without a mask, H200, 2026-12-02, docs/backward.md). Every
combination is a candidate; validate.py refuses what does not fit (SMEM, registers, the knobs
that do not combine) and the tuner's build step what spills. `deterministic` stays as the
spec has it. dK and dV go by TMA through the dead K and V tiles wherever that is built (the
lagged orders on the grid: 1.00-1.04x their register stores on an H200, 2026-12-02) and
from registers elsewhere.

At head_dim 256 (the consumers split head_dim: a block whose B_c is not 64 per consumer) the
kernel has one order (validate refuses `overlap`, `early_dv` and `dv_before_meeting` there),
one dQ path and one ring size that fit; its knob is B_c (80 or 64).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from ....ir import GradRole
from ....ir.backward import Backward
from ...tuning import BackwardCandidate, BackwardTuneSpace
from .routes import DK_TMA

BLOCK_MS = (64, 128, 80)
# dS's path at each B_r (80: dQ^T reads dS with the queries as rows, stored transposed)
DS_PATHS = {80: "rf -stmatrix-> smem[cta] -wgmma-> rf"}
DS_STORED = "rf -st.shared-> smem[cta] -wgmma-> rf"
DS_STMATRIX = "rf -stmatrix-> smem[cta] -wgmma-> rf"  # (elsewhere: dS^T's blocks whole)
# The consumer's orders by name: the keys each sets
_ORDER_KEYS = ("overlap", "early_dv", "dv_before_meeting", "dq_lag", "dq_first")
ORDERS = {
    name: dict(zip(_ORDER_KEYS, values))
    for name, values in {
        "plain": ("off", "off", "off", "off", "off"),
        "overlap": ("on", "off", "off", "off", "off"),
        "early_dv": ("on", "on", "off", "off", "off"),
        "dv_before_meeting": ("on", "off", "on", "off", "off"),
        # dQ one m-block behind, no meeting (with dQ by red.add only: validate refuses it
        # staged), issued after dV or before it
        "dq_lag": ("on", "off", "off", "on", "off"),
        "dq_lag_first": ("on", "off", "off", "on", "on"),
    }.items()
}
STAGED, RED, WRITER = "staged", "red.add", "staged+writer"
# dQ's path by name (None: the default, staged) and whether writer warps add the staging
DQ_CHOICES = {STAGED: (None, False), RED: ("rf -red.add-> gmem", False), WRITER: (None, True)}
# the deterministic writer's second register split (producer, consumers): the writer's loop
# beside the producer's needs more than 24 at head_dim 64 (tests/test_backward_spec.py)
WRITER_REGISTERS = (32, 232)
# dK's and dV's path by TMA (the lagged consumer's, one tile per CTA); None: the default
DKV_TMA = DK_TMA.text()
STAGES = (2, 3)
SPLIT_BLOCK_NS = (80, 64)  # head_dim 256's B_c (validate.py's)


def _label(
    block_m: int,
    order: str,
    dq: str,
    stages: int,
    longest_first=False,
    registers=None,
    ds=False,
    tma=False,
) -> str:
    first = ", longest first" if longest_first else ""
    regs = f", registers {registers[0]}/{registers[1]}" if registers else ""
    stored = ", dS stmatrix" if ds else ""
    stored += ", dK dV TMA" if tma else ""
    return f"B_r {block_m}, {order}, dQ {dq}{stored}, stages {stages}{first}{regs}"


def _dq_of(bwd: Backward) -> str:
    return WRITER if bwd.dq_writer else RED if bwd.dq_red else STAGED


def _order_of(bwd: Backward) -> str:
    if bwd.early_dv:
        return "early_dv"
    if bwd.dv_before_meeting:
        return "dv_before_meeting"
    if bwd.dq_lag:
        return "dq_lag_first" if bwd.dq_first else "dq_lag"
    return "overlap" if bwd.overlap else "plain"


def _split(bwd: Backward) -> bool:
    """Whether the block is head_dim 256's (its consumers split head_dim, not the keys)."""
    return bwd.keys_per_consumer != 64


def label_of(bwd: Backward) -> str:
    """The knobs a backward block sets, e.g. "B_r 128, overlap, dQ red.add, stages 2" (and
    the register split where writer warps run: the knob the writer's candidates vary)."""
    regs = (bwd.producer_regs, bwd.consumer_regs) if bwd.dq_writer else None
    knobs = (bwd.block_m, _order_of(bwd), _dq_of(bwd), bwd.stages, bwd.longest_first, regs)
    label = _label(*knobs, ds=bwd.ds_stmatrix, tma=bwd.dkv_tma) + (
        ", dQ converted in-kernel" if bwd.fused_convert else ""
    )
    label += ", K and V prefetched" if bwd.prefetch_kv else ""
    label += ", dV stored before the last dQ" if bwd.dv_out_first else ""
    label += ", dead first m-block peeled" if bwd.peel_dead else ""
    label += ", V late" if bwd.late_v else ""
    label += _chains_label(bwd.dq_chains)
    return f"B_c {bwd.block_n}, {label}" if _split(bwd) else label


def _chains_label(chains: int) -> str:
    return f", dQ tickets in {chains} chains" if chains != 1 else ""


def knobs_of(bwd: Backward) -> tuple:
    knobs = (bwd.block_m, _order_of(bwd), _dq_of(bwd), bwd.stages, bwd.longest_first)
    if bwd.dq_writer:
        knobs += (bwd.producer_regs, bwd.consumer_regs)
    knobs += ("dS stmatrix",) if bwd.ds_stmatrix else ()
    knobs += ("dK dV TMA",) if bwd.dkv_tma else ()
    knobs += ("fused convert",) if bwd.fused_convert else ()
    knobs += ("prefetch K V",) if bwd.prefetch_kv else ()
    knobs += ("dV out first",) if bwd.dv_out_first else ()
    knobs += ("peel dead",) if bwd.peel_dead else ()
    knobs += ("late V",) if bwd.late_v else ()
    knobs += (f"dQ chains {bwd.dq_chains}",) if bwd.dq_chains != 1 else ()
    return knobs + ((bwd.block_n,) if _split(bwd) else ())


def _flipped(base: Backward, key: str) -> BackwardCandidate:
    """The input's block with the on/off ``key`` (a Backward field of that name) flipped."""
    on = not getattr(base, key)
    return BackwardCandidate(label_of(replace(base, **{key: on})), {key: "on" if on else "off"}, {})


def _flips(base: Backward) -> tuple[BackwardCandidate, ...]:
    """`fused_convert` flipped where the block admits it (dQ by red.add, not deterministic:
    validate.py's), `prefetch_kv` where it runs a tile per CTA, `dv_out_first` where dK and
    dV go by TMA, `peel_dead` where it peels the lagged consumer (knobs.py's _peel_dead),
    `late_v` where the lagged consumer runs a tile per CTA (knobs.py's _late_v); with the
    deterministic writer warps, one chain of dQ tickets against two (`dq_chains`)."""
    keys = ("fused_convert",) if base.dq_red and not base.deterministic else ()
    keys += () if base.persistent else ("prefetch_kv",)
    keys += ("dv_out_first",) if base.dkv_tma else ()
    keys += ("peel_dead",) if _peels(base.dq_lag, base.persistent, base.block_m) else ()
    keys += ("late_v",) if base.dq_lag and not base.persistent else ()
    flips = tuple(_flipped(base, key) for key in keys)
    if base.deterministic and base.dq_writer:  # one chain of dQ tickets against two
        chains = 2 if base.dq_chains == 1 else 1
        label = label_of(replace(base, dq_chains=chains))
        flips += (BackwardCandidate(label, {"dq_chains": str(chains)}, {}),)
    return flips


def candidates(base: Backward, causal: bool) -> tuple[BackwardCandidate, ...]:
    if _split(base):
        return _split_candidates(base, causal)
    out = []
    dqs = (STAGED, RED, WRITER) if base.deterministic else (STAGED, RED)
    # (dS by stmatrix: where dS^T keeps the keys as rows, each block tried both ways)
    dss = (False, True)
    for block_m, order, dq, ds, stages in itertools.product(BLOCK_MS, ORDERS, dqs, dss, STAGES):
        if ds and block_m in DS_PATHS:
            continue
        # (the lag adds dQ from registers, or hands it to the writer warps)
        if order.startswith("dq_lag") and dq not in (RED, WRITER):
            continue
        settings = {
            "tile": f"B_r = {block_m}, B_c = {base.block_n}",
            **ORDERS[order],
            "stages": str(stages),
        }
        path, writer = DQ_CHOICES[dq]
        if writer or base.dq_writer:
            settings["dq_writer"] = "on" if writer else "off"
        if base.dq_chains != 1 and not writer:  # (the chains are the writer warps')
            settings["dq_chains"] = "1"
        paths = {GradRole.DQ.value: path}
        if ds:
            paths[GradRole.DS.value] = DS_STMATRIX
        elif block_m in DS_PATHS or base.block_m in DS_PATHS or base.ds_stmatrix:
            paths[GradRole.DS.value] = DS_PATHS.get(block_m, DS_STORED)  # (follows the tile)
        tma = order.startswith("dq_lag") and not base.persistent
        if tma or base.dkv_tma:  # (both or neither: validate.py)
            paths[GradRole.DK.value] = paths[GradRole.DV.value] = DKV_TMA if tma else None
        if base.dv_out_first and not tma:  # (it moves dV's TMA store)
            settings["dv_out_first"] = "off"
        peel = base.peel_dead and _peels(order.startswith("dq_lag"), base.persistent, block_m)
        if base.peel_dead and not peel:  # (the lagged consumer's, a tile per CTA)
            settings["peel_dead"] = "off"
        late = base.late_v and tma  # (the lagged consumer's, a tile per CTA, as the TMA stores)
        if base.late_v and not late:
            settings["late_v"] = "off"
        label = _label(block_m, order, dq, stages, ds=ds, tma=tma)
        label += ", dV stored before the last dQ" if base.dv_out_first and tma else ""
        label += ", dead first m-block peeled" if peel else ""
        label += ", V late" if late else ""
        label += _chains_label(base.dq_chains) if writer else ""
        out.append(BackwardCandidate(label, settings, paths))
        if writer:  # the same block at the writer's second register split
            producer, consumers = WRITER_REGISTERS
            regs = {"registers": f"producer = {producer}, consumers = {consumers}"}
            label = _label(block_m, order, dq, stages, registers=WRITER_REGISTERS, ds=ds, tma=tma)
            label += _chains_label(base.dq_chains)
            out.append(BackwardCandidate(label, {**settings, **regs}, paths))
    if causal:  # the input's block in the other CTA order
        flipped = "off" if base.longest_first else "on"
        out.append(BackwardCandidate(label_of(base), {"longest_first": flipped}, {}))
    if not (base.deterministic or base.dq_writer):  # the input's block on the other scheduler
        scheduler = "grid" if base.persistent else "persistent"
        plain = replace(base, prefetch_kv=False, dv_out_first=False, peel_dead=False, late_v=False)
        label = f"{label_of(plain)}, scheduler {scheduler}"
        # (persistent CTAs store dK and dV from registers: their next K and V reuse the tiles)
        stored = {GradRole.DK.value: None, GradRole.DV.value: None} if base.dkv_tma else {}
        # (a persistent CTA loads its next K and V early: no prefetch_kv)
        off = {"prefetch_kv": "off"} if base.prefetch_kv else {}
        off |= {"dv_out_first": "off"} if base.dv_out_first else {}
        off |= {"peel_dead": "off"} if base.peel_dead else {}  # (a tile per CTA)
        off |= {"late_v": "off"} if base.late_v else {}  # (a tile per CTA)
        out.append(BackwardCandidate(label, {"scheduler": scheduler, **off}, stored))
    return tuple(out) + _flips(base)


def _split_candidates(base: Backward, causal: bool) -> tuple[BackwardCandidate, ...]:
    """head_dim 256: each B_c (in either CTA order under the causal mask)."""
    out = []
    for block_n in SPLIT_BLOCK_NS:
        tile = {"tile": f"B_r = {base.block_m}, B_c = {block_n}"}
        label = f"B_c {block_n}, " + _label(base.block_m, "plain", RED, base.stages)
        out.append(BackwardCandidate(label, tile, {}))
        if causal:
            flipped = "off" if base.longest_first else "on"
            first = _label(base.block_m, "plain", RED, base.stages, flipped == "on")
            out.append(
                BackwardCandidate(f"B_c {block_n}, {first}", {**tile, "longest_first": flipped}, {})
            )
    return tuple(out) + _flips(base)


BACKWARD_TUNE_SPACE = BackwardTuneSpace(candidates=candidates, label=label_of, knobs=knobs_of)


def _peels(dq_lag: bool, persistent: bool, block_m: int) -> bool:
    """Whether `peel_dead on` is built with the order, scheduler and B_r (knobs.py's)."""
    return dq_lag and not persistent and block_m % 64 == 0
