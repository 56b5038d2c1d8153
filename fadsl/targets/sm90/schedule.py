"""sm_90a's schedule: which role runs each step, which ring item it works on, what it touches.

Roles (``Step.who``): the producer warpgroup (setmaxnreg.dec) whose elected thread
issues every TMA load; the consumer warpgroups (setmaxnreg.inc), each running every
consumer step on its own 64 query rows (``Partition.SLICE`` of a warpgroup-scoped
tile) or the whole of a CTA-scoped K/V slot (``Partition.WHOLE``).

The K/V blocks are items of two rings (``Buffer.slots`` = stages); Q, loaded once per
tile, is a ring of ``q_slots`` tiles (tile t in slot t % q_slots). Both roles run the
same iteration space, once per tile of the CTA's tile loop: the prologue at it = 0, the
mainloop at it = 1 .. n_blocks - 1, the epilogue at it = n_blocks (setmaxnreg runs once,
in the setup); a ring step works on item it + lag (``Step.lag``):

  producer   prologue Q, K(it)     mainloop K(it), V(it-1)     epilogue V(it-1)
  consumers  prologue S(it), softmax(it), P                     (K one block ahead of V)
             mainloop, overlap on:  S(it), rescale O, O += P V(it-1), softmax(it), P
             mainloop, overlap off: rescale O, O += P V(it-1), S(it), softmax(it), P
             epilogue rescale O, O += P V(it-1), normalise, O -> smem, O -> gmem

S = Q K^T and O += P V are wgmma (async: ``WGMMA``), the loads TMA (``TMA_LOAD``), O's
store a TMA store (``TMA_STORE``). Register tiles are not SMEM buffers: their uses are
``REGISTERS`` below, which the sync pass reads to place wgmma waits. No syncs yet.

8-bit dtypes (research/fp8-forward.md §3.2): FP8 wgmma reads its B operand K-major only, so
V's raw ring (TMA-written, rows = keys) is transposed by the producer warpgroup's 4 warps
(``Threads.PRODUCER_WARPS``, each its own head_dim / 4 rows) into a second ring, ``Vt``
(rows = head_dim, keys contiguous), which P V reads; V is loaded with K (FA3's order):

  producer thread  prologue Q, K(it), V(it)   mainloop K(it), V(it)
  producer warps                              mainloop transpose V(it-1)   epilogue the same
  consumers        as above, O += P Vt(it-1)

(with one stage the transpose of V(it-1) comes before the load of V(it), into its slot).

Q, K, V and Vt hold 1-byte elements, O the `output` type's 2.
"""

from __future__ import annotations

from ...ir import Access, Buffer, Kernel, Mode, Partition, Phase, Role, Scope, Step, Threads
from ...ir.lowered import Lowered
from ...ir.ops import Move, Op
from .caps import TMA_LOAD, TMA_STORE, WGMMA, panel_columns

# The transposed V ring of 8-bit kernels (no tensor of its own: V's second SMEM level)
VT = "Vt"

# Register tiles each consumer op reads and writes (per thread, in the warpgroup's rows).
S, P, O_ACC = "S", "P", "O"
REGISTERS: dict[Op, tuple[frozenset[str], frozenset[str]]] = {  # op -> (reads, writes)
    Op.INIT: (frozenset(), frozenset({O_ACC})),
    Op.QK: (frozenset(), frozenset({S})),
    Op.SOFTMAX: (frozenset({S}), frozenset({S})),
    Op.CONVERT_P: (frozenset({S}), frozenset({P})),
    Op.RESCALE_O: (frozenset({O_ACC}), frozenset({O_ACC})),
    Op.PV: (frozenset({P, O_ACC}), frozenset({O_ACC})),
    Op.NORMALIZE: (frozenset({O_ACC}), frozenset({O_ACC})),
    Op.O_R2S: (frozenset({O_ACC}), frozenset()),
}


def ring_buffers(kernel: Kernel) -> frozenset[str]:
    """The tiles loaded once per K/V block (their steps carry a ring item): rings of
    ``stages`` slots, even a ring of one slot, as opposed to Q, loaded once."""
    return frozenset(
        a.buffer
        for s in kernel.steps()
        if s.lag is not None
        for a in s.accesses
        if a.mode is Mode.WRITE
    )


