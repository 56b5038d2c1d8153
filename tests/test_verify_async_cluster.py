"""The async model's proof on clusters of two CTAs: the K ring multicast of docs/clusters.md is proven, and
each realistic mistake in its syncs is refused with a message that names it. The brute-force
interleaving checker (tests/bruteforce_async.py) must agree on every case."""

from __future__ import annotations

from dataclasses import replace

import pytest

from async_programs import CLUSTER_SYNCS, TILE, multicast_ring
from bruteforce_async import explore
from fadsl.passes.asyncmodel.model import (
    Agent,
    BarSync,
    ClusterArrive,
    ClusterWait,
    GenericAccess,
    Program,
    RemoteArrive,
    Span,
    TmaMulticast,
    Wait,
)
from fadsl.passes.asyncmodel.prove import check


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("blocks", [1, 2, 3, 5])
@pytest.mark.parametrize("consumers", [1, 2])
def test_multicast_ring_is_proven(stages, blocks, consumers):
    assert check(multicast_ring(stages, blocks, consumers)) == ()


@pytest.mark.parametrize("stages,blocks", [(1, 1), (1, 3), (2, 3)])
def test_bruteforce_agrees_on_the_multicast_ring(stages, blocks):
    assert explore(multicast_ring(stages, blocks), all_kinds=True) == set()


def _refused(mutate: dict, needle: str, stages: int = 2, blocks: int = 3) -> tuple[str, ...]:
    program = multicast_ring(stages, blocks, mutate=mutate)
    problems = check(program)
    assert any(needle in p for p in problems), problems
    small = multicast_ring(1, 2, mutate=mutate)  # small enough for every interleaving
    assert check(small) and explore(small), "verify and the brute-force checker must agree"
    return problems


