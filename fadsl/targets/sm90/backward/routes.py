"""The paths sm_90a's backward gives each tensor (``Route``), the other paths a tensor may take
instead, and which of them a block's tile admits: the tables validate.py checks a block's
paths against (moved out of it; validate.py re-exports them).

dS has three: stored by `st.shared` (the default: 4-byte stores of 16-bit pairs in the
accumulator's layout), or by `stmatrix` (``DS_STMATRIX``: the same bytes, an 8 x 8 block of
16-bit elements per matrix, four per instruction, so B_r / 16 stores a thread instead of B_r
/ 4) where dS^T is stored with the keys as rows, and at B_r 80 by `stmatrix .trans` (the
queries as rows, for dQ^T: ``DS_TRANSPOSED``, its one path there). Each is a generic-proxy
store of the warpgroup's rows of the same buffer, so the sync plan is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ....ir import GradRole, Instr, Level, Role, Scope
from .plan_smem import SPLIT_HEAD_DIM

# B_r = 80 at head_dim 128 (FlashAttention-3's non-causal tile): not a multiple of wgmma's M,
# so dQ is computed transposed (dQ^T = K^T dS^T, a 64-column panel of head_dim per consumer)
TRANSPOSED_BLOCK_M = 80

GMEM, SMEM, RF = Level.GMEM, Level.SMEM, Level.RF


@dataclass(frozen=True)
class Route:
    """The one path the backward kernel gives a tensor, and why (for the messages)."""

    levels: tuple[Level, ...]
    instrs: tuple[Instr, ...]
    scope: Scope | None  # the smem level's; None: the path skips SMEM
    why: str

    def text(self) -> str:
        parts = [self.levels[0].value]
        for instr, level in zip(self.instrs, self.levels[1:]):
            shown = f"smem[{self.scope.value}]" if level is SMEM and self.scope else level.value
            parts.append(f"-{instr.value}-> {shown}")
        return " ".join(parts)


_WGMMA_INPUT = (GMEM, SMEM, RF), (Instr.TMA, Instr.WGMMA), Scope.CTA
_ROW_STATISTIC = (GMEM, SMEM, RF), (Instr.BULK, Instr.LD_SHARED), Scope.CTA
_WRITTEN_ONCE = (RF, GMEM), (Instr.ST_GLOBAL,), None
PATHS: dict[Role | GradRole, Route] = {
    Role.Q: Route(*_WGMMA_INPUT, "every consumer warpgroup reads each m-block's Q whole"),
    Role.K: Route(*_WGMMA_INPUT, "loaded once per n-block; dQ = dS K reads all of it"),
    Role.V: Route(*_WGMMA_INPUT, "loaded once per n-block, read by dP^T = V dO^T"),
    GradRole.DO: Route(*_WGMMA_INPUT, "streamed per m-block with Q; read whole by each consumer"),
    GradRole.LSE: Route(
        *_ROW_STATISTIC, "an m-block's 64 fp32 values: a plain bulk copy, no tensor map"
    ),
    GradRole.D: Route(
        *_ROW_STATISTIC, "an m-block's 64 fp32 values: a plain bulk copy, no tensor map"
    ),
    GradRole.DS: Route(
        (RF, SMEM, RF),
        (Instr.ST_SHARED, Instr.WGMMA),
        Scope.CTA,
        "dK += dS^T Q and dQ = dS K read every consumer's part of it from SMEM",
    ),
    GradRole.DQ: Route(
        (RF, SMEM, GMEM),
        (Instr.ST_SHARED, Instr.REDUCE_ADD),
        Scope.WARPGROUP,
        "each consumer warpgroup stages its share in fp32 for a bulk reduce-add into the "
        "fp32 accumulator",
    ),
    GradRole.DK: Route(
        *_WRITTEN_ONCE, "each consumer warpgroup stores its rows once, after the last m-block"
    ),
    GradRole.DV: Route(
        *_WRITTEN_ONCE, "each consumer warpgroup stores its rows once, after the last m-block"
    ),
}


# The other path a tensor may take (``Backward`` records which one the spec wrote).
DQ_RED = Route(
    (RF, GMEM),
    (Instr.RED_ADD,),
    None,
    "each consumer thread adds its fp32 share into the accumulator (red.global.add.v4.f32), "
    "no staging in SMEM",
)
# dS^T's 8 x 8 blocks stored whole (the accumulator's fragment is stmatrix's register layout)
DS_STMATRIX = Route(
    (RF, SMEM, RF),
    (Instr.STMATRIX, Instr.WGMMA),
    Scope.CTA,
    "dK += dS^T Q and dQ = dS K read every consumer's part of it from SMEM; stmatrix "
    "stores it four 8 x 8 blocks an instruction",
)
# dK and dV staged in the K and V tiles (dead once the last m-block's wgmmas retired) and
# stored by TMA, a warpgroup's 64 rows a box, instead of 16-byte st.global from registers
DKV_TMA_WHY = (
    "each consumer warpgroup stages its rows in the dead {tile} tile by stmatrix (no SMEM "
    "of its own) and one of its threads stores them by TMA"
)
DK_TMA, DV_TMA = (
    Route(
        (RF, SMEM, GMEM), (Instr.STMATRIX, Instr.TMA), Scope.WARPGROUP, DKV_TMA_WHY.format(tile=t)
    )
    for t in ("K", "V")
)
OTHER_PATHS: dict[Role | GradRole, Route] = {GradRole.DQ: DQ_RED, GradRole.DS: DS_STMATRIX}
OTHER_PATHS |= {GradRole.DK: DK_TMA, GradRole.DV: DV_TMA}
# dS's path where dQ is computed transposed (B_r = 80): the queries as rows
DS_TRANSPOSED = Route(
    (RF, SMEM, RF),
    (Instr.STMATRIX, Instr.WGMMA),
    Scope.CTA,
    f"at B_r = {TRANSPOSED_BLOCK_M} dQ^T = K^T dS^T reads dS with the queries as rows, so "
    "stmatrix .trans stores each 8 x 8 block of dS^T transposed",
)


# head_dim 256 (the consumers split head_dim): P and dS through SMEM with the keys as rows,
# dQ added from registers
SPLIT_WHY = (
    "at head_dim 256 each consumer warpgroup computes {what} for its B_c / 2 keys and both "
    "read all of it ({readers}), so stmatrix .trans stores each 8 x 8 block with the keys as "
    "rows"
)
SPLIT_PATHS: dict[Role | GradRole, Route] = {
    GradRole.P: Route(
        (RF, SMEM, RF),
        (Instr.STMATRIX, Instr.WGMMA),
        Scope.CTA,
        SPLIT_WHY.format(what="P", readers="dV^T += dO^T P"),
    ),
    GradRole.DS: Route(
        (RF, SMEM, RF),
        (Instr.STMATRIX, Instr.WGMMA),
        Scope.CTA,
        SPLIT_WHY.format(what="dS", readers="dK^T += Q^T dS, dQ^T = K^T dS^T"),
    ),
    GradRole.DQ: replace(
        DQ_RED,
        why="each consumer thread adds its fp32 share into the accumulator "
        "(red.global.add.v4.f32): at head_dim 256 its staging does not fit in SMEM beside K, "
        "V, Q, dO, P and dS",
    ),
}


def paths_of(block_m: int, head_dim: int | None) -> dict[Role | GradRole, Route]:
    """The paths of a block's tile: PATHS, dS's transposed where B_r is 80; at head_dim
    256 P's and dS's through SMEM and dQ's from registers."""
    if head_dim == SPLIT_HEAD_DIM:  # (P before dS, in the order the kernel makes them)
        roles = [r for r in PATHS if r is not GradRole.DS]
        roles.insert(roles.index(GradRole.DQ), GradRole.P)
        roles.insert(roles.index(GradRole.DQ), GradRole.DS)
        return {role: SPLIT_PATHS.get(role, PATHS.get(role)) for role in roles}
    if block_m != TRANSPOSED_BLOCK_M:
        return PATHS
    return PATHS | {GradRole.DS: DS_TRANSPOSED}


def other_path(role: Role | GradRole, block_m: int, head_dim: int | None) -> Route | None:
    """The path ``role`` may take instead of its default: none at head_dim 256, and dS's
    stmatrix store not at B_r 80 (where stmatrix .trans is its one path)."""
    if head_dim == SPLIT_HEAD_DIM or (role is GradRole.DS and block_m == TRANSPOSED_BLOCK_M):
        return None
    return OTHER_PATHS.get(role)
