"""examples/modifiers/document_causal.fa's forward (the keep's tiles classed each call by
<kernel>_keep_classes, its EMPTY blocks skipped) beside the plain causal kernel of the same
tile on the same tensors (no documents: the work every document-masked tile is cut from)
and FlexAttention's document mask (torch.compile'd flex_attention with a BlockMask made once,
as a model reuses it over its layers; its making timed apart), bf16, head_dim 128, hidden
2048, documents of equal length; prints ms, ratios and fadsl's error against FlexAttention.

Usage (a Hopper GPU): python3 -P research/probes/document_mask_speed.py [--tokens 16384]
[--documents 1,8,32]"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fadsl
from fadsl.tools.bench import median_times

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--documents", default="1,8,32")
    args = parser.parse_args()
    doc_text = (ROOT / "examples/modifiers/document_causal.fa").read_text()
    document = fadsl.load(doc_text, verbose=False)
    plain = fadsl.load(_plain(doc_text), verbose=False)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    n, heads, d = args.tokens, 16, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, n, heads, d, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(3)
    )
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for docs in map(int, args.documents.split(",")):
        ids = (torch.arange(n, device="cuda") * docs // n).to(torch.int32)[None]

        def mask_mod(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

        made = median_times({"mask": lambda _: create_block_mask(mask_mod, 1, None, n, n)}, 2, 5, 1)
        block_mask = create_block_mask(mask_mod, 1, None, n, n)
        contenders = {
            "fadsl document": lambda _: document(q, k, v, q_doc=ids, kv_doc=ids),
            "fadsl causal": lambda _: plain(q, k, v),
            "flex document": lambda _: flex(qt, kt, vt, block_mask=block_mask),
        }
        ms = median_times(contenders, 10, 30)
        ours = document(q, k, v, q_doc=ids, kv_doc=ids).float()
        theirs = flex(qt, kt, vt, block_mask=block_mask).transpose(1, 2).float()
        err = (ours - theirs).abs().max().item()
        line = "  ".join(f"{name} {t:.3f}" for name, t in ms.items())
        print(
            f"{docs:3d} documents of {n // docs}: {line} ms;  document x causal "
            f"{ms['fadsl causal'] / ms['fadsl document']:.2f}, x flex "
            f"{ms['flex document'] / ms['fadsl document']:.2f};  flex's BlockMask made in "
            f"{made['mask']:.3f} ms;  max |fadsl - flex| {err:.2e}",
            flush=True,
        )


def _plain(text: str) -> str:
    """The document example without its inputs and keep: the same kernel, causal alone."""
    lines = [s for s in text.splitlines() if not s.lstrip().startswith(("input ", "keep "))]
    return "\n".join(lines).replace("kernel document_causal", "kernel document_plain") + "\n"


if __name__ == "__main__":
    main()
