"""The backward main kernel's steps: the work of each role, in the header's order, with no
sync (``schedule``), the input of the sync pass (syncs/: ``insert_syncs``).

A step is a call that accesses memory or the registers a wgmma uses: a TMA or bulk load, a
wgmma, ordinary compute on registers (with the ld.shared of LSE or D it makes), a
st.shared, the bulk reduce-add of dQ's staging and the st.global of dK and dV. Each names
its SMEM operands (buffer, ring slot or dS^T buffer, part), the registers it reads and
writes, the threads that run it, the function of the header it is in and its phase; a load
names the full mbarrier its bytes complete on (the transaction it belongs to). Which syncs
order them is the pass's to find: nothing here says so.

- the setup has no step (thread 0's mbarrier inits are syncs);
- the producer (bwd_producer, its elected thread, only when the CTA visits an m-block):
  K and V panel by panel once before the loop, completing on kv_full; per m-block Q and dO
  panel by panel into the ring slot, then LSE and D (bulk loads), completing on the slot's
  q_full; with ``late_v`` K alone before the loop, and V's panels in the first m-block
  after the slot's loads, completing on v_full of their own (``Guard.FIRST``);
- the consumer warpgroups (bwd_consumer, in its default order or with ``overlap`` the
  overlapped one, its helpers meet_and_issue_dq and reduce_dq inlined): dK and dV zeroed
  before the loop; per m-block the front (S^T, dP^T, P, dS, both packed to 16 bits, dS^T
  to SMEM), then the gradients' wgmmas, then dQ staged and reduce-added by the leader
  (through ordered_reduce_add with ``deterministic``), or with ``dq_red`` added from every
  thread's registers; dK and dV stored after the loop. The two
  consumers differ in the order after the front: bwd_consumer issues dV, dK, then dQ and
  stages dQ last; the overlapped one issues dQ first, then dV and dK, and stages dQ while
  they run. With ``early_dv`` the overlapped one issues dV inside the front instead, as
  soon as P^T is packed (before dS), so that it runs under the softmax gradient; with
  ``dv_before_meeting`` after the dS^T store, before the meeting (FlashAttention-3's
  order), so that it runs under the warpgroups' meeting. With ``dq_lag``
  (bwd_consumer_lagged, its helpers issue_dq_lagged and reduce_dq inlined) dQ runs one
  m-block behind (its LSE loaded into registers before S^T, its D under P's exponentials):
  after the front of m-block i, dV(i), then dQ(i - 1) from its dS^T buffer
  (``Guard.LAGGED``: the step acts for m-block i - 1, so ``Index.ALTERNATE`` names the
  previous buffer), dK(i) and dQ(i - 1)'s adds (with ``dq_first``, dQ(i - 1) before dV(i),
  so that its adds run under both); after the loop the last m-block's dQ and its adds.
  Nothing here says how dS^T reaches dQ a step later: that is the sync pass's
  (syncs/handover.py).

With ``dq_writer`` the consumer stages dQ and its writer warp (bwd_dq_writer, warp 1 + w of
the producer warpgroup for consumer w) issues the bulk reduce-add of that staging, from its
lane 0, once per m-block: the add moves from the consumer's program to the writer's (with
``dq_lag`` the staging is the lagged step: m-block i stages dQ(i - 1), the writer's loop
takes the m-blocks in the same order).

At head_dim 256 (``Params.split``: bwd_producer_split, bwd_consumer_split) the producer loads
Q and LSE on the Q ring's q_full and dO and D on the dO ring's do_full; each consumer
computes S and dP of its keys, stores P and dS (its key rows of each), then issues dV^T of
its two head_dim panels with dQ^T of the first, dK^T of the first panel, adds that dQ^T
slice from registers, issues dQ^T and dK^T of the second panel and adds the second slice.
"""

from __future__ import annotations

from dataclasses import replace

from .program import (
    StagedTile,
    Guard,
    Index,
    Item,
    Kind,
    Mbar,
    Operand,
    Params,
    Part,
    LoopPhase,
    Protocol,
    Reg,
    CodeSite,
    Who,
)

__all__ = ["schedule", "producer_steps", "consumer_steps", "writer_steps"]


