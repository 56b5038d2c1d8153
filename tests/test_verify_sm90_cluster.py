"""The sm_90a verify pass on `cluster 2` (fadsl/targets/sm90/cluster_agents.py): the cluster
spec's plan is proven for both CTAs of a cluster, and each realistic mistake in its cluster
syncs is refused with a message that names it: the peer arrivals dropped, the empty
barriers counting one CTA's consumers, the expect_tx of one CTA's share, the cluster
barrier at exit dropped or made relaxed, the one after the inits dropped. The brute-force
checker agrees on a small cluster kernel and its mutants."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bruteforce_async import explore
from fadsl.ir import Kernel, Phase, Sync
from fadsl.passes.asyncmodel.model import (
    Arrive,
    ClusterArrive,
    ClusterWait,
    RemoteArrive,
    TmaLoad,
    TmaMulticast,
)
from fadsl.passes.asyncmodel.prove import AsyncVerifyError, check
from fadsl.pipeline import compile_file, compile_source
from fadsl.targets.sm90 import caps
from fadsl.targets.sm90.verify import build_program, problems_of, tile_sequences, verify
from unverified import unverified

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "fa3_hopper.fa"  # `cluster 2`
KERNEL = unverified(CLUSTER.read_text(), str(CLUSTER))
CLUSTER_BARRIER = (caps.CLUSTER_ARRIVE, caps.CLUSTER_ARRIVE_RELAXED, caps.CLUSTER_WAIT)


def _one_wg_cluster() -> str:
    """tests/specs/sm90/fa3_one_wg.fa as a cluster of two, one stage, without a mask: small
    enough for the brute-force checker."""
    text = (ROOT / "tests" / "specs" / "sm90" / "fa3_one_wg.fa").read_text()
    for old, new in (
        ("mask       causal", "mask       none"),
        ("stages     3", "stages     1\n  cluster    2"),
        ("K: gmem -tma-> smem[cta]      ", "K: gmem -tma-> smem[cluster]  "),
        ("V: gmem -tma-> smem[cta]      ", "V: gmem -tma-> smem[cluster]  "),
    ):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def _edit(kernel: Kernel, change, phases: tuple[Phase, ...] | None = None) -> Kernel:
    """``kernel`` with each sync (of ``phases``, or of every phase) replaced by
    ``change(sync)``, or dropped where that is None."""
    edited = {}
    for phase, items in kernel.phases():
        kept = []
        for item in items:
            if isinstance(item, Sync) and (phases is None or phase in phases):
                item = change(item)
            if item is not None:
                kept.append(item)
        edited[phase.value] = tuple(kept)
    return replace(kernel, **edited)


def _refused(kernel: Kernel) -> tuple[str, ...]:
    with pytest.raises(AsyncVerifyError) as refused:
        verify(kernel)
    return refused.value.failures


def _in_pairs(kernel: Kernel) -> list[str]:
    """The problems of the launch in pairs, over verify's tile sequences (verify reports the
    first failing launch, which may be the one alone)."""
    return [f for tiles in tile_sequences(kernel) for f in problems_of(kernel, tiles, ctas=2)]


def _no_peer_arrivals(sync: Sync) -> Sync | None:
    return None if sync.kind is caps.MBAR_ARRIVE_PEER else sync


def _local_empty_counts(sync: Sync) -> Sync:
    """The K/V empty barriers' init counting one CTA's consumer warps, in pairs too."""
    if sync.kind is caps.MBAR_INIT and sync.barrier in ("k_empty", "v_empty"):
        return replace(sync, count=sync.count // 2)
    return sync


def _half_expect_tx(sync: Sync) -> Sync:
    if sync.kind is caps.MBAR_EXPECT_TX and sync.barrier in ("k_full", "v_full"):
        return replace(sync, tx=sync.tx // 2)
    return sync


def _no_cluster_barrier(sync: Sync) -> Sync | None:
    return None if sync.kind in CLUSTER_BARRIER else sync


def _relaxed(sync: Sync) -> Sync:
    return (
        replace(sync, kind=caps.CLUSTER_ARRIVE_RELAXED)
        if sync.kind is caps.CLUSTER_ARRIVE
        else sync
    )


def test_the_cluster_spec_compiles_and_verifies():
    compiled = compile_file(CLUSTER)
    assert compiled.kernel.config.ext.cluster == 2
    assert verify(KERNEL) is KERNEL


def test_the_cluster_plan_has_what_the_proof_relies_on():
    """The plan under proof: peer arrivals, empty barriers of both CTAs' consumer warps, a
    relaxed cluster barrier after the inits and a release one at exit (else the mutation
    tests below would prove nothing)."""
    kinds = [s.kind for s in KERNEL.syncs()]
    assert caps.MBAR_ARRIVE_PEER in kinds
    inits = {s.barrier: s.count for s in KERNEL.setup if isinstance(s, Sync)}
    warps = 4 * KERNEL.config.ext.consumers
    assert inits["k_empty"] == inits["v_empty"] == 2 * warps and inits["q_empty"] == warps
    setup = [s.kind for s in KERNEL.setup if isinstance(s, Sync) and s.kind in CLUSTER_BARRIER]
    teardown = [s.kind for s in KERNEL.teardown if isinstance(s, Sync)]
    assert setup == [caps.CLUSTER_ARRIVE_RELAXED, caps.CLUSTER_WAIT]
    assert teardown[-2:] == [caps.CLUSTER_ARRIVE, caps.CLUSTER_WAIT]


def test_build_program_runs_both_ctas_and_multicasts_half_of_each_kv_tile():
    program = build_program(KERNEL, (3,))
    consumers = KERNEL.config.ext.consumers
    assert program.ctas == 2
    assert [(a.name, a.cta) for a in program.agents] == [
        (f"cta{cta}.{role}", cta)
        for cta in (0, 1)
        for role in ["producer"] + [f"wg{wg}" for wg in range(consumers)]
    ]
    tile = KERNEL.buffer("K").tile_bytes
    for agent in program.agents:
        events = agent.events
        # the cluster barrier opens and closes every agent's program
        assert events[:2] == (ClusterArrive(True, events[0].why), ClusterWait(events[1].why))
        assert isinstance(events[-2], ClusterArrive) and not events[-2].relaxed
        assert isinstance(events[-1], ClusterWait)
        remote = [e for e in events if isinstance(e, RemoteArrive)]
        if agent.name.endswith("producer"):
            k_loads = [e for e in events if "k_g2s" in getattr(e, "what", "")]
            assert len(k_loads) == 3 and all(isinstance(e, TmaMulticast) for e in k_loads)
            for load in k_loads:  # this CTA's panel: half the slot, into both CTAs
                assert load.mask == 0b11 and load.nbytes == tile // 2
                assert load.span.hi - load.span.lo == tile // 2 and load.span.cta == agent.cta
            assert f"panel {agent.cta}" in k_loads[0].what
            # Q stays a local load of this CTA
            (q,) = [e for e in events if isinstance(e, TmaLoad)]
            assert q.span.name == "Q" and q.span.cta == agent.cta
            assert not remote
        else:  # each release of a K/V slot: one arrival per warp here and one on the peer
            assert remote and all(e.cta == 1 - agent.cta and e.count == 4 for e in remote)


def test_the_two_ctas_load_complementary_halves():
    """Panel p of K's slot is CTA p % 2's: together the two CTAs' multicasts cover the slot
    once."""
    program = build_program(KERNEL, (1,))
    covered = []
    for agent in program.agents:
        covered += [
            (e.span.lo, e.span.hi, agent.cta)
            for e in agent.events
            if isinstance(e, TmaMulticast) and e.barrier == "k_full[0]"
        ]
    buf = KERNEL.buffer("K")
    half = buf.tile_bytes // 2
    assert sorted(covered) == [
        (buf.offset, buf.offset + half, 0),
        (buf.offset + half, buf.offset + 2 * half, 1),
    ]


def test_dropping_the_peer_arrivals_hangs_the_producer():
    """Each empty barrier counts both CTAs' consumer warps: without the peer's arrivals the
    producer waits forever before its first refill of a slot (stages + 1 blocks), alone
    (where the CTA is its own peer) and in pairs."""
    mutant = _edit(KERNEL, _no_peer_arrivals)
    failures = _refused(mutant)
    assert failures[0].startswith(
        "with CTAs launched alone, one tile of 3 K/V blocks: hang: producer"
    )
    assert any(
        "hang: cta0.producer" in f and "(k_empty[0]@cta0 stays in phase 0 with 8 arrival(s)" in f
        for f in _in_pairs(mutant)
    )


def test_empty_barriers_counting_one_ctas_consumers_are_refused():
    """With both CTAs' arrivals on an init count of one CTA's warps, the peer's arrivals of one
    release may complete a phase meant for the next: a refill need not wait for the readers."""
    mutant = _edit(KERNEL, _local_empty_counts)
    assert _refused(mutant)
    failures = _in_pairs(mutant)
    assert any(
        "remote arrive on k_empty[0] of cta1 x4) may count towards phase 0 of k_empty[0]@cta1 "
        "instead of phase 1" in f
        for f in failures
    )


def test_empty_barriers_of_local_consumers_only_let_the_peer_overwrite_a_slot_in_use():
    """Counts of one CTA and no peer arrivals (a cluster-blind plan): the producer refills a
    slot once its own consumers are done, and its multicast overwrites the peer's copy while
    the peer's consumers may still read it."""
    local = _edit(_edit(KERNEL, _no_peer_arrivals), _local_empty_counts)
    failures = _refused(local)
    assert any(
        "WAR on K[slot 0] of cta1: cta1.wg0 #6 (qk (tile 0, it=0): wgmma) and cta0.producer "
        "#16 (k_g2s (tile 0, it=2), panel 0: TMA multicast" in f
        for f in failures
    )


