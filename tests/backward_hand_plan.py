"""The backward main kernel's sync plan written by hand: a test oracle only.

The kernel's plan is ``protocol(p)`` (fadsl/targets/sm90/backward/protocol.py): the sync
pass's placement in the schedule's steps. This is the same plan listed by hand from the
header, call by call: each role's syncs in order, with the steps of ``build_schedule(p)`` named
where they fall between them (a name must be the schedule's next step, and every step is
named once). tests/test_backward_syncs.py checks that the pass places exactly these syncs,
field for field but ``why``, in every configuration; nothing in fadsl imports this.
"""

from __future__ import annotations

from dataclasses import replace

from fadsl.targets.sm90.backward.program import (
    WARPGROUP_THREADS,
    WRITER_BAR_THREADS,
    Guard,
    Index,
    Item,
    Kind,
    Mbar,
    Named,
    Params,
    WaitParity,
    LoopPhase,
    Protocol,
    CodeSite,
    Who,
)
from fadsl.targets.sm90.backward.schedule import build_schedule


def hand_protocol(p: Params) -> Protocol:
    """The schedule's steps interleaved with the hand-listed syncs."""
    steps = build_schedule(p)
    if p.split:
        producer = _interleave(steps.producer, _split_producer(p, steps.producer))
        consumer = _interleave(steps.consumer, _split_consumer(p))
    else:
        producer = _interleave(steps.producer, _producer(p, steps.producer))
        listing = _lag_consumer(p) if p.dq_lag else _consumer(p)
        consumer = _interleave(steps.consumer, listing)
    writer = _interleave(steps.writer, _writer(p))
    return Protocol(p, _setup(p), producer, consumer, steps.layout, writer)


def _interleave(steps: tuple[Item, ...], listing: list[Item | str]) -> tuple[Item, ...]:
    """The listing with each step name replaced by the schedule's step of that name."""
    out, remaining = [], list(steps)
    for entry in listing:
        if isinstance(entry, str):
            assert remaining and remaining[0].name == entry, (entry, remaining[:1])
            out.append(remaining.pop(0))
        else:
            assert entry.is_sync, entry
            out.append(entry)
    assert not remaining, f"steps the hand plan does not name: {remaining}"
    return tuple(out)


def _names(steps: tuple[Item, ...], phase: LoopPhase) -> list[str]:
    return [x.name for x in steps if x.phase is phase]


def _setup(p: Params) -> tuple[Item, ...]:
    init = dict(who=Who.THREAD0, source=CodeSite.KERNEL, phase=LoopPhase.BEFORE)
    rings = [(Mbar.Q_FULL, Mbar.Q_EMPTY, Index.RING)]
    if p.split:  # dO's ring of its own
        rings.append((Mbar.DO_FULL, Mbar.DO_EMPTY, Index.RING_DO))
    return (
        Item(Kind.MBAR_INIT, mbar=Mbar.KV_FULL, count=1, why="the producer's expect_tx", **init),
        *(
            item
            for full, empty, slot in rings
            for item in (
                Item(Kind.MBAR_INIT, mbar=full, slot=slot, count=1, **init),
                Item(
                    Kind.MBAR_INIT,
                    mbar=empty,
                    slot=slot,
                    count=p.consumer_threads,
                    why="every consumer thread, once per m-block",
                    **init,
                ),
            )
        ),
        # `late_v on`: V's own full barrier, the producer's expect_tx
        *([Item(Kind.MBAR_INIT, mbar=Mbar.V_FULL, count=1, **init)] if p.late_v else []),
        *(
            Item(Kind.MBAR_INIT, mbar=mbar, slot=Index.ALTERNATE, count=p.consumer_threads, **init)
            for mbar in ((Mbar.DS_FULL, Mbar.DS_EMPTY) if p.dq_lag else ())
        ),  # dq_lag: dS^T's full and empty per buffer, every consumer thread
        Item(Kind.FENCE_MBAR_INIT, why="the inits visible to TMA's complete_tx", **init),
        Item(
            Kind.SYNCTHREADS,
            Who.CTA,
            CodeSite.KERNEL,
            LoopPhase.BEFORE,
            why="the inits before any use",
        ),
    )


