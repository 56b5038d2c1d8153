"""sm_80's knobs for `fadsl tune` (fadsl.targets.tuning): the tile and the warps.

One K/V stage only (validate.py refuses more), so the tile and the warps are what there is
to try; validate.py judges each (whole 16-row mma tiles per warp, whole cp.async rounds, the
registers at the peak of each mma) and ptxas's spill check the rest. The paths (fragment-wise
loads) and the mainloop order are the spec's design and stay as written.
"""

from __future__ import annotations

from typing import Any

from ...ir import Config
from ..tuning import Knob, TuneSpace, Values

KNOBS = (
    Knob("B_r", (32, 64, 128, 192, 256), "r{}"),
    Knob("B_c", (16, 32, 64, 96, 128), "c{}"),
    Knob("warps", (2, 4, 8), "w{}"),
)


def read(config: Config) -> dict[str, Any]:
    return {"B_r": config.block_r, "B_c": config.block_c, "warps": config.warps}


def settings(values: Values, base: Config) -> dict[str, str]:
    return {
        "tile": f"B_r = {values['B_r']}, B_c = {values['B_c']}",
        "warps": str(values["warps"]),
    }


TUNE_SPACE = TuneSpace(
    knobs=KNOBS,
    read=read,
    settings=settings,
    # more warps split B_r finer (16 rows each at least); B_c trades registers
    repair=("warps", "B_c"),
)
