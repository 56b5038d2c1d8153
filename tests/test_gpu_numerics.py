"""The numerics suite: every kernel of tests/gpu_specs.py's ``numerics_specs()`` (each sm_90a
example in every rescale mode, with and without the causal mask; split_kv tails, cluster
pairs, Q rings; every sm_80 example), both dtypes, GQA, on the inputs that break online
softmaxes:

- adversarial score sequences (tests/softmax_cases.py: jumps at and around every threshold,
  different in each row of a warp, in the first, a middle and the last block) set exactly:
  q_i = e_(i mod d) and k_j[i] = the score of row i at key j, so that S = Q K^T holds the
  sequence's bf16 values bit for bit; the kernel against the float64 softmax and against
  the float32 model of its softmax (tests/softmax_model.py);
- large logits (q and k scaled by 30), very negative scores, rows that see no key.

The model runs each warp's rows over whole tiles in the sm_90a layout: where a kernel splits
a tile (split_kv) or lays its rows out otherwise (sm_80), the comparison holds at
FlashAttention's tolerance, not bit for bit.

FlashAttention's rule throughout: max |out - ref| <= 2 max |ref16 - ref| + 1e-3, with ref in
float64 and ref16 PyTorch's own attention in the 16-bit dtype (softmax in fp32); the LSE
within 1e-3, relative to max(1, |LSE|); NaN-poisoned outputs. Run before every change to
generated code: `bash scripts/device.sh numerics` (minutes on an H100).
"""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

import fadsl
from fadsl.targets.sm90.host.launch import (
    PAIR_MIN_KV_BLOCKS,
    launch_cluster,
    grid_ctas,
    split_plan,
)
from gpu_specs import numerics_specs
from softmax_cases import random_case
from softmax_model import Mode, attend, problems, scale_log2
from test_gpu_general import reference

GPU = torch.cuda.is_available()
HOPPER = GPU and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")]

SPECS = numerics_specs()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [(name, dtype) for name in SPECS for dtype in DTYPES]
IDS = [f"{name}-{dtype}" for name, dtype in CASES]
_loaded: dict[str, object] = {}


def kernel(name: str):
    """The spec's kernel (the runtime builds one that `fadsl check` refuses for spilling, as
    guarded at head_dim 256: it must be right too), or a skip for sm_90a off Hopper."""
    if name not in _loaded:
        kern = fadsl.load(SPECS[name], verbose=False)
        if kern.config.ext is not None and not HOPPER:
            pytest.skip("an sm_90a kernel needs a Hopper GPU")
        _loaded[name] = kern
    return _loaded[name]