def build_schedule(lowered: Lowered) -> Kernel:
    cfg = lowered.config
    hw = cfg.ext
    assert hw is not None
    tensors = {t.role: t for t in lowered.tensors}
    elem = cfg.dtypes[0].nbytes
    fp8 = cfg.dtypes[0].is_8bit
    out_elem = (cfg.out_dtype or cfg.dtypes[0]).nbytes
    rows = {Role.Q: cfg.block_r, Role.K: cfg.block_c, Role.V: cfg.block_c, Role.O: cfg.block_r}
    buffers = tuple(
        Buffer(
            name=role.value,
            rows=rows[role],
            cols=cfg.head_dim,
            elem_bytes=out_elem if role is Role.O else elem,
            scope=tensors[role].smem_scope,
            swizzle=None,
            loc=tensors[role].loc,
            slots={Role.K: hw.stages, Role.V: hw.stages, Role.Q: hw.q_slots}.get(role, 1),
        )
        for role in Role
    )
    if fp8:  # Vt: a ring like V's, after it (plan_smem places the buffers in this order)
        vt = Buffer(
            name=VT,
            rows=cfg.head_dim,
            cols=cfg.block_c,
            elem_bytes=elem,
            scope=tensors[Role.V].smem_scope,
            swizzle=None,
            loc=tensors[Role.V].hops[1].loc,
            slots=hw.stages,
        )
        buffers = buffers[:3] + (vt,) + buffers[3:]

    def loc(role: Role, hop: int):
        return tensors[role].hops[hop].loc

    panel_cols = panel_columns(cfg.head_dim, elem)

    def load(role: Role, phase: Phase, lag: int | None) -> Step:
        what = "the tile's Q" if lag is None else f"{role.value}(it{lag:+d})"
        what = what.replace("(it+0)", "(it)")
        return Step(
            op=Op.of(role, Move.G2S),
            phase=phase,
            accesses=(Access(role.value, Mode.WRITE, Partition.WHOLE),),
            async_kind=TMA_LOAD,
            title=f"{what}: gmem -> smem (TMA, {rows[role]} rows in {panel_cols}-column "
            f"panels, {panel_cols * elem}-byte swizzle)"
            + ("" if lag is None else " into its ring slot"),
            loc=loc(role, 0),
            who=Threads.PRODUCER_THREAD,
            lag=lag,
        )

    def consumer(op: Op, phase: Phase, title: str, where, accesses=(), lag=None, kind=None):
        return Step(op, phase, tuple(accesses), kind, title, where, Threads.CONSUMERS, lag)

    def qk(phase: Phase) -> Step:
        return consumer(
            Op.QK,
            phase,
            "S = Q K^T (wgmma, Q and K from SMEM through descriptors), one commit group",
            loc(Role.K, 1),
            (Access("Q", Mode.READ, Partition.SLICE), Access("K", Mode.READ, Partition.WHOLE)),
            lag=0,
            kind=WGMMA,
        )

    def pv(phase: Phase) -> Step:
        if fp8:
            return consumer(
                Op.PV,
                phase,
                "O += P Vt(it-1) (wgmma k32, P as e4m3 quads from registers, Vt K-major from "
                "SMEM), one commit group",
                loc(Role.V, 2),
                (Access(VT, Mode.READ, Partition.WHOLE),),
                lag=-1,
                kind=WGMMA,
            )
        return consumer(
            Op.PV,
            phase,
            "O += P V(it-1) (wgmma, P from registers, V from SMEM), one commit group",
            loc(Role.V, 1),
            (Access("V", Mode.READ, Partition.WHOLE),),
            lag=-1,
            kind=WGMMA,
        )

    def transpose(phase: Phase) -> Step:
        """The producer warps' transpose of V(it-1): each warp reads the raw slot (ldmatrix
        .trans) and writes its own head_dim / 4 rows of the Vt slot (prmt, stmatrix)."""
        return Step(
            Op.TRANSPOSE_V,
            phase,
            (
                Access("V", Mode.READ, Partition.WHOLE),
                Access(VT, Mode.WRITE, Partition.SLICE),
            ),
            None,
            "V(it-1) -> Vt(it-1): each producer warp its head_dim / 4 rows, keys in P's "
            "register order (ldmatrix.x4.trans, prmt, stmatrix)",
            loc(Role.V, 1),
            Threads.PRODUCER_WARPS,
            -1,
        )

    def softmax(phase: Phase) -> list[Step]:
        what = "P to e4m3 quads in P's key order" if fp8 else "P to 16-bit pairs"
        convert = consumer(Op.CONVERT_P, phase, f"{what} (the A operand of P V)", cfg.loc)
        if hw.guarded and phase is Phase.MAINLOOP:
            # `rescale guarded`: a block whose row sums pass 2^120 (or inf) gets S again from
            # the Q and K tiles, once the P V in flight has read P (fadsl/sm90_guard.cuh), so
            # K's slot is read until P is converted.
            convert = consumer(
                Op.CONVERT_P,
                phase,
                "(S again from Q and K if the guarded softmax lost P) P to 16-bit pairs "
                "(the A operand of P V)",
                cfg.loc_of("rescale"),
                (Access("Q", Mode.READ, Partition.SLICE), Access("K", Mode.READ, Partition.WHOLE)),
                lag=0,
            )
        return [
            consumer(
                Op.SOFTMAX,
                phase,
                (
                    "mask (leading and trailing iterations only: the window's two edges)"
                    if cfg.window
                    else "mask (leading iterations only)"
                )
                + " and online softmax of S in place"
                + (" (guarded: no row max)" if hw.guarded and phase is Phase.MAINLOOP else ""),
                cfg.loc,
            ),
            convert,
        ]

    def rescale(phase: Phase) -> Step:
        return consumer(Op.RESCALE_O, phase, "O *= the previous softmax's rescale", cfg.loc)

    regs = Step(
        Op.SETMAXNREG,
        Phase.SETUP,
        (),
        None,
        f"setmaxnreg.dec to {hw.producer_regs} registers",
        cfg.loc_of("registers"),
        Threads.PRODUCER,
    )
    setup = [
        regs,
        consumer(
            Op.SETMAXNREG,
            Phase.SETUP,
            f"setmaxnreg.inc to {hw.consumer_regs} registers",
            cfg.loc_of("registers"),
        ),
    ]
    prologue = [
        load(Role.Q, Phase.PROLOGUE, None),
        load(Role.K, Phase.PROLOGUE, 0),
        *([load(Role.V, Phase.PROLOGUE, 0)] if fp8 else []),
        consumer(Op.INIT, Phase.PROLOGUE, "O = 0, m = -inf, l = 0", cfg.loc),
        qk(Phase.PROLOGUE),
        *softmax(Phase.PROLOGUE),
    ]
    if fp8 and hw.stages == 1:
        # one raw V slot: V(it) overwrites V(it-1), so warp 0 transposes first (loading
        # first, it would wait for its own transpose's release: a hang verify finds)
        loop = [load(Role.K, Phase.MAINLOOP, 0), transpose(Phase.MAINLOOP)]
        loop.append(load(Role.V, Phase.MAINLOOP, 0))
    elif fp8:  # V with K, transposed a block later
        loop = [load(Role.K, Phase.MAINLOOP, 0), load(Role.V, Phase.MAINLOOP, 0)]
        loop.append(transpose(Phase.MAINLOOP))
    else:
        loop = [load(Role.K, Phase.MAINLOOP, 0), load(Role.V, Phase.MAINLOOP, -1)]
    if hw.overlap:
        loop += [qk(Phase.MAINLOOP), rescale(Phase.MAINLOOP), pv(Phase.MAINLOOP)]
    else:
        loop += [rescale(Phase.MAINLOOP), pv(Phase.MAINLOOP), qk(Phase.MAINLOOP)]
    loop += softmax(Phase.MAINLOOP)
    o_slice = (Access("O", Mode.WRITE, Partition.SLICE),)
    epilogue = [
        transpose(Phase.EPILOGUE) if fp8 else load(Role.V, Phase.EPILOGUE, -1),
        rescale(Phase.EPILOGUE),
        pv(Phase.EPILOGUE),
        consumer(Op.NORMALIZE, Phase.EPILOGUE, "row sums, LSE, O /= l", cfg.loc),
        consumer(
            Op.O_R2S,
            Phase.EPILOGUE,
            ("O unpermuted (rho's columns: a register renaming) -> " if fp8 else "O -> ")
            + "16 bits -> the warpgroup's rows of the O tile in SMEM (stmatrix)",
            loc(Role.O, 0),
            o_slice,
        ),
        Step(
            Op.O_S2G,
            Phase.EPILOGUE,
            (Access("O", Mode.READ, Partition.SLICE),),
            TMA_STORE,
            "the warpgroup's 64 O rows: smem -> gmem (TMA store, rows past seqlen_q clipped)",
            loc(Role.O, 1),
            Threads.CONSUMER_ELECTED,
        ),
    ]
    assert all(
        t.smem_scope in (Scope.WARPGROUP, Scope.CTA, Scope.CLUSTER) for t in tensors.values()
    )
    return Kernel(
        config=cfg,
        tensors=lowered.tensors,
        buffers=buffers,
        prologue=tuple(prologue),
        mainloop=tuple(loop),
        epilogue=tuple(epilogue),
        loop_may_be_empty=True,  # n_blocks = 1 runs no mainloop iteration
        setup=tuple(setup),  # once per CTA, before its first tile
        backward=lowered.backward,  # the spec's backward block (docs/backward.md), or None
    )
