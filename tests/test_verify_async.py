"""The async model's proof (fadsl/passes/asyncmodel) proves FlashAttention-3's sync plan and refuses every broken variant of it.

Each mutation below is one of the bugs TileLang users met on Hopper: a missing arrive or
wait, a missing expect_tx, a flipped mbarrier parity, a missing wgmma wait or proxy fence, a
ring with fewer slots than its barriers assume. The brute-force interleaving checker
(tests/bruteforce_async.py, written separately) must agree on every case.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from async_programs import ARRIVES, OTHER_SYNCS, WAITS, drop, fa3, fa3_overlap, swap
from bruteforce_async import explore
from fadsl.passes.asyncmodel.model import (
    Agent,
    Arrive,
    BarSync,
    ExpectTx,
    GenericAccess,
    Program,
    Span,
    TmaLoad,
    Wait,
)
from fadsl.passes.asyncmodel.prove import AsyncVerifyError, check, verify_program


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("consumers", [1, 2, 3])
@pytest.mark.parametrize("blocks", [1, 2, 5])
def test_fa3_plan_is_proven(stages, consumers, blocks):
    program = fa3(stages, blocks, consumers)
    assert check(program) == ()
    assert verify_program(program) is program


@pytest.mark.parametrize("stages,blocks,consumers", [(2, 3, 1), (1, 2, 1), (2, 2, 2)])
def test_bruteforce_agrees_on_the_correct_plan(stages, blocks, consumers):
    assert explore(fa3(stages, blocks, consumers)) == set()


# bar.sync 1 orders one warpgroup's last P V before another's O overwrites V: with one
# consumer warpgroup it has nothing to order, so the mutations use two.
@pytest.mark.parametrize("label", ARRIVES + WAITS + OTHER_SYNCS)
def test_dropping_any_sync_fails(label):
    program = fa3(stages=2, blocks=3, consumers=2, mutate={label: None})
    with pytest.raises(AsyncVerifyError):
        verify_program(program)
    assert explore(program), "the brute-force checker must agree"


@pytest.mark.parametrize("label", WAITS)
def test_flipping_any_parity_fails(label):
    flip = {label: lambda e: replace(e, parity=1 - e.parity)}
    program = fa3(stages=2, blocks=3, consumers=2, mutate=flip)
    assert check(program)
    assert explore(program)


@pytest.mark.parametrize("label", ["arrive q_full", "arrive k_full", "arrive v_full"])
def test_dropping_expect_tx_fails(label):
    program = fa3(stages=2, blocks=3, consumers=1, mutate={label: lambda e: replace(e, tx=0)})
    assert check(program)
    assert explore(program)


@pytest.mark.parametrize("stages", [2, 3])
def test_shrinking_the_ring_fails(stages):
    program = fa3(stages=stages, blocks=stages + 2, consumers=1, data_slots=stages - 1)
    problems = check(program)
    assert any("K[slot 0]" in p and "not ordered" in p for p in problems)
    assert explore(program, all_kinds=True) == {"race"}


def test_a_hang_names_the_wait_and_the_barrier_state():
    program = fa3(stages=2, blocks=3, consumers=2, mutate={"arrive k_empty": None})
    problems = check(program)
    assert problems[0] == (
        "hang: producer #14 (wait on k_empty0, parity 0) never returns (k_empty0 stays in "
        "phase 0 with 2 arrival(s) and 0 transaction byte(s) outstanding)"
    )


def test_a_wait_without_its_predecessor_returns_early():
    """The producer's wait for the slot's second release, with the first removed: parity 0
    already holds while phase 0 is still open, so the wait would not wait."""
    program = fa3(stages=1, blocks=3, consumers=1)
    producer = program.agents[0]
    first_refill = [
        i for i, e in enumerate(producer.events) if isinstance(e, Wait) and e.parity == 0
    ]
    broken = swap(program, 0, first_refill[0], Wait("k_empty0", 1))
    problems = check(broken)
    assert problems
    assert explore(broken)


def test_expect_tx_after_the_copy_is_accepted():
    """The transaction count may dip below zero while an arrival is still pending."""
    program = fa3(stages=2, blocks=2, consumers=1)
    events = list(program.agents[0].events)
    events[0], events[1] = events[1], events[0]  # load Q, then arrive.expect_tx
    program = replace(
        program, agents=(replace(program.agents[0], events=tuple(events)),) + program.agents[1:]
    )
    assert check(program) == ()
    assert explore(program) == set()


def test_transaction_bytes_must_match():
    span = Span("smem", 0, 64, "T")
    for expected, message in ((32, "-32 transaction byte(s)"), (96, "never returns")):
        producer = Agent("p", 1, (Arrive("full", tx=expected), TmaLoad(span, "full", 64, "load")))
        consumer = Agent("c", 1, (Wait("full", 0), GenericAccess(span, False, "read")))
        program = Program((producer, consumer), (("full", 1),))
        problems = check(program)
        assert any(message in p for p in problems), problems
        assert explore(program)


def test_named_barrier_thread_counts_must_agree():
    a = Agent("a", 128, (BarSync(1, 256),))
    b = Agent("b", 128, (BarSync(1, 384),))
    problems = check(Program((a, b), ()))
    assert any("counts 384 threads here but 256" in p for p in problems)


def test_too_many_arrivals_are_refused():
    producer = Agent("p", 1, (Arrive("bar", count=2),))
    problems = check(Program((producer,), (("bar", 1),)))
    assert any("2 arrival(s) where phase 0 of bar expects 1 more" in p for p in problems)
    assert explore(Program((producer,), (("bar", 1),))) == {"over-arrival"}


def test_bare_expect_tx_counts_in_its_phase():
    span = Span("smem", 0, 64, "T")
    producer = Agent(
        "p", 1, (ExpectTx("full", 64), TmaLoad(span, "full", 64, "load"), Arrive("full"))
    )
    consumer = Agent("c", 1, (Wait("full", 0), GenericAccess(span, False, "read")))
    program = Program((producer, consumer), (("full", 1),))
    assert check(program) == ()
    assert explore(program) == set()


def _mutant(rng: random.Random):
    program = fa3(
        rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([1, 2]), o_over_v=rng.random() < 0.7
    )
    for _ in range(rng.choice([1, 1, 2])):
        a = rng.randrange(len(program.agents))
        events = program.agents[a].events
        i = rng.randrange(len(events))
        event = events[i]
        roll = rng.random()
        if roll < 0.4:
            program = drop(program, a, i)
        elif roll < 0.6 and isinstance(event, Wait):
            program = swap(program, a, i, replace(event, parity=1 - event.parity))
        elif roll < 0.7 and isinstance(event, Arrive) and event.tx:
            program = swap(program, a, i, replace(event, tx=0))
        elif i + 1 < len(events):  # move an event one place later
            program = swap(swap(program, a, i, events[i + 1]), a, i + 1, event)
    return program


@pytest.mark.parametrize("seed", range(4))
def test_bruteforce_agrees_on_random_mutants(seed):
    rng = random.Random(seed)
    broken = 0
    for _ in range(15):
        program = _mutant(rng)
        found = explore(program)
        assert bool(check(program)) == bool(found), (found, check(program))
        broken += bool(found)
    assert 0 < broken < 15  # the sample holds both proven and broken plans


# The plan of the sm_90a kernel (emit/sm90): K one block ahead of V, S(j) and P(j-1) V(j-1)
# in flight together, ping-pong named barriers between consumer warpgroups.
OVERLAP_SYNCS = ARRIVES + WAITS + OTHER_SYNCS + ("open turn", "my turn", "hand over", "close turn")


@pytest.mark.parametrize("stages,blocks,consumers", [(1, 3, 1), (2, 1, 2), (2, 4, 2), (3, 5, 3)])
def test_overlapped_pingpong_plan_is_proven(stages, blocks, consumers):
    assert check(fa3_overlap(stages, blocks, consumers)) == ()


def test_bruteforce_agrees_on_the_overlapped_plan():
    assert explore(fa3_overlap(2, 2, 2), all_kinds=True) == set()


@pytest.mark.parametrize("label", OVERLAP_SYNCS)
def test_overlapped_plan_needs_every_sync(label):
    program = fa3_overlap(stages=2, blocks=3, consumers=2, mutate={label: None})
    assert check(program), f"dropping {label} must fail"
    assert explore(program)


@pytest.mark.parametrize("label", WAITS)
def test_overlapped_plan_refuses_flipped_parities(label):
    flip = {label: lambda e: replace(e, parity=1 - e.parity)}
    program = fa3_overlap(stages=2, blocks=3, consumers=2, mutate=flip)
    assert check(program)
    assert explore(program)


def test_waiting_for_the_newest_wgmma_group_only_is_refused():
    """wgmma.wait_group 1 after S(j) and P V: with 2 it would retire neither group, and the
    softmax would read S while its wgmma still writes it."""
    program = fa3_overlap(2, 3, 2, mutate={"wgmma wait qk": lambda e: replace(e, pending=2)})
    assert any("RAW on S" in p or "WAW on S" in p for p in check(program))
    assert explore(program)
