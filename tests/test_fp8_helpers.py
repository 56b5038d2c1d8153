"""fadsl.fp8 (issue 42, research/fp8-forward.md §3.8), on the CPU: quantize's descales are
normal float32 numbers for every finite amax and restore x within e4m3's and e5m2's rounding,
per (batch, scale head) or per block of rows, with the kernels' GQA mapping of query heads to
descales; a NaN or inf entry gives a non-finite descale (the kernels poison such rows);
rotate is orthogonal, leaves q k^T as it is and is fixed by its seed; on inputs with 0.1 %
outliers it lowers the error of attention's output from quantized q and k; bad arguments are
refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from fadsl import fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (mantissa bits, the smallest normal's exponent) of each format: relative error 2^-(m+1) in
# the normal range, absolute 2^(e - m - 1) of the descale below it
FORMATS = {E4M3: (3, -6), E5M2: (2, -14)}


def bound(x: torch.Tensor, descale: torch.Tensor, dtype) -> torch.Tensor:
    m, e = FORMATS[dtype]
    return torch.maximum(x.abs() * 2.0 ** -(m + 1), descale * 2.0 ** (e - m - 1)) * (1 + 1e-6)


def descale_of(descale: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, scale_heads) -> (batch, 1, heads, 1): query head h takes h // (heads / scale)."""
    group = heads // descale.shape[1]
    return descale.repeat_interleave(group, dim=1)[:, None, :, None]


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale_heads", [None, 1, 2, 8])
def test_quantize_restores_x_within_the_formats_rounding(dtype, scale_heads):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 45, 8, 64, generator=gen) * torch.logspace(-6, 6, 8)[None, None, :, None]
    x8, descale = fp8.quantize(x, dtype, scale_heads=scale_heads)
    assert x8.dtype is dtype and x8.shape == x.shape
    assert descale.dtype is torch.float32 and descale.shape == (3, scale_heads or 8)
    full = descale_of(descale, 8)
    # nothing saturates: the largest |x| / descale is fmax up to the division's rounding
    assert (x.abs() / full).max() <= fp8.FP8_MAX[dtype] * (1 + 2.0**-22)
    err = (fp8.dequantize(x8, descale) - x).abs()
    assert (err <= bound(x, full, dtype)).all()
    # the largest entry of each scale group lands on the format's largest value
    grouped = x8.float().abs().reshape(3, 45, descale.shape[1], -1, 64)
    assert torch.equal(grouped.amax(dim=(1, 3, 4)), torch.full_like(descale, fp8.FP8_MAX[dtype]))


@pytest.mark.parametrize("block_rows, blocks", [(16, 3), (45, 1), (64, 1), (1, 45)])
def test_block_descales_one_per_block_of_rows(block_rows, blocks):
    gen = torch.Generator().manual_seed(block_rows)
    x = torch.randn(2, 45, 4, 32, generator=gen)
    x[:, :16] *= 1000  # a loud first block must not coarsen the others
    x8, descale = fp8.quantize(x, scale_heads=2, block_rows=block_rows)
    assert descale.shape == (2, 2, blocks)
    rows = torch.arange(45) // block_rows
    full = descale[:, :, rows].repeat_interleave(2, dim=1).permute(0, 2, 1)[..., None]
    err = (fp8.dequantize(x8, descale, block_rows=block_rows) - x).abs()
    assert (err <= bound(x, full, E4M3)).all()
    if block_rows == 16:
        assert (descale[:, :, 1:] < descale[:, :, :1] / 100).all()


@pytest.mark.parametrize(
    "amax", [0.0, 2.0**-149, 1e-30, 2.0**-100, 1.0, 1e30, torch.finfo(torch.float32).max]
)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_the_descale_is_a_normal_float32_for_every_finite_amax(amax, dtype):
    x = torch.zeros(1, 4, 1, 16)
    x[0, 2, 0, 5] = -amax
    x8, descale = fp8.quantize(x, dtype)
    d = descale.item()
    assert math.isfinite(d) and d >= torch.finfo(torch.float32).tiny
    floor = torch.tensor(max(amax, 2.0**-100), dtype=torch.float32)
    assert d == (floor / fp8.FP8_MAX[dtype]).item()
    assert torch.isfinite(x8.float()).all()
    assert x8.float().abs().max().item() <= fp8.FP8_MAX[dtype]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_entry_gives_a_non_finite_descale(bad):
    x = torch.randn(2, 8, 4, 16)
    x[1, 3, 2, 7] = bad
    _, descale = fp8.quantize(x, scale_heads=2)
    assert not math.isfinite(descale[1, 1].item())  # the kernels poison the rows it scales
    assert torch.isfinite(descale[0]).all() and math.isfinite(descale[1, 0].item())


