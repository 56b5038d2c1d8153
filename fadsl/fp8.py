"""FP8 inputs for attention (issue 42; research/fp8-forward.md §3.8): quantization with
FlashAttention-3's descale convention, and the incoherent processing of FA3's paper §3.3.

- ``quantize(x, dtype, scale_heads=None, block_rows=None) -> (x8, descale)``: x (batch,
  seqlen, heads, head_dim) in 8 bits and the float32 factor that restores it, ``x ~= x8 *
  descale``. One descale per (batch, scale head) by default, (batch, scale_heads) as FA3's
  ``q_descale``, ``k_descale`` and ``v_descale`` are (per KV head: a query head h takes the
  factor of head h // (heads // scale_heads), the kernels' GQA mapping); with ``block_rows``
  one per block of that many rows, (batch, scale_heads, cdiv(seqlen, block_rows)).
- ``dequantize(x8, descale, block_rows=None)``: back to float32 (references, error checks).
- ``rotate(x, seed)``: x times a random orthogonal Hadamard matrix, ``x H diag(s) / sqrt(d)``
  (H Sylvester's, s random signs from ``seed``). Rotating q and k with the same seed leaves
  q k^T as it is, in exact arithmetic, and spreads a few large entries (outliers) over the
  whole head_dim before quantization, where one would otherwise set the descale of the
  entire row. v is not rotated (the output would need the inverse). A KV cache's keys must
  be rotated with the queries' seed.

Numerics: the descale is ``max(amax, 2^-100) / fmax`` (fmax: 448 for e4m3, 57344 for e5m2),
a normal float32 for every finite amax (2^-100 / 57344 > 2^-126), never 0, so x / descale
is finite and at most fmax in magnitude, and the cast saturates nothing. A NaN or inf entry
makes its descale NaN or inf, which the kernels take as a bad scale (their rows NaN): no
silent garbage (a float64 input past FLT_MAX becomes inf in float32 first). Measured on
random inputs with 0.1 % outliers (docs/numerics.md, "FP8 inputs"): with q, k and v quantized,
the rotation of q and k lowers the output's RMSE 1.8x (per-head descales).
"""

from __future__ import annotations

import math

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
DESCALE_FLOOR = 2.0**-100  # the smallest amax a descale is taken from: never a zero factor