def build_schedule(p: Params) -> Protocol:
    """The plan's steps, every role's, with no sync: what ``insert_syncs`` places syncs in."""
    return Protocol(p, (), producer_steps(p), consumer_steps(p), writer=writer_steps(p))


def writer_steps(p: Params) -> tuple[Item, ...]:
    """``dq_writer``: the writer's lane 0 reduce-adds its consumer's staging each m-block."""
    if not p.dq_writer:
        return ()
    stage = Operand(StagedTile.DQ_STAGE, part=Part.ROWS_OF_WG)
    add = Item(
        Kind.BULK_REDUCE_ADD,
        Who.WRITER_LANE0,
        CodeSite.DQ_WRITER,
        LoopPhase.LOOP,
        name="dQ reduce-add",
        reads=(stage,),
    )
    return (add,)


def producer_steps(p: Params) -> tuple[Item, ...]:
    """bwd_producer's loads: K and V once, then each m-block the ring slot's Q, dO, LSE, D."""

    def load(kind: Kind, phase: LoopPhase, operand: Operand, name: str, **fields) -> Item:
        return _load(kind, phase, operand, name, **({"source": CodeSite.PRODUCER} | fields))

    out = []
    once = (StagedTile.K,) if p.late_v else (StagedTile.K, StagedTile.V)
    for panel in range(p.panels):  # (in bwd_load_kv)
        for buffer in once:
            operand = Operand(buffer, part=Part.PANEL, panel=panel)
            name = f"{buffer.value} panel {panel} load"
            kv = dict(mbar=Mbar.KV_FULL, source=CodeSite.LOAD_KV)
            out.append(load(Kind.TMA_LOAD, LoopPhase.BEFORE, operand, name, **kv))
    if p.split:
        return tuple(out) + _split_producer_loop(p)
    ring = dict(mbar=Mbar.Q_FULL, slot=Index.RING)
    for panel in range(p.panels):
        for buffer in (StagedTile.Q, StagedTile.DO):
            operand = Operand(buffer, Index.RING, Part.PANEL, panel)
            name = f"{buffer.value} panel {panel} load"
            out.append(load(Kind.TMA_LOAD, LoopPhase.LOOP, operand, name, **ring))
    for buffer in (StagedTile.LSE, StagedTile.D):
        operand = Operand(buffer, Index.RING)
        out.append(load(Kind.BULK_LOAD, LoopPhase.LOOP, operand, f"{buffer.value} load", **ring))
    if p.late_v:  # (bwd_load_v_late: in m-block 0, after its slot's loads)
        late = dict(mbar=Mbar.V_FULL, source=CodeSite.LOAD_V_LATE)
        for panel in range(p.panels):
            operand = Operand(StagedTile.V, part=Part.PANEL, panel=panel)
            v = load(Kind.TMA_LOAD, LoopPhase.LOOP, operand, f"V panel {panel} load", **late)
            out.append(replace(v, guard=Guard.FIRST))
    return tuple(out)


def _load(kind: Kind, phase: LoopPhase, operand: Operand, name: str, **fields) -> Item:
    """A load of the producer's elected thread (none for a CTA without an m-block)."""
    return Item(
        kind, Who.ELECTED, phase=phase, name=name, guard=Guard.HAS_WORK, writes=(operand,), **fields
    )


def _split_producer_loop(p: Params) -> tuple[Item, ...]:
    """bwd_producer_split's m-block: Q's panels and LSE complete on the Q ring's q_full,
    dO's panels and D on the dO ring's do_full."""
    out = []
    for full, index, tile, row in (
        (Mbar.Q_FULL, Index.RING, StagedTile.Q, StagedTile.LSE),
        (Mbar.DO_FULL, Index.RING_DO, StagedTile.DO, StagedTile.D),
    ):
        ring = dict(mbar=full, slot=index, source=CodeSite.PRODUCER_SPLIT)
        for panel in range(p.panels):
            operand = Operand(tile, index, Part.PANEL, panel)
            name = f"{tile.value} panel {panel} load"
            out.append(_load(Kind.TMA_LOAD, LoopPhase.LOOP, operand, name, **ring))
        operand = Operand(row, index)
        out.append(_load(Kind.BULK_LOAD, LoopPhase.LOOP, operand, f"{row.value} load", **ring))
    return tuple(out)


