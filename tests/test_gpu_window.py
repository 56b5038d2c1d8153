"""Sliding windows on the GPU: the windowed specs (tests/specs/sm90/fa3_window*.fa, in every
rescale mode) and tests/gpu_specs.py's WINDOW_VARIANTS (a window narrower than a block, left
0 with the causal mask, a right side only, one wider than the sequence, the grid scheduler,
192-row tiles), both dtypes, GQA and MQA, seqlen_q != seqlen_k both ways, rows that see no
key (O = 0, LSE -inf), against float64 with FlashAttention's rule (tests/test_gpu_general.py's
reference with the window); scores that are large just outside each window, which must not
leak in; and the blocks outside the windows skipped (timed against the causal mask alone).
`GPU_TESTS=tests/test_gpu_window.py bash scripts/device.sh tests`."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from gpu_specs import window_of, window_specs, with_setting
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

SPECS = window_specs()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (seqlen_q, seqlen_k): one row; tails both ways; sq > sk (the first rows see no key); equal
SHAPES = [(1, 1), (300, 1100), (1100, 300), (1024, 1023), (2000, 2000), (257, 700), (1, 3000),
          (3000, 1)]  # fmt: skip
HEADS = [(8, 2), (8, 8), (8, 1)]  # GQA 4, none, MQA
CASES = [
    (name, dtype, sq, sk, *HEADS[i % len(HEADS)])
    for i, (name, dtype, (sq, sk)) in enumerate(
        (n, d, s) for n in SPECS for d in DTYPES for s in SHAPES
    )
]
_loaded: dict[str, object] = {}


def kernel(name: str):
    if name not in _loaded:
        _loaded[name] = fadsl.load(SPECS[name], verbose=False)
    return _loaded[name]


def run(kern, q, k, v, scale):
    """The kernel's output and LSE, both poisoned with NaN first."""
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
    kern.forward_into(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    return out, lse


def assert_matches(kern, name, q, k, v, scale, out, lse):
    """FlashAttention's rule against float64; the LSE within 1e-3 and -inf exactly where the
    reference's is; rows that see no key output 0."""
    window = window_of(SPECS[name])
    causal = kern.config.mask.value == "causal"
    cap = kern.config.ext.softcap or None
    ref, ref_lse = reference(q, k, v, scale, causal, torch.float64, softcap=cap, window=window)
    low, _ = reference(q, k, v, scale, causal, q.dtype, softcap=cap, window=window)
    assert not out.isnan().any() and not lse.isnan().any(), "outputs never written (or NaN)"
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"
    empty = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty), "LSE -inf exactly for the rows with no key"
    if (~empty).any():
        rel = (lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
        assert rel[~empty].max().item() <= 1e-3
    if empty.any():
        assert (out.double()[empty.transpose(1, 2)] == 0).all(), "a row with no key outputs 0"


@pytest.mark.parametrize(
    "name, dtype, sq, sk, hq, hkv", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_windowed_attention_matches_float64(name, dtype, sq, sk, hq, hkv):
    kern = kernel(name)
    d = kern.config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(sq * 7919 + sk)
    q = torch.randn(2, sq, hq, d, device="cuda", generator=gen).to(DTYPES[dtype])
    k = torch.randn(2, sk, hkv, d, device="cuda", generator=gen).to(DTYPES[dtype])
    v = torch.randn(2, sk, hkv, d, device="cuda", generator=gen).to(DTYPES[dtype])
    scale = d**-0.5
    out, lse = run(kern, q, k, v, scale)
    assert_matches(kern, name, q, k, v, scale, out, lse)


BIG = 64.0  # a score (exact in both dtypes) that outweighs a row's window by e^60 and more


def leaking_inputs(kern, window, dtype, sq, sk, heads=(2, 4, 2), seed=0):
    """q, k, v whose score of query i at key j is k[j, i mod d] exactly (q_i = e_(i mod d)):
    BIG at every key that no query of column i mod d sees (right outside the windows, where a
    leak would dominate the row), small random values elsewhere; and how many queries have
    a BIG key next to their window, on either side (None where the window leaves no key out)."""
    d = kern.config.head_dim
    batch, hq, hkv = heads
    left, right = window
    rows, keys = torch.arange(sq), torch.arange(sk)
    diag = rows[:, None] + sk - sq
    sees = (keys[None, :] >= diag - left) & (keys[None, :] <= diag + right)  # (sq, sk)
    column_sees = torch.zeros(d, sk, dtype=torch.bool)
    for column in range(min(d, sq)):
        column_sees[column] = sees[column::d].any(dim=0)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, sk, hkv, d, generator=gen)
    k = torch.where(column_sees.T[None, :, None, :], k, torch.full_like(k, BIG))
    q = torch.zeros(batch, sq, hq, d)
    q[:, rows, :, rows % d] = 1.0
    v = torch.randn(batch, sk, hkv, d, generator=gen)
    big = ~column_sees[rows % d]  # (sq, sk): where query i's score is BIG
    edges = [(diag - left - 1).squeeze(1), (diag + right + 1).squeeze(1)]
    next_to = sum(
        (big[rows, edge.clamp(0, sk - 1)] & (edge >= 0) & (edge < sk)).sum().item()
        for edge in edges
    )
    if not (~sees).any():
        next_to = None  # the window leaves no key out: nothing can leak
    return *(t.to(dtype).cuda() for t in (q, k, v)), next_to


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SPECS)
def test_large_scores_just_outside_the_window_do_not_leak_in(name, dtype):
    """A query per column of Q (seqlen_q = head_dim, one tile) over keys reaching past its
    windows on both sides, and three tiles and a tail where queries share columns; a score
    of 64 right outside every window (where the keys are still in the tile's blocks)
    against O(1) inside."""
    kern = kernel(name)
    d, block_m = kern.config.head_dim, kern.config.block_r
    window = window_of(SPECS[name])
    one_tile = (d, 2 * d + min(window[0], 1000) + 37, True)
    for sq, sk, each_column in (one_tile, (3 * block_m + 17, 2 * block_m, False)):
        q, k, v, next_to = leaking_inputs(kern, window, DTYPES[dtype], sq, sk)
        if each_column and next_to is not None:
            assert next_to > 0, "the case puts no large score next to a window"
        out, lse = run(kern, q, k, v, 1.0)
        assert_matches(kern, name, q, k, v, 1.0, out, lse)  # a leak: an error of O(1)


def _median_ms(kern, q, k, v, runs=10):
    for _ in range(3):
        kern(q, k, v)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        start.record()
        kern(q, k, v)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def test_a_window_skips_the_blocks_outside_it():
    """causal, window(256) at seqlen 8192 visits about 3 blocks of 128 keys per tile where the
    causal mask alone visits 32 on average: at least 4x faster (the fixed costs of a tile
    aside, about 7x)."""
    windowed = kernel("fa3_window_guarded")
    causal = fadsl.load(
        with_setting(SPECS["fa3_window_guarded"], "mask", "causal").replace(
            "kernel fa3_window_guarded", "kernel fa3_window_as_causal"
        ),
        verbose=False,
    )
    q, k, v = (torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ratio = _median_ms(causal, q, k, v) / _median_ms(windowed, q, k, v)
    assert ratio >= 4, f"the window is only {ratio:.2f}x faster than the causal mask"