def _producer_sync(kind: Kind, phase: LoopPhase, source: CodeSite, **fields) -> Item:
    return Item(kind, Who.ELECTED, source, phase, guard=Guard.HAS_WORK, **fields)


def _load_kv(p: Params, steps: tuple[Item, ...]) -> list[Item | str]:
    """bwd_load_kv: kv_full armed with K's and V's bytes (`late_v on`: K's), then their loads."""
    return [
        _producer_sync(
            Kind.MBAR_ARRIVE_EXPECT_TX,
            LoopPhase.BEFORE,
            CodeSite.LOAD_KV,
            mbar=Mbar.KV_FULL,
            tx=(1 if p.late_v else 2) * p.kv_bytes,
            why="K's and V's bytes complete kv_full",
        ),
        *_names(steps, LoopPhase.BEFORE),  # K and V, panel by panel
    ]


def _split_producer(p: Params, steps: tuple[Item, ...]) -> list[Item | str]:
    """bwd_producer_split: per m-block the Q ring's slot (Q, LSE), then the dO ring's (dO,
    D), each after its empty barrier's wait and armed with its bytes."""
    out = _load_kv(p, steps)
    names = iter(_names(steps, LoopPhase.LOOP))
    for empty, full, slot, flip in (
        (Mbar.Q_EMPTY, Mbar.Q_FULL, Index.RING, WaitParity.RING_FLIP),
        (Mbar.DO_EMPTY, Mbar.DO_FULL, Index.RING_DO, WaitParity.RING_DO_FLIP),
    ):
        ring = dict(slot=slot, why="the ring's slot")
        out += [
            _producer_sync(
                Kind.MBAR_WAIT, LoopPhase.LOOP, CodeSite.PRODUCER_SPLIT, mbar=empty, parity=flip, **ring
            ),
            _producer_sync(
                Kind.MBAR_ARRIVE_EXPECT_TX, LoopPhase.LOOP, CodeSite.PRODUCER_SPLIT, mbar=full,
                tx=p.q_bytes + p.row_floats_bytes, **ring,
            ),
            *(next(names) for _ in range(p.panels + 1)),  # the panels, then LSE or D
        ]  # fmt: skip
    return out


def _producer(p: Params, steps: tuple[Item, ...]) -> list[Item | str]:
    def sync(kind: Kind, phase: LoopPhase, **fields) -> Item:
        return _producer_sync(kind, phase, CodeSite.PRODUCER, **fields)

    return [
        *_load_kv(p, steps),
        sync(
            Kind.MBAR_WAIT,
            LoopPhase.LOOP,
            mbar=Mbar.Q_EMPTY,
            slot=Index.RING,
            parity=WaitParity.RING_FLIP,
            why="WAR: every consumer is done with the slot's Q, dO, LSE and D",
        ),
        sync(
            Kind.MBAR_ARRIVE_EXPECT_TX,
            LoopPhase.LOOP,
            mbar=Mbar.Q_FULL,
            slot=Index.RING,
            tx=2 * p.q_bytes + 2 * p.row_floats_bytes,
            why="Q's, dO's, LSE's and D's bytes complete q_full",
        ),
        *_names(steps, LoopPhase.LOOP)[: 2 * p.panels + 2],  # Q and dO panel by panel, LSE, D
        # `late_v on`: V in m-block 0, on its own barrier (bwd_load_v_late)
        *(
            [
                Item(
                    Kind.MBAR_ARRIVE_EXPECT_TX, Who.ELECTED, CodeSite.LOAD_V_LATE, LoopPhase.LOOP,
                    guard=Guard.FIRST, mbar=Mbar.V_FULL, tx=p.kv_bytes,
                ),
                *_names(steps, LoopPhase.LOOP)[2 * p.panels + 2 :],
            ]
            if p.late_v
            else []
        ),
    ]  # fmt: skip


