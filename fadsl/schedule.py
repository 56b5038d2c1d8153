"""Build the schedule: which step touches which SMEM buffer, how, and by whom.

Prologue: Q gmem -> smem -> rf and the softmax state. Mainloop (once per KV
block, in the spec's order): K and V gmem -> smem -> rf, S = Q K^T, online
softmax, O += P V. Epilogue: normalise, O rf -> smem -> gmem. No syncs yet:
insert_barriers adds them.
"""

from __future__ import annotations

from .errors import Loc
from .ir import (
    Access,
    Buffer,
    Kernel,
    Mask,
    Mode,
    Partition,
    Phase,
    Role,
    Scope,
    Step,
)
from .lower import Lowered


def _slice_rows(rows: int, warps: int) -> int:
    return rows // warps


def build_schedule(lowered: Lowered) -> Kernel:
    cfg = lowered.config
    tensors = {t.role: t for t in lowered.tensors}
    elem = cfg.dtypes[0].nbytes
    shape = {Role.Q: cfg.block_r, Role.K: cfg.block_c, Role.V: cfg.block_c, Role.O: cfg.block_r}
    buffers = tuple(
        Buffer(
            name=role.value,
            rows=shape[role],
            cols=cfg.head_dim,
            elem_bytes=elem,
            scope=tensors[role].smem_scope,
            swizzle=cfg.swizzle,
            loc=tensors[role].loc,
        )
        for role in Role
    )

    def rows_of(role: Role) -> str:
        return f"{_slice_rows(shape[role], cfg.warps)} rows"

    def read_partition(role: Role) -> Partition:
        # A cta-scoped K/V tile is read whole by every warp; a warp-scoped tile
        # only by the warp that owns the slice.
        return Partition.WHOLE if tensors[role].smem_scope is Scope.CTA else Partition.SLICE

    def g2s(role: Role, phase: Phase, loc: Loc) -> Step:
        hop = tensors[role].hops[0]
        rows = _slice_rows(shape[role], cfg.warps)
        return Step(
            op=f"{role.value.lower()}_g2s",
            phase=phase,
            accesses=(Access(role.value, Mode.WRITE, Partition.SLICE),),
            is_async=True,
            title=f"{role.value}: gmem -> smem ({hop.instr.value}; warp w copies rows "
            f"[{rows}w, {rows}w + {rows}) of {shape[role]}), one commit group",
            loc=loc,
        )

    def s2r(role: Role, phase: Phase, loc: Loc) -> Step:
        hop = tensors[role].hops[1]
        part = read_partition(role)
        what = f"the whole {shape[role]}-row tile" if part is Partition.WHOLE else rows_of(role)
        return Step(
            op=f"{role.value.lower()}_s2r",
            phase=phase,
            accesses=(Access(role.value, Mode.READ, part),),
            is_async=False,
            title=f"{role.value}: smem -> rf ({hop.instr.value}, each warp {what})",
            loc=loc,
        )

    def compute(op: str, phase: Phase, title: str, loc: Loc) -> Step:
        return Step(op=op, phase=phase, accesses=(), is_async=False, title=title, loc=loc)

    q, o = tensors[Role.Q], tensors[Role.O]
    prologue = (
        g2s(Role.Q, Phase.PROLOGUE, q.hops[0].loc),
        compute("init", Phase.PROLOGUE, "zero the O accumulators; m = -inf, l = 0", cfg.loc),
        s2r(Role.Q, Phase.PROLOGUE, q.hops[1].loc),
    )
    explicit = any(loc != cfg.loc for _, loc in lowered.order)
    loop_steps = []
    for op, loc in lowered.order:
        match op:
            case "k_g2s" | "v_g2s":
                role = Role(op[0].upper())
                loop_steps.append(
                    g2s(role, Phase.MAINLOOP, loc if explicit else tensors[role].hops[0].loc)
                )
            case "k_s2r" | "v_s2r":
                role = Role(op[0].upper())
                loop_steps.append(
                    s2r(role, Phase.MAINLOOP, loc if explicit else tensors[role].hops[1].loc)
                )
            case "qk":
                loop_steps.append(
                    compute(
                        op,
                        Phase.MAINLOOP,
                        "S = Q @ K^T (mma.sync m16n8k16, fp32 accumulators)",
                        loc,
                    )
                )
            case "softmax":
                loop_steps.append(
                    compute(
                        op,
                        Phase.MAINLOOP,
                        "online softmax: row max, rescale O and l, P = exp(S - m)",
                        loc,
                    )
                )
            case "pv":
                loop_steps.append(
                    compute(op, Phase.MAINLOOP, "O += P @ V (mma.sync m16n8k16)", loc)
                )
            case _:
                raise AssertionError(f"unknown mainloop op {op}")
    epilogue = (
        compute(
            "normalize", Phase.EPILOGUE, "finish the row sums l across each quad; O /= l", cfg.loc
        ),
        Step(
            op="o_r2s",
            phase=Phase.EPILOGUE,
            accesses=(Access("O", Mode.WRITE, Partition.SLICE),),
            is_async=False,
            title=f"O: rf -> smem ({o.hops[0].instr.value}, each warp its own {rows_of(Role.O)})",
            loc=o.hops[0].loc,
        ),
        Step(
            op="o_s2g",
            phase=Phase.EPILOGUE,
            accesses=(Access("O", Mode.READ, Partition.SLICE),),
            is_async=False,
            title=f"O: smem -> gmem ({o.hops[1].instr.value}, 16 bytes a lane, each warp its own "
            f"{rows_of(Role.O)})",
            loc=o.hops[1].loc,
        ),
    )
    return Kernel(
        config=cfg,
        tensors=lowered.tensors,
        buffers=buffers,
        prologue=prologue,
        mainloop=tuple(loop_steps),
        epilogue=epilogue,
        loop_may_be_empty=cfg.mask is Mask.CAUSAL,
    )