def test_empty_barrier_counting_local_consumers_only_is_refused():
    """The producer refills a slot once its own CTA's consumers are done, while its multicast
    also overwrites the peer's copy that the peer's consumers may still read."""
    local_only = {"empty count": lambda n: n // 2, "remote arrive empty": None}
    problems = _refused(local_only, "WAR on K[slot 0] of cta1: cta1.wg0")
    assert any("cta0.producer" in p and "TMA multicast" in p for p in problems)


def test_dropping_the_remote_arrive_hangs():
    problems = _refused({"remote arrive empty": None}, "never returns")
    assert any("empty0@cta0 stays in phase 0 with 1 arrival(s)" in p for p in problems)


def test_a_remote_arrive_on_the_own_cta_is_refused():
    """Right count, wrong target: each empty barrier counts its own consumers twice."""
    own = {"remote arrive empty": lambda e: replace(e, cta=1 - e.cta)}
    _refused(own, "WAR on K[slot 0] of cta0: cta0.wg0")


def test_expect_tx_of_half_the_tile_is_refused():
    """Each CTA receives its half and the peer's: expecting half completes the phase early."""
    half = {"arrive full": lambda e: replace(e, tx=e.tx // 2)}
    _refused(half, "more bytes landed than expected: an expect_tx too small")


def test_a_missing_drain_lets_a_peer_reach_an_exited_cta():
    problems = _refused(
        {"drain": None}, "may reach cta0 after every agent of cta0 has finished", blocks=3
    )
    assert any(p.startswith("cta1.wg0 #") and "remote arrive on empty" in p for p in problems)


def test_a_multicast_to_the_own_cta_only_is_refused():
    """mask 0b01 from both producers: CTA 1 never receives its tile."""
    _refused({"multicast": lambda e: replace(e, mask=0b01)}, "never returns")


def test_both_ctas_loading_the_same_half_is_refused():
    """Each producer must take its own rows of the tile (a ctarank left out of the offset)."""

    def first_half(event: TmaMulticast) -> TmaMulticast:
        lo = event.span.lo - event.span.lo % TILE
        return replace(event, span=Span("smem", lo, lo + TILE // 2, event.span.name))

    _refused({"multicast": first_half}, "WAW on K[slot 0] half")


@pytest.mark.parametrize("label", CLUSTER_SYNCS)
def test_dropping_any_sync_fails(label):
    program = multicast_ring(2, 3, mutate={label: None})
    assert check(program), f"dropping {label} must fail"
    small = multicast_ring(1, 2, mutate={label: None})
    assert bool(check(small)) == bool(explore(small))


@pytest.mark.parametrize("label", ["wait empty", "wait full", "drain"])
def test_flipping_any_parity_fails(label):
    flip = {label: lambda e: replace(e, parity=1 - e.parity)}
    assert check(multicast_ring(2, 3, mutate=flip))
    small = multicast_ring(1, 2, mutate=flip)
    assert check(small) and explore(small)


def test_the_same_names_in_two_ctas_are_two_objects():
    """A wait in CTA 1 is not released by an arrive on CTA 0's barrier of the same name."""
    arrive = Agent("cta0.p", 1, (RemoteArrive("bar", 0),), 0)
    wait = Agent("cta1.c", 1, (Wait("bar", 0),), 1)
    problems = check(Program((arrive, wait), (("bar", 1),), ctas=2))
    assert problems == (
        "hang: cta1.c #0 (wait on bar, parity 0) never returns (bar@cta1 stays in phase 0 with "
        "1 arrival(s) and 0 transaction byte(s) outstanding)",
    )


def test_references_outside_the_cluster_are_refused():
    span = Span("smem", 0, 64, "T")
    agent = Agent("p", 1, (RemoteArrive("bar", 2), TmaMulticast(span, "bar", 64, 0b100, "x")))
    problems = check(Program((agent, replace(agent, name="q", cta=2)), (("bar", 1),), ctas=2))
    assert problems == (
        "p #0 (remote arrive on bar of cta2): there is no cta2 in the cluster",
        "p #1 (x: TMA multicast into T, mask 0b100, 64 bytes on bar): mask 0b100 names no CTA "
        "or one outside the 2-CTA cluster",
        "q is in cta2 of a 2-CTA cluster",
        "q #0 (remote arrive on bar of cta2): there is no cta2 in the cluster",
        "q #1 (x: TMA multicast into T, mask 0b100, 64 bytes on bar): mask 0b100 names no CTA "
        "or one outside the 2-CTA cluster",
    )


def test_named_barriers_are_per_cta():
    """bar.sync ids are CTA-local: two warpgroups of different CTAs never meet at barrier 1."""
    wgs = tuple(Agent(f"cta{c}.wg", 128, (BarSync(1, 256),), c) for c in range(2))
    problems = check(Program(wgs, (), ctas=2))
    assert problems == tuple(
        f"hang: cta{c}.wg #0 (bar.sync 1, 256) never returns (named barrier 1@cta{c} gets 128 "
        "of 256 threads)"
        for c in range(2)
    )
    assert explore(Program(wgs, (), ctas=2)) == {"hang"}


# --- barrier.cluster: meeting at a cluster barrier before exit instead of draining the ring ---


def _skipping_exit_barrier(program: Program, name: str) -> Program:
    """``program`` with agent ``name``'s final arrive + wait left out."""
    agents = tuple(
        replace(a, events=a.events[:-2]) if a.name == name else a for a in program.agents
    )
    return replace(program, agents=agents)


@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("blocks", [1, 2, 3, 5])
@pytest.mark.parametrize("consumers", [1, 2])
def test_meeting_at_a_cluster_barrier_before_exit_is_proven(stages, blocks, consumers):
    assert check(multicast_ring(stages, blocks, consumers, meet=True)) == ()


@pytest.mark.parametrize("stages,blocks", [(1, 1), (1, 3), (2, 3)])
def test_bruteforce_agrees_on_meeting_at_a_cluster_barrier(stages, blocks):
    assert explore(multicast_ring(stages, blocks, meet=True), all_kinds=True) == set()


def test_a_consumer_skipping_the_exit_barrier_hangs_the_others():
    program = _skipping_exit_barrier(multicast_ring(2, 3, meet=True), "cta1.wg0")
    problems = check(program)
    assert problems == tuple(
        f"hang: {agent} (barrier.cluster.wait) never returns (generation 0 of the cluster "
        "barrier waits for cta1.wg0 to arrive)"
        for agent in ("cta0.producer #10", "cta0.wg0 #22", "cta1.producer #10")
    )
    small = _skipping_exit_barrier(multicast_ring(1, 2, meet=True), "cta1.wg0")
    assert check(small) and explore(small, all_kinds=True) == {"hang"}


def test_a_relaxed_arrive_does_not_protect_the_exit():
    """barrier.cluster.arrive.relaxed orders nothing: a consumer's last remote arrive may reach
    the peer after the peer's agents have met and exited."""
    relaxed = {"exit arrive": lambda e: replace(e, relaxed=True)}
    problems = check(multicast_ring(2, 3, mutate=relaxed, meet=True))
    assert problems and all("may reach cta" in p for p in problems), problems
    assert any(
        p.startswith(
            "cta1.wg0 #19 (remote arrive on empty0 of cta0) may reach cta0 after every "
            "agent of cta0 has finished"
        )
        for p in problems
    )
    small = multicast_ring(1, 2, mutate=relaxed, meet=True)
    assert check(small) and explore(small, all_kinds=True) == {"exit race"}


def test_a_cluster_wait_without_an_arrive_is_refused():
    problems = check(multicast_ring(2, 3, mutate={"exit arrive": None}, meet=True))
    assert problems[0] == (
        "cta0.producer #9 (barrier.cluster.wait): cta0.producer waits at the cluster barrier "
        "without a barrier.cluster.arrive before it (it would wait for a generation it never "
        "joined)"
    )
    assert len(problems) == 4  # every agent
    small = multicast_ring(1, 2, mutate={"exit arrive": None}, meet=True)
    assert "cluster wait without arrive" in explore(small, all_kinds=True)


def test_a_second_arrive_before_the_wait_is_refused():
    agents = tuple(
        Agent(f"cta{c}.a", 1, (ClusterArrive(), ClusterArrive(), ClusterWait()), c)
        for c in range(2)
    )
    assert check(Program(agents, (), ctas=2)) == tuple(
        f"cta{c}.a #1 (barrier.cluster.arrive): cta{c}.a arrives at the cluster barrier again "
        "before its barrier.cluster.wait"
        for c in range(2)
    )


def test_a_cluster_barrier_is_reusable():
    """Two generations: a write before the first barrier and a read after the second in
    another CTA's agent are ordered; relaxed arrives leave them unordered."""
    span = Span("smem", 0, 64, "T")
    meet = (ClusterArrive(), ClusterWait())
    writer = Agent("cta0.w", 1, (*meet, GenericAccess(span, True, "write"), *meet), 0)
    reader = Agent("cta0.r", 1, (*meet, *meet, GenericAccess(span, False, "read")), 0)
    peer = Agent("cta1.p", 1, (*meet, *meet), 1)
    assert check(Program((writer, reader, peer), (), ctas=2)) == ()
    assert explore(Program((writer, reader, peer), (), ctas=2), all_kinds=True) == set()
    loose = (ClusterArrive(relaxed=True), ClusterWait())
    writer = replace(writer, events=(*meet, GenericAccess(span, True, "write"), *loose))
    assert check(Program((writer, reader, peer), (), ctas=2)) == (
        "RAW on T of cta0: cta0.w #2 (write: write T) and cta0.r #4 (read: read T) are not "
        "ordered",
    )
    assert explore(Program((writer, reader, peer), (), ctas=2), all_kinds=True) == {"race"}
