"""`fadsl bench --backward`: the backward pass timed against PyTorch's FlashAttention and cuDNN
backends and FlashAttention-4's backward, where installed.

Each contender's backward alone is timed: its forward runs once on the same q, k, v (and
keeps its graph), then ``torch.autograd.grad`` of the output with the same dO is timed,
warm-up first, median over the runs, the contenders in balanced orders (bench.py's Williams
design, for the power cap's sake). fadsl's is timed the same way, through autograd, and so
is each variant of ``against`` (other specs with a backward block, the same head_dim and
mask: ``fadsl:<kernel>``). TF/s follows FlashAttention's convention: 2.5 x the forward's
FLOPs / backward time. Before any timing, every fadsl contender's dQ, dK and dV are checked
against the cuDNN (else FLASH) backend's on the same inputs: a wrong kernel is never timed.
"""

from __future__ import annotations

import sys
from typing import Callable

from ..runtime.arguments import torch_dtype_of
from ..runtime.attention import FlashAttention
from .bench import (
    DEFAULT_HEADS,
    DEFAULT_SEQLENS,
    _backends,
    _flash_attention_4,
    median_times,
    ratio_table,
    flops,
    variants,
)

BACKWARD_FLOPS = 2.5  # times the forward's (FlashAttention's convention)
# fadsl's gradients against a backend's, as a share of the largest gradient entry: bf16's
# 8 bits of mantissa leave about 2^-8 between two correct backwards
AGREEMENT = 0.03


def run(
    kern: FlashAttention,
    seqlens: tuple[int, ...] = DEFAULT_SEQLENS,
    causal: bool = False,
    tokens: int = 16384,
    heads: int = DEFAULT_HEADS,
    warmup: int = 8,
    runs: int = 32,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
    dtype_name: str | None = None,
    against: tuple[FlashAttention, ...] = (),
    named: dict[str, FlashAttention] | None = None,
) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    name = dtype_name or kern.config.dtypes[0].value
    # "fadsl", then "fadsl:<kernel>" each; or the caller's names (fadsl tune --backward)
    ours_by_name = named if named is not None else variants(kern, against, name)
    for label, each in ours_by_name.items():
        if not each.has_backward:
            raise ValueError(f"{each.config.name} has no backward block: nothing to time")
    if name not in {d.value for d in kern.config.dtypes}:
        raise ValueError(f"{kern.config.name} is not built for {name}")
    dtype = torch_dtype_of(name)
    d = kern.config.head_dim
    backends = _backends()
    fa4 = _flash_attention_4()  # its autograd runs FA4's backward
    rows = []
    for seqlen in seqlens:
        batch = max(1, tokens // seqlen)
        shape = (batch, seqlen, heads, d)
        q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(4))
        contenders: dict[str, Callable[[int], object]] = {}
        ours = {}  # each fadsl contender's gradients, checked before any timing
        for label, each in ours_by_name.items():
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = each(*leaves)
            contenders[label] = grad_of(out, leaves, dout)
            ours[label] = torch.autograd.grad(out, leaves, dout, retain_graph=True)
        checked = False
        for name, backend in backends.items():
            qt, kt, vt = (t.transpose(1, 2).requires_grad_() for t in (q, k, v))
            try:
                with sdpa_kernel([backend]):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                theirs = torch.autograd.grad(
                    o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True
                )
            except RuntimeError as err:
                log(f"  {name}: not timed ({str(err).splitlines()[0][:80]})")
                continue
            if not checked:
                for label, grads in ours.items():
                    check_grads(grads, [t.transpose(1, 2) for t in theirs], name, seqlen, label)
                checked = True
            contenders[name] = grad_of(o, (qt, kt, vt), dout.transpose(1, 2))
        if fa4 is not None:
            q4, k4, v4 = (t.clone().requires_grad_() for t in (q, k, v))
            try:
                o4 = fa4(q4, k4, v4, causal=causal)
                o4 = o4[0] if isinstance(o4, tuple) else o4
                contenders["fa4"] = grad_of(o4, (q4, k4, v4), dout)
            except Exception as err:  # FA4 not built for this shape: not timed
                log(f"  fa4: not timed ({str(err).splitlines()[0][:80]})")
        names = list(contenders)
        ms = median_times(contenders, warmup, runs, None)
        work = BACKWARD_FLOPS * flops(batch, heads, seqlen, seqlen, d, causal)
        row = {
            "seqlen": seqlen,
            "batch": batch,
            "heads": heads,
            "head_dim": d,
            "ms": ms,
        }
        row["tflops"] = {n: work / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
        rows.append(row)
        log(
            f"seqlen {seqlen:6d} batch {batch:3d}: "
            + "  ".join(f"{n} {row['tflops'][n]:6.1f}" for n in names)
            + " TF/s (backward)"
        )
    return {"kernel": kern.config.name, "causal": causal, "dtype": str(dtype), "rows": rows}


def grad_of(out, inputs, dout) -> Callable[[int], object]:
    import torch

    def backward(_: int):
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)

    return backward


def check_grads(ours, theirs, name: str, seqlen: int, label: str = "fadsl") -> None:
    """fadsl's dq, dk, dv against another backward's (``name``), within AGREEMENT of the
    largest entry; RuntimeError (not timed) otherwise."""
    for what, a, b in zip(("dq", "dk", "dv"), ours, theirs):
        scale = b.float().abs().max().item()
        err = (a.float() - b.float()).abs().max().item()
        if not err <= AGREEMENT * scale:
            raise RuntimeError(
                f"{label}'s {what} at seqlen {seqlen} differs from {name}'s by {err:.3g} "
                f"(largest entry {scale:.3g}); not timed"
            )


def table(result: dict, first: str = "fadsl") -> str:
    """The timing as a table, ``first`` (a contender's name) first with its ratio to each."""
    mask = "causal" if result["causal"] else "no mask"
    return ratio_table(
        f"{result['kernel']} backward ({mask}), TF/s = 2.5 x forward FLOPs / time",
        "seqlen  ",
        result["rows"],
        lambda row: f"{row['seqlen']:6d}  ",
        "tflops",
        first=first,
    )