def test_empty_rows_take_the_floor():
    x8, descale = fp8.quantize(torch.zeros(2, 0, 4, 16))
    assert x8.shape == (2, 0, 4, 16)
    assert torch.equal(descale, torch.full((2, 4), 2.0**-100 / 448))


@pytest.mark.parametrize("shape", [(0, 5, 4, 16), (2, 5, 4, 0), (0, 0, 4, 0)])
@pytest.mark.parametrize("block_rows", [None, 2])
def test_empty_tensors_round_trip(shape, block_rows):
    x = torch.zeros(shape)
    x8, descale = fp8.quantize(x, scale_heads=2, block_rows=block_rows)
    assert x8.shape == x.shape and descale.shape[:2] == (shape[0], 2)
    assert fp8.dequantize(x8, descale, block_rows=block_rows).shape == x.shape


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_rotation_is_orthogonal_and_keeps_q_k(head_dim):
    m = fp8.hadamard_rotation(head_dim, seed=3).double()
    assert torch.allclose(m @ m.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6)
    gen = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(2, 9, 3, head_dim, generator=gen), torch.randn(
        2, 11, 3, head_dim, generator=gen
    )
    qk = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double())
    rotated = torch.einsum("bqhd,bkhd->bhqk", fp8.rotate(q, 3).double(), fp8.rotate(k, 3).double())
    assert (rotated - qk).abs().max() <= 1e-5 * qk.abs().max()
    assert torch.equal(fp8.rotate(q, 3), fp8.rotate(q, 3))
    assert not torch.equal(fp8.hadamard_rotation(head_dim, 3), fp8.hadamard_rotation(head_dim, 4))


def _attention(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def test_the_rotation_lowers_the_error_of_quantized_q_and_k_with_outliers():
    """0.1 % of the entries ten times larger (FA3's paper, §4.3): per-head descales follow the
    outliers, and the rotation spreads them over head_dim first."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, 256, 4, 128)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))
    for x in (q, k):
        hit = torch.rand(shape, generator=gen, dtype=torch.float64) < 0.001
        x[hit] *= 10
    ref = _attention(q, k, v)

    def error(qx, kx):
        qd, kd = (fp8.dequantize(*fp8.quantize(x.float())).double() for x in (qx, kx))
        return (_attention(qd, kd, v) - ref).pow(2).mean().sqrt().item()

    plain, rotated = error(q, k), error(fp8.rotate(q, 1), fp8.rotate(k, 1))
    assert rotated < 0.75 * plain, (rotated, plain)


def test_bad_arguments_are_refused_by_name():
    x = torch.randn(1, 4, 4, 16)
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        fp8.quantize([1.0])
    with pytest.raises(ValueError, match=r"x must be \(batch, seqlen, heads, head_dim\)"):
        fp8.quantize(torch.randn(4, 16))
    with pytest.raises(TypeError, match=r"dtype must be torch.float8_e4m3fn or"):
        fp8.quantize(x, torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale_heads \(3\) must divide the heads \(4\)"):
        fp8.quantize(x, scale_heads=3)
    with pytest.raises(ValueError, match=r"block_rows must be a positive int, got 0"):
        fp8.quantize(x, block_rows=0)
    with pytest.raises(ValueError, match=r"head_dim must be a power of 2, got 96"):
        fp8.rotate(torch.randn(1, 2, 1, 96))
    with pytest.raises(TypeError, match=r"seed must be an int"):
        fp8.rotate(x, seed=1.5)
    x8, descale = fp8.quantize(x)
    with pytest.raises(ValueError, match=r"descale must be \(batch, scale_heads, blocks\)"):
        fp8.dequantize(x8, descale, block_rows=2)
    with pytest.raises(ValueError, match=r"descale's shape \(2, 4\) does not fit"):
        fp8.dequantize(x8, torch.ones(2, 4))
    with pytest.raises(TypeError, match=r"x8 must be a float8 tensor"):
        fp8.dequantize(x, descale)
