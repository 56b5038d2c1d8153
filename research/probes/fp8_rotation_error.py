"""What fadsl.fp8's quantization and rotation do to attention's output, on the CPU: the
error of softmax(q k^T / sqrt(d)) v in float64 from inputs quantized to e4m3 (per (batch,
head) descales, or per block of rows), with and without the Hadamard rotation of q and k,
against the same attention of the unquantized inputs. The inputs are standard normal with a
share of outlier entries scaled by a factor (FA3's paper, §4.3: 0.1 % outliers).

This measures the input quantization alone: the kernel's P in e4m3 and the tensor core's FP8
accumulation add their own error (docs/numerics.md).

Usage: python3 research/probes/fp8_rotation_error.py [--seqlen 1024] [--head-dim 128]
[--outliers 0.001] [--factor 10] [--seeds 3]"""

from __future__ import annotations

import argparse

import torch

from fadsl import fp8


def attention(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


def with_outliers(shape, share: float, factor: float, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    hit = torch.rand(shape, generator=gen, dtype=torch.float64) < share
    return torch.where(hit, x * factor, x)


def rmse(a, b) -> float:
    return (a - b).pow(2).mean().sqrt().item()


def errors(seqlen: int, d: int, share: float, factor: float, seed: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (with_outliers((1, seqlen, 4, d), share, factor, gen) for _ in range(3))
    ref = attention(q, k, v)
    found = {}
    for rotated in (False, True):
        qr, kr = (fp8.rotate(x, seed).double() if rotated else x for x in (q, k))
        for block in (None, 128):
            qd, kd, vd = (
                fp8.dequantize(
                    *fp8.quantize(x.float(), block_rows=block), block_rows=block
                ).double()
                for x in (qr, kr, v)
            )
            name = (
                f"{'rotated' if rotated else 'plain'}, {'blocks of 128' if block else 'per head'}"
            )
            found[name] = rmse(attention(qd, kd, vd), ref)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--outliers", type=float, default=0.001)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    runs = [
        errors(args.seqlen, args.head_dim, args.outliers, args.factor, s) for s in range(args.seeds)
    ]
    for name in runs[0]:
        values = [r[name] for r in runs]
        print(
            f"{name:26s} RMSE {sum(values) / len(values):.3e}  ({', '.join(f'{x:.3e}' for x in values)})"
        )


if __name__ == "__main__":
    main()
