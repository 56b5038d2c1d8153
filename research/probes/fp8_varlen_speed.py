"""The 8-bit varlen forward beside the padded 8-bit call on the same tokens (issue 42): a
batch of equal lengths (the padded call's tensors, packed by reshape) and a ragged batch of
as many tokens (lengths uniform in [L/8, L]), e4m3, descales per sequence, through
fadsl.attention_varlen and fadsl.attention, in balanced orders.

    python3 -P research/probes/fp8_varlen_speed.py --head-dims 128 --seqlens 1024,4096,16384

TF/s over the work the mask keeps (hidden 2048 / head_dim heads, 16k tokens a call)."""

from __future__ import annotations

import argparse

import torch

import fadsl
from fadsl.tools.bench import median_times


def flops(lengths_q, lengths_k, heads: int, head_dim: int, causal: bool) -> float:
    total = 0.0
    for lq, lk in zip(lengths_q, lengths_k):
        pairs = lq * lk - (lq * (lq - 1) / 2 if causal else 0)  # (lq == lk under causal here)
        total += 4 * pairs * heads * head_dim
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="128")
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--runs", type=int, default=30)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    for d in map(int, args.head_dims.split(",")):
        heads = args.hidden // d
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                batch = max(1, args.tokens // seqlen)
                q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda").to(torch.float8_e4m3fn)
                           for _ in range(3))  # fmt: skip
                descales = tuple(torch.rand(batch, heads, device="cuda") + 0.5 for _ in range(3))
                cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
                packed = [t.reshape(batch * seqlen, heads, d) for t in (q, k, v)]
                # ragged: lengths uniform in [L/8, L], as many tokens (about)
                lengths = []
                while sum(lengths) < batch * seqlen:
                    lengths.append(int(torch.randint(seqlen // 8, seqlen + 1, (1,), generator=g)))
                lengths[-1] -= sum(lengths) - batch * seqlen
                lengths = [n for n in lengths if n > 0]
                cu_r = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                    dtype=torch.int32, device="cuda")  # fmt: skip
                rd = tuple(torch.rand(len(lengths), heads, device="cuda") + 0.5 for _ in range(3))
                names = ("q_descale", "k_descale", "v_descale")
                contenders = {
                    "padded": lambda _: fadsl.attention(q, k, v, causal, **dict(zip(names, descales))),
                    "varlen equal": lambda _: fadsl.attention_varlen(
                        *packed, cu, cu, seqlen, seqlen, causal, **dict(zip(names, descales))
                    ),
                    "varlen ragged": lambda _: fadsl.attention_varlen(
                        *packed, cu_r, cu_r, max(lengths), max(lengths), causal,
                        **dict(zip(names, rd)),
                    ),
                }  # fmt: skip
                for f in contenders.values():
                    f(0)
                torch.cuda.synchronize()
                ms = median_times(contenders, 5, args.runs)
                work = {
                    "padded": flops([seqlen] * batch, [seqlen] * batch, heads, d, causal),
                    "varlen equal": flops([seqlen] * batch, [seqlen] * batch, heads, d, causal),
                    "varlen ragged": flops(lengths, lengths, heads, d, causal),
                }
                cells = "  ".join(
                    f"{n} {ms[n]:.3f} ms {work[n] / ms[n] / 1e9:.0f} TF/s" for n in ms
                )
                print(f"d {d} causal={causal} L {seqlen} ({len(lengths)} ragged): {cells}  "
                      f"equal/padded {ms['padded'] / ms['varlen equal']:.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    with torch.no_grad():
        main()
