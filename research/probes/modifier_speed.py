"""The modifier examples (examples/modifiers/: ALiBi, prefix-LM, the T5-style bias table)
beside FlexAttention with the same score_mod / mask_mod (torch.compile'd flex_attention, its
BlockMask made once, outside the timing), forward and backward alone (torch.autograd.grad over
a graph kept from one forward), bf16, head_dim 128, 16 heads, 16k tokens per call (batch x
seqlen); TF/s over the scores each variant keeps (causal: L (L + 1) / 2 pairs a sequence;
prefix-LM adds the prefix's keys above the diagonal), 2.5x the forward's FLOPs backward.
Prints ms, TF/s, fadsl x Flex and the largest output difference (issue 41's acceptance).

Usage (a Hopper GPU): python3 -P research/probes/modifier_speed.py [--seqlens 16384,4096]
[--variants alibi_causal,prefix_lm,t5_bias_causal]"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import fadsl
from fadsl.tools.bench import median_times

ROOT = Path(__file__).resolve().parents[2]
HEADS, HEAD_DIM, TOKENS = 16, 128, 16384


def t5_bucket(d):
    """The T5 example's bucket of a distance d = q_idx - kv_idx (its score line, in torch)."""
    far = 16 + torch.floor(torch.log(torch.clamp(d, min=16).float() / 16.0) / math.log(8.0) * 16.0)
    return torch.where(d < 16, d, far.to(d.dtype)).clamp(0, 31)


def variant(name: str, batch: int, n: int):
    """(fadsl's inputs, Flex's score_mod, Flex's mask_mod, kept pairs)."""
    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    causal_pairs = batch * n * (n + 1) / 2
    if name == "alibi_causal":
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)], device="cuda")

        def score(s, b, h, q, kv):
            return s + slopes[h] * (kv - q)

        return {"slopes": slopes}, score, causal, causal_pairs
    if name == "t5_bias_causal":
        bias = torch.linspace(-2, 2, HEADS * 32, device="cuda").view(HEADS, 32)

        def score(s, b, h, q, kv):
            return s + bias[h, t5_bucket(q - kv)]

        return {"bias": bias}, score, causal, causal_pairs
    if name == "prefix_lm":
        prefix = torch.tensor([n // 4, n // 8, n // 2, 0][:batch], device="cuda", dtype=torch.int32)

        def mask(b, h, q, kv):
            return (kv <= q) | (kv < prefix[b])

        # above the diagonal, query i < p - 1 keeps keys i + 1 .. p - 1: p (p - 1) / 2 pairs
        extra = sum(p * (p - 1) / 2 for p in prefix.tolist())
        return {"prefix": prefix}, None, mask, causal_pairs + extra
    raise ValueError(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="16384,4096")
    parser.add_argument("--variants", default="alibi_causal,prefix_lm,t5_bias_causal")
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # (a variant's score_mod and each shape recompile it: past dynamo's default of 8 graphs it
    # would fall back to the unfused eager flex_attention, 30-60x slower)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    flex = torch.compile(flex_attention, dynamic=False)
    for n in map(int, args.seqlens.split(",")):
        batch = TOKENS // n
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v, dout = (
            torch.randn(
                batch, n, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16
            )
            for _ in range(4)
        )
        for name in args.variants.split(","):
            kern = fadsl.load(
                (ROOT / "examples/modifiers" / f"{name}.fa").read_text(), verbose=False
            )
            inputs, score, mask, pairs = variant(name, batch, n)
            block_mask = create_block_mask(mask, batch, None, n, n)
            flops = 4 * HEAD_DIM * HEADS * pairs
            qt, kt, vt, dt = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            flex_leaves = [t.detach().clone().requires_grad_() for t in (qt, kt, vt)]
            ours = kern(*leaves, **inputs)
            theirs = flex(*flex_leaves, score_mod=score, block_mask=block_mask)
            err = (ours.float() - theirs.transpose(1, 2).float()).abs().max().item()
            fwd = median_times(
                {
                    "fadsl": lambda _: kern(q, k, v, **inputs),
                    "flex": lambda _: flex(qt, kt, vt, score_mod=score, block_mask=block_mask),
                },
                5,
                20,
            )
            bwd = median_times(
                {
                    "fadsl": lambda _: torch.autograd.grad(ours, leaves, dout, retain_graph=True),
                    "flex": lambda _: torch.autograd.grad(
                        theirs, flex_leaves, dt, retain_graph=True
                    ),
                },
                3,
                10,
            )
            line = []
            for what, ms, f in (("forward", fwd, flops), ("backward", bwd, 2.5 * flops)):
                line.append(
                    f"{what} fadsl {ms['fadsl']:.3f} ms ({f / ms['fadsl'] / 1e9:.0f} TF/s), flex "
                    f"{ms['flex']:.3f} ms ({f / ms['flex'] / 1e9:.0f} TF/s), x flex "
                    f"{ms['flex'] / ms['fadsl']:.2f}"
                )
            print(
                f"{name} {batch} x {n}: " + ";  ".join(line) + f";  max |fadsl - flex| {err:.2e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
