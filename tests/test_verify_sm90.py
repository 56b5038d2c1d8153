"""The sm_90a verify pass: the generated kernels' sync plans are proven over a CTA's tile
loop, and every sync in them is needed: dropping any one, flipping any parity (ring or
per-tile), a per-tile parity made ZERO, dropping any expect_tx, leaving a wgmma group in
flight or shrinking a ring makes verify fail for some tile sequence. The single-tile plan
of before the persistent scheduler (tests/fixtures) proves for one tile and is refused for
two, naming the Q and O/V hazards. The brute-force checker agrees on multi-tile programs."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from bruteforce_async import explore
from fadsl.ir import Kernel, Parity, Step, Sync, Threads
from fadsl.ir.ops import Op
from ir_reader import read_kernel
from fadsl.passes.asyncmodel.prove import AsyncVerifyError, check
from fadsl.pipeline import compile_file, compile_source
from fadsl.targets.sm90.verify import (
    block_counts,
    build_program,
    problems_of,
    tile_sequences,
    verify,
)
from gpu_specs import spec_body
from gpu_specs import single_ctas
from sync_mutants import mutants as _mutants
from sync_mutants import survivors as _survivors
from unverified import SM90_SPECS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("fa3_*.fa"))
# insert_syncs' plan before the persistent scheduler (its golden IR then, kept by hand)
SINGLE_TILE = read_kernel((ROOT / "tests/fixtures/fa3_hopper.single_tile_plan.ir").read_text())
# The variants' base: the fa3_hopper example, 128 x 128 (room for 3 stages, and for O's own
# bytes); FA3's 128 x 176 (O over the V ring) as tests/specs/bench/fa3_hopper_bc176.fa.
HOPPER = (ROOT / "examples" / "fa3_hopper.fa").read_text()
HOPPER_176 = (ROOT / "tests" / "specs" / "bench" / "fa3_hopper_bc176.fa").read_text()
# Q in a ring of two tiles (q_slots 2): head_dim 64, three consumer warpgroups; and 128 x 128
# causal (two consumer warpgroups, empty tiles).
Q_RING = (ROOT / "tests" / "specs" / "sm90" / "fa3_q_ring.fa").read_text()
Q_RING_CAUSAL = (ROOT / "tests" / "specs" / "bench" / "fa3_causal_q2.fa").read_text()


def _variant(text: str = HOPPER, **settings: str) -> str:
    for key, value in settings.items():
        # the kernel's own lines (two spaces in), not its backward block's
        text, n = re.subn(rf"^(  ){key}\s+\S+", rf"\g<1>{key} {value}", text, flags=re.M)
        assert n == 1, key
    return text


VARIANTS = {
    "pingpong_off": _variant(pingpong="off"),
    "overlap_off": _variant(overlap="off"),
    "both_off": _variant(pingpong="off", overlap="off"),
    "stages_1": _variant(stages="1"),
    "stages_3": _variant(single_ctas(HOPPER), stages="3"),  # O over the rings: no cluster
    "cluster_off": single_ctas(HOPPER),
    # O over the V ring (no room for its own bytes at 128 x 176)
    "o_over_v_both_off": _variant(HOPPER_176, pingpong="off", overlap="off"),
    "o_over_v_stages_1": _variant(HOPPER_176, stages="1"),
    "q_ring_both_off": _variant(Q_RING, pingpong="off", overlap="off"),
    "q_ring_stages_1": _variant(Q_RING, stages="1"),
    "q_ring_causal": Q_RING_CAUSAL,
    # one consumer warpgroup (small enough for the brute-force checker)
    "q_ring_one_wg": re.sub(
        r"^  stages     3$",
        "  stages     2\n  q_slots    2",
        (ROOT / "tests" / "specs" / "sm90" / "fa3_one_wg.fa").read_text(),
        flags=re.M,
    ),
}


def test_no_variant_is_an_example_again():
    """Each variant proves a plan the examples do not (fa3_hopper, causal, is fa3_causal)."""
    examples = {spec_body(path.read_text()) for path in SM90_SPECS}
    assert not [name for name, text in VARIANTS.items() if spec_body(text) in examples]


def _kernels() -> dict[str, Kernel]:
    kernels = {path.stem: compile_file(path).kernel for path in SM90_SPECS}
    kernels.update({name: compile_source(text, name).kernel for name, text in VARIANTS.items()})
    return kernels


KERNELS = _kernels()


def test_the_examples_exist():
    assert {p.stem for p in EXAMPLES} >= {"fa3_hopper", "fa3_causal", "fa3_hdim64", "fa3_hdim256"}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_plan_is_proven(name):
    assert verify(KERNELS[name]) is KERNELS[name]


# Syncs of a plan that verify proves unnecessary (findings for insert_syncs), each a strict
# xfail until the sync pass drops it. None today: with one stage the producer's mainloop wait
# for O's store was implied by its k_empty wait while the ping-pong turns closed at each
# tile's end; since the turns run on from tile to tile, it is needed (o_over_v_stages_1).
UNNEEDED: dict[str, str] = {}


@pytest.mark.parametrize(
    "name",
    [
        (
            pytest.param(
                name,
                marks=pytest.mark.xfail(strict=True, reason=f"finding: {UNNEEDED[name]}"),
            )
            if name in UNNEEDED
            else name
        )
        for name in sorted(KERNELS)
    ],
)
def test_every_sync_is_needed(name):
    assert _survivors(KERNELS[name]) == []


@pytest.mark.parametrize("name", sorted(UNNEEDED))
def test_the_unneeded_syncs_are_the_known_ones(name):
    assert [s[: len(UNNEEDED[name])] for s in _survivors(KERNELS[name])] == [UNNEEDED[name]]


def test_the_mutants_include_the_tile_loop_syncs():
    """The persistent plan's per-tile waits are among the mutants (the test above is not
    vacuous for them)."""
    whats = [what for what, _ in _mutants(KERNELS["fa3_hopper_bc176"])]  # O over the V ring
    assert any(w.startswith("zero") and "q_full" in w for w in whats)
    assert any(w.startswith("flip") and "q_empty" in w for w in whats)
    assert any(w.startswith("drop") and "o_free" in w for w in whats)


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_one_wg", "stages_3"])
@pytest.mark.parametrize("tile", ["K", "V"])
def test_shrinking_a_ring_fails(name, tile):
    kernel = KERNELS[name]
    buffers = tuple(replace(b, slots=1) if b.name == tile else b for b in kernel.buffers)
    with pytest.raises(AsyncVerifyError, match=rf"on {tile}\[slot 0\]|on {tile}:"):
        verify(replace(kernel, buffers=buffers))


def test_a_missing_init_is_named():
    kernel = KERNELS["fa3_hopper"]
    setup = tuple(
        i for i in kernel.setup if not (isinstance(i, Sync) and i.barrier == "v_full" and i.count)
    )
    with pytest.raises(AsyncVerifyError, match="mbarrier v_full is used but never initialised"):
        verify(replace(kernel, setup=setup))


@pytest.mark.parametrize(
    "name", ["fa3_hopper", "both_off", "stages_1", "fa3_one_wg", "o_over_v_both_off"]
)
@pytest.mark.parametrize("tiles", [(1,), (3,), (1, 1), (2, 1), (1, 1, 1)])
def test_bruteforce_agrees_on_the_generated_plans(name, tiles):
    """One CTA (a `cluster 2` kernel launched alone): two CTAs of these are too many states
    for the brute force (tests/test_verify_sm90_cluster.py explores a small cluster kernel)."""
    assert explore(build_program(KERNELS[name], tiles, ctas=1), all_kinds=True) == set()


@pytest.mark.parametrize("tiles", [(1, 1), (2, 1), (1, 2)])
def test_bruteforce_agrees_on_mutants_across_tiles(tiles):
    """Every mutant of the one-warpgroup causal kernel (small enough to explore): both
    checkers accept or refuse its program for these tiles alike (and some are refused)."""
    refused = 0
    for what, mutant in _mutants(KERNELS["fa3_one_wg"]):
        if "init" in what or "__syncthreads" in what:
            continue  # the setup runs before the roles split: no program event
        program = build_program(mutant, tiles)  # wgmma.fence is verify's rule, not the model's
        found = explore(program)
        assert bool(check(program)) == bool(found), (what, found)
        refused += bool(found)
    assert refused > 0


# --- the tile loop ---------------------------------------------------------------------


def test_the_single_tile_plan_still_proves_one_tile():
    for n in block_counts(SINGLE_TILE):
        assert problems_of(SINGLE_TILE, (n,)) == [], n


def test_the_single_tile_plan_is_refused_for_two_tiles_on_q():
    """q_full waited at parity 0 and nothing freeing Q: the next tile's Q load overwrites Q
    while the consumers still read it. The smallest failing sequence is named."""
    with pytest.raises(AsyncVerifyError) as err:
        verify(SINGLE_TILE)
    failures = err.value.failures
    assert all(f.startswith("with tiles of 1, 1 K/V blocks: ") for f in failures)
    assert any(re.search(r"WAR on Q rows of wg0: wg0 #\d+ \(qk \(tile 0", f) for f in failures)
    assert any("q_g2s (tile 1, it=0)" in f and "are not ordered" in f for f in failures)
    assert any("wait on q_full, parity 0) may wait for the wrong phase" in f for f in failures)


def test_the_single_tile_plan_lets_the_next_v_overwrite_o():
    """V's ring shares its bytes with O: nothing keeps the next tile's V load off O while
    the TMA store still reads it."""
    problems = problems_of(SINGLE_TILE, (2, 1))
    assert any(
        p.startswith("WAR on O rows of wg0") and "o_s2g (tile 0" in p and "v_g2s (tile 1" in p
        for p in problems
    ), problems
    assert any(p.startswith("WAW on O rows of wg1") and "o_r2s (tile 0" in p for p in problems)


def test_bruteforce_refuses_the_single_tile_plan_across_tiles():
    assert explore(build_program(SINGLE_TILE, (2,)), all_kinds=True) == set()
    assert "race" in explore(build_program(SINGLE_TILE, (2, 1)), all_kinds=True)


def test_a_zero_parity_is_refused_only_across_tiles():
    """Parity.ZERO for q_full is right for one tile and wrong from the second on."""
    kernel = KERNELS["fa3_hopper"]
    prologue = tuple(
        replace(i, parity=Parity.ZERO) if isinstance(i, Sync) and i.parity is Parity.TILE else i
        for i in kernel.prologue
    )
    zero = replace(kernel, prologue=prologue)
    assert all(problems_of(zero, (n,)) == [] for n in block_counts(zero))
    with pytest.raises(AsyncVerifyError, match=r"^1 problem|, tiles of 1, 1 K/V blocks"):
        verify(zero)


def test_empty_tiles_run_nothing():
    kernel = KERNELS["fa3_causal"]
    assert build_program(kernel, (0,)).agents == build_program(kernel, ()).agents
    # no tile but the setup and teardown: the ping-pong turns opened and closed
    assert build_program(kernel, (0, 0)) == build_program(kernel, ())
    assert all(a.events == () for a in build_program(kernel, ()).agents[:1])
    assert build_program(kernel, (2, 0, 1)) == build_program(kernel, (2, 1))


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 5])
def test_the_tile_sequences_cover_the_loop(stages):
    kernel = replace(
        KERNELS["fa3_hopper"],
        config=replace(
            KERNELS["fa3_hopper"].config,
            ext=replace(KERNELS["fa3_hopper"].config.ext, stages=stages),
        ),
    )
    sequences = tile_sequences(kernel)
    shapes = set(range(1, stages + 3))
    assert {s[0] for s in sequences if len(s) == 1} == shapes
    # the second tile starts at every slot and phase of the ring, with every shape
    for n1 in shapes:
        starts = {s[0] % (2 * stages) for s in sequences if len(s) == 2 and s[1] == n1}
        assert starts == set(range(2 * stages)), (n1, starts)
    # a third tile whose ring slots last held a block of the first (a short middle tile)
    assert any(len(s) == 3 and s[1] < max(stages, 2) for s in sequences)
    assert sequences == tuple(sorted(sequences, key=lambda s: (len(s), sum(s), s)))
    assert all(n > 0 for s in sequences for n in s)


# --- Q in a ring of tiles (q_slots 2) -----------------------------------------------------


def _q_syncs(kernel: Kernel, **changes) -> Kernel:
    """``kernel`` with ``changes`` made to every sync on Q's barriers (inits included)."""

    def change(items):
        return tuple(
            replace(i, **changes) if isinstance(i, Sync) and i.barrier.startswith("q_") else i
            for i in items
        )

    phases = ("setup", "prologue", "mainloop", "epilogue", "teardown")
    return replace(kernel, **{p: change(getattr(kernel, p)) for p in phases})