def _consumer(p: Params) -> list[Item | str]:
    """bwd_consumer with its helpers inlined: by default it commits dV and dK, then dQ
    (meet_and_issue_dq), and waits for all three (wait_group 0) before it releases the slot
    and stages dQ; with ``overlap`` it commits dQ, then dV and dK, waits
    for dQ alone (wait_group 1), stages and reduce-adds it while dV and dK run, then waits
    for them (wait_group 0) and releases the slot. With ``early_dv`` it commits dV alone
    right after P^T is packed, waits for dP^T with dV's group still running (wait_group 1),
    and after the meeting commits dQ, then dK. With ``dv_before_meeting`` it packs and stores
    dS^T, then commits dV alone (its fence covers dQ's too), meets, commits dQ, then dK."""
    main = CodeSite.CONSUMER
    meet = CodeSite.MEET_AND_ISSUE_DQ

    def sync(
        kind: Kind, phase: LoopPhase = LoopPhase.LOOP, source: CodeSite = main, **fields
    ) -> Item:
        return Item(kind, Who.WARPGROUP, source, phase, **fields)

    listing = [
        "dK, dV = 0",
        sync(
            Kind.MBAR_WAIT,
            LoopPhase.BEFORE,
            guard=Guard.HAS_WORK,
            mbar=Mbar.KV_FULL,
            parity=WaitParity.ZERO,
            why="RAW: K and V landed",
        ),
        sync(
            Kind.MBAR_WAIT,
            mbar=Mbar.Q_FULL,
            slot=Index.RING,
            parity=WaitParity.RING,
            why="RAW: the slot's Q, dO, LSE and D landed",
        ),
        sync(Kind.WGMMA_FENCE, why="S^T, dP^T were accessed by ordinary code"),
        "S^T = K Q^T",
        sync(Kind.WGMMA_COMMIT),
        "dP^T = V dO^T",
        sync(Kind.WGMMA_COMMIT),
        *_owed_release(p, LoopPhase.LOOP),  # m-block i - 1's ticket, under S^T and dP^T
        sync(Kind.WGMMA_WAIT, pending=1, why="S^T in registers (dP^T's group may run on)"),
        "P = exp2(S - LSE)",
    ]
    if p.early_dv:
        listing += [
            "P^T to 16 bits",
            sync(Kind.WGMMA_FENCE, why="the A registers P^T were written by ordinary code"),
            "dV += P^T dO",
            sync(Kind.WGMMA_COMMIT),
            sync(Kind.WGMMA_WAIT, pending=1, why="dP^T in registers (dV's group may run on)"),
            "dS = P (dP - D)",
        ]
    else:
        listing += [
            sync(Kind.WGMMA_WAIT, pending=0, why="dP^T in registers"),
            "dS = P (dP - D)",
            "P^T to 16 bits",
        ]
    listing += ["dS^T to 16 bits", "dS^T -> smem"]
    if p.dv_before_meeting:  # dV in a group of its own, after dS^T's store, before the meeting
        listing += [
            sync(Kind.WGMMA_FENCE, why="the A registers P^T were written by ordinary code"),
            "dV += P^T dO",
            sync(Kind.WGMMA_COMMIT),
        ]
    regs_fence = sync(
        Kind.WGMMA_FENCE, why="the A registers P^T, dS^T were written by ordinary code"
    )
    dv_issued = p.early_dv or p.dv_before_meeting
    grads = ["dK += dS^T Q"] if dv_issued else ["dV += P^T dO", "dK += dS^T Q"]
    grads.append(sync(Kind.WGMMA_COMMIT))
    ds_fence = sync(Kind.FENCE_PROXY_ASYNC_SMEM, why="RAW: dS^T's st.shared before dQ's wgmma")
    if p.dq_by_keys:
        ds_ready = sync(
            Kind.NAMED_BAR_SYNC,
            source=meet,
            named=Named.DQ,
            threads=WARPGROUP_THREADS,
            why="RAW: the warpgroup's rows of dS^T written",
        )
    else:
        ds_ready = sync(
            Kind.NAMED_BAR_SYNC,
            source=meet,
            named=Named.DS,
            threads=p.consumer_threads,
            why="RAW: all B_c rows of dS^T written",
        )
    release = sync(
        Kind.MBAR_ARRIVE,
        mbar=Mbar.Q_EMPTY,
        slot=Index.RING,
        why="WAR: the slot's Q, dO (wgmma retired), LSE and D (read) are free",
    )
    staging = _stage_and_reduce(p, CodeSite.REDUCE_DQ)
    if p.overlap:
        listing += [
            ds_fence,
            *([] if p.dv_before_meeting else [regs_fence]),  # dV's fence covers them
            ds_ready,
            "dQ = dS K",
            sync(Kind.WGMMA_COMMIT, source=meet),
            *grads,
            sync(Kind.WGMMA_WAIT, pending=1, why="dQ in registers (dV's and dK's group runs on)"),
            *staging,
            sync(Kind.WGMMA_WAIT, pending=0, why="dV, dK retired: Q, dO read"),
            release,
        ]
    else:
        listing += [
            regs_fence,
            *grads,
            ds_fence,
            ds_ready,
            "dQ = dS K",
            sync(Kind.WGMMA_COMMIT, source=meet),
            sync(Kind.WGMMA_WAIT, pending=0, why="dV, dK, dQ retired: Q, dO, dS^T read"),
            release,
            *staging,
        ]
    exit_wait = Item(
        Kind.BULK_WAIT,
        Who.LEADER,
        main,
        LoopPhase.AFTER,
        why="the last reduce-add read the staging before the CTA exits",
    )
    listing += _owed_release(p, LoopPhase.AFTER)  # the last m-block's ticket
    no_bulk = p.dq_red or p.dq_writer  # (the writer waits for its own adds)
    return listing + ([] if no_bulk else [exit_wait]) + ["dK -> global", "dV -> global"]


