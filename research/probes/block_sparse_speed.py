"""examples/modifiers/block_sparse.fa beside FlexAttention on the same BlockMask: forward and
backward milliseconds (CUDA events, median of 20 calls after 5, the same tensors), for a
BlockMask of each kind: a causal window of W 128-key blocks (contiguous kept blocks per row)
and a strided pattern (the diagonal block and every S-th block before it: skipped blocks
between kept ones). fadsl's tiles classed once (``keep_classes``); FlexAttention compiled.
TF/s count the kept blocks' scores (the BlockMask's own count, 128 x 128 each).

Usage (a Hopper GPU): python3 -P research/probes/block_sparse_speed.py [--tokens 16384]
[--window 8] [--stride 8]"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import fadsl

ROOT = Path(__file__).resolve().parents[2]


def median_ms(fn, calls: int = 20) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--stride", type=int, default=8)
    args = parser.parse_args()
    kern = fadsl.load((ROOT / "examples/modifiers/block_sparse.fa").read_text(), verbose=False)
    n, heads = args.tokens, 16
    w, s = args.window, args.stride
    masks = {
        f"window of {w} blocks": lambda b, h, q, kv: (q >= kv) & (q // 128 - kv // 128 < w),
        f"every {s}th block": lambda b, h, q, kv: (q >= kv) & ((q // 128 - kv // 128) % s == 0),
    }
    compiled = torch.compile(flex_attention)
    q, k, v, dout = (
        torch.randn(1, n, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    for name, fn in masks.items():
        bm = create_block_mask(fn, 1, 1, n, n)
        table = fadsl.block_table(bm, batch=1, heads=heads)
        classes = kern.keep_classes(q, k, blocks=table)
        kept = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()) * heads
        flops = 4 * kept * 128 * 128 * 128
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        tq, tk, tv = (t.transpose(1, 2) for t in leaves)
        ours = kern(*leaves, blocks=table, keep_classes=classes)
        theirs = compiled(tq, tk, tv, block_mask=bm)
        err = (ours.float() - theirs.transpose(1, 2).float()).abs().max().item()
        rows = {
            "forward": (
                lambda: kern(q, k, v, blocks=table, keep_classes=classes),
                lambda: compiled(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm
                ),
            ),
            "backward": (
                lambda: torch.autograd.grad(ours, leaves, dout, retain_graph=True),
                lambda: torch.autograd.grad(
                    theirs, leaves, dout.transpose(1, 2), retain_graph=True
                ),
            ),
        }
        for what, (mine, flex) in rows.items():
            with torch.no_grad() if what == "forward" else torch.enable_grad():
                a, b = median_ms(mine), median_ms(flex)
            scale = 1 if what == "forward" else 2.5
            print(
                f"{name:22s} {what:8s} fadsl {a:.3f} ms ({scale * flops / a / 1e9:.0f} TF/s)  "
                f"flex {b:.3f} ms ({scale * flops / b / 1e9:.0f} TF/s)  x flex {b / a:.2f}  "
                f"(max |fadsl - flex| {err:.2e})",
                flush=True,
            )


if __name__ == "__main__":
    main()