def consumer_steps(p: Params) -> tuple[Item, ...]:
    """A consumer warpgroup's steps (module docstring: the two consumers' orders)."""
    if p.split:
        return _split_consumer_steps(p)
    main = CodeSite.CONSUMER_LAGGED if p.dq_lag else CodeSite.CONSUMER

    def step(
        kind: Kind, name: str, phase: LoopPhase = LoopPhase.LOOP, source: CodeSite = main, **fields
    ) -> Item:
        return Item(kind, Who.WARPGROUP, source, phase, name=name, **fields)

    def wgmma(name: str, reads: tuple, regs: tuple, acc: Reg, source: CodeSite = main) -> Item:
        return step(Kind.WGMMA, name, source=source, reads=reads, reg_reads=regs, reg_writes=(acc,))

    q, do = Operand(StagedTile.Q, Index.RING), Operand(StagedTile.DO, Index.RING)
    ds_rows = Operand(StagedTile.DS, Index.ALTERNATE, Part.ROWS_OF_WG)
    # the warpgroup's 64 keys of dS: its key rows of every query panel, or (dQ transposed,
    # queries as rows) its key panel
    ds_part = Part.PANEL_OF_WG if p.dq_transposed else Part.ROWS_OF_WG
    ds_store = Operand(StagedTile.DS, Index.ALTERNATE, ds_part)
    k_rows = Operand(StagedTile.K, part=Part.ROWS_OF_WG)
    v_rows = Operand(StagedTile.V, part=Part.ROWS_OF_WG)
    lse, d = Operand(StagedTile.LSE, Index.RING), Operand(StagedTile.D, Index.RING)
    # the lagged consumer loads LSE ahead of S^T and D under P's exponentials (no ld.shared
    # then waits behind the wgmmas' operand reads), so P reads D and dS reads registers
    ahead = p.dq_lag
    probs = step(
        Kind.PROBS,
        "P = exp2(S - LSE)",
        reads=(d if ahead else lse,),
        reg_reads=(Reg.S, Reg.LSE) if ahead else (Reg.S,),
        reg_writes=(Reg.S, Reg.D) if ahead else (Reg.S,),
    )
    grad_scores = step(
        Kind.GRAD_SCORES,
        "dS = P (dP - D)",
        reads=() if ahead else (d,),
        reg_reads=(Reg.S, Reg.DP, Reg.D) if ahead else (Reg.S, Reg.DP),
        reg_writes=(Reg.DP,),
    )
    pack_p = step(Kind.PACK, "P^T to 16 bits", reg_reads=(Reg.S,), reg_writes=(Reg.P16,))
    dv = wgmma("dV += P^T dO", (do,), (Reg.P16, Reg.DV), Reg.DV)
    dk = wgmma("dK += dS^T Q", (q,), (Reg.DS16, Reg.DK), Reg.DK)
    scores = [
        *(
            [step(Kind.LOAD_ROWS, "LSE -> registers", reads=(lse,), reg_writes=(Reg.LSE,))]
            if ahead
            else []
        ),
        wgmma("S^T = K Q^T", (k_rows, q), (), Reg.S),
        wgmma("dP^T = V dO^T", (v_rows, do), (), Reg.DP),
        probs,
        *([pack_p, dv, grad_scores] if p.early_dv else [grad_scores, pack_p]),
    ]
    front = scores + [
        step(Kind.PACK, "dS^T to 16 bits", reg_reads=(Reg.DP,), reg_writes=(Reg.DS16,)),
        # (st.shared, stmatrix with ds_stmatrix, stmatrix .trans where dQ is transposed: each
        # a generic-proxy store of the warpgroup's part, so one kind of step)
        step(Kind.ST_SHARED, "dS^T -> smem", writes=(ds_store,), reg_reads=(Reg.DS16,)),
        *([dv] if p.dv_before_meeting else []),
    ]
    grads = [dk] if p.early_dv or p.dv_before_meeting else [dv, dk]
    # dQ = dS K: by keys, the warpgroup's own rows of dS^T and K; by head_dim panels, all
    # B_c rows of dS^T and the warpgroup's panel of K; by queries, the warpgroup's panel of
    # dS^T (its 64 queries of every key row) and all of K
    if p.dq_by_keys:
        dq_reads = (ds_rows, k_rows)
    elif p.dq_by_queries:  # (not transposed: that reads as by head_dim panels)
        dq_reads = (
            Operand(StagedTile.DS, Index.ALTERNATE, Part.PANEL_OF_WG),
            Operand(StagedTile.K),
        )
    else:
        dq_reads = (
            Operand(StagedTile.DS, Index.ALTERNATE),
            Operand(StagedTile.K, part=Part.PANEL_OF_WG),
        )
    dq = wgmma("dQ = dS K", dq_reads, (), Reg.DQ, CodeSite.MEET_AND_ISSUE_DQ)
    staging = _stage_and_reduce(p, CodeSite.REDUCE_DQ)  # both consumers call reduce_dq
    loop = front + ([dq, *grads, *staging] if p.overlap else [*grads, dq, *staging])
    last = []
    if p.dq_lag:  # dQ(i - 1) and its adds between dV(i) and dK(i) (dq_first: before dV(i));
        # the last after the loop
        lagged = dict(source=CodeSite.ISSUE_DQ_LAGGED, guard=Guard.LAGGED)
        dq, (add,) = replace(dq, **lagged), staging
        add = replace(add, guard=Guard.LAGGED)
        loop = front + ([dq, dv, dk, add] if p.dq_first else [dv, dq, dk, add])
        last = [
            replace(dq, phase=LoopPhase.AFTER, name="dQ = dS K (the last m-block)"),
            replace(add, phase=LoopPhase.AFTER, name=f"{add.name} (the last m-block)"),
        ]
    stores = []
    if p.dkv_tma:  # dV through its dead V rows first (the warpgroup's own reads), then dK's
        for grad, tile, reg in (("dV", v_rows, Reg.DV), ("dK", k_rows, Reg.DK)):
            rows = f"{tile.buffer.value}'s rows"
            stores += [
                step(
                    Kind.ST_SHARED,
                    f"{grad} -> smem ({rows})",
                    LoopPhase.AFTER,
                    writes=(tile,),
                    reg_reads=(reg,),
                ),
                Item(
                    Kind.TMA_STORE,
                    Who.LEADER,
                    main,
                    LoopPhase.AFTER,
                    name=f"{grad} TMA store",
                    reads=(tile,),
                ),
            ]
    else:
        stores = [
            step(Kind.STORE_GLOBAL, "dK -> global", LoopPhase.AFTER, reg_reads=(Reg.DK,)),
            step(Kind.STORE_GLOBAL, "dV -> global", LoopPhase.AFTER, reg_reads=(Reg.DV,)),
        ]
    # dv_out_first: dV's staging and TMA store (stores' first two) before the last dQ, under
    # it; dK's after
    tail = [*stores[:2], *last, *stores[2:]] if p.dv_out_first else [*last, *stores]
    return (
        step(Kind.ZERO, "dK, dV = 0", LoopPhase.BEFORE, reg_writes=(Reg.DK, Reg.DV)),
        *loop,
        *tail,
    )