def _lag_consumer(p: Params) -> list[Item | str]:
    """bwd_consumer_lagged (`dq_lag on`, issue_dq_lagged and reduce_dq inlined): the
    overlapped front, LSE loaded after the slot's q_full wait, before S^T; from m-block 2
    on the wait on the buffer's ds_empty (its previous use's dQ retired), the dS^T store;
    dV in a group of its own, then dS^T's proxy fence and each thread's ds_full arrival
    (under dV); from m-block 1 on the wait on the previous buffer's ds_full, dQ(i - 1) in
    a group of its own; dK; then dQ(i - 1)'s wait_group 1, ds_empty arrival and adds;
    wait_group 0 and the slot's release. With `dq_first on` the proxy fence and the
    arrival right after the store, then the ds_full wait, one wgmma.fence (every
    m-block), dQ(i - 1) in a group of its own, then dV and dK in one
    group, wait_group 1 (dQ alone retired). After the loop (m_count > 0) the last dQ
    likewise, its wgmma.fence after the ds_full wait, wait_group 0."""
    main = CodeSite.CONSUMER_LAGGED
    lagged = dict(guard=Guard.LAGGED)

    def sync(kind: Kind, phase: LoopPhase = LoopPhase.LOOP, source: CodeSite = main, **fields):
        return Item(kind, Who.WARPGROUP, source, phase, **fields)

    buf = dict(slot=Index.ALTERNATE)
    full_wait = dict(mbar=Mbar.DS_FULL, parity=WaitParity.ALTERNATE, **buf, **lagged)
    empty = dict(mbar=Mbar.DS_EMPTY, **buf, **lagged)
    dq_commit = dict(source=CodeSite.ISSUE_DQ_LAGGED, **lagged)
    handed = [
        sync(Kind.FENCE_PROXY_ASYNC_SMEM, why="RAW: dS^T's st.shared before dQ's wgmma"),
        sync(Kind.MBAR_ARRIVE, mbar=Mbar.DS_FULL, why="RAW: this thread's part stored", **buf),
    ]
    gradients = [
        sync(Kind.WGMMA_FENCE, why="dV, P^T, dK, dS^T written by ordinary code"),
        "dV += P^T dO",
        sync(Kind.WGMMA_COMMIT),
        *handed,  # under dV: the fence waits for the stores to land
        sync(Kind.MBAR_WAIT, why="RAW: both warpgroups' parts of dS^T(i - 1)", **full_wait),
        "dQ = dS K",
        sync(Kind.WGMMA_COMMIT, **dq_commit),
        "dK += dS^T Q",
        sync(Kind.WGMMA_COMMIT),
        sync(Kind.WGMMA_WAIT, pending=1, why="dV(i) and dQ(i - 1) retired", **lagged),
    ]
    if p.dq_first:
        gradients = [
            *handed,
            sync(Kind.MBAR_WAIT, why="RAW: both warpgroups' parts of dS^T(i - 1)", **full_wait),
            sync(Kind.WGMMA_FENCE, why="dV, P^T, dK, dS^T written by ordinary code"),
            "dQ = dS K",
            sync(Kind.WGMMA_COMMIT, **dq_commit),
            "dV += P^T dO",
            "dK += dS^T Q",
            sync(Kind.WGMMA_COMMIT),
            sync(Kind.WGMMA_WAIT, pending=1, why="dQ(i - 1) retired", **lagged),
        ]
    return [
        "dK, dV = 0",
        sync(
            Kind.MBAR_WAIT, LoopPhase.BEFORE, guard=Guard.HAS_WORK, mbar=Mbar.KV_FULL,
            parity=WaitParity.ZERO, why="RAW: K and V landed",
        ),
        sync(Kind.MBAR_WAIT, mbar=Mbar.Q_FULL, slot=Index.RING, parity=WaitParity.RING),
        "LSE -> registers",
        sync(Kind.WGMMA_FENCE, why="S^T, dP^T were accessed by ordinary code"),
        "S^T = K Q^T",
        sync(Kind.WGMMA_COMMIT),
        *(
            [sync(Kind.MBAR_WAIT, guard=Guard.FIRST, mbar=Mbar.V_FULL, parity=WaitParity.ZERO)]
            if p.late_v
            else []
        ),  # `late_v on`: V landed, in the warpgroup's first pass
        "dP^T = V dO^T",
        sync(Kind.WGMMA_COMMIT),
        sync(Kind.WGMMA_WAIT, pending=1, why="S^T in registers"),
        "P = exp2(S - LSE)",
        sync(Kind.WGMMA_WAIT, pending=0, why="dP^T in registers"),
        "dS = P (dP - D)",
        "P^T to 16 bits",
        "dS^T to 16 bits",
        sync(
            Kind.MBAR_WAIT, mbar=Mbar.DS_EMPTY, parity=WaitParity.ALTERNATE_PREVIOUS,
            guard=Guard.REUSED, why="WAR: both warpgroups' dQ(i - 2) retired", **buf,
        ),
        "dS^T -> smem",
        *gradients,
        sync(Kind.MBAR_ARRIVE, why="WAR: this warpgroup's reads of dS^T(i - 1) retired", **empty),
        *_lagged_add(p, LoopPhase.LOOP),
        sync(Kind.WGMMA_WAIT, pending=0, why="dV and dK retired: Q, dO read"),
        sync(Kind.MBAR_ARRIVE, mbar=Mbar.Q_EMPTY, slot=Index.RING, why="WAR: the slot is free"),
        *(
            [
                sync(
                    Kind.MBAR_WAIT, LoopPhase.AFTER, guard=Guard.HAS_WORK, mbar=Mbar.V_FULL,
                    parity=WaitParity.ZERO,
                )
            ]
            if p.late_v and p.peel_dead
            else []
        ),  # `late_v on`: V landed (a peeled warpgroup's loop may not run)
        # `dv_out_first on`: dV's staging and TMA store first (the header's first dkv_store branch)
        *(_tma_epilogue(main)[:5] if p.dv_out_first else []),
        sync(Kind.MBAR_WAIT, LoopPhase.AFTER, why="RAW: the last dS^T stored", **full_wait),
        sync(Kind.WGMMA_FENCE, LoopPhase.AFTER, why="dq read by the adds", **lagged),
        "dQ = dS K (the last m-block)",
        sync(Kind.WGMMA_COMMIT, LoopPhase.AFTER, **dq_commit),
        sync(Kind.WGMMA_WAIT, LoopPhase.AFTER, pending=0, why="the last dQ", **lagged),
        sync(Kind.MBAR_ARRIVE, LoopPhase.AFTER, why="WAR: the last dS^T read", **empty),
        *_lagged_add(p, LoopPhase.AFTER),
        *(
            [sync(Kind.MBAR_ARRIVE, LoopPhase.AFTER, guard=Guard.HAS_WORK, mbar=Mbar.KV_EMPTY)]
            if p.persistent
            else []
        ),  # K and V freed once the last dQ retired
        *(_tma_epilogue(main)[5 if p.dv_out_first else 0 :] if p.dkv_tma else ["dK -> global", "dV -> global"]),
    ]  # fmt: skip