def test_the_q_ring_is_planned_as_a_ring_of_tiles():
    kernel = KERNELS["fa3_q_ring"]
    assert kernel.buffer("Q").slots == 2
    q_syncs = [s for s in kernel.syncs() if s.barrier in ("q_full", "q_empty")]
    # two inits, the producer's empty wait and expect_tx, the consumers' full wait and release
    assert len(q_syncs) == 6 and {s.slots for s in q_syncs} == {2}
    assert "bar=q_full[t%2]" in next(s.text() for s in q_syncs if s.parity is Parity.TILE)


def test_shrinking_the_q_ring_fails():
    """Q in one slot under the two-slot plan: the producer loads tile t + 1's Q over the Q
    that tile t's consumers still read."""
    kernel = KERNELS["fa3_q_ring"]
    buffers = tuple(replace(b, slots=1) if b.name == "Q" else b for b in kernel.buffers)
    with pytest.raises(AsyncVerifyError) as err:
        verify(replace(kernel, buffers=buffers))
    failures = err.value.failures
    assert all(f.startswith("with tiles of 1, 1 K/V blocks: ") for f in failures)
    assert any(re.search(r"on Q: producer #\d+ \(q_g2s \(tile 1.*qk \(tile 0", f) for f in failures)


def test_one_barrier_pair_over_two_q_slots_is_proven():
    """Q's barriers planned one per tile over Q's two slots: each Q load then waits for the
    previous tile's release (slower, and correct); the proof does not lean on the counts
    being equal."""
    kernel = _q_syncs(KERNELS["fa3_q_ring"], slots=1)
    assert kernel.buffer("Q").slots == 2
    assert verify(kernel) is kernel