def _split_consumer_steps(p: Params) -> tuple[Item, ...]:
    """bwd_consumer_split's steps (head_dim 256): the warpgroup's keys of S and dP, P and dS
    into SMEM by key rows, then dV^T of both its head_dim panels, and per panel dQ^T, dK^T
    and dQ^T's adds from registers."""
    main = CodeSite.CONSUMER_SPLIT

    def step(kind: Kind, name: str, phase: LoopPhase = LoopPhase.LOOP, **fields) -> Item:
        return Item(kind, Who.WARPGROUP, main, phase, name=name, **fields)

    def wgmma(name: str, reads: tuple, regs: tuple, acc: Reg) -> Item:
        return step(Kind.WGMMA, name, reads=reads, reg_reads=regs, reg_writes=(acc,))

    q, do = Operand(StagedTile.Q, Index.RING), Operand(StagedTile.DO, Index.RING_DO)
    p_buf, ds_buf = Operand(StagedTile.P, Index.ALTERNATE), Operand(StagedTile.DS, Index.ALTERNATE)
    rows = Part.ROWS_OF_WG  # the warpgroup's keys: rows of K and V, of P and dS

    def panel(buffer: StagedTile, index: Index, n: int) -> Operand:  # panel 2 wg + n
        return Operand(buffer, index, Part.WG_PANEL, n)

    loop = [
        wgmma("S = Q K_w^T", (q, Operand(StagedTile.K, part=rows)), (), Reg.S),
        wgmma("dP = dO V_w^T", (do, Operand(StagedTile.V, part=rows)), (), Reg.DP),
        step(
            Kind.PROBS,
            "P = exp2(S - LSE)",
            reads=(Operand(StagedTile.LSE, Index.RING),),
            reg_reads=(Reg.S,),
            reg_writes=(Reg.S,),
        ),
        step(
            Kind.GRAD_SCORES,
            "dS = P (dP - D)",
            reads=(Operand(StagedTile.D, Index.RING_DO),),
            reg_reads=(Reg.S, Reg.DP),
            reg_writes=(Reg.DP,),
        ),
        step(Kind.PACK, "P to 16 bits", reg_reads=(Reg.S,), reg_writes=(Reg.P16,)),
        step(Kind.PACK, "dS to 16 bits", reg_reads=(Reg.DP,), reg_writes=(Reg.DS16,)),
        step(
            Kind.ST_SHARED,
            "P -> smem",
            writes=(replace(p_buf, part=rows),),
            reg_reads=(Reg.P16,),
        ),
        step(
            Kind.ST_SHARED,
            "dS -> smem",
            writes=(replace(ds_buf, part=rows),),
            reg_reads=(Reg.DS16,),
        ),
        *(
            wgmma(
                f"dV^T += dO^T P (panel {n})",
                (panel(StagedTile.DO, Index.RING_DO, n), p_buf),
                (Reg.DV,),
                Reg.DV,
            )
            for n in range(2)
        ),
    ]
    for n in range(2):  # dQ^T's slices (into the same registers), each with a dK^T panel
        loop += [
            wgmma(f"dQ^T = K^T dS^T (panel {n})", (panel(StagedTile.K, Index.NONE, n), ds_buf), (), Reg.DQ),
            wgmma(f"dK^T += Q^T dS (panel {n})", (panel(StagedTile.Q, Index.RING, n), ds_buf), (Reg.DK,), Reg.DK),
            Item(
                Kind.RED_GLOBAL, Who.WARPGROUP, main, LoopPhase.LOOP, name=f"dQ red.add (panel {n})",
                reg_reads=(Reg.DQ,),
            ),
        ]  # fmt: skip
    return (
        step(Kind.ZERO, "dK, dV = 0", LoopPhase.BEFORE, reg_writes=(Reg.DK, Reg.DV)),
        *loop,
        step(Kind.STORE_GLOBAL, "dK -> global", LoopPhase.AFTER, reg_reads=(Reg.DK,)),
        step(Kind.STORE_GLOBAL, "dV -> global", LoopPhase.AFTER, reg_reads=(Reg.DV,)),
    )