def _lagged_add(p: Params, phase: LoopPhase) -> list[Item | str]:
    """reduce_dq inlined in bwd_consumer_lagged, for m-block i - 1 in m-block i (after the
    loop for the last): dQ's red.add from registers; with `dq_writer on` its writer branch,
    whose empty barrier's wait (reduce_dq's i > 0, i the m-block it acts for) runs from m-block
    2 on and after a loop of two or more, then the staging, its proxy fence and the full
    barrier's arrival."""
    last = " (the last m-block)" if phase is LoopPhase.AFTER else ""
    if not p.dq_writer:
        return [f"dQ red.add{last}"]

    def sync(kind: Kind, **fields) -> Item:
        return Item(kind, Who.WARPGROUP, CodeSite.REDUCE_DQ, phase, **fields)

    bar = dict(threads=WRITER_BAR_THREADS)
    return [
        sync(
            Kind.NAMED_BAR_SYNC, named=Named.DQ_EMPTY, guard=Guard.LAGGED_AFTER_FIRST,
            why="WAR: the writer's add of the m-block before read the staging", **bar,
        ),
        f"dQ -> staging{last}",
        sync(Kind.FENCE_PROXY_ASYNC_SMEM, guard=Guard.LAGGED, why="RAW: before the writer's add"),
        sync(
            Kind.NAMED_BAR_ARRIVE, named=Named.DQ_FULL, guard=Guard.LAGGED,
            why="RAW: the staging handed to the writer", **bar,
        ),
    ]  # fmt: skip


