"""examples/modifiers/document_causal.fa (the keep's tiles classed each call by
<kernel>_keep_classes, its EMPTY blocks skipped; the backward classes its own tiles) beside
the plain causal kernel of the same tiles on the same tensors (no documents: the work every
document-masked tile is cut from) and FlexAttention's document mask (torch.compile'd
flex_attention with a BlockMask made once, as a model reuses it over its layers; its making
timed apart), bf16, head_dim 128, 16 heads, documents of equal length; forward and (with
--backward) backward alone (torch.autograd.grad over a graph kept from one forward); "fadsl
reused" passes classes made once (kern.keep_classes), as a model's layers would. Prints
ms, TF/s counted over the kept scores only (documents x L (L + 1) / 2 pairs; FLOPs 4 d heads
per pair forward, 2.5 times that backward), ratios, and fadsl's error against FlexAttention.

Usage (a Hopper GPU): python3 -P research/probes/document_mask_speed.py [--tokens 16384]
[--documents 1,8,16,32] [--backward]"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fadsl
from fadsl.tools.bench import median_times

ROOT = Path(__file__).resolve().parents[2]
HEADS, HEAD_DIM = 16, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--documents", default="1,8,32")
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    doc_text = (ROOT / "examples/modifiers/document_causal.fa").read_text()
    document = fadsl.load(doc_text, verbose=False)
    plain = fadsl.load(_plain(doc_text), verbose=False)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    n = args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, n, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(4)
    )
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for docs in map(int, args.documents.split(",")):
        ids = (torch.arange(n, device="cuda") * docs // n).to(torch.int32)[None]

        def mask_mod(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

        made = median_times({"mask": lambda _: create_block_mask(mask_mod, 1, None, n, n)}, 2, 5, 1)
        block_mask = create_block_mask(mask_mod, 1, None, n, n)
        lengths = torch.bincount(ids[0].long()).double()
        kept = (lengths * (lengths + 1) / 2).sum().item()
        causal_pairs = n * (n + 1) / 2
        fwd_flops = 4 * HEAD_DIM * HEADS * kept
        classes = document.keep_classes(q, k, q_doc=ids, kv_doc=ids)
        made_ours = median_times(
            {"classes": lambda _: document.keep_classes(q, k, q_doc=ids, kv_doc=ids)}, 2, 10, 1
        )
        contenders = {
            "fadsl document": lambda _: document(q, k, v, q_doc=ids, kv_doc=ids),
            "fadsl reused": lambda _: document(
                q, k, v, q_doc=ids, kv_doc=ids, keep_classes=classes
            ),
            "fadsl causal": lambda _: plain(q, k, v),
            "flex document": lambda _: flex(qt, kt, vt, block_mask=block_mask),
        }
        flops = {
            "fadsl document": fwd_flops,
            "fadsl reused": fwd_flops,
            "fadsl causal": 4 * HEAD_DIM * HEADS * causal_pairs,
            "flex document": fwd_flops,
        }
        ms = median_times(contenders, 10, 30)
        ours = document(q, k, v, q_doc=ids, kv_doc=ids).float()
        theirs = flex(qt, kt, vt, block_mask=block_mask).transpose(1, 2).float()
        err = (ours - theirs).abs().max().item()
        _report("forward", docs, n, ms, flops, made["mask"], err)
        print(
            f"  fadsl's keep_classes made (forward and backward) in {made_ours['classes']:.3f} ms"
        )
        if args.backward:
            ms, err = _backward(document, plain, flex, block_mask, (q, k, v, dout), ids, classes)
            _report("backward", docs, n, ms, {c: 2.5 * f for c, f in flops.items()}, 0.0, err)


def _backward(document, plain, flex, block_mask, tensors, ids, classes):
    """Each contender's backward alone (ms), over a graph made once; and the largest dQ,
    dK, dV difference between fadsl's and FlexAttention's."""
    q, k, v, dout = tensors
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    flex_leaves = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    outs = {
        "fadsl document": document(*leaves, q_doc=ids, kv_doc=ids),
        "fadsl reused": document(*leaves, q_doc=ids, kv_doc=ids, keep_classes=classes),
        "fadsl causal": plain(*leaves),
        "flex document": flex(*flex_leaves, block_mask=block_mask),
    }
    grads = {"flex document": dout.transpose(1, 2).contiguous()}

    def backward(name):
        found = flex_leaves if name == "flex document" else leaves
        return lambda _: torch.autograd.grad(
            outs[name], found, grads.get(name, dout), retain_graph=True
        )

    ms = median_times({name: backward(name) for name in outs}, 5, 20)
    ours = backward("fadsl document")(0)
    theirs = [g.transpose(1, 2) for g in backward("flex document")(0)]
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs))
    return ms, err


def _report(what, docs, n, ms, flops, mask_ms, err) -> None:
    line = "  ".join(
        f"{name} {t:.3f} ms ({flops[name] / t / 1e9:.0f} TF/s)" for name, t in ms.items()
    )
    tf = {name: flops[name] / t for name, t in ms.items()}
    made = f";  flex's BlockMask made in {mask_ms:.3f} ms" if mask_ms else ""
    print(
        f"{what} {docs:3d} documents of {n // docs}: {line};  document x causal TF/s "
        f"{tf['fadsl document'] / tf['fadsl causal']:.2f}, x flex "
        f"{ms['flex document'] / ms['fadsl document']:.2f} (reused {ms['flex document'] / ms['fadsl reused']:.2f}){made};  max |fadsl - flex| {err:.2e}",
        flush=True,
    )


def _plain(text: str) -> str:
    """The document example without its inputs and keep: the same kernel, causal alone."""
    lines = [s for s in text.splitlines() if not s.lstrip().startswith(("input ", "keep "))]
    return "\n".join(lines).replace("kernel document_causal", "kernel document_plain") + "\n"


if __name__ == "__main__":
    main()