def _stage_and_reduce(p: Params, source: CodeSite) -> list[Item]:
    """The warpgroup's dQ into its staging buffer, reduce-added into global memory by its
    leader (in ordered_reduce_add with ``deterministic``); with ``dq_red``, added into
    global memory from every thread's registers instead (red_add_dq), no SMEM."""
    if p.dq_red:
        return [
            Item(
                Kind.RED_GLOBAL, Who.WARPGROUP, source, LoopPhase.LOOP, name="dQ red.add",
                reg_reads=(Reg.DQ,),
            )  # fmt: skip
        ]
    stage = Operand(StagedTile.DQ_STAGE, part=Part.ROWS_OF_WG)
    add_source = CodeSite.ORDERED_REDUCE_ADD if p.deterministic else source
    store = Item(
        Kind.ST_SHARED,
        Who.WARPGROUP,
        source,
        LoopPhase.LOOP,
        name="dQ -> staging",
        writes=(stage,),
        reg_reads=(Reg.DQ,),
    )
    if p.dq_writer:  # the add is the writer's (writer_steps)
        return [store]
    return [
        store,
        Item(
            Kind.BULK_REDUCE_ADD,
            Who.LEADER,
            add_source,
            LoopPhase.LOOP,
            name="dQ reduce-add",
            reads=(stage,),
        ),
    ]
