"""The sliding-window backward timed beside the causal one and FlashAttention-4's
(issue 40: a window of 1024 at 8k at least 3x faster than the causal backward).

Usage (on the GPU machine, after device.sh's install): python3 -P scripts/window_backward_bench.py
[--seqlens 8192,16384] [--windows 1024,256] [--head-dims 128,64] [--hidden 2048] [--json F]

Each row times, on the same q, k, v and dO (bf16, hidden 2048, 16k tokens), the backward alone
(autograd.grad of a forward kept with its graph) of fadsl.attention with causal=True and
window_size=(W - 1, 0) (each query sees itself and the W - 1 keys before it), of the same call
without a window, and of FlashAttention-4's with the same window where it is installed; warm-up,
median, balanced orders (fadsl/tools/bench.py). Before timing, fadsl's windowed gradients are
checked against FA4's (else against PyTorch's memory-efficient backend with the window as a
boolean mask). TF/s counts the pairs each query sees (2.5 x 4 d per pair)."""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadsl
from fadsl.tools.bench import _flash_attention_4, median_times
from fadsl.tools.bench_backward import check_grads, grad_of


def visible_pairs(seqlen: int, left: int) -> int:
    """Pairs (i, j) with i - left <= j <= i, 0 <= j (left < 0: the whole causal triangle)."""
    if left < 0 or left >= seqlen:
        return seqlen * (seqlen + 1) // 2
    return sum(min(i, left) + 1 for i in range(seqlen))


def reference_grads(q, k, v, dout, left: int, fa4):
    if fa4 is not None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fa4(*leaves, causal=True, window_size=(left, 0))
        out = out[0] if isinstance(out, tuple) else out
        return "fa4", torch.autograd.grad(out, leaves, dout)
    s = q.shape[1]
    i = torch.arange(s, device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)
    leaves = [t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    grads = torch.autograd.grad(out, leaves, dout.transpose(1, 2))
    return "sdpa efficient (masked)", [g.transpose(1, 2) for g in grads]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="8192,16384")
    parser.add_argument("--windows", default="1024")
    parser.add_argument("--head-dims", default="128")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--json")
    args = parser.parse_args()
    fa4 = _flash_attention_4()
    rows = []
    for d in map(int, args.head_dims.split(",")):
        heads = args.hidden // d
        for seqlen in map(int, args.seqlens.split(",")):
            batch = max(1, args.tokens // seqlen)
            shape = (batch, seqlen, heads, d)
            q, k, v, dout = (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4)
            )
            for width in map(int, args.windows.split(",")):
                left = width - 1
                contenders = {}
                for name, window in (
                    (f"fadsl window {width}", (left, 0)),
                    ("fadsl causal", (-1, -1)),
                ):
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    out = fadsl.attention(*leaves, causal=True, window_size=window)
                    if window != (-1, -1):
                        ref_name, ref = reference_grads(q, k, v, dout, left, fa4)
                        grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
                        check_grads(grads, ref, ref_name, seqlen, name)
                    contenders[name] = grad_of(out, leaves, dout)
                if fa4 is not None:
                    for name, window in (
                        (f"fa4 window {width}", (left, 0)),
                        ("fa4 causal", (None, None)),
                    ):
                        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                        try:
                            out = fa4(*leaves, causal=True, window_size=window)
                        except Exception as err:  # not built for this shape
                            print(
                                f"  {name}: not timed ({str(err).splitlines()[0][:80]})",
                                file=sys.stderr,
                            )
                            continue
                        out = out[0] if isinstance(out, tuple) else out
                        contenders[name] = grad_of(out, leaves, dout)
                ms = median_times(contenders, 8, 32)
                pairs = {n: visible_pairs(seqlen, left if "window" in n else -1) for n in ms}
                tflops = {
                    n: 2.5 * 4 * d * batch * heads * pairs[n] / (ms[n] * 1e-3) / 1e12 for n in ms
                }
                row = {
                    "head_dim": d,
                    "seqlen": seqlen,
                    "batch": batch,
                    "window": width,
                    "ms": ms,
                    "tflops": tflops,
                }
                rows.append(row)
                ours = f"fadsl window {width}"
                line = "  ".join(f"{n} {ms[n]:.3f} ms ({tflops[n]:.0f} TF/s)" for n in ms)
                speedup = ms["fadsl causal"] / ms[ours]
                vs_fa4 = (
                    f", x FA4 {ms[f'fa4 window {width}'] / ms[ours]:.2f}"
                    if f"fa4 window {width}" in ms
                    else ""
                )
                print(
                    f"d {d} seqlen {seqlen} window {width}: {line}; causal / window {speedup:.2f}x{vs_fa4}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