def test_expect_tx_of_one_ctas_share_is_refused():
    """Each CTA's full barrier receives both shares: expecting one completes the phase before
    the peer's panel has landed, and the consumers read it too early."""
    mutant = _edit(KERNEL, _half_expect_tx)
    assert _refused(mutant)
    failures = _in_pairs(mutant)
    assert any(
        "RAW on K[slot 0] panel 1 of cta0: cta1.producer #7 (k_g2s (tile 0, it=0), panel 1: "
        "TMA multicast" in f
        for f in failures
    )
    assert any(
        "phase 1 of k_full[0]@cta0 expects 0 transaction bytes but its TMA copies land 16384" in f
        for f in failures
    )


@pytest.mark.parametrize("change", [_no_cluster_barrier, _relaxed], ids=["dropped", "relaxed"])
def test_the_exit_cluster_barrier_is_needed(change):
    """Nothing in a CTA waits for the peer's last arrivals on its empty barriers: without the
    cluster barrier at exit (or with a relaxed arrive, which orders nothing before it) the CTA
    may have exited when they reach it."""
    failures = _refused(_edit(KERNEL, change, (Phase.TEARDOWN,)))
    assert failures[0].startswith("with CTAs in pairs, one tile of 1 K/V block: ")
    assert any(
        "cta1.wg0 #11 (remote arrive on k_empty[0] of cta0 x4) may reach cta0 after every "
        "agent of cta0 has finished" in f
        for f in failures
    )


