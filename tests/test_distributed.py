"""fadsl.distributed on CPU process groups (gloo): ring attention (zigzag and contiguous
layouts, causal and not, GQA) and the all-to-all (Ulysses) against float64 attention of the
whole sequence, forward and backward, every rank's shard gathered; the LSE merge's edge rows;
the zigzag helpers; the argument checks. The attention of each step is ReferenceStep (fp32
torch): the ring's exchanges, plans and merges are what is tested here; fadsl's kernels inside
it are tests/test_gpu_distributed.py's (2 GPUs)."""

from __future__ import annotations

import datetime
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fadsl.distributed as fcp
from fadsl.distributed.merge import merge_into
from fadsl.distributed.steps import ReferenceStep

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


def full_attention(q, k, v, causal: bool, scale: float):
    """softmax(q k^T scale [+ bottom-right causal mask]) v in q's dtype (float64 here)."""
    group = q.shape[2] // k.shape[2]
    kf, vf = (t.repeat_interleave(group, dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kf) * scale
    if causal:
        i = torch.arange(q.shape[1])[:, None]
        j = torch.arange(k.shape[1])[None, :]
        s = s.masked_fill(j > i + k.shape[1] - q.shape[1], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vf)


def _case_tensors(seed, batch, seqlen_q, seqlen_k, heads, heads_kv, d):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, heads_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, heads_kv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seqlen_q, heads, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def _contiguous(x, rank, world):
    return x.chunk(world, dim=1)[rank]


def _gather(x, world, unshard):
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return unshard(parts)


def _close(name, got, want, tol=2e-5):
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= tol * max(scale, 1.0), f"{name}: max error {err:.3e} of {scale:.3e}"


# (name, causal, layout, batch, seqlen_q, seqlen_k (whole), heads, heads_kv, head_dim)
RING_CASES = [
    ("plain_contiguous_gqa", False, "contiguous", 2, 6, 5, 4, 2, 16),
    ("causal_zigzag", True, "zigzag", 1, 4, 4, 2, 2, 8),
    ("causal_zigzag_gqa", True, "zigzag", 2, 2, 2, 4, 1, 16),
    ("causal_contiguous", True, "contiguous", 1, 3, 3, 2, 1, 8),
    ("plain_zigzag", False, "zigzag", 1, 2, 2, 2, 2, 8),
]


def _ring_case(rank, world, case, head_chunks=None):
    """One case of RING_CASES; ``head_chunks``: the ring run once per group of heads (a group
    per K/V head: head_chunks = heads_kv)."""
    name, causal, layout, batch, per_q, per_k, heads, heads_kv, d = case
    name = name if head_chunks is None else f"{name} in {head_chunks} groups"
    chunks = 2 * world if layout == "zigzag" else world
    q, k, v, dout = _case_tensors(7, batch, per_q * chunks, per_k * chunks, heads, heads_kv, d)
    scale = 1 / math.sqrt(d) * 1.3
    if layout == "zigzag":
        shard, unshard = (lambda t: fcp.shard_zigzag(t, rank, world)), fcp.unshard_zigzag
    else:
        shard, unshard = (lambda t: _contiguous(t, rank, world)), (lambda p: torch.cat(p, 1))
    mine = [shard(t).float().requires_grad_() for t in (q, k, v)]
    out, lse = fcp.ring_attention(
        *mine, causal=causal, softmax_scale=scale, layout=layout, step=ReferenceStep(),
        return_lse=True, head_chunks=head_chunks,
    )  # fmt: skip
    out.backward(shard(dout).float())
    leaves = [t.requires_grad_() for t in (q, k, v)]
    want = full_attention(*leaves, causal, scale)
    want.backward(dout)
    _close(f"{name} out", _gather(out.detach(), world, unshard), want.detach())
    for label, got, leaf in zip("qkv", mine, leaves):
        _close(f"{name} d{label}", _gather(got.grad, world, unshard), leaf.grad)
    # the LSE: logsumexp of this rank's rows of the whole scores
    s = torch.einsum(
        "bqhd,bkhd->bhqk", q, k.repeat_interleave(heads // heads_kv, dim=2)
    ) * scale  # fmt: skip
    if causal:
        i, j = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
        s = s.masked_fill(j > i, float("-inf"))
    whole_lse = torch.logsumexp(s, dim=-1)  # (batch, heads, seqlen)
    _close(f"{name} lse", lse, shard(whole_lse.transpose(1, 2)).transpose(1, 2))


# (name, causal, batch, seqlen (whole, a multiple of world), heads, heads_kv, head_dim)
ULYSSES_CASES = [
    ("plain_gqa", False, 2, 6, 12, 6, 8),
    ("causal", True, 1, 12, 6, 6, 16),
    ("causal_gqa", True, 2, 12, 12, 6, 8),
]


def _ulysses_case(rank, world, case):
    name, causal, batch, seqlen, heads, heads_kv, d = case
    q, k, v, dout = _case_tensors(11, batch, seqlen, seqlen, heads, heads_kv, d)
    scale = 0.4
    mine = [_contiguous(t, rank, world).clone().requires_grad_() for t in (q, k, v)]
    out = fcp.ulysses_attention(
        *mine, attend=lambda a, b, c: full_attention(a, b, c, causal, scale)
    )
    out.backward(_contiguous(dout, rank, world))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    want = full_attention(*leaves, causal, scale)
    want.backward(dout)
    cat = lambda parts: torch.cat(parts, 1)  # noqa: E731
    _close(f"ulysses {name} out", _gather(out.detach(), world, cat), want.detach(), 1e-10)
    for label, got, leaf in zip("qkv", mine, leaves):
        _close(f"ulysses {name} d{label}", _gather(got.grad, world, cat), leaf.grad, 1e-10)


def _ulysses_step_case(rank, world, case):
    """The default form (UlyssesAttention: ReferenceStep over groups of heads) with one group
    and with a group per K/V head of the rank: the same output and gradients as
    whole-sequence attention; what autograd keeps with groups is the shards, the output shard
    and the LSE, not the gathered tensors (gathered again in the backward)."""
    name, causal, batch, seqlen, heads, heads_kv, d = case
    q, k, v, dout = _case_tensors(13, batch, seqlen, seqlen, heads, heads_kv, d)
    scale = 0.4
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = full_attention(*leaves, causal, scale)
    want.backward(dout)
    cat = lambda parts: torch.cat(parts, 1)  # noqa: E731
    for chunks in sorted({1, heads_kv // world}):
        # with groups, (batch, heads, seqlen, d) tensors seen transposed: non-contiguous shards
        bases = [
            _contiguous(t, rank, world).transpose(1, 2).contiguous().requires_grad_()
            for t in (q, k, v)
        ]
        mine = [b.transpose(1, 2) if chunks > 1 else b.transpose(1, 2).contiguous() for b in bases]
        for t in mine:
            t.retain_grad()
        out = fcp.ulysses_attention(
            *mine, causal=causal, softmax_scale=scale, step=ReferenceStep(), head_chunks=chunks
        )
        # kept: q, k, v and out, then the LSE (fp32 rows of this rank's heads, whole); the
        # shards with groups (gathered again in the backward), the gathered tensors with one
        kept = out.grad_fn.saved_tensors
        lse_floats = batch * heads // world * seqlen
        assert (
            sum(t.numel() for t in kept) == 2 * mine[0].numel() + 2 * mine[1].numel() + lse_floats
        )
        rows = seqlen if chunks == 1 else seqlen // world
        assert all(t.shape[1] == rows for t in kept[:4]), (chunks, [t.shape for t in kept])
        # twice through a retained graph: the gradients add up to twice the whole's
        out.backward(_contiguous(dout, rank, world), retain_graph=True)
        out.backward(_contiguous(dout, rank, world))
        label = f"ulysses step {name} chunks {chunks}"
        _close(f"{label} out", _gather(out.detach(), world, cat), want.detach())
        for x, got, leaf in zip("qkv", mine, leaves):
            _close(f"{label} d{x}", _gather(got.grad, world, cat), 2 * leaf.grad)


# (name, causal, whole sequence lengths (multiples of 2 x world), heads, heads_kv, head_dim)
VARLEN_CASES = [("causal_gqa", True, [4, 12, 8], 4, 2, 8), ("plain", False, [8, 4], 2, 2, 16)]


def _varlen_case(rank, world, case):
    name, causal, lengths, heads, heads_kv, d = case
    lengths = [n * world for n in lengths]  # each a multiple of 2 x world
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(cu[-1], heads, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(cu[-1], heads_kv, d, generator=g, dtype=torch.float64) for _ in "kv")
    dout = torch.randn(cu[-1], heads, d, generator=g, dtype=torch.float64)
    scale = 0.3
    shards = [fcp.shard_zigzag_varlen(t, cu, rank, world) for t in (q, k, v, dout)]
    cu_local = shards[0][1]
    mine = [t.float().requires_grad_() for t, _ in shards[:3]]
    out = fcp.ring_attention_varlen(
        *mine, cu_local, causal=causal, softmax_scale=scale, step=ReferenceStep()
    )
    out.backward(shards[3][0].float())
    leaves = [t.requires_grad_() for t in (q, k, v)]
    want = torch.cat(
        [
            full_attention(*(t[None, a:b] for t in leaves), causal, scale)[0]
            for a, b in zip(cu, cu[1:])
        ]
    )
    want.backward(dout)
    unshard = lambda parts: fcp.unshard_zigzag_varlen(parts, cu)  # noqa: E731
    _close(f"varlen {name} out", _gather(out.detach(), world, unshard), want.detach())
    for label, got, leaf in zip("qkv", mine, leaves):
        _close(f"varlen {name} d{label}", _gather(got.grad, world, unshard), leaf.grad)


def _worker(rank, world, init_file, ulysses_too):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case in RING_CASES:
            _ring_case(rank, world, case)
            if case[-2] > 1:
                _ring_case(rank, world, case, head_chunks=case[-2])
        if ulysses_too:
            for case in ULYSSES_CASES:
                _ulysses_case(rank, world, case)
                _ulysses_step_case(rank, world, case)
        for case in VARLEN_CASES:
            _varlen_case(rank, world, case)
        with pytest.raises(RuntimeError, match="gradient through the returned LSE"):
            q, k, v = (torch.randn(1, 4, 2, 8, requires_grad=True) for _ in range(3))
            out, lse = fcp.ring_attention(q, k, v, step=ReferenceStep(), return_lse=True)
            (out.sum() + lse.sum()).backward()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_and_ulysses_match_whole_sequence_attention(world):
    with tempfile.TemporaryDirectory() as where:
        mp.spawn(_worker, args=(world, os.path.join(where, "init"), True), nprocs=world)


def _autograd_guard_worker(rank, world, init_file):
    """With groups of heads the backward reads the saved shards and output again: an in-place
    edit of them after the call must make backward raise (autograd's version check), not
    give silently wrong gradients; a double backward is refused (once_differentiable)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        step = ReferenceStep()
        calls = [
            lambda q, k, v: fcp.ulysses_attention(q, k, v, step=step, head_chunks=2),
            lambda q, k, v: fcp.ring_attention(q, k, v, step=step, head_chunks=2),
        ]
        for call in calls:
            q, k, v = (torch.randn(1, 4, 4, 8, requires_grad=True) for _ in range(3))
            out = call(q, k, v)
            with torch.no_grad():
                k.mul_(1.0)  # (same values, a new version)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
            out = call(q, k, v)
            with torch.no_grad():
                out.mul_(1.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.sum().backward()
            out = call(q, k, v)
            (dq,) = torch.autograd.grad((out * out).sum(), q, create_graph=True)
            with pytest.raises(RuntimeError, match="once_differentiable"):
                dq.sum().backward()
    finally:
        dist.destroy_process_group()


def test_in_place_edits_and_double_backward_raise():
    with tempfile.TemporaryDirectory() as where:
        mp.spawn(_autograd_guard_worker, args=(2, os.path.join(where, "init")), nprocs=2)


def test_automatic_head_chunks_count_waves_on_the_device(monkeypatch):
    """head_chunks=None: the most groups (dividing the rank's K/V heads, at most 8) that keep
    16 waves of 128-row tiles a group on the device's SMs (faked: 132, an H100/H200's)."""
    from types import SimpleNamespace

    from fadsl.distributed import _head_chunks, _tiles

    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(multi_processor_count=132),
    )
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    # the all-to-all on two ranks, 32 heads: 16 of them a rank over the whole sequence
    assert _head_chunks(None, on_gpu, 16, 16, _tiles(1, 131072)) == 4  # 4 x 1024 tiles >= 2112
    assert _head_chunks(None, on_gpu, 16, 16, _tiles(1, 32768)) == 1  # 8 x 256 < 2112
    assert _head_chunks(None, on_gpu, 16, 16, _tiles(1, 65536)) == 2
    # GQA 32/8: groups divide the 4 K/V heads of a rank; 1M tokens would allow 8, capped by 4
    assert _head_chunks(None, on_gpu, 4, 16, _tiles(1, 1 << 20)) == 4
    assert _head_chunks(None, on_gpu, 48, 48, _tiles(1, 1 << 20)) == 8  # at most 8
    assert _head_chunks(3, on_gpu, 48, 48, 1) == 3  # given: taken as it is
    off_gpu = SimpleNamespace(device=torch.device("cpu"))
    assert _head_chunks(None, off_gpu, 16, 16, _tiles(1, 1 << 20)) == 1


def test_merge_of_rows_that_saw_no_key_and_of_partials_with_nan_rows():
    out = torch.zeros(1, 3, 1, 2)
    lse = torch.full((1, 1, 3), float("-inf"))
    part = torch.tensor([[[[1.0, 2.0]], [[float("nan"), 0.0]], [[3.0, 4.0]]]])
    part_lse = torch.tensor([[[0.5, float("-inf"), float("-inf")]]])
    merge_into(out, lse, part, part_lse)
    # row 0 takes the partial; row 1 saw no key (its NaN output ignored); row 2 neither
    assert torch.equal(out[0, :, 0], torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]))
    assert lse[0, 0, 0] == 0.5 and torch.isinf(lse[0, 0, 1:]).all()
    # equal LSEs average; a partial 100 nats below weighs e^-100 (no overflow either way)
    merge_into(out, lse, torch.tensor([[[[3.0, 0.0]], [[5.0, 5.0]], [[1.0, 1.0]]]]),
               torch.tensor([[[0.5, 80.0, -1e4]]]))  # fmt: skip
    assert torch.allclose(out[0, 0, 0], torch.tensor([2.0, 1.0]))
    assert torch.equal(out[0, 1, 0], torch.tensor([5.0, 5.0])) and lse[0, 0, 1] == 80.0
    assert torch.equal(out[0, 2, 0], torch.tensor([1.0, 1.0])) and lse[0, 0, 2] == -1e4
    assert torch.isfinite(out).all()


def test_varlen_zigzag_shards_round_trip():
    cu = [0, 4, 16, 24]
    x = torch.arange(24).view(24, 1)
    shards = [fcp.shard_zigzag_varlen(x, cu, r, 2) for r in range(2)]
    assert shards[0][1].tolist() == [0, 2, 8, 12]
    assert shards[0][0].flatten().tolist()[:2] == [0, 3] and shards[1][0].flatten()[
        :2
    ].tolist() == [1, 2]
    assert torch.equal(fcp.unshard_zigzag_varlen([s for s, _ in shards], cu), x)
    with pytest.raises(ValueError, match="cu_seqlens: every sequence's length must be a multiple"):
        fcp.shard_zigzag_varlen(x, [0, 6, 24], 0, 2)


def test_zigzag_shards_round_trip_and_balance_causal_work():
    x = torch.arange(2 * 3 * 4).view(2, 12, 1, 1)
    shards = [fcp.shard_zigzag(x, r, 3) for r in range(3)]
    assert shards[0][0, :, 0, 0].tolist() == [0, 1, 10, 11]
    assert torch.equal(fcp.unshard_zigzag(shards), x)
    # the causal pairs (query, key) each rank's queries see: equal over ranks
    pos = torch.arange(12).view(1, 12, 1, 1)
    work = [int((fcp.shard_zigzag(pos, r, 3).flatten() + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="x: length 10 along dim 1 is not a multiple of 2 x 3"):
        fcp.shard_zigzag(torch.zeros(1, 10, 1, 1), 0, 3)
    with pytest.raises(ValueError, match="rank: 3 is not in 0 .. 2"):
        fcp.shard_zigzag(torch.zeros(1, 12, 1, 1), 3, 3)


def _checks_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        q = torch.randn(1, 4, 4, 8)
        step = ReferenceStep()
        bad = [
            (dict(q=q[0]), "q: expected a 4-D tensor"),
            (dict(v=torch.randn(1, 4, 4, 16)), "v: shape"),
            (dict(k=torch.randn(1, 4, 3, 8), v=torch.randn(1, 4, 3, 8)), "k: 3 heads"),
            (dict(k=torch.randn(1, 6, 4, 8), v=torch.randn(1, 6, 4, 8), causal=True), "equal length"),
            (dict(q=torch.randn(1, 3, 4, 8), k=torch.randn(1, 3, 4, 8), v=torch.randn(1, 3, 4, 8),
                  causal=True), "q: a zigzag shard holds two chunks"),
            (dict(layout="striped"), "layout: expected one of zigzag, contiguous"),
            (dict(softmax_scale=-1.0), "softmax_scale: expected a positive number"),
        ]  # fmt: skip
        for change, message in bad:
            args = dict(q=q, k=q.clone(), v=q.clone(), step=step) | change
            with pytest.raises(ValueError, match=message):
                fcp.ring_attention(**args)
        with pytest.raises(TypeError, match="causal: expected True or False, got 1"):
            fcp.ring_attention(q, q, q, causal=1, step=step)
        with pytest.raises(TypeError, match="return_lse: expected True or False"):
            fcp.ring_attention(q, q, q, return_lse="yes", step=step)
        with pytest.raises(ValueError, match="k, v: q, k and v need one dtype"):
            fcp.ring_attention(q, q.double(), q.double(), step=step)
        with pytest.raises(ValueError, match="q: on cpu; fadsl's kernels run on CUDA"):
            fcp.ring_attention(q, q, q)
        packed = torch.randn(8, 4, 8)
        cu = torch.tensor([0, 4, 8], dtype=torch.int32)
        bad_varlen = [
            (dict(q=q), "q: expected a 3-D tensor"),
            (dict(cu_seqlens=cu.long()), "cu_seqlens: expected a 1-D int32 tensor"),
            (dict(cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)), "must run from 0 to the 8"),
            (dict(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32)), "two equal chunks"),
            (dict(k=packed[:6], v=packed[:6]), "k: 6 tokens where q has 8"),
        ]
        for change, message in bad_varlen:
            args = dict(q=packed, k=packed, v=packed, cu_seqlens=cu, step=step) | change
            with pytest.raises(ValueError, match=message):
                fcp.ring_attention_varlen(**args)
        with pytest.raises(ValueError, match="k: 3 heads do not split over 2 ranks"):
            six = torch.randn(1, 4, 6, 8)
            fcp.ulysses_attention(six, torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8))
        with pytest.raises(ValueError, match="head_chunks: 3 does not divide the 2 K/V heads"):
            fcp.ulysses_attention(q, q, q, step=step, head_chunks=3)
        with pytest.raises(ValueError, match="head_chunks: 3 does not divide the 4 K/V heads"):
            fcp.ring_attention(q, q, q, step=step, head_chunks=3)
        for chunks in (0, 1.0, True):
            with pytest.raises(ValueError, match="head_chunks: expected a positive int"):
                fcp.ulysses_attention(q, q, q, step=step, head_chunks=chunks)
        with pytest.raises(ValueError, match="attend: a local attention of its own"):
            fcp.ulysses_attention(q, q, q, attend=lambda *a: a[0], head_chunks=2)
        with pytest.raises(ValueError, match="q: on cpu; fadsl's kernels run on CUDA"):
            fcp.ulysses_attention(q, q, q)
    finally:
        dist.destroy_process_group()


def test_bad_arguments_are_named():
    with tempfile.TemporaryDirectory() as where:
        mp.spawn(_checks_worker, args=(2, os.path.join(where, "init")), nprocs=2)


def _disagreeing_worker(rank, world, init_file):
    """Rank 1 alone passes bad arguments, or a call that differs from rank 0's: every rank
    must raise (a rank that went on would wait forever in the ring's first exchange; the
    group's 60 s timeout turns such a hang into a failure)."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        step = ReferenceStep()
        q = torch.randn(1, 4, 4, 8)
        bad_q = q[0] if rank == 1 else q
        with pytest.raises(ValueError) as err:
            fcp.ring_attention(bad_q, q, q, step=step)
        want = "q: expected a 4-D tensor" if rank == 1 else "rank 1: q: expected a 4-D tensor"
        assert want in str(err.value)
        with pytest.raises(TypeError, match="rank 1: causal: expected True or False|^causal"):
            fcp.ring_attention(q, q, q, causal=1 if rank == 1 else False, step=step)
        longer = torch.randn(1, 6, 4, 8) if rank == 1 else q
        with pytest.raises(ValueError, match=r"the ranks' calls differ .* ranks \[1\]"):
            fcp.ring_attention(q, longer, longer, step=step)
        with pytest.raises(ValueError, match="the ranks' calls differ"):
            fcp.ring_attention(q, q, q, softmax_scale=0.5 if rank else 0.25, step=step)
        packed = torch.randn(8, 4, 8)
        cu = torch.tensor([0, 4, 8] if rank == 0 else [0, 2, 8], dtype=torch.int32)
        with pytest.raises(ValueError, match="the ranks' calls differ"):
            fcp.ring_attention_varlen(packed, packed, packed, cu, step=step)
        with pytest.raises(ValueError, match="rank 1: k: 3 heads do not split|^k: 3 heads"):
            kv = torch.randn(1, 4, 3 if rank == 1 else 2, 8)
            fcp.ulysses_attention(torch.randn(1, 4, 6, 8), kv, kv, step=step)
        with pytest.raises(ValueError, match="the ranks' calls differ"):
            fcp.ring_attention(q, q, q, step=step, head_chunks=2 if rank else 1)
        with pytest.raises(ValueError, match="rank 1: attend: a local attention|^attend: a local"):
            attend = (lambda *a: a[0]) if rank == 1 else None
            fcp.ulysses_attention(q, q, q, step=step, attend=attend)
        # and the group still works: an agreed call runs on both ranks
        out = fcp.ring_attention(q, q.clone(), q.clone(), step=step)
        assert out.shape == q.shape and torch.isfinite(out).all()
    finally:
        dist.destroy_process_group()


def test_a_rank_with_bad_or_different_arguments_is_an_error_on_every_rank():
    with tempfile.TemporaryDirectory() as where:
        mp.spawn(_disagreeing_worker, args=(2, os.path.join(where, "init")), nprocs=2)


def test_without_a_process_group_the_error_says_how_to_start_one():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group, or run under torchrun"):
        fcp.ring_attention(q, q, q, step=ReferenceStep())
