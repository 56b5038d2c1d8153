"""`fadsl bench` on a `varlen on` spec: packed batches of sequences of mixed lengths, timed
against FlashAttention-4's varlen forward (``flash_attn.cute.flash_attn_varlen_func``) where
installed; with ``backward`` the backward (through autograd, after one forward that keeps its
graph, as bench_backward.py times the padded one), checked first on the first and the
longest sequence against PyTorch's SDPA on that sequence alone, TF/s = 2.5 x the forward's.

A workload for a maximum length L: sequence lengths drawn (seeded, so every contender and
every run sees the same batch) uniformly from [L / 8, L] until they hold ``tokens`` tokens,
the last one cut to fit; keys as long as queries (prefill). TF/s counts each sequence's own
FLOPs (half of them under the causal mask). Before timing, fadsl's output is checked against
float32 attention on the first and the longest sequence: a wrong kernel is never timed. The
contenders run in balanced orders (bench.py's Williams design), warm-up first, median of the
rounds' medians.

With padded specs to time against (``against``, `fadsl bench VARLEN --against PADDED`), every
sequence is L long (``tokens`` / L of them) and each padded kernel runs the same tokens as a
batch (tokens / L, L, heads, head_dim): what packing costs against the padded layout on equal
work (FlashAttention's "varlen at least 0.95x the padded kernel" question).

An 8-bit spec (`--dtype e4m3|e5m2`) takes bench.operands' quantized tokens, one descale per
head (as every sequence's row of the call's (sequences, heads) descales), and is checked
against float32 attention of the values it reads within research/fp8-forward.md §4's bound;
FlashAttention-4 runs the dequantized values in bf16, an 8-bit padded spec the same bytes.
"""

from __future__ import annotations

import random
import sys
from typing import Callable

from ..ir import Dtype
from ..runtime.attention import FlashAttention
from .bench import DEFAULT_HEADS, fp8_bound, median_times, operands, ratio_table
from .bench_backward import BACKWARD_FLOPS, check_grads, grad_of

DEFAULT_MAX_SEQLENS = (1024, 4096, 16384)
# fadsl's output against float32 attention, as a share of the largest output entry
AGREEMENT = 0.02


