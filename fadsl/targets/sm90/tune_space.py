"""sm_90a's knobs for `fadsl tune` (fadsl.targets.tuning): the tile, the pipeline, warp
specialisation and the schedule variants, each with the values worth trying.

The consumer warpgroups set B_r (64 rows each) and the setmaxnreg split with them
(caps.default_registers: 56/256, 24/240, 32/160, the splits that fill the CTA's register pool);
`cluster 2` moves K and V to smem[cluster]. Everything else the checks judge (validate.py:
SMEM, the pool, the consumers' register estimate, the knobs that do not combine; plan_smem: O's
bytes for cluster and split_kv). ``likely_spills`` adds the register patterns that pass those
checks and are known to spill.
"""

from __future__ import annotations

from typing import Any

from ...ir import Config, Mask, Rescale
from ..tuning import Knob, TuneSpace, Values
from .caps import ROWS_PER_CONSUMER, default_registers

ON_OFF = ("on", "off")

KNOBS = (
    # wgmma's N and TMA's box rows: multiples of 16 up to 256
    Knob("B_c", tuple(range(48, 257, 16)), "c{}", reach=2),
    Knob("consumers", (1, 2, 3), "w{}"),
    Knob("stages", (1, 2, 3, 4), "s{}"),
    Knob("q_slots", (1, 2), "q{}"),
    Knob("cluster", (1, 2), "x{}"),
    Knob("pingpong", ON_OFF, "pp{}"),
    Knob("overlap", ON_OFF, "ov{}"),
    Knob("scheduler", ("persistent", "grid"), "{}"),
    Knob("tail", ("whole", "split_kv"), "{}"),
    Knob("rescale", ("every", "lazy", "guarded"), "{}"),
)


def read(config: Config) -> dict[str, Any]:
    hw = config.ext
    assert hw is not None
    on = {True: "on", False: "off"}
    return {
        "B_c": config.block_c,
        "consumers": hw.consumers,
        "stages": hw.stages,
        "q_slots": hw.q_slots,
        "cluster": hw.cluster,
        "pingpong": on[hw.pingpong],
        "overlap": on[hw.overlap],
        "scheduler": hw.scheduler,
        "tail": "split_kv" if hw.split_kv else "whole",
        "rescale": hw.rescale,
    }


def settings(values: Values, base: Config) -> dict[str, str]:
    hw = base.ext
    assert hw is not None
    consumers = values["consumers"]
    if consumers == hw.consumers:  # the spec's own split, which may not be the default
        producer_regs, consumer_regs = hw.producer_regs, hw.consumer_regs
    else:  # the split that fills the pool for this many consumers
        producer_regs, consumer_regs = default_registers(consumers, hw.ctas_per_sm)
    return {
        "tile": f"B_r = {ROWS_PER_CONSUMER * consumers}, B_c = {values['B_c']}",
        "warpgroups": f"producer = 1, consumers = {consumers}",
        "registers": f"producer = {producer_regs}, consumers = {consumer_regs}",
        "stages": str(values["stages"]),
        "q_slots": str(values["q_slots"]),
        "cluster": str(values["cluster"]),
        "pingpong": values["pingpong"],
        "overlap": values["overlap"],
        "scheduler": values["scheduler"],
        "tail": values["tail"],
        "rescale": values["rescale"],
    }


def scopes(values: Values) -> dict[str, str]:
    """K and V in smem[cluster] with `cluster 2` (both CTAs hold the tile), else smem[cta]."""
    scope = "cluster" if values["cluster"] > 1 else "cta"
    return {"K": scope, "V": scope}


def likely_spills(config: Config) -> str | None:
    """Register patterns that the checks' estimate (validate.consumer_registers) admits and
    ptxas spills, as measured. `rescale guarded` keeps the recompute path (S again from Q and
    K in SMEM) live beside O; the estimate leaves it out."""
    hw = config.ext
    assert hw is not None
    if hw.rescale_mode is not Rescale.GUARDED:
        return None
    # (Guarded with the causal mask at 160 registers spilled until 2026-11-27; since the
    # varlen change to fadsl/sm90.cuh ptxas keeps it in registers: no longer pruned here.)
    if config.head_dim == 256:
        # fadsl tune, 2026-11-27 (tune_build.py): fa3_hdim256 guarded spills at 240 registers
        return "rescale guarded at head_dim 256 spills (O alone takes 128 registers)"
    return None


TUNE_SPACE = TuneSpace(
    knobs=KNOBS,
    read=read,
    settings=settings,
    scopes=scopes,
    likely_spills=likely_spills,
    # consumers and B_c trade registers; stages and B_c trade SMEM; one consumer cannot
    # ping-pong; cluster and split_kv need O's own bytes (fewer stages) and exclude each other
    repair=("pingpong", "stages", "B_c", "q_slots", "cluster", "tail"),
)
