"""The sm_90a backward on the GPU: dQ, dK, dV (and a gradient through the LSE) against float32
autograd of the reference, with FlashAttention's rule: the error at most twice PyTorch's own
in the input dtype, plus a small epsilon. Odd shapes, seqlen_q != seqlen_k with the causal
mask (rows that see no key), GQA 8:1 and MQA, both dtypes, head_dim 64, 128 and 256 (the
consumers split head_dim: `-k 256` runs those, fadsl.attention's windows and softcaps at 256
too); outputs poisoned first; torch.compile(fullgraph=True) and a CUDA graph over forward
and backward."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from test_gpu_general import reference
from training_specs import EXAMPLES, training_spec

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

# The training examples (each with its backward block: B_c 128, 2 consumers, overlap on, dQ by
# red.add; head_dim 128 with B_r 80 (dQ transposed), head_dim 64 with B_r 128)
FORWARDS = ("fa3_hopper", "fa3_causal", "fa3_hdim64", "fa3_hdim64_causal")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv)
SHAPES = [
    (1, 1, 1, 1, 1),
    (2, 128, 128, 2, 2),
    (1, 300, 1100, 4, 1),
    (1, 1000, 333, 8, 1),
    (2, 257, 700, 8, 8),
    (1, 64, 1000, 16, 2),
]
# The examples ship `overlap on` (dQ staged under dV and dK); the plain consumer too
PLAIN = ("fa3_causal-overlap", "fa3_hopper-overlap", "fa3_hdim64-overlap")
# The orders, tiles and dQ paths the examples do not ship: head_dim 128's B_r 64 (dQ by head_dim
# panels) with dV issued early or with dK, dQ staged or added; B_r 80 with dQ staged (2 stages:
# 3 do not fit beside the staging); dV issued early (head_dim 64), head_dim 64's B_r 64 (dQ
# split by keys), dQ staged (head_dim 64)
VARIANTS = ("fa3_hopper+br64+early_dv", "fa3_causal+br64", "fa3_hopper+br64-dqred")
VARIANTS += ("fa3_causal+br64+early_dv-dqred", "fa3_causal+br64-overlap")
VARIANTS += ("fa3_hopper-dqred+s2", "fa3_causal-dqred")
VARIANTS += ("fa3_hdim64+br64+early_dv-dqred",)
VARIANTS += ("fa3_hdim64_causal+br64+early_dv", "fa3_hdim64+br64-dqred", "fa3_hdim64_causal+br64")
VARIANTS += ("fa3_hdim64+br64-overlap", "fa3_hdim64-dqred", "fa3_hdim64_causal-dqred")
# every head's n-block 0 launched first (the causal mask's CTA order; head_dim 64's B_r 128
# block spills 4 bytes with it, nvrtc 13.5)
VARIANTS += ("fa3_causal+longest_first",)
# `scheduler persistent` (a CTA per SM looping over the tiles, K and V of the next tile loaded
# under this one's epilogue): the four examples' blocks, and causal in longest_first order
VARIANTS += ("fa3_hopper+persistent", "fa3_causal+persistent", "fa3_hdim64+persistent")
VARIANTS += ("fa3_hdim64-persistent",)  # (the example ships persistent: its grid twin)
VARIANTS += ("fa3_hdim64_causal+persistent", "fa3_causal+persistent+longest_first")
# dV issued after the dS^T store, before the warpgroups meet (B_r 80, 64 and 128)
VARIANTS += ("fa3_hopper+dv_before_meeting", "fa3_causal+br64+dv_before_meeting")
VARIANTS += ("fa3_hdim64+dv_before_meeting",)
# `dq_writer on` (a writer warp per consumer reduce-adds its staged dQ): both consumer orders,
# every disjoint split (transposed at B_r 80, by panels at B_r 64, by queries at head_dim 64),
# in either mode; head_dim 64's deterministic writer with setmaxnreg 32/232 (+p32: at 24 the
# writer spills 8 bytes in visit order, NVRTC 13.5, 2026-11-30)
WRITERS = ("fa3_hopper+dq_writer-dqred+s2", "fa3_causal+dq_writer-dqred")
WRITERS += ("fa3_causal-overlap+dq_writer-dqred", "fa3_hopper+br64+dq_writer-dqred")
WRITERS += ("fa3_hdim64+dq_writer-dqred", "fa3_hdim64_causal+dq_writer-dqred")
WRITERS += (
    "fa3_causal+deterministic+dq_writer-dqred",
    "fa3_hopper+br64+deterministic+dq_writer-dqred",
    "fa3_hopper+deterministic+dq_writer-dqred+s2",
    "fa3_hdim64+deterministic+dq_writer-dqred+p32",
)
WRITERS += ("fa3_hdim64_causal+deterministic+dq_writer-dqred",)
VARIANTS += WRITERS
# the writer warps beside `dq_lag on` (dQ(i - 1) staged in m-block i, no meeting): every
# disjoint split, in either mode, dK and dV by TMA where the example has them (head_dim 64
# without a mask: from registers), dq_first with head_dim 64's examples
LAGGED_WRITERS = ("fa3_causal+dq_writer-dqred+dq_lag", "fa3_hdim64+dq_writer-dqred+dq_lag")
LAGGED_WRITERS += (
    "fa3_causal+deterministic+dq_writer-dqred+dq_lag",
    "fa3_hopper+deterministic+dq_writer-dqred+s2+dq_lag",
    "fa3_hdim64+deterministic+dq_writer-dqred+dq_lag",
    "fa3_hdim64_causal+deterministic+dq_writer-dqred+dq_lag",
)
VARIANTS += LAGGED_WRITERS
# `dq_chains N` (the deterministic writer's tickets in N chains, summed by the conversion):
# each split the writer takes (by queries, transposed, by panels), both masks, beside the lag;
# 3 chains with setmaxnreg 32/232 (at 24 the writer spills 12 bytes, NVRTC 13.5, 2026-12-06)
CHAINS = ("fa3_hdim64+deterministic+dq_writer-dqred+p32+chains2",)
CHAINS += ("fa3_hdim64+deterministic+dq_writer-dqred+p32+chains3",)
CHAINS += ("fa3_hdim64+deterministic+dq_writer-dqred+p32+chains4",)
CHAINS += ("fa3_hdim64_causal+deterministic+dq_writer-dqred+chains2",)
CHAINS += ("fa3_hopper+deterministic+dq_writer-dqred+s2+chains2",)
CHAINS += ("fa3_hopper+br64+deterministic+dq_writer-dqred+chains2",)
CHAINS += ("fa3_causal+deterministic+dq_writer-dqred+chains2",)
CHAINS += ("fa3_hdim64+deterministic+dq_writer-dqred+dq_lag+chains2",)
CHAINS += ("fa3_causal+deterministic+dq_writer-dqred+dq_lag+chains2",)
VARIANTS += CHAINS
# dS^T stored by stmatrix (four 8 x 8 blocks an instruction, the bytes st.shared stores; the
# head_dim 64 examples' path since 2026-11-30, so their st.shared twins are the variants): dQ
# by queries (head_dim 64's B_r 128, both masks), by head_dim panels (B_r 64, dQ added or
# staged) and by keys (head_dim 64 at B_r 64, staged), and beside the writer warps' ordered adds
DS_STMATRIX = ("fa3_hdim64-ds_stmatrix", "fa3_hdim64_causal-ds_stmatrix")
DS_STMATRIX += ("fa3_hopper+br64+ds_stmatrix", "fa3_causal+br64+ds_stmatrix-dqred")
DS_STMATRIX += ("fa3_hdim64+br64+ds_stmatrix-dqred",)
DS_STMATRIX += ("fa3_hdim64_causal+ds_stmatrix+deterministic+dq_writer-dqred",)
VARIANTS += DS_STMATRIX
# `dq_lag on` (dQ one m-block behind, dS^T handed over by mbarriers, no meeting) is the four
# examples' order since 2026-11-30, so the variants above built on them run it too where they
# admit it (dQ transposed at B_r 80, by head_dim panels at B_r 64 with dS by st.shared and by
# stmatrix, by queries at head_dim 64's B_r 128, persistent and not); the meeting's order is
# the twin here
MEETING = (
    "fa3_hopper-dq_lag",
    "fa3_causal-dq_lag",
    "fa3_hdim64-dq_lag",
    "fa3_hdim64_causal-dq_lag",
)
VARIANTS += MEETING
# `dq_first on` (the lagged dQ issued before dV) is the head_dim 64 examples' since
# 2026-12-01: their twins keep the lag after dV; and dQ by head_dim panels (B_r 64 at head_dim
# 128, dS by stmatrix and by st.shared) issued first
DQ_FIRST = ("fa3_hdim64-dq_first", "fa3_hdim64_causal-dq_first")
DQ_FIRST += ("fa3_hopper+br64+ds_stmatrix+dq_first", "fa3_causal+br64+dq_first")
VARIANTS += DQ_FIRST
# `fused_convert on` (dQ converted by the CTA that completes each m-block, no convert_dq): the
# examples' blocks with it (fa3_hdim64's persistent CTAs and its grid twin), dQ by panels,
# persistent causal, and the un-lagged order; SHAPES' causal 1000 x 333 has m-blocks no n-block visits (host-zeroed)
FUSED = ("fa3_hopper+fused_convert", "fa3_causal+fused_convert", "fa3_hdim64_causal+fused_convert")
FUSED += ("fa3_hdim64+fused_convert", "fa3_hdim64-persistent+fused_convert")
FUSED += ("fa3_causal+br64+fused_convert", "fa3_causal+persistent+fused_convert")
FUSED += ("fa3_hopper-dq_lag+fused_convert", "fa3_causal+longest_first+fused_convert")
FUSED += ("fa3_hdim64+br64+fused_convert",)  # (dQ split by keys: both warpgroups add into all)
VARIANTS += FUSED
# dK and dV by TMA through the dead K and V tiles (the lagged examples' since 2026-12-02, so
# the variants above built on them run it where they admit it): their st.global twins, and
# head_dim 64 without a mask (dQ by queries) on the grid
DKV_TMA = ("fa3_hopper-dkv_tma", "fa3_causal-dkv_tma", "fa3_hdim64_causal-dkv_tma")
DKV_TMA += ("fa3_hdim64-persistent+dkv_tma",)
VARIANTS += DKV_TMA
# `prefetch_kv on`: a later CTA's K and V fetched into the L2 (a hint: the same gradients)
VARIANTS += ("fa3_causal+prefetch_kv", "fa3_hopper+prefetch_kv", "fa3_hdim64_causal+prefetch_kv")
# `dv_out_first on`: dV's TMA store before the last m-block's dQ (the examples with dK, dV by TMA)
VARIANTS += ("fa3_causal+dv_out_first", "fa3_hopper+dv_out_first", "fa3_hdim64_causal+dv_out_first")
# `peel_dead on` (a warpgroup whose keys the first m-block masks entirely skips its products
# there): fa3_causal's since 2026-12-04 (the diagonal's second warpgroup), its twin without;
# with dS by st.shared, the writer warps' staged dQ, and where only the keys' end makes a
# warpgroup dead (SHAPES' 1 x 1 and 700 keys): without a mask at B_r 64, head_dim 64's B_r 128
PEEL_DEAD = ("fa3_causal-peel_dead", "fa3_causal-ds_stmatrix", "fa3_causal+dq_writer-dqred+dq_lag")
PEEL_DEAD += ("fa3_hopper+br64+ds_stmatrix+peel_dead", "fa3_hdim64_causal+peel_dead")
VARIANTS += PEEL_DEAD
# `late_v on` (V loaded after the first m-block's slot, on its own barrier): fa3_causal's since
# 2026-12-05, its twin without, without the peel, and the lagged examples that do not ship it
LATE_V = ("fa3_causal-late_v", "fa3_causal-peel_dead", "fa3_hopper+late_v")
LATE_V += ("fa3_hdim64_causal+late_v", "fa3_hdim64-persistent+late_v")
VARIANTS += LATE_V
CASES = [(n, d, s) for n in FORWARDS + PLAIN + VARIANTS for d in DTYPES for s in SHAPES]
# head_dim 256 (sm90_bwd_split.cuh: B_r 64, each consumer S and dP of B_c / 2 keys, dK^T, dV^T
# and dQ^T of its half of head_dim): the examples' B_c 80 and the B_c 64 fallback; seqlens off
# both 64 and 80, seqlen_q != seqlen_k both ways (causal: rows that see no key), GQA 8:1, MQA
FORWARDS_256 = ("fa3_hdim256", "fa3_hdim256_causal", "fa3_hdim256+bc64", "fa3_hdim256_causal+bc64")
SHAPES_256 = [
    (1, 1, 1, 1, 1),
    (2, 80, 80, 2, 2),
    (1, 63, 81, 2, 1),
    (1, 161, 479, 4, 1),
    (1, 1000, 333, 8, 1),
    (2, 257, 700, 8, 8),
    (1, 64, 1000, 16, 2),
]
CASES += [(n, d, s) for n in FORWARDS_256 for d in DTYPES for s in SHAPES_256]
FUSED_256 = ("fa3_hdim256+fused_convert", "fa3_hdim256_causal+fused_convert")  # (dQ^T's units)
FUSED_256 += ("fa3_hdim256_causal+bc64+fused_convert",)
CASES += [(n, d, s) for n in FUSED_256 for d in DTYPES for s in SHAPES_256]
_loaded: dict[str, object] = {}


def kernel(name):
    if name not in _loaded:
        _loaded[name] = fadsl.load(training_spec(name), verbose=False)
    return _loaded[name]


def poison_allocator(nbytes: int) -> None:
    """Fill the caching allocator's free blocks with NaN, so that a gradient the kernels do
    not write shows up."""
    junk = torch.full((nbytes // 4 + 1024,), float("nan"), device="cuda")
    del junk


def inputs(shape, dtype, head_dim, seed):
    b, sq, sk, hq, hkv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, head_dim, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, sk, hkv, head_dim, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, sk, hkv, head_dim, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(b, sq, hq, head_dim, device="cuda", dtype=dtype, generator=g)
    return q, k, v, dout


def reference_grads(q, k, v, dout, scale, causal, dtype, dlse=None):
    """Gradients of reference attention computed in ``dtype`` (float32: the truth)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = reference(*leaves, scale, causal, dtype)
    loss = (out.to(torch.float32) * dout.to(torch.float32)).sum()
    if dlse is not None:
        loss = loss + (torch.where(lse.isinf(), 0.0, lse) * dlse).sum()
    loss.backward()
    return [t.grad.to(torch.float32) for t in leaves]