@pytest.mark.parametrize(
    "kinds",
    [CLUSTER_BARRIER, (caps.CLUSTER_WAIT,), (caps.CLUSTER_ARRIVE_RELAXED,)],
    ids=["dropped", "no wait", "no arrive"],
)
def test_the_setup_cluster_barrier_is_needed(kinds):
    """The peer's multicast and arrivals may reach an mbarrier before its CTA has
    initialised it, unless a cluster barrier follows the inits' fence."""
    mutant = _edit(KERNEL, lambda s: None if s.kind in kinds else s, (Phase.SETUP,))
    assert _refused(mutant) == (
        "no cluster barrier (arrive, then wait, by every thread) between the mbarrier inits' "
        "fence and their first use: a peer CTA of the 2-CTA cluster may multicast into, or "
        "arrive on, an mbarrier not yet initialised",
    )


def test_a_cta_barrier_does_not_stand_for_the_cluster_barrier_after_init():
    def syncthreads(sync: Sync) -> Sync | None:
        if sync.kind is caps.CLUSTER_ARRIVE_RELAXED:
            return replace(sync, kind=caps.SYNCTHREADS)
        return None if sync.kind is caps.CLUSTER_WAIT else sync

    assert "no cluster barrier" in _refused(_edit(KERNEL, syncthreads, (Phase.SETUP,)))[0]


def test_a_release_arrive_after_init_is_proven_too():
    release = _edit(
        KERNEL,
        lambda s: (
            replace(s, kind=caps.CLUSTER_ARRIVE) if s.kind is caps.CLUSTER_ARRIVE_RELAXED else s
        ),
        (Phase.SETUP,),
    )
    assert verify(release) is release


