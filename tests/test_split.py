"""`tail split_kv` on the host and in the proof: the split plan (which tiles stay whole,
into how many pieces the last round's tiles go), the launch's grid and FwdParamsSm90's
tail, and verify's model of a piece that skips its tile's tail (the GPU tests are in
tests/test_gpu_split.py)."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fadsl.targets.sm90.host.launch as params
from fadsl.targets.sm90.host.launch import (
    SM90_BASE_OFFSET,
    SM90_PARAMS_BYTES,
    SPLIT_FIXED_BLOCKS,
    SPLIT_TAIL,
    split_plan,
)
from fadsl.targets.launch import FWD_PARAMS, Args
from fadsl.targets import launch_for
from fadsl.passes.asyncmodel.prove import AsyncVerifyError
from fadsl.pipeline import compile_file
from fadsl.targets.sm90.verify import problems_of, skip_patterns, verify

ROOT = Path(__file__).resolve().parents[1]
SPLIT = compile_file(ROOT / "examples" / "fa3_hdim64.fa").kernel  # `tail split_kv`
WHOLE = compile_file(
    ROOT / "tests" / "specs" / "bench" / "fa3_hdim64_whole.fa"
).kernel  # `tail whole`


def _last_round(tiles: int, ctas: int, blocks: int, splits: int) -> float:
    """The last round's time in whole tiles' time, as split_plan models it."""
    rest = tiles % ctas
    rounds = -(-rest * splits // ctas)
    return rounds * (blocks / splits + SPLIT_FIXED_BLOCKS) / (blocks + SPLIT_FIXED_BLOCKS)


@pytest.mark.parametrize(
    "tiles, ctas, blocks, plan",
    [
        (1408, 132, 16, (1320, 3)),  # 16 heads x 2048 at head_dim 64: two pieces per CTA
        (2816, 132, 16, (2772, 3)),  # 32 heads: one piece per CTA
        (1320, 132, 16, (1320, 1)),  # whole rounds only: nothing to split
        (1408, 132, 1, (1408, 1)),  # one K/V block: nothing to split it into
        (88, 132, 16, (0, 3)),  # fewer tiles than CTAs: one part-full round
        (6, 132, 32, (0, 8)),  # a few long tiles: as many pieces as the plan allows
    ],
)
def test_split_plan(tiles, ctas, blocks, plan):
    assert split_plan(tiles, ctas, blocks) == plan


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 200), st.integers(1, 200))
def test_split_plan_only_splits_the_last_round_and_only_to_gain(tiles, ctas, blocks):
    start, splits = split_plan(tiles, ctas, blocks)
    if splits == 1:
        assert start == tiles
        return
    assert start == tiles // ctas * ctas < tiles  # whole rounds stay whole
    assert 2 <= splits <= min(params.MAX_SPLITS, blocks)  # every piece has a block
    cost = _last_round(tiles, ctas, blocks, splits)
    assert cost < 1.0
    assert all(
        cost <= _last_round(tiles, ctas, blocks, s) + 1e-9
        for s in range(2, min(params.MAX_SPLITS, blocks) + 1)
    )


def _args(batch: int, sq: int, sk: int, heads: int, d: int = 64) -> Args:
    q = torch.empty(batch, sq, heads, d, dtype=torch.bfloat16, device="meta")
    k = torch.empty(batch, sk, heads, d, dtype=torch.bfloat16, device="meta")
    return Args(q, k, k, q, None, d**-0.5)


def test_the_grid_counts_pieces_and_stays_one_cta_per_sm(monkeypatch):
    monkeypatch.setattr(params, "sm_count", lambda index: 132)
    grid = launch_for("sm_90a").grid
    # 16 heads x 2048 rows: 1408 tiles of 192 rows, the last 88 in 264 pieces
    assert grid(SPLIT, _args(8, 2048, 2048, 16)) == (132, 1, 1)
    # 88 tiles, fewer than the SMs: split into 3, 264 pieces, still one CTA per SM at most
    assert grid(SPLIT, _args(1, 2048, 2048, 8)) == (132, 1, 1)
    assert grid(WHOLE, _args(1, 2048, 2048, 8)) == (88, 1, 1)
    # 4 tiles of 1 block each: nothing to split
    assert grid(SPLIT, _args(1, 192, 100, 4)) == (4, 1, 1)


def test_the_params_tail_holds_the_plan_and_the_workspace(monkeypatch):
    monkeypatch.setattr(params, "sm_count", lambda index: 132)
    monkeypatch.setattr(params, "_SM90_PACKED", {})
    monkeypatch.setattr("fadsl.targets.sm90.host.tma.tensor_map", lambda t, cols, rows: bytes(128))
    asked = []

    def workspace(device, floats, counters):
        asked.append((floats, counters))
        return 0x1000, 0x2000

    monkeypatch.setattr("fadsl.targets.sm90.host.workspace.split_workspace", workspace)
    raw = params.pack_fwd_params_sm90(SPLIT, _args(8, 2048, 2048, 16))
    assert len(raw) == SM90_PARAMS_BYTES
    tail = SM90_BASE_OFFSET + FWD_PARAMS.size
    assert SPLIT_TAIL.unpack_from(raw, tail) == (0x1000, 0x2000, 1320, 3)
    # the scheduler's divisors: 11 query blocks of 192 rows, 16 heads, 1 per K/V head, 3 pieces
    divisors = params.DIVISORS.unpack_from(raw, tail + SPLIT_TAIL.size)
    fast_div = params.fast_div
    assert divisors == (*fast_div(11), *fast_div(16), *fast_div(1), *fast_div(3))
    # 88 split tiles x 3 pieces x 3 warpgroups x 128 threads x (32 O registers + m, l)
    assert asked == [(88 * 3 * 3 * 128 * (32 + 4), 88 * 3)]
    # whole rounds only: splits 1, no workspace; a kernel without the knob: zeros
    whole_rounds = params.pack_fwd_params_sm90(SPLIT, _args(8, 1920, 2048, 33))
    assert SPLIT_TAIL.unpack_from(whole_rounds, tail) == (0, 0, 10 * 33 * 8, 1)
    after = tail + SPLIT_TAIL.size
    assert params.DIVISORS.unpack_from(whole_rounds, after)[6:] == fast_div(1)
    assert len(asked) == 1
    plain = params.pack_fwd_params_sm90(WHOLE, _args(8, 2048, 2048, 16))
    assert plain[tail:after] == bytes(SPLIT_TAIL.size)  # no split fields: zeros
    assert params.DIVISORS.unpack_from(plain, after) == (*divisors[:6], *fast_div(1))
    assert len(plain) == SM90_PARAMS_BYTES


def test_the_split_kernel_is_proven_with_skipped_tails():
    patterns = skip_patterns(SPLIT)
    assert patterns and skip_patterns(WHOLE) == ()
    # every set of warpgroups skipping each tile's tail of a pair (two pieces in a row)
    pairs = {skips for tiles, skips in patterns if tiles == (1, 2)}
    assert len(pairs) == 2**3 * 2**3 - 1
    assert (frozenset({0, 1}), frozenset({2})) in pairs
    # a skipped tail between two that run
    assert ((2, 2, 2), (frozenset(), frozenset({1}), frozenset())) in patterns
    assert verify(SPLIT) is SPLIT


def test_a_skipped_tail_with_a_barrier_of_every_warpgroup_hangs():
    """O over the dead V ring: the tail holds the all-consumer barrier before stmatrix and
    O's free barrier; a warpgroup that skips it leaves the others waiting (plan_smem
    refuses the spec; forced here, verify refuses the plan)."""
    hopper = compile_file(ROOT / "tests" / "specs" / "bench" / "fa3_hopper_bc176.fa").kernel
    forced = replace(
        hopper,
        config=replace(hopper.config, ext=replace(hopper.config.ext, split_kv=True)),
    )
    skips = (frozenset({0}), frozenset())
    assert problems_of(hopper, (1, 1)) == []
    found = problems_of(forced, (1, 1), skips)
    assert any("ring_dead" in p or "o_free" in p or "never" in p for p in found), found
    with pytest.raises(AsyncVerifyError, match="tail skipped by wg"):
        verify(forced)


def test_the_tail_of_a_piece_is_rendered(tmp_path):
    from fadsl.codegen.render import render

    compiled = compile_file(ROOT / "examples" / "fa3_hdim64.fa")
    text = render(compiled.kernel, compiled.target, compiled.file)[0].text
    assert text.count("split_tile_index<Cfg>(P, step)") == 2  # producer and consumers
    assert "w.block_end - 1 - (it)" in text and "w.n_blocks - 1 - (" not in text
    skip = "if (w.split >= 0 && !combine_split<Cfg>(P, w, wg, o, m, l, scale_log2, threadIdx.x % 128)) continue;"
    assert text.index(skip) < text.index("row_sum_quad(l);")
    plain_text = render(WHOLE, compiled.target, compiled.file)[0].text
    assert "split_tile" not in plain_text and "combine_split" not in plain_text