def _tma_epilogue(main: CodeSite) -> list[Item | str]:
    """bwd_consumer_lagged's epilogue with dK and dV by TMA: dV's rows staged in V's, the
    proxy fence, the warpgroup's barrier, thread 0's TMA store and commit; the wait on the
    last dS^T buffer's ds_empty (every warpgroup's last dQ, which read K, retired); dK the
    same way through K's rows, then thread 0's wait_group.read 0 before the exit (its first
    five entries, dV's, go before the last dQ with `dv_out_first on`)."""

    def sync(kind: Kind, who: Who = Who.WARPGROUP, **fields) -> Item:
        return Item(kind, who, main, LoopPhase.AFTER, **fields)

    met = [
        sync(Kind.FENCE_PROXY_ASYNC_SMEM, why="RAW: the stmatrix before the TMA store"),
        sync(Kind.NAMED_BAR_SYNC, named=Named.DQ, threads=WARPGROUP_THREADS, why="RAW: staged"),
    ]
    return [
        "dV -> smem (V's rows)",
        *met,
        "dV TMA store",
        sync(Kind.BULK_COMMIT, Who.LEADER),
        sync(
            Kind.MBAR_WAIT, mbar=Mbar.DS_EMPTY, slot=Index.ALTERNATE, parity=WaitParity.ALTERNATE,
            guard=Guard.LAGGED, why="WAR: every warpgroup's last dQ read K",
        ),
        "dK -> smem (K's rows)",
        *met,
        "dK TMA store",
        sync(Kind.BULK_COMMIT, Who.LEADER),
        sync(Kind.BULK_WAIT_READ, Who.LEADER, pending=0, why="the stores read their tiles"),
    ]  # fmt: skip


