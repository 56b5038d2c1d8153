"""sm_80's schedule: which step touches which SMEM buffer, how, and by whom.

Every warp runs every step (``Threads.ALL_WARPS``), each over its own rows of a
warp-scoped tile or the whole of a CTA-scoped one; a gmem -> smem step issues
cp.async copies and commits them as one group.

Prologue: Q gmem -> smem (-> rf unless Q is loaded fragment-wise), the first
K/V block of a tile the mainloop loads ahead, and the softmax state. Mainloop
(once per KV block, in the spec's order): K and V gmem -> smem -> rf, S = Q K^T,
online softmax, O += P V; a tile loaded fragment-wise (rf[frag]) has no
smem -> rf step: the mma that multiplies it reads its SMEM tile. Epilogue:
normalise, O rf -> smem -> gmem. No syncs yet: insert_barriers adds them.
"""

from __future__ import annotations

from ...errors import Loc
from ...ir import Access, Buffer, Kernel, Mask, Mode, Partition, Phase, RegLoad, Role, Scope, Step
from ...ir.lowered import Lowered
from ...ir.ops import Move, Op
from .caps import CAPABILITIES, CP_ASYNC


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
            op=Op.of(role, Move.G2S, ahead=block == "next"),
            phase=phase,
            accesses=(Access(role.value, Mode.WRITE, Partition.SLICE),),
            async_kind=CP_ASYNC,
            title=f"{role.value}{which}: gmem -> smem ({hop.instr.value}; warp w copies rows "
            f"[{rows}w, {rows}w + {rows}) of {shape[role]}), one commit group",
            loc=loc,
        )

    def s2r(role: Role, phase: Phase, loc: Loc) -> Step:
        hop = tensors[role].hops[1]
        part = read_partition(role)
        what = f"the whole {shape[role]}-row tile" if part is Partition.WHOLE else rows_of(role)
        return Step(
            op=Op.of(role, Move.S2R),
            phase=phase,
            accesses=(Access(role.value, Mode.READ, part),),
            async_kind=None,
            title=f"{role.value}: smem -> rf ({hop.instr.value}, each warp {what})",
            loc=loc,
        )

    def compute(op: Op, phase: Phase, title: str, loc: Loc, reads: tuple[Role, ...] = ()) -> Step:
        """A register-only step, except the tiles it loads fragment-wise from SMEM itself."""
        fused = [r for r in reads if tensors[r].reg_load is RegLoad.FRAG]
        accesses = tuple(Access(r.value, Mode.READ, read_partition(r)) for r in fused)
        if fused:
            loads = ", ".join(f"{r.value} ({tensors[r].hops[1].instr.value})" for r in fused)
            title += f"; loads {loads} one k16 slice at a time from smem"
        return Step(op=op, phase=phase, accesses=accesses, async_kind=None, title=title, loc=loc)

    q, o = tensors[Role.Q], tensors[Role.O]
    first_blocks = []  # tiles the mainloop loads one block ahead: the prologue loads block 0
    explicit = any(loc != cfg.loc for _, loc in lowered.order)
    loop_steps = []
    for op, loc in lowered.order:
        match op:
            case Op.K_G2S | Op.V_G2S:
                hop_loc = tensors[op.tensor].hops[0].loc
                loop_steps.append(g2s(op.tensor, Phase.MAINLOOP, loc if explicit else hop_loc))
            case Op.K_G2S_NEXT | Op.V_G2S_NEXT:
                # The first block's tile is loaded by the prologue; each iteration loads the next.
                hop_loc = tensors[op.tensor].hops[0].loc
                first_blocks.append(g2s(op.tensor, Phase.PROLOGUE, hop_loc, "first"))
                loop_steps.append(g2s(op.tensor, Phase.MAINLOOP, loc, "next"))
            case Op.K_S2R | Op.V_S2R:
                hop_loc = tensors[op.tensor].hops[1].loc
                loop_steps.append(s2r(op.tensor, Phase.MAINLOOP, loc if explicit else hop_loc))
            case Op.QK:
                loop_steps.append(
                    compute(
                        op,
                        Phase.MAINLOOP,
                        f"S = Q @ K^T ({CAPABILITIES.mma}, fp32 accumulators)",
                        loc,
                        reads=(Role.Q, Role.K),
                    )
                )
            case Op.SOFTMAX:
                loop_steps.append(
                    compute(
                        op,
                        Phase.MAINLOOP,
                        "online softmax: row max, rescale O and l, P = exp(S - m)",
                        loc,
                    )
                )
            case Op.PV:
                loop_steps.append(
                    compute(op, Phase.MAINLOOP, f"O += P @ V ({CAPABILITIES.mma})", loc, (Role.V,))
                )
            case _:
                raise AssertionError(f"unknown mainloop op {op}")
    prologue = [
        g2s(Role.Q, Phase.PROLOGUE, q.hops[0].loc),
        *first_blocks,
        compute(Op.INIT, Phase.PROLOGUE, "zero the O accumulators; m = -inf, l = 0", cfg.loc),
    ]
    if q.reg_load is RegLoad.TILE:
        prologue.append(s2r(Role.Q, Phase.PROLOGUE, q.hops[1].loc))
    epilogue = (
        compute(
            Op.NORMALIZE, Phase.EPILOGUE, "finish the row sums l across each quad; O /= l", cfg.loc
        ),
        Step(
            op=Op.O_R2S,
            phase=Phase.EPILOGUE,
            accesses=(Access("O", Mode.WRITE, Partition.SLICE),),
            async_kind=None,
            title=f"O: rf -> smem ({o.hops[0].instr.value}, each warp its own {rows_of(Role.O)})",
            loc=o.hops[0].loc,
        ),
        Step(
            op=Op.O_S2G,
            phase=Phase.EPILOGUE,
            accesses=(Access("O", Mode.READ, Partition.SLICE),),
            async_kind=None,
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
        backward=lowered.backward,
    )
