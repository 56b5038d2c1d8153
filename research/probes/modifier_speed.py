"""The modifier examples (examples/modifiers/: ALiBi, prefix-LM, the T5-style bias table)
beside FlexAttention with the same score_mod / mask_mod (torch.compile'd flex_attention, its
BlockMask made once, outside the timing), forward and backward alone (torch.autograd.grad over
a graph kept from one forward), bf16, head_dim 128, 16 heads, 16k tokens per call (batch x
seqlen); TF/s over the scores each variant keeps (causal: L (L + 1) / 2 pairs a sequence;
prefix-LM adds the prefix's keys above the diagonal), 2.5x the forward's FLOPs backward.
Prints ms, TF/s, fadsl x Flex and the largest output difference (issue 41's acceptance).
With --fa4 (FlashAttention-4 installed: scripts/device.sh's fa4stage, then .fa4b/install.sh)
the score variants (ALiBi, T5) run through FA4's flash_attn_func too, `causal=True` with a
CuTe DSL score_mod and its score_mod_bwd written from the same expression (fa4_mods), and
prefix-LM with a CuTe DSL mask_mod and block-sparse tables taken from FlexAttention's
BlockMask (its partial and full lists of 128 x 128 blocks, by rows for the forward and by
columns for the backward), so FA4 skips the empty blocks as fadsl and Flex do.

Usage (a Hopper GPU): python3 -P research/probes/modifier_speed.py [--seqlens 16384,4096]
[--variants alibi_causal,prefix_lm,t5_bias_causal,document_causal] [--fa4] [--kernels]
(document_causal: 16 documents a row, fadsl's tile classes made once and passed to each call
as kern.keep_classes gives them, as FA4's and Flex's tables are.)"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

import fadsl
from fadsl.tools.bench import median_times

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # (scripts.backward_budget, for --kernels)
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
    if name == "document_causal":  # 16 documents of n / 16 tokens in each row, causal
        docs = (torch.arange(n, device="cuda", dtype=torch.int32) // (n // 16)).expand(batch, n)
        docs = docs.contiguous()

        def same_document(b, h, q, kv):
            return (docs[b, q] == docs[b, kv]) & (q >= kv)

        length = n // 16
        return (
            {"q_doc": docs, "kv_doc": docs},
            None,
            same_document,
            batch * 16 * length * (length + 1) / 2,
        )
    raise ValueError(name)


def fa4_mods(name: str, seqlen: int):
    """FA4's (score_mod, score_mod_bwd, mask_mod) for a variant. The mods see vectors of one
    element (FA4 reads aux tensors one index at a time), the score_mod the scaled score; both
    score variants add a term that does not depend on the score, so the backward passes the
    gradient through."""
    import operator

    import cutlass
    import cutlass.cute as cute

    def one(table, index, dtype):
        at = cute.make_rmem_tensor(1, cutlass.Int32)
        at.store(index)
        value = cute.make_rmem_tensor(1, dtype)
        value[0] = table[at[0]]
        return value.load()

    @cute.jit
    def passthrough(grad, s, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    if name == "alibi_causal":

        @cute.jit
        def alibi(s, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            slope = one(aux_tensors[0], h, cutlass.Float32)
            return s + slope * (kv_idx - q_idx).to(cutlass.Float32)

        return alibi, passthrough, None
    if name == "t5_bias_causal":

        @cute.jit
        def t5(s, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            d = q_idx - kv_idx
            df = d.to(cutlass.Float32)
            sixteen = cute.full_like(df, 16.0)
            wide = cute.where(operator.lt(df, sixteen), sixteen, df)
            # log(x) / log(8) = log2(x) / 3; the argument is >= 1, so truncation is floor
            far = (cute.math.log2(wide / sixteen) * cute.full_like(df, 16.0 / 3.0)).to(
                cutlass.Int32
            )
            far = far + cute.full_like(d, 16)
            bucket = cute.where(operator.lt(d, cute.full_like(d, 16)), d, far)
            bucket = cute.where(
                operator.lt(bucket, cute.full_like(d, 0)), cute.full_like(d, 0), bucket
            )
            bucket = cute.where(
                operator.gt(bucket, cute.full_like(d, 31)), cute.full_like(d, 31), bucket
            )
            term = one(aux_tensors[0], h * cute.full_like(h, 32) + bucket, cutlass.Float32)
            return s + term

        return t5, passthrough, None
    if name == "prefix_lm":

        @cute.jit
        def prefix_lm(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            prefix = one(aux_tensors[0], b, cutlass.Int32)
            return operator.le(kv_idx, q_idx) | operator.lt(kv_idx, prefix)

        return None, None, prefix_lm
    if name == "document_causal":

        @cute.jit
        def document(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
            row = b * cute.full_like(b, seqlen)
            same = operator.eq(
                one(aux_tensors[0], row + q_idx, cutlass.Int32),
                one(aux_tensors[0], row + kv_idx, cutlass.Int32),
            )
            return same & operator.le(kv_idx, q_idx)

        return None, None, document
    raise ValueError(name)


def fa4_block_sparsity(block_mask, batch: int):
    """FA4's forward and backward block-sparse tables from a FlexAttention BlockMask of
    128 x 128 blocks (heads broadcast to HEADS)."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    def tables(cnt, idx, full_cnt, full_idx):
        grow = lambda t: t.expand(batch, HEADS, *t.shape[2:]).contiguous()  # noqa: E731
        return BlockSparseTensorsTorch(
            mask_block_cnt=grow(cnt),
            mask_block_idx=grow(idx),
            full_block_cnt=grow(full_cnt),
            full_block_idx=grow(full_idx),
            block_size=(128, 128),
        )

    m = block_mask
    forward = tables(m.kv_num_blocks, m.kv_indices, m.full_kv_num_blocks, m.full_kv_indices)
    backward = tables(m.q_num_blocks, m.q_indices, m.full_q_num_blocks, m.full_q_indices)
    return forward, backward


