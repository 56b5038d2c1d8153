"""GPU tests of `tail split_kv` (examples/fa3_hdim64.fa) on a Hopper GPU: shapes whose
last round of tiles the host splits into pieces (one or two per CTA, a masked last K/V block,
GQA, a launch of fewer tiles than SMs), against the float32 reference with outputs and LSE
poisoned first; the same bits on every run whichever piece of a tile finishes last, and
after launches of other split plans (the counters wrap back to 0); CUDA-graph replay."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fadsl
import fadsl.targets.sm90.host.launch as params
from test_gpu_sm90 import HOPPER, assert_matches, random_qkv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

SPEC = Path(__file__).resolve().parents[1] / "examples" / "fa3_hdim64.fa"
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): on 132 SMs, 176 tiles (44 split, one piece
# per CTA); 220 tiles (88 split, two pieces per CTA, the last K/V block masked, GQA); 560
# tiles of 3 blocks; 6 tiles of 32 blocks (fewer tiles than SMs, 8 pieces each).
SHAPES = [
    (1, 2048, 2048, 16, 16),
    (1, 2048, 2000, 20, 4),
    (2, 600, 333, 70, 7),
    (1, 300, 4096, 3, 3),
]


@pytest.fixture(scope="module")
def kern():
    return fadsl.load(str(SPEC), verbose=False)


def _plan(kern, batch, sq, sk, hq):
    tiles = -(-sq // kern.config.block_r) * hq * batch
    blocks = -(-sk // kern.config.block_c)
    return params.split_plan(tiles, params.grid_ctas(kern, 0), blocks)


def _run(kern, q, k, v):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda", dtype=torch.float32
    )
    kern.forward_into(q, k, v, out, lse, q.shape[-1] ** -0.5)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["-".join(map(str, s)) for s in SHAPES])
def test_split_tail_matches_reference(kern, shape, dtype):
    batch, sq, sk, hq, hkv = shape
    start, splits = _plan(kern, batch, sq, sk, hq)
    assert splits > 1, "the shape must split its last round"
    q, k, v = random_qkv(batch, sq, sk, hq, hkv, 64, dtype, sq * 31 + sk)
    out, lse = _run(kern, q, k, v)
    torch.cuda.synchronize()
    assert_matches(kern, q, k, v, q.shape[-1] ** -0.5, out, lse)


def test_split_tiles_have_the_same_bits_every_run(kern):
    batch, sq, sk, hq, hkv = SHAPES[1]
    q, k, v = random_qkv(batch, sq, sk, hq, hkv, 64, torch.bfloat16, 7)
    first = _run(kern, q, k, v)
    for shape in SHAPES[2:] + SHAPES[:1]:  # other plans in between: 3, 8 and 3 pieces
        other = random_qkv(*shape, 64, torch.bfloat16, 11)
        _run(kern, *other)
    again = [_run(kern, q, k, v) for _ in range(3)]
    torch.cuda.synchronize()
    for out, lse in again:
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1])


def test_split_tail_replays_in_a_cuda_graph(kern):
    batch, sq, sk, hq, hkv = SHAPES[0]
    q, k, v = random_qkv(batch, sq, sk, hq, hkv, 64, torch.bfloat16, 3)
    eager = _run(kern, q, k, v)
    out = torch.empty_like(q)
    lse = torch.empty(batch, hq, sq, device="cuda", dtype=torch.float32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kern.forward_into(q, k, v, out, lse, 64**-0.5)  # warm-up off the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern.forward_into(q, k, v, out, lse, 64**-0.5)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
