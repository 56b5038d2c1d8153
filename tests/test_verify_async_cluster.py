"""verify_async on clusters of two CTAs: the K ring multicast of docs/clusters.md is proven, and
each realistic mistake in its syncs is refused with a message that names it. The brute-force
interleaving checker (tests/bruteforce_async.py) must agree on every case."""

from __future__ import annotations

from dataclasses import replace

import pytest

from async_programs import CLUSTER_SYNCS, TILE, multicast_ring
from bruteforce_async import explore
from fadsl.passes.async_model import Agent, BarSync, Program, RemoteArrive, Span, TmaMulticast, Wait
from fadsl.passes.verify_async import check


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