def lengths_for(max_len: int, tokens: int, seed: int = 0) -> list[int]:
    """Sequence lengths in [max_len / 8, max_len] adding up to ``tokens`` (the last one cut
    to fit, so it may be shorter)."""
    rng = random.Random(seed * 1_000_003 + max_len)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(max(1, max_len // 8), max_len), tokens - sum(lengths)))
    return lengths


def _fa4_varlen() -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # not installed, or its compiler library missing: not timed
        return None
    return flash_attn_varlen_func


def run(
    kern: FlashAttention,
    max_seqlens: tuple[int, ...] = DEFAULT_MAX_SEQLENS,
    causal: bool = False,
    tokens: int = 32768,
    heads: int = DEFAULT_HEADS,
    warmup: int = 16,
    runs: int = 64,
    rounds: int | None = None,
    dtype_name: str | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    backward: bool = False,
    against: tuple[FlashAttention, ...] = (),
) -> dict:
    import torch

    from .bench import variants

    if backward and not kern.has_backward:
        raise ValueError(f"{kern.config.name} has no backward block: nothing to time")
    name = dtype_name or kern.config.dtypes[0].value
    eight = Dtype(name).is_8bit
    d = kern.config.head_dim
    scale = d**-0.5
    fa4 = _fa4_varlen()
    padded = dict(list(variants(kern, against, name).items())[1:])  # "fadsl:<kernel>": kernel
    for other in against:
        if other.is_varlen or (backward and not other.has_backward):
            raise ValueError(
                f"--against {other.compiled.file}: a padded spec"
                + (" with a backward block" if backward else "")
                + " is what a varlen spec is timed against"
            )
    rows = []
    for max_len in max_seqlens:
        if against and tokens % max_len:
            raise ValueError(
                f"--tokens {tokens} is not a multiple of the sequence length {max_len}"
            )
        lengths = [max_len] * (tokens // max_len) if against else lengths_for(max_len, tokens)
        cu = torch.tensor([0, *_prefix(lengths)], dtype=torch.int32, device="cuda")
        ops = operands(name, (1, tokens, heads, d))
        q, k, v = (t[0] for t in ops.args)
        # 8-bit: one descale a head, each sequence's row of the call's (sequences, heads)
        scales = {n: t.expand(len(lengths), heads) for n, t in ops.keywords.items()}
        views = tuple(t[0] for t in ops.views)  # (FA4's: 8-bit values dequantized, bf16)
        out = torch.empty(q.shape, dtype=kern.out_torch_dtype or q.dtype, device="cuda")
        longest = max(lengths)
        if backward:
            contenders = _backward_contenders(kern, fa4, q, k, v, cu, lengths, scale, causal, log)
        else:
            contenders = {
                "fadsl": lambda _, q=q, k=k, v=v, cu=cu, out=out: kern.varlen(
                    q, k, v, cu, cu, longest, longest, scale, out=out, **scales
                )
            }
            contenders["fadsl"](0)
            values = tuple(t[0] for t in ops.values())  # as the kernel reads them
            _check(out, *values, lengths, scale, causal, max_len, eight)
        for label, other in padded.items():  # the same tokens as a padded batch
            contenders[label] = _padded_call(other, q, k, v, max_len, scale, backward, scales)
        if fa4 is not None and not backward:

            def fa4_call(_, q=views[0], k=views[1], v=views[2], cu=cu, longest=longest):
                return fa4(
                    q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                    max_seqlen_k=longest, softmax_scale=scale, causal=causal,
                )  # fmt: skip

            try:
                fa4_call(0)
                contenders["fa4"] = fa4_call
            except Exception as err:  # FA4 not built for this shape: not timed
                log(f"  fa4: not timed ({str(err).splitlines()[0][:80]})")
        names = list(contenders)
        ms = median_times(contenders, warmup, runs, rounds)
        work = sum(4.0 * heads * n * n * d for n in lengths) / (2 if causal else 1)
        work *= BACKWARD_FLOPS if backward else 1.0
        row = {
            "max_seqlen": max_len,
            "sequences": len(lengths),
            "tokens": tokens,
            "heads": heads,
            "head_dim": d,
            "ms": ms,
        }
        row["tflops"] = {n: work / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
        rows.append(row)
        log(
            f"max seqlen {max_len:6d} ({len(lengths)} sequences): "
            + "  ".join(f"{n} {row['tflops'][n]:6.1f}" for n in names)
            + " TF/s"
        )
    return {
        "kernel": kern.config.name,
        "causal": causal,
        "dtype": name,
        "backward": backward,
        "equal_lengths": bool(against),
        "rows": rows,
    }


def _padded_call(
    other: FlashAttention, q, k, v, seqlen: int, scale: float, backward: bool, scales: dict
):
    """A padded kernel's forward (or, with ``backward``, its backward through autograd) on the
    packed tokens viewed as a batch of sequences of ``seqlen`` (``scales``: an 8-bit call's
    descales, a row per sequence, so per batch)."""
    import torch

    batch = q.shape[0] // seqlen
    as_batch = [t.view(batch, seqlen, *t.shape[1:]) for t in (q, k, v)]
    if not backward:
        out = torch.empty(
            as_batch[0].shape, dtype=other.out_torch_dtype or q.dtype, device=q.device
        )
        return lambda _: other(*as_batch, scale, out=out, **scales)
    leaves = [t.clone().requires_grad_() for t in as_batch]
    out = other(*leaves, scale)
    return grad_of(out, leaves, torch.randn_like(out))


def _backward_contenders(kern, fa4, q, k, v, cu, lengths, scale, causal, log) -> dict:
    """fadsl's varlen backward (and FA4's, where it runs) as timed calls, fadsl's gradients
    checked first."""
    import torch

    longest = max(lengths)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kern.varlen(*leaves, cu, cu, longest, longest, scale)
    grads = torch.autograd.grad(out, leaves, dout, retain_graph=True)
    _check_grads(grads, q, k, v, dout, lengths, scale, causal)
    contenders = {"fadsl": grad_of(out, leaves, dout)}
    if fa4 is not None:
        ours = [t.clone().requires_grad_() for t in (q, k, v)]
        try:
            o4 = fa4(
                *ours, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                max_seqlen_k=longest, softmax_scale=scale, causal=causal,
            )  # fmt: skip
            o4 = o4[0] if isinstance(o4, tuple) else o4
            contenders["fa4"] = grad_of(o4, ours, dout)
            contenders["fa4"](0)
        except Exception as err:  # FA4's varlen backward not built here: not timed
            contenders.pop("fa4", None)
            log(f"  fa4: not timed ({str(err).splitlines()[0][:80]})")
    return contenders


def _check_grads(grads, q, k, v, dout, lengths, scale, causal) -> None:
    """fadsl's dq, dk, dv on the first and the longest sequence against PyTorch's SDPA
    backward on that sequence alone (same dtype: the agreement of two correct backwards)."""
    import torch
    import torch.nn.functional as F

    starts = [0, *_prefix(lengths)]
    group = q.shape[1] // k.shape[1]
    for b in {0, max(range(len(lengths)), key=lengths.__getitem__)}:
        rows = slice(starts[b], starts[b + 1])
        if rows.stop == rows.start:
            continue
        mine = [t[rows].detach().transpose(0, 1)[None].requires_grad_() for t in (q, k, v)]
        keys, values = (t.repeat_interleave(group, dim=1) for t in mine[1:])  # GQA
        o = F.scaled_dot_product_attention(mine[0], keys, values, is_causal=causal, scale=scale)
        theirs = torch.autograd.grad(o, mine, dout[rows].transpose(0, 1)[None])
        check_grads(
            [g[rows] for g in grads],
            [t[0].transpose(0, 1) for t in theirs],
            "SDPA",
            lengths[b],
            f"fadsl (varlen sequence {b})",
        )


def _prefix(lengths: list[int]) -> list[int]:
    total, found = 0, []
    for n in lengths:
        total += n
        found.append(total)
    return found


# float32 scores of one chunk of heads (1 GiB); the check holds about twice that at once (the
# scores, masked in place, and their softmax)
REFERENCE_SCORES = 1 << 28


def _check(out, q, k, v, lengths, scale, causal, max_len, eight: bool = False) -> None:
    """fadsl's output on the first and the longest sequence against float32 attention, a few
    heads at a time (the scores of one sequence of 16384 over 32 heads are 34 GB); within
    AGREEMENT of the largest output entry, or an 8-bit kernel's bound (``eight``: q, k and v
    as it reads them, dequantized)."""
    import torch

    starts = [0, *_prefix(lengths)]
    group = q.shape[1] // k.shape[1]  # GQA: query heads per K/V head
    for b in {0, max(range(len(lengths)), key=lengths.__getitem__)}:
        rows = slice(starts[b], starts[b + 1])
        n = rows.stop - rows.start
        if n == 0:
            continue  # no row to check
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1) if causal else None
        per_chunk = max(1, REFERENCE_SCORES // (n * n))  # heads a chunk
        for h0 in range(0, q.shape[1], per_chunk):
            heads = slice(h0, h0 + per_chunk)
            kv_heads = torch.arange(q.shape[1], device=q.device)[heads] // group
            qs = q[rows, heads].transpose(0, 1).float()
            ks, vs = (t[rows][:, kv_heads].transpose(0, 1).float() for t in (k, v))
            scores = torch.matmul(qs, ks.transpose(1, 2)).mul_(scale)
            if above is not None:
                scores.masked_fill_(above, float("-inf"))
            ref = torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1)
            err = (out[rows, heads].float() - ref).abs().max().item()
            ref_max = ref.abs().max().item()
            limit = fp8_bound(vs.abs().max().item(), ref_max) if eight else AGREEMENT * ref_max
            if not err <= limit:
                raise RuntimeError(
                    f"fadsl's output on sequence {b} (max seqlen {max_len}) differs from "
                    f"float32 attention by {err:.3g}; not timed"
                )


def table(result: dict) -> str:
    rows = result["rows"]
    lengths = "every length L" if result.get("equal_lengths") else "lengths uniform in [L/8, L]"
    return ratio_table(
        f"{result['kernel']} varlen{' backward' if result.get('backward') else ''} "
        f"({'causal' if result['causal'] else 'no mask'}, "
        f"{result['dtype']}), {lengths}, {rows[0]['tokens'] if rows else 0} "
        "tokens",
        "max L  seqs  ",
        rows,
        lambda row: f"{row['max_seqlen']:5d}  {row['sequences']:4d}  ",
        "tflops",
    )