def _split_consumer(p: Params) -> list[Item | str]:
    """bwd_consumer_split (head_dim 256): S and dP in groups of their own, each after its
    ring's full barrier; P and dS stored, fenced and met at kBarDS by both warpgroups; dV^T
    of both panels with dQ^T of the first in one group, dK^T of the first panel in the next;
    wait_group 1 (dV^T and dQ^T retired): the dO slot released, the first slice added; a
    wgmma.fence, the second slice's dQ^T and dK^T in groups of their own, wait_group 1 and
    its adds; wait_group 0, the Q slot released."""

    def sync(kind: Kind, phase: LoopPhase = LoopPhase.LOOP, **fields) -> Item:
        return Item(kind, Who.WARPGROUP, CodeSite.CONSUMER_SPLIT, phase, **fields)

    do_ring = dict(slot=Index.RING_DO)
    return [
        "dK, dV = 0",
        sync(
            Kind.MBAR_WAIT, LoopPhase.BEFORE, guard=Guard.HAS_WORK, mbar=Mbar.KV_FULL,
            parity=WaitParity.ZERO, why="RAW: K and V landed",
        ),
        sync(Kind.MBAR_WAIT, mbar=Mbar.Q_FULL, slot=Index.RING, parity=WaitParity.RING),
        sync(Kind.WGMMA_FENCE, why="S, dP (and dQ, by the adds) were accessed by ordinary code"),
        "S = Q K_w^T",
        sync(Kind.WGMMA_COMMIT),
        sync(Kind.MBAR_WAIT, mbar=Mbar.DO_FULL, parity=WaitParity.RING_DO, **do_ring),
        "dP = dO V_w^T",
        sync(Kind.WGMMA_COMMIT),
        sync(Kind.WGMMA_WAIT, pending=1, why="S in registers"),
        "P = exp2(S - LSE)",
        sync(Kind.WGMMA_WAIT, pending=0, why="dP in registers"),
        "dS = P (dP - D)",
        "P to 16 bits",
        "dS to 16 bits",
        "P -> smem",
        "dS -> smem",
        sync(Kind.FENCE_PROXY_ASYNC_SMEM, why="RAW: P's and dS's stmatrix before the wgmmas"),
        sync(
            Kind.NAMED_BAR_SYNC, named=Named.DS, threads=p.consumer_threads,
            why="RAW: both warpgroups' keys of P and dS",
        ),
        "dV^T += dO^T P (panel 0)",
        "dV^T += dO^T P (panel 1)",
        "dQ^T = K^T dS^T (panel 0)",
        sync(Kind.WGMMA_COMMIT),
        "dK^T += Q^T dS (panel 0)",
        sync(Kind.WGMMA_COMMIT),
        sync(Kind.WGMMA_WAIT, pending=1, why="dV^T and dQ^T's first slice retired"),
        sync(Kind.MBAR_ARRIVE, mbar=Mbar.DO_EMPTY, why="WAR: the dO slot and D free", **do_ring),
        "dQ red.add (panel 0)",
        sync(Kind.WGMMA_FENCE, why="dQ read by the adds"),
        "dQ^T = K^T dS^T (panel 1)",
        sync(Kind.WGMMA_COMMIT),
        "dK^T += Q^T dS (panel 1)",
        sync(Kind.WGMMA_COMMIT),
        sync(Kind.WGMMA_WAIT, pending=1, why="dQ^T's second slice retired"),
        "dQ red.add (panel 1)",
        sync(Kind.WGMMA_WAIT, pending=0, why="dK^T retired: Q read"),
        sync(Kind.MBAR_ARRIVE, mbar=Mbar.Q_EMPTY, slot=Index.RING, why="WAR: the Q slot free"),
        "dK -> global",
        "dV -> global",
    ]  # fmt: skip


def _owed_release(p: Params, phase: LoopPhase) -> list[Item]:
    """Deterministic mode: release_dq_ticket, the leader's release of the ticket it owes
    (from m-block 1 on, and after the loop of a CTA with work); none with a writer."""
    if not p.deterministic or p.dq_writer:
        return []
    owed = dict(who=Who.LEADER, source=CodeSite.RELEASE_DQ_TICKET, phase=phase, guard=Guard.OWED)
    return [
        Item(Kind.BULK_WAIT, pending=0, why="the adds performed", **owed),
        Item(Kind.FENCE_PROXY_ASYNC_GLOBAL, why="the adds before the release", **owed),
        Item(Kind.SEM_RELEASE, why="the next ticket may add", **owed),
    ]