def test_a_peer_arrival_made_local_is_refused():
    """Right count, wrong CTA: each empty barrier counts its own consumers twice."""
    local = _edit(
        KERNEL,
        lambda s: replace(s, kind=caps.MBAR_ARRIVE) if s.kind is caps.MBAR_ARRIVE_PEER else s,
    )
    assert _refused(local)
    assert any("WAR on K[slot 0] of cta1: cta1.wg0" in f for f in _in_pairs(local))


def test_peer_arrivals_without_a_cluster_are_refused():
    """An MBAR_ARRIVE_PEER in a kernel without `cluster`: there is no peer to arrive on
    (and the generated code has no cluster_ctas to test)."""
    hopper = replace(KERNEL.config.ext, cluster=1)
    alone = replace(KERNEL, config=replace(KERNEL.config, ext=hopper))
    failures = _refused(alone)
    assert (
        "arrivals on a peer CTA's mbarriers (k_empty, v_empty) in a kernel without 'cluster'"
        in failures
    )
    two_ctas = build_program(KERNEL, (1,), ctas=2)  # in the model: a CTA that is not there
    one_cta = replace(two_ctas, agents=two_ctas.agents[: len(two_ctas.agents) // 2], ctas=1)
    assert any("there is no cta1 in the cluster" in f for f in check(one_cta))


def test_launched_alone_the_kernel_is_one_cta_loading_whole_tiles():
    """launch_cluster runs a `cluster 2` kernel alone when a head's query blocks are odd:
    %cluster_nctarank is 1, so whole tiles are loaded locally and the CTA is its own peer
    (its consumers arrive twice on its own empty barriers); verify proves that launch too."""
    program = build_program(KERNEL, (3,), ctas=1)
    assert program.ctas == 1 and {a.cta for a in program.agents} == {0}
    events = [e for a in program.agents for e in a.events]
    assert not [e for e in events if isinstance(e, (TmaMulticast, RemoteArrive))]
    loads = [e for e in events if isinstance(e, TmaLoad) and e.barrier.startswith("k_full")]
    assert loads and all(e.nbytes == KERNEL.buffer("K").tile_bytes for e in loads)
    empties = [e for e in events if isinstance(e, Arrive) and e.barrier == "k_empty[0]"]
    # blocks 0 and 2 of the tile use slot 0: each consumer warpgroup arrives twice for each
    assert len(empties) == 2 * 2 * KERNEL.config.ext.consumers
    assert dict(program.mbarriers)["k_empty[0]"] == 2 * 4 * KERNEL.config.ext.consumers
    assert problems_of(KERNEL, (3,), ctas=1) == []


def test_a_cta_launched_alone_must_arrive_for_its_peer():
    """The empty barriers count both CTAs' warps in either launch: a CTA alone that skipped
    its peer arrivals (a branch on the launch) would wait for arrivals that never come."""
    skipped = _edit(KERNEL, _no_peer_arrivals)
    failures = problems_of(skipped, (3,), ctas=1)
    assert any("hang: producer" in f and "k_empty[0]" in f for f in failures)


SMALL = unverified(_one_wg_cluster(), "one_wg_cluster")


def test_bruteforce_agrees_on_a_small_cluster_kernel():
    """Two CTAs of one producer and one consumer warpgroup, one stage, a tile of two blocks
    (the slot refilled once): every interleaving is free of hangs, races and exit races."""
    assert verify(SMALL) is SMALL
    assert compile_source(_one_wg_cluster(), "one_wg_cluster").kernel.config.ext.cluster == 2
    assert explore(build_program(SMALL, (2,)), all_kinds=True) == set()


@pytest.mark.parametrize(
    "change,phases,found",
    [
        (_relaxed, (Phase.TEARDOWN,), "exit race"),
        (_no_cluster_barrier, (Phase.TEARDOWN,), "exit race"),
        (_half_expect_tx, None, "race"),
        (lambda s: _local_empty_counts(s) if _no_peer_arrivals(s) else None, None, "race"),
    ],
    ids=["relaxed exit", "no exit barrier", "half expect_tx", "local empty barriers"],
)
def test_bruteforce_agrees_on_the_mutants(change, phases, found):
    mutant = _edit(SMALL, change, phases)
    assert problems_of(mutant, (2,))
    assert found in explore(build_program(mutant, (2,)))