def quantize(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    scale_heads: int | None = None,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x8, descale)`` with ``x ~= x8.float() * descale`` broadcast per (batch, scale
    head[, block]); see the module docstring."""
    _check_4d("x", x)
    if dtype not in FP8_MAX:
        raise TypeError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}")
    batch, seqlen, heads, head_dim = x.shape
    scale_heads = _scale_heads(scale_heads, heads)
    blocks = _blocks(block_rows, seqlen)
    grouped = _grouped(x.float(), scale_heads, blocks, block_rows)
    if grouped.numel():
        amax = grouped.abs().amax(dim=(2, 4, 5))  # (batch, blocks, scale_heads)
    else:  # no rows (seqlen 0) or no columns: the floor's descale
        amax = grouped.new_zeros(batch, blocks, scale_heads)
    # NaN stays NaN (clamp_min keeps it), inf stays inf: the kernels poison such rows
    descale = amax.clamp_min(DESCALE_FLOOR) / FP8_MAX[dtype]
    # |x| / descale <= fmax up to the division's rounding (448.00003): clamped, so that the
    # cast never meets a value past the format's largest (e4m3fn has no inf); NaN stays NaN
    fmax = FP8_MAX[dtype]
    scaled = (grouped / descale[:, :, None, :, None, None]).clamp(-fmax, fmax)
    x8 = _ungrouped(scaled, x.shape).to(dtype)
    descale = descale.permute(0, 2, 1).contiguous()  # (batch, scale_heads, blocks)
    return x8, descale if block_rows is not None else descale[:, :, 0].contiguous()


def dequantize(
    x8: torch.Tensor, descale: torch.Tensor, *, block_rows: int | None = None
) -> torch.Tensor:
    """``x8.float() * descale``, the descale broadcast as ``quantize`` made it."""
    _check_4d("x8", x8)
    if x8.dtype not in FP8_MAX:
        raise TypeError(f"x8 must be a float8 tensor, got {x8.dtype}")
    batch, seqlen, heads, _ = x8.shape
    blocks = _blocks(block_rows, seqlen)
    if not isinstance(descale, torch.Tensor):
        raise TypeError(f"descale must be a torch.Tensor, got {type(descale).__name__}")
    if descale.dim() != (2 if block_rows is None else 3):
        layout = "(batch, scale_heads)" if block_rows is None else "(batch, scale_heads, blocks)"
        raise ValueError(
            f"descale must be {layout} as quantize returns it, got shape {tuple(descale.shape)}"
        )
    scale_heads = _scale_heads(descale.shape[1], heads)
    if descale.shape[0] != batch or (block_rows is not None and descale.shape[2] != blocks):
        raise ValueError(
            f"descale's shape {tuple(descale.shape)} does not fit x8's {tuple(x8.shape)} "
            f"(batch {batch}, {blocks} block(s) of rows)"
        )
    per = descale.float() if block_rows is not None else descale.float()[:, :, None]
    grouped = _grouped(x8.float(), scale_heads, blocks, block_rows)
    return _ungrouped(grouped * per.permute(0, 2, 1)[:, :, None, :, None, None], x8.shape)


def hadamard_rotation(head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """The orthogonal ``head_dim`` x ``head_dim`` matrix ``H diag(s) / sqrt(head_dim)``
    (float32): H Sylvester's Hadamard matrix, s random signs drawn from ``seed``."""
    if not isinstance(head_dim, int) or head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of 2, got {head_dim!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed))
    m = h * (2.0 * signs.to(torch.float64) - 1.0)[None, :] / math.sqrt(head_dim)
    return m.to(device=device, dtype=torch.float32)


def rotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """``x @ hadamard_rotation(head_dim, seed)`` in float32, x (batch, seqlen, heads,
    head_dim): rotate q and k with the same seed, then quantize them."""
    _check_4d("x", x)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    return x.float() @ hadamard_rotation(x.shape[-1], seed, x.device)


def _check_4d(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"{name} must be (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}"
        )


def _scale_heads(scale_heads, heads: int) -> int:
    if heads == 0:
        raise ValueError("the tensor has no heads (its third dimension is 0)")
    if scale_heads is None:
        return heads
    if not isinstance(scale_heads, int) or isinstance(scale_heads, bool) or scale_heads < 1:
        raise ValueError(f"scale_heads must be a positive int, got {scale_heads!r}")
    if heads % scale_heads:
        raise ValueError(f"scale_heads ({scale_heads}) must divide the heads ({heads})")
    return scale_heads


def _blocks(block_rows, seqlen: int) -> int:
    if block_rows is None:
        return 1
    if not isinstance(block_rows, int) or isinstance(block_rows, bool) or block_rows < 1:
        raise ValueError(f"block_rows must be a positive int, got {block_rows!r}")
    return max(1, -(-seqlen // block_rows))


def _grouped(x: torch.Tensor, scale_heads: int, blocks: int, block_rows) -> torch.Tensor:
    """x (batch, seqlen, heads, d) as (batch, blocks, rows, scale_heads, heads per scale,
    d), the rows padded with zeros to whole blocks."""
    batch, seqlen, heads, d = x.shape
    rows = seqlen if block_rows is None else block_rows
    pad = blocks * rows - seqlen
    if pad:
        x = torch.cat([x, x.new_zeros(batch, pad, heads, d)], 1)
    return x.reshape(batch, blocks, rows, scale_heads, heads // scale_heads, d)


def _ungrouped(x: torch.Tensor, shape) -> torch.Tensor:
    batch, seqlen, heads, d = shape
    return x.reshape(batch, x.shape[1] * x.shape[2], heads, d)[:, :seqlen]