def kernel_ms(call) -> float:
    """The kernels' device time of one call of ``call(0)``, ms (scripts/backward_budget.py's
    device_times: torch.profiler, the median of 7 calls after a warm-up)."""
    from scripts.backward_budget import device_times

    return sum(device_times(lambda: call(0), calls=7).values()) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="16384,4096")
    parser.add_argument("--variants", default="alibi_causal,prefix_lm,t5_bias_causal")
    parser.add_argument("--fa4", action="store_true", help="FlashAttention-4's column too")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="each call's kernel time (torch.profiler, the median of 7 calls) in place of the "
        "call's span: a call shorter than its host path times the host otherwise",
    )
    args = parser.parse_args()
    if args.fa4:
        from flash_attn.cute import flash_attn_func
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
            if name == "document_causal":  # classes made once, as a model's layers would
                inputs["keep_classes"] = kern.keep_classes(q, k, **inputs)
            block_mask = create_block_mask(mask, batch, None, n, n)
            flops = 4 * HEAD_DIM * HEADS * pairs
            qt, kt, vt, dt = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            flex_leaves = [t.detach().clone().requires_grad_() for t in (qt, kt, vt)]
            ours = kern(*leaves, **inputs)
            theirs = flex(*flex_leaves, score_mod=score, block_mask=block_mask)
            err = (ours.float() - theirs.transpose(1, 2).float()).abs().max().item()
            forwards = {
                "fadsl": lambda _: kern(q, k, v, **inputs),
                "flex": lambda _: flex(qt, kt, vt, score_mod=score, block_mask=block_mask),
            }
            backwards = {
                "fadsl": lambda _: torch.autograd.grad(ours, leaves, dout, retain_graph=True),
                "flex": lambda _: torch.autograd.grad(theirs, flex_leaves, dt, retain_graph=True),
            }
            mods = fa4_mods(name, n) if args.fa4 else None
            if mods is not None:
                table = next(iter(inputs.values())).reshape(-1).contiguous()
                aux = [table.float() if table.is_floating_point() else table]
                sparse = {}
                if mods[2] is not None:  # a mask: FA4 skips Flex's empty blocks
                    fwd_tables, bwd_tables = fa4_block_sparsity(block_mask, batch)
                    sparse = dict(
                        block_sparse_tensors=fwd_tables, block_sparse_tensors_bwd=bwd_tables
                    )
                fa4_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

                def fa4(a, b, c, mods=mods, aux=aux, sparse=sparse):
                    out = flash_attn_func(
                        a,
                        b,
                        c,
                        causal=mods[2] is None,
                        score_mod=mods[0],
                        score_mod_bwd=mods[1],
                        mask_mod=mods[2],
                        aux_tensors=aux,
                        **sparse,
                    )
                    return out[0] if isinstance(out, tuple) else out

                fa4_out = fa4(*fa4_leaves)
                err4 = (ours.float() - fa4_out.float()).abs().max().item()
                forwards["fa4"] = lambda _: fa4(q, k, v)
                backwards["fa4"] = lambda _: torch.autograd.grad(
                    fa4_out, fa4_leaves, dout, retain_graph=True
                )
            if args.kernels:
                fwd = {c: kernel_ms(call) for c, call in forwards.items()}
                bwd = {c: kernel_ms(call) for c, call in backwards.items()}
            else:
                fwd = median_times(forwards, 5, 20)
                bwd = median_times(backwards, 3, 10)
            line = []
            for what, ms, f in (("forward", fwd, flops), ("backward", bwd, 2.5 * flops)):
                cells = [f"{c} {t:.3f} ms ({f / t / 1e9:.0f} TF/s)" for c, t in ms.items()]
                ratios = [f"x {c} {t / ms['fadsl']:.2f}" for c, t in ms.items() if c != "fadsl"]
                line.append(f"{what} " + ", ".join(cells + ratios))
            errs = f"max |fadsl - flex| {err:.2e}"
            if mods is not None:
                errs += f", |fadsl - fa4| {err4:.2e}"
            print(f"{name} {batch} x {n}: " + ";  ".join(line) + f";  {errs}", flush=True)


if __name__ == "__main__":
    main()