def _stage_and_reduce(p: Params, source: CodeSite) -> list[Item | str]:
    """The staging's syncs around dQ's st.shared and the leader's reduce-add (ordered by the
    semaphore in deterministic mode); with ``dq_red`` the registers' adds alone, no sync."""
    if p.dq_red:
        return ["dQ red.add"]
    own_bar = dict(named=Named.DQ, threads=WARPGROUP_THREADS)

    def sync(kind: Kind, who: Who = Who.WARPGROUP, **fields) -> Item:
        return Item(kind, who, source, LoopPhase.LOOP, **fields)

    if p.dq_writer:  # reduce_dq's writer branch: the staging handed over, no add here
        return [
            sync(
                Kind.NAMED_BAR_SYNC, named=Named.DQ_EMPTY, threads=WRITER_BAR_THREADS,
                guard=Guard.AFTER_FIRST, why="WAR: the writer's previous add read the staging",
            ),
            "dQ -> staging",
            sync(Kind.FENCE_PROXY_ASYNC_SMEM, why="RAW: the staging's st.shared before the add"),
            sync(
                Kind.NAMED_BAR_ARRIVE, named=Named.DQ_FULL, threads=WRITER_BAR_THREADS,
                why="RAW: the staging handed to the writer",
            ),
        ]  # fmt: skip

    out = [
        sync(Kind.BULK_WAIT_READ, Who.LEADER, why="WAR: the previous reduce-add read the staging"),
        sync(Kind.NAMED_BAR_SYNC, why="WAR: the leader's wait before the staging", **own_bar),
        "dQ -> staging",
        sync(Kind.FENCE_PROXY_ASYNC_SMEM, why="RAW: the staging's st.shared before the reduce"),
        sync(Kind.NAMED_BAR_SYNC, why="RAW: all of the staging written", **own_bar),
    ]
    commit = sync(Kind.BULK_COMMIT, Who.LEADER)
    if not p.deterministic:
        return out + ["dQ reduce-add", commit]
    ordered = dict(who=Who.LEADER, source=CodeSite.ORDERED_REDUCE_ADD, phase=LoopPhase.LOOP)
    return out + [
        Item(Kind.SEM_ACQUIRE, why="the reduce-adds before this ticket's done", **ordered),
        Item(Kind.FENCE_PROXY_ASYNC_GLOBAL, why="the acquire before the adds", **ordered),
        "dQ reduce-add",
        replace(commit, source=CodeSite.ORDERED_REDUCE_ADD),
    ]  # the release is owed: _owed_release


def _writer(p: Params) -> list[Item | str]:
    """bwd_dq_writer: per m-block the full barrier, lane 0's (ordered) bulk reduce-add, its
    commit and read wait, __syncwarp, the empty barrier's arrival but in the last m-block,
    and in deterministic mode lane 0's wait_group 0, fence and release, then __syncwarp;
    otherwise lane 0's wait_group 0 after the loop."""
    if not p.dq_writer:
        return []

    def sync(kind: Kind, who: Who = Who.WRITER, **fields) -> Item:
        return Item(kind, who, CodeSite.DQ_WRITER, LoopPhase.LOOP, **fields)

    lane0 = Who.WRITER_LANE0
    acquire = [
        sync(Kind.SEM_ACQUIRE, lane0, why="the lower tickets' adds done"),
        sync(Kind.FENCE_PROXY_ASYNC_GLOBAL, lane0, why="the acquire before the adds"),
    ]
    release = [
        sync(Kind.BULK_WAIT, lane0, pending=0, why="the adds performed"),
        sync(Kind.FENCE_PROXY_ASYNC_GLOBAL, lane0, why="the adds before the release"),
        sync(Kind.SEM_RELEASE, lane0, why="the next ticket may add"),
        sync(Kind.SYNCWARP, why="lane 0's release before the next m-block's bar.sync"),
    ]
    # without the release's wait_group 0: the last add performed before the warp exits
    exit_wait = replace(
        sync(Kind.BULK_WAIT, lane0, pending=0, why="the last add performed"),
        phase=LoopPhase.AFTER,
    )
    return [
        sync(Kind.NAMED_BAR_SYNC, named=Named.DQ_FULL, threads=WRITER_BAR_THREADS),
        *(acquire if p.deterministic else []),
        "dQ reduce-add",
        sync(Kind.BULK_COMMIT, lane0),
        sync(Kind.BULK_WAIT_READ, lane0, pending=0, why="WAR: the add read the staging"),
        sync(Kind.SYNCWARP, why="lane 0's wait before the warp's arrival"),
        sync(
            Kind.NAMED_BAR_ARRIVE,
            named=Named.DQ_EMPTY,
            threads=WRITER_BAR_THREADS,
            guard=Guard.BEFORE_LAST,
        ),
        *(release if p.deterministic else [exit_wait]),
    ]
