"""Build the schedule: which step touches which SMEM buffer, how, and by whom.

Prologue: Q gmem -> smem (-> rf unless Q is loaded fragment-wise), the first
K/V block of a tile the mainloop loads ahead, and the softmax state. Mainloop
(once per KV block, in the spec's order): K and V gmem -> smem -> rf, S = Q K^T,
online softmax, O += P V; a tile loaded fragment-wise (rf[frag]) has no
smem -> rf step: the mma that multiplies it reads its SMEM tile. Epilogue:
normalise, O rf -> smem -> gmem. No syncs yet: insert_barriers adds them.
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
    RegLoad,
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

    def g2s(role: Role, phase: Phase, loc: Loc, block: str = "") -> Step:
        """block: '' for Q or the current K/V block, 'first' (prologue) or 'next' (ahead)."""
        hop = tensors[role].hops[0]
        rows = _slice_rows(shape[role], cfg.warps)
        which = f" of the {block} block" if block else ""
        return Step(
            op=f"{role.value.lower()}_g2s" + ("_next" if block == "next" else ""),
            phase=phase,
            accesses=(Access(role.value, Mode.WRITE, Partition.SLICE),),
            is_async=True,
            title=f"{role.value}{which}: gmem -> smem ({hop.instr.value}; warp w copies rows "
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

    def compute(op: str, phase: Phase, title: str, loc: Loc, reads: tuple[Role, ...] = ()) -> Step:
        """A register-only step, except the tiles it loads fragment-wise from SMEM itself."""
        fused = [r for r in reads if tensors[r].reg_load is RegLoad.FRAG]
        accesses = tuple(Access(r.value, Mode.READ, read_partition(r)) for r in fused)
        if fused:
            loads = ", ".join(f"{r.value} ({tensors[r].hops[1].instr.value})" for r in fused)
            title += f"; loads {loads} one k16 slice at a time from smem"
        return Step(op=op, phase=phase, accesses=accesses, is_async=False, title=title, loc=loc)

    q, o = tensors[Role.Q], tensors[Role.O]
    first_blocks = []  # tiles the mainloop loads one block ahead: the prologue loads block 0
    explicit = any(loc != cfg.loc for _, loc in lowered.order)
    loop_steps = []
    for op, loc in lowered.order:
        match op:
            case "k_g2s" | "v_g2s":
                role = Role(op[0].upper())
                loop_steps.append(
                    g2s(role, Phase.MAINLOOP, loc if explicit else tensors[role].hops[0].loc)
                )
            case "k_g2s_next" | "v_g2s_next":
                # The first block's tile is loaded by the prologue; each iteration loads the next.
                role = Role(op[0].upper())
                hop_loc = tensors[role].hops[0].loc
                first_blocks.append(g2s(role, Phase.PROLOGUE, hop_loc, "first"))
                loop_steps.append(g2s(role, Phase.MAINLOOP, loc, "next"))
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
                        reads=(Role.Q, Role.K),
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
                    compute(op, Phase.MAINLOOP, "O += P @ V (mma.sync m16n8k16)", loc, (Role.V,))
                )
            case _:
                raise AssertionError(f"unknown mainloop op {op}")
    prologue = [
        g2s(Role.Q, Phase.PROLOGUE, q.hops[0].loc),
        *first_blocks,
        compute("init", Phase.PROLOGUE, "zero the O accumulators; m = -inf, l = 0", cfg.loc),
    ]
    if q.reg_load is RegLoad.TILE:
        prologue.append(s2r(Role.Q, Phase.PROLOGUE, q.hops[1].loc))
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
        prologue=tuple(prologue),
        mainloop=tuple(loop_steps),
        epilogue=epilogue,
        loop_may_be_empty=cfg.mask is Mask.CAUSAL,
    )