def test_a_q_ring_of_three_barriers_is_refused():
    """Barriers of three slots over Q's two: tile 2 loads into slot 0 while tile 0's
    consumers may still read it (q_empty[2] is fresh)."""
    with pytest.raises(AsyncVerifyError) as err:
        verify(_q_syncs(KERNELS["fa3_q_ring"], slots=3))
    assert any(
        re.search(r"on Q\[slot 0\]: producer #\d+ \(q_g2s \(tile 2.*qk \(tile 0", f)
        for f in err.value.failures
    )


@pytest.mark.parametrize("tiles", [(1, 1, 1), (2, 1, 1), (1, 1, 1, 1, 1)])
def test_bruteforce_agrees_on_the_q_ring(tiles):
    kernel = KERNELS["q_ring_one_wg"]
    assert kernel.buffer("Q").slots == 2 and kernel.config.ext.stages == 2
    assert explore(build_program(kernel, tiles), all_kinds=True) == set()
    shrunk = tuple(replace(b, slots=1) if b.name == "Q" else b for b in kernel.buffers)
    assert "race" in explore(build_program(replace(kernel, buffers=shrunk), tiles))


def test_the_tile_sequences_cover_the_q_ring():
    """Runs of 2q + 1 tiles: each Q slot used three times (fresh, then each phase no longer
    fresh), after a first tile that sets every offset of the K/V ring (stages 1 too)."""
    for name in ("fa3_q_ring", "q_ring_stages_1"):
        kernel = KERNELS[name]
        stages = kernel.config.ext.stages
        runs = [s for s in tile_sequences(kernel) if len(s) == 5]
        assert {s[0] for s in runs} == set(range(1, 2 * stages + 1))  # every ring offset
        assert len(runs) == 2 * stages + 2**4 - 1
        assert (1, 1, 1, 1, 1) in runs and (1, 2, 1, 2, 2) in runs
    assert all(len(s) <= 3 for s in tile_sequences(KERNELS["fa3_hdim64"]))


