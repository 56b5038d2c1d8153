"""Backward blocks rewritten for a test: the examples' blocks (fa3_causal's and the modifier
examples' `dq_lag on`, dK and dV by TMA) turned into the ones a switch needs."""

from __future__ import annotations

TMA_DKV = "rf -stmatrix-> smem[warpgroup] -tma-> gmem"


def unlagged(text: str) -> str:
    """The block with dQ added in its own m-block (`dq_lag off`) and dK, dV stored from
    registers (TMA's store is the lagged consumer's epilogue), no `peel_dead` (it peels the
    lagged consumer) and no `late_v` (the lagged consumer waits for the late V)."""
    text = text.replace("    dq_lag     on\n", "")
    lagged_only = ("peel_dead", "late_v")
    text = "\n".join(x for x in text.split("\n") if not x.lstrip().startswith(lagged_only))
    return text.replace(TMA_DKV, "rf -st.global-> gmem")


def deterministic(text: str) -> str:
    """The block with `deterministic on`: dQ staged for its ordered adds, unlagged."""
    text = unlagged(text).replace(
        "    early_dv   off\n", "    early_dv   off\n    deterministic on\n"
    )
    return text.replace("    dQ: rf -red.add-> gmem\n", "")
