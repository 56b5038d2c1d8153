"""The FP8 forward on the GPU (issue 42, research/fp8-forward.md §6 tests 7, 8 and 10):
fadsl.attention and the loaded 8-bit examples against float64 attention of the dequantized
inputs (q8 * q_descale, ...), outputs poisoned (NaN) before every call; both 8-bit dtypes,
causal or not, GQA, ragged lengths, descales None, per tensor (an expanded scalar), per
(batch, head) and strided; the thresholds of §3.5 and §4 (c' = softmax_scale log2(e)
q_descale k_descale a positive normal float32 or NaN rows of that (batch, head) only; the
lazy slack 0.8 on rows whose max rises by just under it each block); outliers with and
without fadsl.fp8's rotation; torch.compile.

Error bound (§4): P is rounded to e4m3 (relative 2^-4 for P >= 2^-6), so |O - O_ref| <=
2^-4 max|v| in the worst (correlated) case, plus O's own rounding (bf16: 2^-8 relative);
the RMSE, over random inputs, stays below 2^-4 / sqrt(3) rms(v). The LSE uses fp32 P:
within 1e-3 relative."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from conftest import ROOT
from fadsl.fp8 import quantize, rotate
from fadsl.runtime import dispatch
from fadsl.targets import get
from test_gpu_backward import poison_allocator
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = {"e4m3": E4M3, "e5m2": E5M2}
LOG2E = math.log2(math.e)
# (batch, seqlen_q, seqlen_k, heads_q, heads_kv): a single key, ragged tails, GQA 16/4, MQA
SHAPES = [
    (1, 1, 1, 2, 2),
    (2, 127, 300, 4, 4),
    (1, 128, 128, 16, 4),
    (2, 1000, 1000, 4, 1),
    (1, 333, 4096, 2, 2),
    (1, 4096, 4096, 4, 4),
]


def _ids(shape) -> str:
    return "x".join(map(str, shape))


def fp8_inputs(shape, dtype, seed: int, scale: float = 1.0, d: int = 128):
    """Random q, k, v of head_dim d quantized per (batch, K/V head) by fadsl.fp8.quantize:
    (q8, k8, v8, (q_descale, k_descale, v_descale))."""
    b, sq, sk, hq, hkv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", generator=g) * scale
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g) * scale
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g)
    q8, qd = quantize(q, dtype, scale_heads=hkv)
    k8, kd = quantize(k, dtype)
    v8, vd = quantize(v, dtype)
    return q8, k8, v8, (qd, kd, vd)


def encoded_inputs(shape, dtype, descales, seed: int):
    """q, k, v of N(0, 1) stored as t / descale in the 8-bit type, so that t8 * descale is
    the N(0, 1) tensor to within the type's rounding whatever the descales: the logits stay
    those of unit-variance inputs. (fp8_inputs' tensors read with descales other than their
    own give logits of order 10^4: rows whose top two keys differ by less than FP8 wgmma's
    accumulation error (it keeps about 14 bits, DeepSeek-V3's report, 2024) then pick
    another key, a property of the hardware, not of a descale's reading.)"""
    b, sq, sk, hq, hkv = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    tensors = (
        torch.randn(b, sq, hq, 128, device="cuda", generator=g),
        torch.randn(b, sk, hkv, 128, device="cuda", generator=g),
        torch.randn(b, sk, hkv, 128, device="cuda", generator=g),
    )
    encoded = []
    for t, descale in zip(tensors, descales):
        if descale is not None:
            group = t.shape[2] // hkv
            t = t / descale.repeat_interleave(group, dim=1)[:, None, :, None]
        encoded.append(t.to(dtype))
    return tuple(encoded)


def dequantized(t8, descale, heads_kv: int):
    """t8 * descale in float64, the descale (batch, heads_kv) of each head's K/V head (None:
    1)."""
    x = t8.double()
    if descale is None:
        return x
    group = t8.shape[2] // heads_kv
    per_head = descale.double().repeat_interleave(group, dim=1)  # (batch, heads)
    return x * per_head[:, None, :, None]


def fp8_reference(q8, k8, v8, descales, scale: float, causal: bool):
    hkv = k8.shape[2]
    q, k, v = (dequantized(t, d, hkv) for t, d in zip((q8, k8, v8), descales))
    return reference(q, k, v, scale, causal, torch.float64)


def check_close(out, lse, ref_out, ref_lse, v_max: float, v_rms: float, what: str) -> None:
    """§4's bounds (module docstring), rows that see no key excepted (none here)."""
    assert out.isfinite().all(), f"{what}: non-finite output (poisoned memory not written?)"
    err = (out.double() - ref_out).abs()
    bound = 2**-4 * v_max * 1.05 + 2**-7 * ref_out.abs().max().item()
    assert err.max().item() <= bound, (what, err.max().item(), bound)
    rmse = err.square().mean().sqrt().item()
    assert rmse <= 2**-4 / math.sqrt(3) * v_rms, (what, rmse, v_rms)
    if lse is not None:
        rel = (lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
        assert rel.max().item() <= 1e-3, (what, rel.max().item())


def _v_stats(v8, vd, hkv):
    v = dequantized(v8, vd, hkv)
    return v.abs().max().item(), v.square().mean().sqrt().item()


# head_dim 256 (fa3_fp8_hdim256's 128 x 128 tiles, the causal spec's 128 x 64): a single key,
# ragged tails and seqlen_q < seqlen_k (the causal diagonal off the tile grid), GQA, MQA, and
# a long row of 32 causal blocks
SHAPES_256 = [
    (1, 1, 1, 2, 2),
    (2, 127, 300, 4, 4),
    (1, 128, 128, 16, 4),
    (2, 1000, 1000, 4, 1),
    (1, 200, 1111, 2, 2),
    (1, 2048, 2048, 4, 4),
]
# head_dim 64 through fadsl.attention (the loaded examples: SHAPES_64's test below)
CASES = [(128, s) for s in SHAPES] + [(256, s) for s in SHAPES_256] + [(64, SHAPES[1])]


@pytest.mark.parametrize("head_dim, shape", CASES, ids=[f"d{d}-{_ids(s)}" for d, s in CASES])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_fp8_attention_matches_the_dequantized_reference(name, causal, head_dim, shape):
    q8, k8, v8, descales = fp8_inputs(shape, DTYPES[name], seed=sum(shape) + causal, d=head_dim)
    scale = 1 / math.sqrt(head_dim)
    poison_allocator(8 * q8.numel() * 4)
    out, lse = fadsl.attention(q8, k8, v8, causal=causal, return_lse=True,
                               q_descale=descales[0], k_descale=descales[1],
                               v_descale=descales[2])  # fmt: skip
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = fp8_reference(q8, k8, v8, descales, scale, causal)
    check_close(out, lse, ref_out, ref_lse, *_v_stats(v8, descales[2], shape[4]), name)


def _descale_layouts(batch: int, heads_kv: int):
    """Descales of one meaning in the layouts a caller may pass: None (1), an expanded
    scalar, contiguous per (batch, head), and a transposed (strided) view."""
    g = torch.Generator(device="cuda").manual_seed(batch * 31 + heads_kv)
    per_head = torch.rand(batch, heads_kv, device="cuda", generator=g) * 1.5 + 0.25
    return {
        "none": None,
        "scalar": torch.tensor([0.75], device="cuda").expand(batch, heads_kv),
        "per_head": per_head,
        "strided": per_head.t().contiguous().t(),
    }


@pytest.mark.parametrize("layout", ["none", "scalar", "per_head", "strided"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_every_descale_layout_is_read_as_given(name, layout):
    shape = (2, 200, 700, 8, 2)
    chosen = _descale_layouts(2, 2)[layout]
    descales = (chosen, None if chosen is None else chosen.flip(0), chosen)
    q8, k8, v8 = encoded_inputs(shape, DTYPES[name], descales, seed=5)
    poison_allocator(8 * q8.numel() * 4)
    out, lse = fadsl.attention(q8, k8, v8, causal=True, return_lse=True,
                               q_descale=descales[0], k_descale=descales[1],
                               v_descale=descales[2])  # fmt: skip
    ref_out, ref_lse = fp8_reference(q8, k8, v8, descales, 1 / math.sqrt(128), True)
    check_close(out, lse, ref_out, ref_lse, *_v_stats(v8, descales[2], 2), layout)


@pytest.mark.parametrize(
    "spec",
    [
        "fa3_fp8_hdim64",
        "fa3_fp8_hdim64_causal",
        "fa3_fp8_hdim128",
        "fa3_fp8_hdim128_causal",
        "fa3_fp8_hdim256",
        "fa3_fp8_hdim256_causal",
    ],
)
def test_a_loaded_spec_writes_a_poisoned_out_and_fp16_through_fadsl_attention(spec):
    """The loaded example with out= NaN-filled (every element written), and fadsl.attention's
    out_dtype=torch.float16 (its `output fp16` variant) against the same reference."""
    kern = fadsl.load(ROOT / "examples" / f"{spec}.fa", verbose=False)
    causal = kern.config.mask.value == "causal"
    shape = (2, 300, 451, 4, 2)
    q8, k8, v8, descales = fp8_inputs(shape, E4M3, seed=11, d=kern.config.head_dim)
    out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    kern(q8, k8, v8, 0.1, out=out, q_descale=descales[0], k_descale=descales[1],
         v_descale=descales[2])  # fmt: skip
    ref_out, _ = fp8_reference(q8, k8, v8, descales, 0.1, causal)
    stats = _v_stats(v8, descales[2], 2)
    check_close(out, None, ref_out, None, *stats, spec)
    poison_allocator(8 * q8.numel() * 4)
    half = fadsl.attention(q8, k8, v8, causal, 0.1, q_descale=descales[0],
                           k_descale=descales[1], v_descale=descales[2],
                           out_dtype=torch.float16)  # fmt: skip
    assert half.dtype == torch.float16
    check_close(half, None, ref_out, None, *stats, spec + " fp16")


# head_dim 64 (examples/fa3_fp8_hdim64.fa and its causal twin: 64-byte rows, the 64-byte
# swizzle, transpose_v_narrow; fadsl.attention's since 2026-12-04): a single key, ragged tails, the
# causal diagonal off the tile grid, GQA, MQA, and rows of many key blocks
SHAPES_64 = [
    (1, 1, 1, 2, 2),
    (2, 127, 300, 4, 4),
    (1, 200, 1111, 8, 2),
    (2, 1000, 1000, 4, 1),
    (1, 2048, 2048, 4, 4),
]


@pytest.mark.parametrize("shape", SHAPES_64, ids=[_ids(s) for s in SHAPES_64])
@pytest.mark.parametrize("spec", ["fa3_fp8_hdim64", "fa3_fp8_hdim64_causal"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_head_dim_64_matches_the_dequantized_reference(name, spec, shape):
    """The loaded head_dim 64 examples, out poisoned with NaN (every element written), the
    LSE beside it, against float64 attention of the dequantized inputs."""
    kern = fadsl.load(ROOT / "examples" / f"{spec}.fa", verbose=False)
    causal = kern.config.mask.value == "causal"
    q8, k8, v8, descales = fp8_inputs(shape, DTYPES[name], seed=sum(shape) + causal, d=64)
    out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    poison_allocator(8 * q8.numel() * 4)
    _, lse = kern(q8, k8, v8, 0.125, out=out, return_lse=True, q_descale=descales[0],
                  k_descale=descales[1], v_descale=descales[2])  # fmt: skip
    ref_out, ref_lse = fp8_reference(q8, k8, v8, descales, 0.125, causal)
    check_close(out, lse, ref_out, ref_lse, *_v_stats(v8, descales[2], shape[4]), spec)


# `tail split_kv` (tests/specs/fp8/fa3_fp8_tail_split.fa, 128 x 192): shapes whose last round
# of tiles is part-full, so that it runs as pieces merged by their tile's last piece (each
# case asserts the split plan splits): fewer tiles than SMs (every tile split), a part-full
# round after whole ones, ragged seqlen_k, GQA and MQA, and a bad v_descale in one head
SHAPES_TAIL = [
    (1, 333, 4096, 2, 2),
    (2, 1000, 3001, 4, 1),
    (1, 1200, 2500, 40, 8),
    (1, 4096, 4096, 40, 40),
]


def _tail_splits(kern, shape) -> int:
    from fadsl.targets.launch import sm_count
    from fadsl.targets.sm90.host.launch import split_plan

    b, sq, sk, hq, _ = shape
    tiles = -(-sq // kern.config.block_r) * hq * b
    return split_plan(tiles, sm_count(0), -(-sk // kern.config.block_c))[1]


@pytest.mark.parametrize("shape", SHAPES_TAIL, ids=[_ids(s) for s in SHAPES_TAIL])
@pytest.mark.parametrize("name", list(DTYPES))
def test_the_tail_split_merges_8bit_pieces_within_the_bound(name, shape):
    """The tail split's pieces merged by their tile's last piece, out poisoned (NaN) and
    the LSE beside it, against float64 attention of the dequantized inputs; and bitwise
    stable over calls (the merge runs in piece order, whichever piece ends last)."""
    kern = fadsl.load(ROOT / "tests/specs/fp8/fa3_fp8_tail_split.fa", verbose=False)
    assert _tail_splits(kern, shape) > 1, "the shape must split its last round"
    q8, k8, v8, descales = fp8_inputs(shape, DTYPES[name], seed=sum(shape))
    outs = []
    for _ in range(3):
        out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        poison_allocator(8 * q8.numel() * 4)
        _, lse = kern(q8, k8, v8, 0.1, out=out, return_lse=True, q_descale=descales[0],
                      k_descale=descales[1], v_descale=descales[2])  # fmt: skip
        outs.append((out, lse))
    ref_out, ref_lse = fp8_reference(q8, k8, v8, descales, 0.1, False)
    check_close(outs[0][0], outs[0][1], ref_out, ref_lse, *_v_stats(v8, descales[2], shape[4]),
                f"tail split {name} {shape}")  # fmt: skip
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


def test_a_bad_v_descale_poisons_only_its_rows_through_the_tail_split():
    """A NaN v_descale of one (batch, K/V head): a piece's partial carries it (O times
    v_descale before the merge), so its rows come out NaN and every other row exact."""
    kern = fadsl.load(ROOT / "tests/specs/fp8/fa3_fp8_tail_split.fa", verbose=False)
    shape = (2, 1000, 3001, 4, 2)
    assert _tail_splits(kern, shape) > 1
    q8, k8, v8, (qd, kd, vd) = fp8_inputs(shape, E4M3, seed=5)
    vd = vd.clone()
    vd[1, 0] = math.nan
    out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    kern(q8, k8, v8, 0.1, out=out, q_descale=qd, k_descale=kd, v_descale=vd)
    bad = out[1, :, :2]  # the query heads of K/V head 0 (GQA 2)
    assert bad.isnan().all()
    good = torch.ones(out.shape[0], out.shape[2], dtype=torch.bool, device="cuda")
    good[1, :2] = False
    ref_out, _ = fp8_reference(q8, k8, v8, (qd, kd, vd.nan_to_num(1.0)), 0.1, False)
    rows = good[:, None, :, None].expand_as(out)
    check_close(out[rows].view(-1, 128), None, ref_out[rows].view(-1, 128), None,
                *_v_stats(v8, vd.nan_to_num(1.0), 2), "tail split, good heads")  # fmt: skip


def _threshold_k_descales(scale: float) -> tuple[float, float]:
    """(below, at): k_descale values whose c' = fl(fl(fl(scale log2 e) 1) k_descale), the
    kernel's roundings (round to nearest, q_descale 1), falls just below and at or above the
    smallest normal float32, 2^-126."""
    c0 = torch.tensor(scale, dtype=torch.float32) * torch.tensor(LOG2E, dtype=torch.float32)
    tiny = torch.tensor(2.0**-126, dtype=torch.float32)
    kd = (tiny / c0).float()
    while (c0 * kd) < tiny:
        kd = torch.nextafter(kd, torch.tensor(math.inf))
    below = kd
    while (c0 * below) >= tiny:
        below = torch.nextafter(below, torch.tensor(0.0))
    assert c0 * below < tiny <= c0 * kd
    return below.item(), kd.item()


BAD = {
    "zero": 0.0,
    "negative": -1.0,
    "inf": math.inf,
    "nan": math.nan,
    "overflow": 2.0**127,  # times q_descale 2^127: the product past FLT_MAX
    "below_normal": None,  # _threshold_k_descales' below
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("name", list(DTYPES))
def test_a_bad_scale_makes_only_its_batch_and_heads_nan(name, bad):
    """§3.5: c' not a positive normal float32 -> that (batch, K/V head)'s rows NaN (and
    their LSE), every other row as the reference; at the smallest normal itself, finite."""
    shape = (2, 150, 400, 4, 2)
    vd = torch.full((2, 2), 0.5, device="cuda")
    q8, k8, v8 = encoded_inputs(shape, DTYPES[name], (None, None, vd), seed=3)
    scale = 1 / math.sqrt(128)
    qd, kd = torch.ones(2, 2, device="cuda"), torch.ones(2, 2, device="cuda")
    below, at = _threshold_k_descales(scale)
    if bad == "overflow":
        qd[1, 0], kd[1, 0] = 2.0**127, 2.0**127
    else:
        kd[1, 0] = below if bad == "below_normal" else BAD[bad]
    kd[0, 1] = at  # c' exactly normal: finite rows
    poison_allocator(8 * q8.numel() * 4)
    out, lse = fadsl.attention(q8, k8, v8, return_lse=True, q_descale=qd, k_descale=kd,
                               v_descale=vd)  # fmt: skip
    bad_rows = out[1, :, 0:2]  # batch 1, the query heads of K/V head 0
    assert bad_rows.isnan().all() and lse[1, 0:2].isnan().all(), bad
    good = torch.ones_like(out, dtype=torch.bool)
    good[1, :, 0:2] = False
    assert out[good].isfinite().all() and lse[0].isfinite().all() and lse[1, 2:].isfinite().all()
    ref_out, ref_lse = fp8_reference(q8, k8, v8, (qd, kd, vd), scale, False)
    keep = (0, slice(None), slice(0, 4))
    check_close(out[keep], lse[0], ref_out[keep], ref_lse[0], *_v_stats(v8, vd, 2), bad)


def test_a_nan_v_descale_poisons_its_rows_only():
    shape = (2, 64, 256, 2, 2)
    q8, k8, v8, (qd, kd, vd) = fp8_inputs(shape, E4M3, seed=4)
    vd = vd.clone()
    vd[0, 1] = math.nan
    out = fadsl.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    assert out[0, :, 1].isnan().all()
    assert out[0, :, 0].isfinite().all() and out[1].isfinite().all()


@pytest.mark.parametrize("name", list(DTYPES))
def test_rows_rising_just_under_the_lazy_slack_stay_within_e4m3(name):
    """§3.5: the lazy reference moves only when a row's max rises past 0.8 (log2 units) of
    it, so P reaches 2^(8 + 0.79) ~ 443 < 448 and satfinite never clamps: each 192-key
    block's scores sit 0.79 above the last one's (k's first column steps through [1, 2) by
    the type's spacing, 0.125 for e4m3, 0.25 for e5m2; c' = 0.79 / step); a slack of 8
    would clamp P at 448 (2^16 wanted) and miss by far."""
    dtype = DTYPES[name]
    step = 0.125 if dtype == E4M3 else 0.25
    b, sq, hq, blocks, block = 1, 128, 2, int(1 / step), 192
    sk = blocks * block
    q = torch.zeros(b, sq, hq, 128, device="cuda")
    q[..., 0] = 1.0
    steps = 1.0 + step * (torch.arange(sk, device="cuda") // block)
    k = torch.zeros(b, sk, hq, 128, device="cuda")
    k[..., 0] = steps[None, :, None]
    v = torch.randn(b, sk, hq, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    q8, k8, v8 = q.to(dtype), k.to(dtype), v.to(dtype)
    assert torch.equal(k8.float(), k), "the steps must be exact in the 8-bit type"
    scale = 0.79 / step / LOG2E  # c' = 0.79 / step: 0.79 a block
    poison_allocator(8 * q8.numel() * 4)
    out, lse = fadsl.attention(q8, k8, v8, softmax_scale=scale, return_lse=True)
    ref_out, ref_lse = fp8_reference(q8, k8, v8, (None, None, None), scale, False)
    check_close(out, lse, ref_out, ref_lse, *_v_stats(v8, None, hq), name)


def _outliers(shape, seed: int):
    """N(0, 1) with 0.1 % of the entries times 10 to 100 (FA3's paper's experiment)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    chosen = torch.rand(shape, device="cuda", generator=g) < 1e-3
    factor = 10 + 90 * torch.rand(shape, device="cuda", generator=g)
    return torch.where(chosen, x * factor, x)


def test_outliers_rotation_lowers_the_error():
    """§6 test 8: q, k, v with outliers, quantized per (batch, head), against the float64
    attention of the unquantized inputs: the RMSE with fadsl.fp8.rotate on q and k (one seed)
    below the RMSE without (FA3's paper: ~2.6x; the CPU model, docs/numerics.md: 1.8x)."""
    b, sq, sk, h = 2, 1024, 1024, 4
    q, k = _outliers((b, sq, h, 128), 1), _outliers((b, sk, h, 128), 2)
    v = _outliers((b, sk, h, 128), 3)
    scale = 1 / math.sqrt(128)
    exact, _ = reference(q.double(), k.double(), v.double(), scale, False, torch.float64)
    errors = {}
    for rotated in (False, True):
        qr, kr = (rotate(q, seed=7), rotate(k, seed=7)) if rotated else (q, k)
        q8, qd = quantize(qr, E4M3)
        k8, kd = quantize(kr, E4M3)
        v8, vd = quantize(v, E4M3)
        out = fadsl.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
        errors[rotated] = (out.double() - exact).square().mean().sqrt().item()
    print(f"outliers: RMSE per-head descales {errors[False]:.3e}, rotated {errors[True]:.3e}")
    assert errors[True] < errors[False], errors


def test_torch_compile_fullgraph_gives_the_eager_bits():
    shape = (2, 300, 300, 4, 2)
    q8, k8, v8, (qd, kd, vd) = fp8_inputs(shape, E4M3, seed=21)

    def call(q, k, v, qd, kd, vd):
        return fadsl.attention(q, k, v, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True)  # fmt: skip

    eager = call(q8, k8, v8, qd, kd, vd)
    compiled = torch.compile(call, fullgraph=True)(q8, k8, v8, qd, kd, vd)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_a_planned_call_reads_each_calls_descales():
    """The third call of one signature runs its plan: new descale tensors (other addresses,
    other values) are read, not the planned call's."""
    shape = (1, 256, 512, 2, 2)
    q8, k8, v8, (qd, kd, vd) = fp8_inputs(shape, E4M3, seed=8)
    for factor in (1.0, 0.5, 2.0):
        scaled = (qd * factor, kd.clone(), vd * factor)
        out = fadsl.attention(q8, k8, v8, q_descale=scaled[0], k_descale=scaled[1],
                              v_descale=scaled[2])  # fmt: skip
        ref_out, _ = fp8_reference(q8, k8, v8, scaled, 1 / math.sqrt(128), False)
        check_close(out, None, ref_out, None, *_v_stats(v8, scaled[2], 2), str(factor))


SHORT = sorted((d, c, limit) for (d, c), (limit, _) in get("sm_90a").shipped_fp8_short.items())


@pytest.mark.parametrize("head_dim, causal, limit", SHORT, ids=[f"d{d}-{c}" for d, c, _ in SHORT])
def test_short_and_long_queries_run_their_8bit_specs(head_dim, causal, limit):
    """On both sides of Target.shipped_fp8_short's threshold: the spec each side runs (the
    128 x 128 twin up to the limit), its output against the dequantized reference, and under
    torch.compile(fullgraph=True, dynamic=True) the eager bits on both sides."""
    capability = torch.cuda.get_device_capability(0)

    def call(q, k, v, qd, kd, vd):
        return fadsl.attention(q, k, v, causal, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True)  # fmt: skip

    compiled = torch.compile(call, fullgraph=True, dynamic=True)
    for seqlen in (limit - 77, limit, limit + 1):
        shape = (1, seqlen, seqlen, 4, 2)
        q8, k8, v8, descales = fp8_inputs(shape, E4M3, seed=seqlen, d=head_dim)
        poison_allocator(8 * q8.numel() * 4)
        out, lse = call(q8, k8, v8, *descales)
        ref_out, ref_lse = fp8_reference(q8, k8, v8, descales, head_dim**-0.5, causal)
        check_close(out, lse, ref_out, ref_lse, *_v_stats(v8, descales[2], 2), str(seqlen))
        name = dispatch.shipped_fp8_spec(capability, head_dim, causal, E4M3, seqlen)
        assert name.endswith("_short") == (seqlen <= limit), seqlen
        assert dispatch._LOADED[name].config.name == name
        again = compiled(q8, k8, v8, *descales)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse), seqlen