def test_the_tail_sees_the_next_tile_count():
    """The generated code counts a tile done before the consumers' tail (normalise on): Q's
    release moved into the tail would arrive on the next tile's slot, and verify, which
    counts the tile where the code does, refuses it."""
    kernel = KERNELS["fa3_q_ring"]
    epilogue = list(kernel.epilogue)
    release = next(
        i for i, x in enumerate(epilogue) if isinstance(x, Sync) and x.barrier == "q_empty"
    )
    item = epilogue.pop(release)
    cut = next(i for i, x in enumerate(epilogue) if getattr(x, "op", None) is Op.NORMALIZE)
    epilogue.insert(cut + 1, item)
    with pytest.raises(AsyncVerifyError, match="q_empty"):
        verify(replace(kernel, epilogue=tuple(epilogue)))


def test_a_guarded_softmax_holds_its_k_slot_until_p_is_converted():
    """`rescale guarded` reads K again (its rare recompute of S) in the step that converts P,
    so the slot's empty arrival follows that step; where `rescale lazy` puts it, right after
    S's wgmma wait, verify finds the refill racing the recompute."""
    kernel = KERNELS["fa3_hdim64"]
    assert kernel.config.ext.guarded
    loop = list(kernel.mainloop)
    arrival = next(
        i
        for i, x in enumerate(loop)
        if isinstance(x, Sync) and x.barrier == "k_empty" and x.who is not Threads.PRODUCER_THREAD
    )
    convert = next(i for i, x in enumerate(loop) if isinstance(x, Step) and x.op is Op.CONVERT_P)
    softmax = next(i for i, x in enumerate(loop) if isinstance(x, Step) and x.op is Op.SOFTMAX)
    assert softmax < convert < arrival
    early = loop[:softmax] + [loop[arrival]] + loop[softmax:arrival] + loop[arrival + 1 :]
    with pytest.raises(AsyncVerifyError, match=r"WAR on K\[slot \d\]: .*convert_p"):
        verify(replace(kernel, mainloop=tuple(early)))
    lazy = compile_source(
        _variant((ROOT / "examples" / "fa3_hdim64.fa").read_text(), rescale="lazy")
    ).kernel
    loop = list(lazy.mainloop)
    arrival = next(
        i
        for i, x in enumerate(loop)
        if isinstance(x, Sync) and x.barrier == "k_empty" and x.who is not Threads.PRODUCER_THREAD
    )
    softmax = next(i for i, x in enumerate(loop) if isinstance(x, Step) and x.op is Op.SOFTMAX)
    assert arrival < softmax