def run(kern, q, k, v, scale):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(
        (q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda", dtype=torch.float32
    )
    kern.forward_into(q, k, v, out, lse, scale)
    torch.cuda.synchronize()
    return out, lse


def mode_of(kern) -> Mode:
    return Mode.EVERY if kern.config.ext is None else Mode(kern.config.ext.rescale)


def assert_lse(lse, expected, what: str):
    """Within 1e-3 of max(1, |expected|); -inf exactly where expected."""
    empty = expected == -math.inf
    assert not lse.isnan().any(), "LSE never written (or NaN)"
    assert torch.equal(lse == -math.inf, empty), f"LSE -inf exactly where {what} has it"
    if (~empty).any():
        rel = (lse.double() - expected).abs() / expected.abs().clamp_min(1.0)
        worst = rel[~empty].max().item()
        assert worst <= 1e-3, f"LSE {worst:.2e} from {what} (relative)"


def assert_fa_rule(out, lse, q, k, v, scale, causal, model_out=None, model_lse=None):
    """FlashAttention's rule against float64 (and against the model where given)."""
    ref, ref_lse = reference(q, k, v, scale, causal, torch.float64)
    low, _ = reference(q, k, v, scale, causal, q.dtype)
    assert not out.isnan().any(), "outputs never written (or NaN)"
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, f"max error {err:.3e} > {bound:.3e} (FlashAttention's rule)"
    assert_lse(lse, ref_lse, "float64")
    if model_out is not None:
        err = (out.double() - model_out).abs().max().item()
        assert err <= bound, f"max distance to the model {err:.3e} > {bound:.3e}"
        assert_lse(lse, model_lse, "the model")


def exact_scores(kern, dtype, seed, n_blocks=None, sq=None, heads=(2, 4, 2)):
    """q, k, v whose scores are adversarial sequences, exactly; the scores (batch, heads_q,
    rows, keys) with the causal mask's -inf, keys padded to whole blocks (-inf) and rows to
    whole warps of 16 (0: the rows past seqlen_q that TMA fills with zeros, so that the
    model's warps decide as the kernel's do)."""
    d, block_n, block_m = kern.config.head_dim, kern.config.block_c, kern.config.block_r
    rng = random.Random(seed)
    batch, hq, hkv = heads
    n_blocks = n_blocks or rng.randint(2, 5)
    sk = n_blocks * block_n - (7 if seed % 2 else 0)  # a tail: the first block visited masked
    if sq is None:  # two tiles and a tail tile, or one
        sq = max(2 * block_m + 17 if seed % 3 else d, d)
    k = torch.zeros(batch, sk, hkv, d)
    for b in range(batch):
        for h in range(hkv):
            warps, _ = random_case(rng, block_n, n_blocks, warps=d // 16, masks=False)
            k[b, :, h] = warps.reshape(d, -1)[:, :sk].T
    rows = torch.arange(sq)
    q = torch.zeros(batch, sq, hq, d)
    q[:, rows, :, rows % d] = 1.0
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(batch, sk, hkv, d, generator=gen)
    q, k, v = (t.to(dtype).cuda() for t in (q, k, v))
    # S[b, h, i, j] = k[b, j, h // groups, i mod d]
    kh = k.float().repeat_interleave(hq // hkv, dim=2)  # (batch, sk, hq, d)
    rows_in_warps = torch.arange(sq + (-sq % 16), device="cuda")
    scores = torch.zeros(batch, hq, len(rows_in_warps), sk, device="cuda")
    scores[:, :, :sq] = kh[:, :, :, rows % d].permute(0, 2, 3, 1)  # (batch, hq, sq, sk)
    if kern.config.mask.value == "causal":
        j = torch.arange(sk, device="cuda")
        scores = scores.masked_fill(j[None, :] > rows_in_warps[:, None] + sk - sq, -math.inf)
    padded = torch.full((*scores.shape[:3], n_blocks * block_n), -math.inf, device="cuda")
    padded[..., :sk] = scores
    return q, k, v, padded


def check_against_the_model(kern, dtype, q, k, v, scores, scale):
    """Run the kernel on exact scores; its output against float64 and the model's."""
    out, lse = run(kern, q, k, v, scale)
    batch, hq, rows, keys = scores.shape
    sq = q.shape[1]
    warps = scores.reshape(-1, 16, keys)
    result = attend(warps, kern.config.block_c, scale_log2(scale), mode_of(kern), dtype)
    assert problems(result, warps, scale, dtype) == []
    weights = result.weights.reshape(batch, hq, rows, keys)[:, :, :sq, : k.shape[1]]
    vh = v.double().repeat_interleave(hq // k.shape[2], dim=2).transpose(1, 2)
    model_out = (weights.double() @ vh).transpose(1, 2)
    model_lse = result.lse.reshape(batch, hq, rows)[:, :, :sq].double()
    causal = kern.config.mask.value == "causal"
    assert_fa_rule(out, lse, q, k, v, scale, causal, model_out, model_lse)


def splits_of(kern, q, k) -> int:
    """The pieces the launch splits its last round's tiles into (1: whole tiles)."""
    hw = kern.config.ext
    if hw is None or not hw.split_kv:
        return 1
    tiles = q.shape[0] * q.shape[2] * -(-q.shape[1] // kern.config.block_r)
    blocks = -(-k.shape[1] // kern.config.block_c)
    return split_plan(tiles, grid_ctas(kern, q.device.index), blocks)[1]


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_adversarial_scores_match_float64_and_the_model(name, dtype):
    """The split_kv specs split these launches' tiles (asserted): pieces start guarded
    tiles of their own and combine."""
    kern = kernel(name)
    scale = math.log(2)  # the kernel's c is 1: scores in log2 units
    for seed in (1, 2):
        q, k, v, scores = exact_scores(kern, DTYPES[dtype], seed + 17 * len(name))
        if kern.config.ext is not None and kern.config.ext.split_kv:
            assert splits_of(kern, q, k) > 1, "meant to split the tiles"
        check_against_the_model(kern, DTYPES[dtype], q, k, v, scores, scale)


CLUSTERED = [(n, d) for n, d in CASES if re.search(r"^\s*cluster\s+2", SPECS[n], re.MULTILINE)]


@pytest.mark.parametrize("name, dtype", CLUSTERED, ids=[f"{n}-{d}" for n, d in CLUSTERED])
def test_cluster_pairs_on_adversarial_scores(name, dtype):
    """Long enough rows (PAIR_MIN_KV_BLOCKS blocks) and an even count of query blocks that
    the launch pairs its CTAs (asserted), each loading half of every K/V block."""
    kern = kernel(name)
    sq = 2 * kern.config.block_r
    q, k, v, scores = exact_scores(
        kern, DTYPES[dtype], 5, n_blocks=PAIR_MIN_KV_BLOCKS, sq=sq, heads=(1, 2, 1)
    )
    assert launch_cluster(kern.compiled.kernel, sq, k.shape[1]) == 2, "meant to pair CTAs"
    check_against_the_model(kern, DTYPES[dtype], q, k, v, scores, math.log(2))


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_large_logits(name, dtype):
    """q and k scaled by 30: scores of thousands (log2 units), jumps between blocks of
    hundreds; MQA."""
    kern = kernel(name)
    d = kern.config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(len(name))
    q = 30 * torch.randn(2, 300, 4, d, device="cuda", generator=gen)
    k = 30 * torch.randn(2, 1100, 1, d, device="cuda", generator=gen)
    v = torch.randn(2, 1100, 1, d, device="cuda", generator=gen)
    q, k, v = (t.to(DTYPES[dtype]) for t in (q, k, v))
    out, lse = run(kern, q, k, v, d**-0.5)
    assert_fa_rule(out, lse, q, k, v, d**-0.5, kern.config.mask.value == "causal")


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_very_negative_scores(name, dtype):
    """Every score near -3600 (natural log units): the softmax is shift-invariant, the
    kernel's references must be too. GQA 4:1."""
    kern = kernel(name)
    d = kern.config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(3 * len(name))
    axis = torch.zeros(d, device="cuda")
    axis[0] = 60.0
    q = torch.randn(1, 333, 8, d, device="cuda", generator=gen) + axis
    k = torch.randn(1, 777, 2, d, device="cuda", generator=gen) - axis
    v = torch.randn(1, 777, 2, d, device="cuda", generator=gen)
    q, k, v = (t.to(DTYPES[dtype]) for t in (q, k, v))
    out, lse = run(kern, q, k, v, 1.0)
    assert lse.max().item() < -3000, "the scores were meant to be very negative"
    assert_fa_rule(out, lse, q, k, v, 1.0, kern.config.mask.value == "causal")


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_rows_that_see_no_key(name, dtype):
    """Causal with seqlen_q > seqlen_k: the first rows see no key (0 out, LSE -inf); the
    kernels without a mask see every key of a one-key sequence."""
    kern = kernel(name)
    d = kern.config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(5 * len(name))
    sq, sk = (300, 100) if kern.config.mask.value == "causal" else (300, 1)
    q = torch.randn(2, sq, 4, d, device="cuda", generator=gen)
    k = torch.randn(2, sk, 2, d, device="cuda", generator=gen)
    v = torch.randn(2, sk, 2, d, device="cuda", generator=gen)
    q, k, v = (t.to(DTYPES[dtype]) for t in (q, k, v))
    out, lse = run(kern, q, k, v, d**-0.5)
    causal = kern.config.mask.value == "causal"
    assert_fa_rule(out, lse, q, k, v, d**-0.5, causal)
    if causal:
        empty = lse == -math.inf
        assert empty.any(), "some rows were meant to see no key"
        assert (out.float().transpose(1, 2)[empty] == 0).all()
