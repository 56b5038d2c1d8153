"""Hand-written warp-specialised pipelines (FlashAttention-3's protocol) for the async verifier.

``fa3(...)`` builds the sync plan the seed describes, for one Q tile: a producer thread loads Q
on a one-shot barrier and K and V into a ring of ``stages`` slots, each slot with a full and an
empty mbarrier; ``consumers`` warpgroups wait on full, run S = Q K^T and O += P V with wgmma,
and release each slot on empty as soon as its wgmma has retired; the epilogue writes O over the
dead V ring, fences, meets at a named barrier and stores O with TMA. Knobs break it on purpose.
"""

from __future__ import annotations

from dataclasses import replace

from fadsl.passes.asyncmodel.model import (
    Agent,
    Arrive,
    BarArrive,
    BarSync,
    BulkCommit,
    BulkWait,
    ClusterArrive,
    ClusterWait,
    FenceProxyAsync,
    GenericAccess,
    Program,
    RemoteArrive,
    Span,
    TmaLoad,
    TmaMulticast,
    TmaStore,
    Wait,
    Wgmma,
    WgmmaCommit,
    WgmmaWait,
)

ROWS = 64  # query rows per consumer warpgroup
TILE = 1024  # bytes of one K or V slot (small numbers keep messages readable)


def fa3(
    stages: int = 2,
    blocks: int = 3,
    consumers: int = 2,
    data_slots: int | None = None,
    o_over_v: bool = True,
    mutate: dict | None = None,
) -> Program:
    """The correct plan. ``data_slots`` < ``stages`` shrinks the ring's bytes but not its
    barriers (a broken ring). ``mutate`` maps an event's label (``LABELS``) to None (drop it
    everywhere: in every iteration and every warpgroup) or to a function of the event."""
    mutate = mutate or {}

    def emit(events: list, label: str, event) -> None:
        if label in mutate:
            if mutate[label] is None:
                return
            event = mutate[label](event)
        events.append(event)

    slots = stages if data_slots is None else data_slots
    q = [Span("smem", w * TILE, (w + 1) * TILE, f"Q rows of wg{w}") for w in range(consumers)]
    base = consumers * TILE
    k = [Span("smem", base + s * TILE, base + (s + 1) * TILE, f"K[slot {s}]") for s in range(slots)]
    base += slots * TILE
    v = [Span("smem", base + s * TILE, base + (s + 1) * TILE, f"V[slot {s}]") for s in range(slots)]
    # O (consumers * TILE / 2 bytes here) placed over the dead V ring, or after it.
    o_base = v[0].lo if o_over_v else base + slots * TILE
    o = [
        Span("smem", o_base + w * TILE // 2, o_base + (w + 1) * TILE // 2, f"O rows of wg{w}")
        for w in range(consumers)
    ]
    o_all = Span("smem", o_base, o_base + consumers * TILE // 2, "O")

    producer: list = []
    emit(producer, "arrive q_full", Arrive("q_full", tx=consumers * TILE))
    q_all = Span("smem", 0, consumers * TILE, "Q")
    emit(producer, "load Q", TmaLoad(q_all, "q_full", consumers * TILE, "load Q"))
    for j in range(blocks):
        s, r = j % stages, j // stages
        for t, ring in (("k", k), ("v", v)):
            emit(producer, f"wait {t}_empty", Wait(f"{t}_empty{s}", (r + 1) % 2))
            emit(producer, f"arrive {t}_full", Arrive(f"{t}_full{s}", tx=TILE))
            load = TmaLoad(ring[j % slots], f"{t}_full{s}", TILE, f"load {t.upper()} block {j}")
            emit(producer, f"load {t}", load)
    agents = [Agent("producer", 1, tuple(producer))]
    for w in range(consumers):
        regs = f"rf:wg{w}"
        s_acc, p_regs, o_acc = (
            Span(regs, 0, 64, "S"),
            Span(regs, 64, 96, "P"),
            Span(regs, 96, 160, "O acc"),
        )
        events: list = []
        emit(events, "wait q_full", Wait("q_full", 0))
        emit(events, "zero O", GenericAccess(o_acc, True, "zero O"))
        for j in range(blocks):
            s, r = j % stages, j // stages
            qk = Wgmma((q[w], k[j % slots]), (s_acc,), f"S = Q K^T, block {j}")
            pv = Wgmma((p_regs, v[j % slots]), (o_acc,), f"O += P V, block {j}")
            for label, event in (
                ("wait k_full", Wait(f"k_full{s}", r % 2)),
                ("qk", qk),
                ("commit qk", WgmmaCommit()),
                ("wgmma wait qk", WgmmaWait(0)),
                ("arrive k_empty", Arrive(f"k_empty{s}")),
                ("read S", GenericAccess(s_acc, False, f"softmax {j}: read S")),
                ("write P", GenericAccess(p_regs, True, f"softmax {j}: write P")),
                ("rescale O", GenericAccess(o_acc, True, f"softmax {j}: rescale O")),
                ("wait v_full", Wait(f"v_full{s}", r % 2)),
                ("pv", pv),
                ("commit pv", WgmmaCommit()),
                ("wgmma wait pv", WgmmaWait(0)),
                ("arrive v_empty", Arrive(f"v_empty{s}")),
            ):
                emit(events, label, event)
        threads = 128 * consumers
        why_1 = "every warpgroup's last P V is done before O overwrites V"
        for label, event in (
            ("normalize O", GenericAccess(o_acc, True, "normalize O")),
            ("bar.sync 1", BarSync(1, threads, why_1)),
            ("O -> smem", GenericAccess(o[w], True, "O -> smem")),
            ("fence", FenceProxyAsync()),
            ("bar.sync 2", BarSync(2, threads, "all of O is in smem before the TMA store")),
        ):
            emit(events, label, event)
        if w == 0:
            emit(events, "store O", TmaStore(o_all, "store O"))
            emit(events, "bulk commit", BulkCommit())
            emit(events, "bulk wait", BulkWait(0))
        agents.append(Agent(f"wg{w}", 128, tuple(events)))
    barriers = [("q_full", 1)] + [
        (f"{t}_{kind}{s}", 1 if kind == "full" else consumers)
        for s in range(stages)
        for t in ("k", "v")
        for kind in ("full", "empty")
    ]
    return Program(tuple(agents), tuple(barriers))


# Every sync event's label, by what a mutation may do to it.
ARRIVES = ("arrive q_full", "arrive k_full", "arrive v_full", "arrive k_empty", "arrive v_empty")
WAITS = ("wait q_full", "wait k_empty", "wait v_empty", "wait k_full", "wait v_full")
OTHER_SYNCS = ("wgmma wait qk", "wgmma wait pv", "fence", "bar.sync 1", "bar.sync 2", "bulk wait")


def drop(program: Program, agent: int, index: int) -> Program:
    """The program without one event."""
    a = program.agents[agent]
    events = a.events[:index] + a.events[index + 1 :]
    return _with_agent(program, agent, replace(a, events=events))


def swap(program: Program, agent: int, index: int, event) -> Program:
    """The program with one event replaced."""
    a = program.agents[agent]
    events = a.events[:index] + (event,) + a.events[index + 1 :]
    return _with_agent(program, agent, replace(a, events=events))


def _with_agent(program: Program, index: int, agent: Agent) -> Program:
    agents = program.agents[:index] + (agent,) + program.agents[index + 1 :]
    return replace(program, agents=agents)


def fa3_overlap(stages: int = 2, blocks: int = 3, consumers: int = 2, mutate=None) -> Program:
    """The plan of emit/sm90's kernel: K one block ahead of V in the producer; in each consumer
    S(j) and O += P(j-1) V(j-1) in flight together (wgmma.wait_group 1, then 0); ping-pong named
    barriers handing the tensor cores from warpgroup to warpgroup; the empty barriers count one
    arrival per consumer warp; O over the dead V ring, stored by one thread per warpgroup."""
    mutate = mutate or {}
    warps = 4
    sched, ring_dead, o_store = 5, 1, 2  # named barrier ids: 5 + wg, 1, 2 + wg

    def emit(events: list, label: str, event) -> None:
        if label in mutate:
            if mutate[label] is None:
                return
            event = mutate[label](event)
        events.append(event)

    q = [Span("smem", w * TILE, (w + 1) * TILE, f"Q rows of wg{w}") for w in range(consumers)]
    base = consumers * TILE
    k = [
        Span("smem", base + s * TILE, base + (s + 1) * TILE, f"K[slot {s}]") for s in range(stages)
    ]
    base += stages * TILE
    v = [
        Span("smem", base + s * TILE, base + (s + 1) * TILE, f"V[slot {s}]") for s in range(stages)
    ]
    half = TILE // 2
    o = [
        Span("smem", v[0].lo + w * half, v[0].lo + (w + 1) * half, f"O rows of wg{w}")
        for w in range(consumers)
    ]

    producer: list = []
    emit(producer, "arrive q_full", Arrive("q_full", tx=consumers * TILE))
    q_all = Span("smem", 0, consumers * TILE, "Q")
    emit(producer, "load Q", TmaLoad(q_all, "q_full", consumers * TILE, "load Q"))

    def load(t: str, ring: list[Span], j: int) -> None:
        s, r = j % stages, j // stages
        emit(producer, f"wait {t}_empty", Wait(f"{t}_empty{s}", (r + 1) % 2))
        emit(producer, f"arrive {t}_full", Arrive(f"{t}_full{s}", tx=TILE))
        emit(producer, f"load {t}", TmaLoad(ring[s], f"{t}_full{s}", TILE, f"load {t.upper()} {j}"))

    load("k", k, 0)
    for j in range(1, blocks):
        load("k", k, j)
        load("v", v, j - 1)
    load("v", v, blocks - 1)
    agents = [Agent("producer", 1, tuple(producer))]

    pingpong = consumers > 1
    turn = 256  # the warpgroup waiting for its turn + the one handing over
    for w in range(consumers):
        regs = f"rf:wg{w}"
        s_acc, p_regs, o_acc = (
            Span(regs, 0, 64, "S"),
            Span(regs, 64, 96, "P"),
            Span(regs, 96, 160, "O acc"),
        )
        mine, nxt = sched + w, sched + (w + 1) % consumers
        ev: list = []
        put = lambda label, event: emit(ev, label, event)  # noqa: E731
        put("zero O", GenericAccess(o_acc, True, "zero O"))
        if pingpong and w == consumers - 1:
            put("open turn", BarArrive(sched, turn, "the last warpgroup opens warpgroup 0's turn"))
        put("wait q_full", Wait("q_full", 0))

        def issue_qk(j: int) -> None:
            s, r = j % stages, j // stages
            put("wait k_full", Wait(f"k_full{s}", r % 2))
            if pingpong:
                put("my turn", BarSync(mine, turn))
            put("qk", Wgmma((q[w], k[s]), (s_acc,), f"S = Q K^T, block {j}"))
            put("commit qk", WgmmaCommit())

        def issue_pv(j: int) -> None:
            s, r = j % stages, j // stages
            put("rescale O", GenericAccess(o_acc, True, f"rescale O before P V {j}"))
            put("wait v_full", Wait(f"v_full{s}", r % 2))
            put("pv", Wgmma((p_regs, v[s]), (o_acc,), f"O += P V, block {j}"))
            put("commit pv", WgmmaCommit())

        def release(t: str, j: int) -> None:
            put(f"arrive {t}_empty", Arrive(f"{t}_empty{j % stages}", count=warps))

        issue_qk(0)
        if pingpong:
            put("hand over", BarArrive(nxt, turn))
        put("wgmma wait qk", WgmmaWait(0))
        release("k", 0)
        put("softmax", GenericAccess(s_acc, True, "softmax 0"))
        put("convert P", GenericAccess(p_regs, True, "convert P 0"))
        for j in range(1, blocks):
            issue_qk(j)
            issue_pv(j - 1)
            if pingpong:
                put("hand over", BarArrive(nxt, turn))
            put("wgmma wait qk", WgmmaWait(1))
            release("k", j)
            put("softmax", GenericAccess(s_acc, True, f"softmax {j}"))
            put("wgmma wait pv", WgmmaWait(0))
            release("v", j - 1)
            put("convert P", GenericAccess(p_regs, True, f"convert P {j}"))
        put("rescale O", GenericAccess(o_acc, True, "rescale O before the last P V"))
        s, r = (blocks - 1) % stages, (blocks - 1) // stages
        put("wait v_full", Wait(f"v_full{s}", r % 2))
        if pingpong:
            put("my turn", BarSync(mine, turn))
        put("pv", Wgmma((p_regs, v[s]), (o_acc,), f"O += P V, block {blocks - 1}"))
        put("commit pv", WgmmaCommit())
        if pingpong:
            put("hand over", BarArrive(nxt, turn))
        put("wgmma wait pv", WgmmaWait(0))
        release("v", blocks - 1)
        if pingpong and w == 0:
            put("close turn", BarSync(sched, turn, "take the last hand-over"))
        put("normalize O", GenericAccess(o_acc, True, "normalize O"))
        put("bar.sync 1", BarSync(ring_dead, 128 * consumers, "the rings are dead"))
        put("O -> smem", GenericAccess(o[w], True, "O -> smem"))
        put("fence", FenceProxyAsync())
        put("bar.sync 2", BarSync(o_store + w, 128, "O rows in smem before the TMA store"))
        put("store O", TmaStore(o[w], f"store O rows of wg{w}"))
        put("bulk commit", BulkCommit())
        put("bulk wait", BulkWait(0))
        agents.append(Agent(f"wg{w}", 128, tuple(ev)))
    barriers = [("q_full", 1)] + [
        (f"{t}_{kind}{s}", 1 if kind == "full" else warps * consumers)
        for s in range(stages)
        for t in ("k", "v")
        for kind in ("full", "empty")
    ]
    return Program(tuple(agents), tuple(barriers))


def multicast_ring(
    stages: int = 2,
    blocks: int = 3,
    consumers: int = 1,
    mutate: dict | None = None,
    meet: bool = False,
) -> Program:
    """A K ring shared by a cluster of two CTAs (docs/clusters.md): in each CTA c a producer
    thread multicasts half c of every slot into both CTAs (mask 0b11), so each CTA's full
    barrier expects the whole slot; each consumer warpgroup reads the slot with wgmma and
    releases it with one local and one remote arrive, so each empty barrier counts both CTAs'
    consumers; after its last load the producer drains the ring (waits for the last release of
    every slot), so that no peer arrives on a CTA that has exited; with ``meet`` every agent
    meets at a cluster barrier at exit instead (labels "exit arrive", "exit wait"). ``mutate``
    as in ``fa3``, with a label (``CLUSTER_LABELS``) or ``"empty count"`` (a function of the
    correct count)."""
    mutate = mutate or {}
    half = TILE // 2

    def emit(events: list, label: str, event) -> None:
        if label in mutate:
            if mutate[label] is None:
                return
            event = mutate[label](event)
        events.append(event)

    def leave(events: list) -> tuple:
        if meet:  # no CTA exits before every agent of the cluster has arrived
            emit(events, "exit arrive", ClusterArrive(why="meet before exit"))
            emit(events, "exit wait", ClusterWait())
        return tuple(events)

    k = [Span("smem", s * TILE, (s + 1) * TILE, f"K[slot {s}]") for s in range(stages)]
    agents = []
    for cta in range(2):
        peer = 1 - cta
        producer: list = []
        for j in range(blocks):
            s, r = j % stages, j // stages
            mine = Span("smem", k[s].lo + cta * half, k[s].lo + (cta + 1) * half, "")
            mine = replace(mine, name=f"K[slot {s}] half {cta}")
            emit(producer, "wait empty", Wait(f"empty{s}", (r + 1) % 2))
            emit(producer, "arrive full", Arrive(f"full{s}", tx=TILE))
            load = TmaMulticast(mine, f"full{s}", half, 0b11, f"load K block {j} half {cta}")
            emit(producer, "multicast", load)
        for j in range(max(blocks - stages, 0), blocks) if not meet else ():  # last fills
            s, r = j % stages, j // stages
            emit(producer, "drain", Wait(f"empty{s}", r % 2, "both CTAs are done with the slot"))
        agents.append(Agent(f"cta{cta}.producer", 1, leave(producer), cta))
        for w in range(consumers):
            s_acc = Span(f"rf:cta{cta}.wg{w}", 0, 64, "S")
            events: list = []
            for j in range(blocks):
                s, r = j % stages, j // stages
                for label, event in (
                    ("wait full", Wait(f"full{s}", r % 2)),
                    ("qk", Wgmma((k[s],), (s_acc,), f"S = Q K^T, block {j}")),
                    ("commit qk", WgmmaCommit()),
                    ("wgmma wait qk", WgmmaWait(0)),
                    ("arrive empty", Arrive(f"empty{s}")),
                    ("remote arrive empty", RemoteArrive(f"empty{s}", peer)),
                    ("read S", GenericAccess(s_acc, False, f"softmax {j}: read S")),
                ):
                    emit(events, label, event)
            agents.append(Agent(f"cta{cta}.wg{w}", 128, leave(events), cta))
    empty_count = 2 * consumers
    if "empty count" in mutate:
        empty_count = mutate["empty count"](empty_count)
    barriers = [(f"full{s}", 1) for s in range(stages)]
    barriers += [(f"empty{s}", empty_count) for s in range(stages)]
    return Program(tuple(agents), tuple(barriers), ctas=2)


CLUSTER_SYNCS = (
    "wait empty",
    "arrive full",
    "drain",
    "wait full",
    "wgmma wait qk",
    "arrive empty",
    "remote arrive empty",
)