def check_rule(ours, truth, torch_own, what):
    err = (ours.float() - truth).abs().max().item()
    own = (torch_own - truth).abs().max().item()
    assert math.isfinite(err), f"{what}: non-finite gradient"
    assert err <= 2 * own + 1e-4, f"{what}: error {err:.3g} > 2 x PyTorch's {own:.3g} + 1e-4"


@pytest.mark.parametrize(
    "name, dtype, shape", CASES, ids=[f"{c[0]}-{c[1]}-{'x'.join(map(str, c[2]))}" for c in CASES]
)
def test_gradients_match_float32_autograd(name, dtype, shape):
    kern = kernel(name)
    d = kern.config.head_dim
    causal = kern.config.mask.value == "causal"
    torch_dtype = DTYPES[dtype]
    q, k, v, dout = inputs(shape, torch_dtype, d, seed=sum(shape) * 31 + d)
    scale = 1.0 / math.sqrt(d)
    poison_allocator(4 * q.numel() * 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kern(*leaves)
    out.backward(dout)
    truth = reference_grads(q, k, v, dout, scale, causal, torch.float32)
    own = reference_grads(q, k, v, dout, scale, causal, torch_dtype)
    for ours, t, o, what in zip((l.grad for l in leaves), truth, own, ("dq", "dk", "dv")):
        assert ours.dtype == torch_dtype and ours.shape == t.shape
        check_rule(ours, t, o, what)


# `fused_convert on` with many CTAs adding into each m-block at once (GQA 2:1, odd lengths), at
# the host's threshold (the main kernel converts) and one query past it (convert_dq does)
# (causal: 2 x 4096 queries over 1000 keys leaves 38 m-blocks of B_r 80 a head to the host)
FUSED_SHAPES = [(2, 2049, 1999, 16, 8), (1, 4096, 4096, 40, 40), (1, 4097, 3000, 8, 4)]
FUSED_SHAPES += [(2, 4096, 1000, 16, 8)]
FUSED_UNDER_LOAD = [
    "fa3_hopper+fused_convert",
    "fa3_hdim64+fused_convert",
    "fa3_causal+fused_convert",
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", FUSED_SHAPES, ids=str)
@pytest.mark.parametrize("name", FUSED_UNDER_LOAD)
def test_fused_convert_under_load_and_past_its_threshold(name, dtype, shape):
    test_gradients_match_float32_autograd(name, dtype, shape)


@pytest.mark.parametrize("name", FUSED_UNDER_LOAD)
def test_fused_convert_is_right_run_after_run(name):
    """A race between the counts and the conversion would show in some runs only: twenty
    backward calls on the same inputs, each dQ within a few ulp of the first (the adds' order
    varies) and within FlashAttention's rule."""
    kern = kernel(name)
    d = kern.config.head_dim
    causal = kern.config.mask.value == "causal"
    q, k, v, dout = inputs((2, 1500, 1500, 16, 8), torch.bfloat16, d, seed=23)
    truth = reference_grads(q, k, v, dout, d**-0.5, causal, torch.float32)[0]
    own = reference_grads(q, k, v, dout, d**-0.5, causal, torch.bfloat16)[0]
    first = None
    for _ in range(20):
        poison_allocator(4 * q.numel() * 8)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kern(*leaves).backward(dout)
        dq = leaves[0].grad
        check_rule(dq, truth, own, "dq")
        first = dq if first is None else first
        assert torch.allclose(
            dq.float(), first.float(), rtol=2e-2, atol=1e-3 * first.abs().max().item()
        )


# score and mask variants beside `fused_convert on` (validate admits a score, not a keep;
# a window moves the first n-block off 0 and leaves leading rows to the host)
FUSED_TEXTS = {
    "alibi+fused": ("modifiers/alibi_causal", ()),
    "window+fused": ("fa3_causal", (("mask       causal", "mask       causal, window(200)"),)),
    "window_d64+fused": (
        "fa3_hdim64",
        (
            ("mask       none", "mask       window(130, 70)"),
            ("tail       split_kv", "tail       whole"),
        ),
    ),
}


def fused_text(name: str, fused: bool) -> str:
    """A FUSED_TEXTS spec, with `fused_convert on` in its backward block or as it is."""
    example, edits = FUSED_TEXTS[name]
    text = (EXAMPLES / f"{example}.fa").read_text()
    for old, new in edits:
        assert old in text, (name, old)
        text = text.replace(old, new, 1)
    return text.replace("backward {", "backward {\n    fused_convert on", 1) if fused else text


def fused_kernel(name):
    if name not in _loaded:
        _loaded[name] = fadsl.load(fused_text(name, True), verbose=False)
    return _loaded[name]


# `scheduler persistent` with more tiles than SMs, so that each CTA runs several tiles (the
# ring's running index, K and V's phases over tiles), odd lengths, GQA 2:1, both dtypes
PERSISTENT_SHAPES = [(2, 2049, 1999, 16, 8), (1, 4096, 4096, 40, 40), (3, 1000, 1300, 24, 12)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", PERSISTENT_SHAPES, ids=str)
@pytest.mark.parametrize("name", [v for v in VARIANTS if "+persistent" in v])
def test_persistent_ctas_loop_over_many_tiles(name, dtype, shape):
    test_gradients_match_float32_autograd(name, dtype, shape)


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_causal", "fa3_hdim256", "fa3_hdim256_causal"])
def test_gradient_through_the_lse(name):
    """A loss on the LSE too: dS gains P dLSE (the preprocess folds it into D)."""
    kern = kernel(name)
    causal = kern.config.mask.value == "causal"
    d = kern.config.head_dim
    q, k, v, dout = inputs((1, 200, 300, 4, 2), torch.bfloat16, d, seed=7)
    dlse = torch.randn(1, 4, 200, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = kern(*leaves, return_lse=True)
    loss = (out.float() * dout.float()).sum() + (torch.where(lse.isinf(), 0.0, lse) * dlse).sum()
    loss.backward()
    scale = 1.0 / math.sqrt(d)
    truth = reference_grads(q, k, v, dout, scale, causal, torch.float32, dlse)
    own = reference_grads(q, k, v, dout, scale, causal, torch.bfloat16, dlse)
    for ours, t, o, what in zip((l.grad for l in leaves), truth, own, ("dq", "dk", "dv")):
        check_rule(ours, t, o, what)


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_hdim256"])
def test_large_logits_stay_finite(name):
    """Scores of a few hundred: P = exp2(S c - LSE) stays in [0, 1]."""
    kern = kernel(name)
    d = kern.config.head_dim
    q, k, v, dout = inputs((1, 129, 257, 2, 2), torch.bfloat16, d, seed=3)
    q = q * 8
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern(*leaves).backward(dout)
    truth = reference_grads(q, k, v, dout, 1 / math.sqrt(d), False, torch.float32)
    own = reference_grads(q, k, v, dout, 1 / math.sqrt(d), False, torch.bfloat16)
    for ours, t, o, what in zip((l.grad for l in leaves), truth, own, ("dq", "dk", "dv")):
        check_rule(ours, t, o, what)


def test_forward_only_spec_still_refuses_gradients():
    plain = fadsl.load(EXAMPLES.parent / "tests/specs/sm90/fa3_q_ring.fa", verbose=False)
    q, k, v, dout = inputs((1, 64, 64, 2, 2), torch.bfloat16, 64, seed=1)
    out = plain(q.requires_grad_(), k, v)
    with pytest.raises(RuntimeError, match="no backward block"):
        out.backward(dout)


def test_compile_fullgraph_forward_and_backward():
    kern = kernel("fa3_causal")
    q, k, v, dout = inputs((2, 300, 300, 4, 4), torch.bfloat16, 128, seed=11)

    def step(q, k, v):
        return (kern(q, k, v).float() * dout.float()).sum()

    assert_compiled_gradients_match_eager(step, q, k, v)


def assert_compiled_gradients_match_eager(step, *inputs) -> None:
    """``step``'s gradients under torch.compile(fullgraph=True) equal the eager ones, bit for
    bit (the same kernels run)."""
    compiled = torch.compile(step, fullgraph=True)
    eager = [t.clone().requires_grad_() for t in inputs]
    step(*eager).backward()
    traced = [t.clone().requires_grad_() for t in inputs]
    compiled(*traced).backward()
    for a, b in zip(eager, traced):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_causal+fused_convert"])
def test_cuda_graph_captures_forward_and_backward(name):
    """Captured once, replayed on new inputs; `fused_convert on`: replayed twice, so that its
    counters must be zeroed again inside the graph (by the preprocess)."""
    kern = kernel(name)
    q, k, v, dout = inputs((1, 512, 512, 4, 4), torch.bfloat16, 128, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: build, load, allocate outside the capture
        kern(*leaves).backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(*leaves).backward(dout)
    graphed = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    with torch.no_grad():
        for t, scale in zip(leaves, (0.5, 2.0, 1.5)):
            t.mul_(scale)
    graph.replay()
    if "fused_convert" in name:  # (NaN first: a count not zeroed again would convert nothing)
        first = [g.clone() for g in graphed]
        for g in graphed:
            g.fill_(float("nan"))
        graph.replay()
        for a, b in zip(graphed, first):
            assert torch.allclose(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    fresh = [t.detach().clone().requires_grad_() for t in leaves]
    kern(*fresh).backward(dout)
    for a, b in zip(graphed, fresh):
        assert torch.allclose(a.float(), b.grad.float(), atol=1e-2, rtol=1e-2)


DETERMINISTIC = (
    (
        "fa3_hopper+deterministic-dqred+s2",
        "fa3_causal+deterministic-dqred",
        "fa3_hopper+br64+deterministic-dqred",
        "fa3_hdim64+deterministic-dqred",
        "fa3_hdim64+br64+deterministic-dqred",
        "fa3_causal+br64+deterministic+early_dv-dqred",
        "fa3_causal+longest_first+deterministic-dqred",
        # `dq_writer on`: the writer warps' ordered adds (both visit orders, by the shapes below)
        "fa3_hopper+deterministic+dq_writer-dqred+s2",
        "fa3_causal+deterministic+dq_writer-dqred",
        "fa3_hopper+br64+deterministic+dq_writer-dqred",
        "fa3_hdim64+deterministic+dq_writer-dqred+p32",
        "fa3_hdim64_causal+deterministic+dq_writer-dqred",
    )
    + tuple(name for name in LAGGED_WRITERS if "deterministic" in name)  # and beside `dq_lag on`
    + CHAINS
)  # (each chain in ticket order, the chains summed in chain order)


# (batch, seqlen_q, seqlen_k, heads, heads_kv): 8 n-blocks a (batch, head), all on the GPU at
# once, so an m-block's adds follow the order the n-blocks reach it (bwd_dq_place's visit
# order); 133 n-blocks, more than an H100's or H200's SMs, so without a mask they follow the
# n-block order (causal: the visit order at any length, its n-blocks launched last first)
DETERMINISTIC_SHAPES = [(2, 700, 900, 8, 2), (1, 300, 133 * 128, 2, 1)]


def stable_and_right(name: str, shape: tuple, runs: int, seed: int) -> None:
    """``runs`` backwards of spec ``name`` on the same tensors give bitwise-identical dQ, dK
    and dV, within FlashAttention's rule of the float32 reference."""
    kern = kernel(name)
    causal = kern.config.mask.value == "causal"
    stable_and_right_call(kern, kern.config.head_dim, causal, shape, runs, seed)


def stable_and_right_call(call, d: int, causal: bool, shape: tuple, runs: int, seed: int):
    """stable_and_right of ``call(q, k, v)`` (head_dim ``d``, the mask ``causal``)."""
    q, k, v, dout = inputs(shape, torch.bfloat16, d, seed=seed)
    grads = []
    for _ in range(runs):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        call(*leaves).backward(dout)
        grads.append([t.grad for t in leaves])
    for later in grads[1:]:
        for a, b in zip(grads[0], later):
            assert torch.equal(a, b)
    scale = 1.0 / math.sqrt(d)
    truth = reference_grads(q, k, v, dout, scale, causal, torch.float32)
    own = reference_grads(q, k, v, dout, scale, causal, torch.bfloat16)
    for ours, t, o, what in zip(grads[0], truth, own, ("dq", "dk", "dv")):
        check_rule(ours, t, o, what)


@pytest.mark.parametrize("shape", DETERMINISTIC_SHAPES, ids=["visit_order", "n_block_order"])
@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_gradients_are_bitwise_stable(name, shape):
    """`deterministic on`: 10 runs give bitwise-identical dQ, dK, dV (GQA, several n-blocks
    per m-block, so that dQ's reduce-adds race), and they are right."""
    stable_and_right(name, shape, runs=10, seed=13)


@pytest.mark.parametrize("name", [n for n in DETERMINISTIC if "causal" in n])
def test_deterministic_causal_adds_past_the_gpus_ctas_are_bitwise_stable(name):
    """Causal, 133 n-blocks a (batch, head) (more than the GPU runs at once) over 27 or more
    m-blocks, each m-block's adds in visit order (up to 133 tickets, the n-blocks launched last
    first): 5 runs bitwise equal, and right."""
    stable_and_right(name, (1, 2100, 133 * 128, 2, 1), runs=5, seed=29)


def test_the_op_called_without_its_lse_refuses_a_backward():
    """torch.ops.fadsl.<op>(..., return_lse=False) on tensors that require grad saves no LSE:
    its backward says so rather than reading an empty tensor."""
    kern = kernel("fa3_hopper")
    functional, _ = kern._ops
    q, k, v, dout = inputs((1, 64, 64, 2, 2), torch.bfloat16, 128, seed=2)
    out, _ = functional(q.requires_grad_(), k, v, 1.0 / math.sqrt(128), False)
    with pytest.raises(RuntimeError, match="needs the forward's LSE"):
        out.backward(dout)


# fadsl.attention at head_dim 256 trains: the shipped fa3_hdim256 / fa3_hdim256_causal and
# their window and softcap variants run the split backward (the example's block as it is).
# (causal, window_size, softcap) as FlashAttention takes them
ATTENTION_256 = [
    (False, (-1, -1), 0.0),
    (True, (-1, -1), 0.0),
    (False, (128, 64), 0.0),
    (True, (256, 0), 0.0),
    (False, (-1, -1), 30.0),
    (True, (-1, -1), 50.0),
    (False, (128, 64), 50.0),
]
ATTENTION_256_CASES = [
    (c, d, s)
    for c in ATTENTION_256
    for d in DTYPES
    for s in ((1, 300, 1100, 4, 1), (1, 1000, 333, 8, 2))
]


@pytest.mark.parametrize(
    "call, dtype, shape",
    ATTENTION_256_CASES,
    ids=[
        f"attention256-{'causal' if c[0] else 'none'}-w{c[1][0]}_{c[1][1]}-cap{int(c[2])}-{d}-"
        + "x".join(map(str, s))
        for c, d, s in ATTENTION_256_CASES
    ],
)
def test_attention_at_head_dim_256_trains(call, dtype, shape):
    causal, window_size, softcap = call
    torch_dtype = DTYPES[dtype]
    q, k, v, dout = inputs(shape, torch_dtype, 256, seed=sum(shape) * 13 + int(softcap))
    if softcap:
        q = q * 8  # logits far past the cap: tanh saturates, its derivative near 0
    poison_allocator(4 * q.numel() * 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fadsl.attention(*leaves, causal=causal, window_size=window_size, softcap=softcap)
    out.backward(dout)
    left, right = window_size
    window = None
    if left >= 0 or (right >= 0 and not causal):
        big = shape[1] + shape[2]  # an unbounded side
        window = (left if left >= 0 else big, 0 if causal else right if right >= 0 else big)
    scale = 1.0 / math.sqrt(256)

    def grads(dtype):
        refs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        ref, _ = reference(*refs, scale, causal, dtype, softcap=softcap or None, window=window)
        (ref.to(torch.float32) * dout.to(torch.float32)).sum().backward()
        return [t.grad.to(torch.float32) for t in refs]

    truth, own = grads(torch.float32), grads(torch_dtype)
    for ours, t, o, what in zip((l.grad for l in leaves), truth, own, ("dq", "dk", "dv")):
        assert ours.dtype == torch_dtype and ours.shape == t.shape
        check_rule(ours, t, o, f"attention {call} {what}")


def unfused_kernel(name):
    key = f"{name}-unfused"
    if key not in _loaded:
        _loaded[key] = fadsl.load(fused_text(name, False), verbose=False)
    return _loaded[key]


@pytest.mark.parametrize("shape", [(2, 700, 900, 8, 2), (1, 1000, 333, 4, 4), (1, 333, 1000, 4, 2)])
@pytest.mark.parametrize("name", list(FUSED_TEXTS))
def test_fused_convert_matches_its_unfused_twin(name, shape):
    """The same spec with and without `fused_convert on` on the same tensors: dK and dV as
    close as two runs of red.add get, dQ within a few ulp (the order of its fp32 adds)."""
    fused, plain = fused_kernel(name), unfused_kernel(name)
    d = fused.config.head_dim
    q, k, v, dout = inputs(shape, torch.bfloat16, d, seed=sum(shape))
    extra = {}
    if name.startswith("alibi"):
        extra["slopes"] = torch.rand(shape[3], device="cuda") * 0.1
    grads = []
    for kern in (fused, plain):
        poison_allocator(4 * q.numel() * 8)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kern(*leaves, **extra).backward(dout)
        grads.append([t.grad.float() for t in leaves])
    for a, b, what in zip(*grads, ("dq", "dk", "dv")):
        assert a.isfinite().all(), f"{what}: not finite"
        scale = b.abs().max().item() + 1e-6
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-3 * scale), f"{what} differs"


@pytest.mark.parametrize("shape", DETERMINISTIC_SHAPES, ids=["visit_order", "n_block_order"])
@pytest.mark.parametrize("head_dim, causal", [(64, False), (64, True), (128, False), (128, True)])
def test_public_deterministic_gradients(head_dim, causal, shape):
    """fadsl.attention(..., deterministic=True): the shipped spec's deterministic twin
    (fadsl/targets/sm90/variants.py), eagerly and through torch.compile(fullgraph=True)."""

    def call(q, k, v):
        return fadsl.attention(q, k, v, causal=causal, deterministic=True)

    stable_and_right_call(call, head_dim, causal, shape, runs=10, seed=11)
    q, k, v, dout = inputs(shape, torch.bfloat16, head_dim, seed=12)
    eager, compiled = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
    call(*eager).backward(dout)
    torch.compile(call, fullgraph=True)(*compiled).backward(dout)
    for a, b in zip(eager, compiled):
        assert torch.equal(a.grad, b.grad)  # the same kernels: bitwise
