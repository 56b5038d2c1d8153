"""`fadsl bench --calls`: the public calls as a user meets them, in one run.

Host time per call: each public call (``fadsl.attention``, ``attention_varlen``,
``attention_with_kvcache`` paged and contiguous, with and without a new token, and
``append_kv``) at a tiny shape, where the GPU's work is a few microseconds and the host's time
is what a loop of calls shows, beside SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends and
FlashAttention-4 (``flash_attn.cute``) on the same shapes where they take them; SDPA FLASH's
tiny attention call sits in every call's rounds, so that each ratio to it is of one time.
Loops of ``calls`` calls, synchronised between loops so that the launch queue never fills;
the median loop over ``rounds`` rounds in balanced orders, in microseconds per call.

Decode: paged decode steps (bf16, head_dim 128, GQA 32/8, one query row, pages of 64) through
``fadsl.attention_with_kvcache``, eager (the host in the loop) and replayed from a CUDA graph,
beside SDPA's cuDNN backend on a contiguous cache (eager and graph) and FA4's paged varlen
call (eager and graph), as TB/s of K and V read; fadsl's output checked against cuDNN's first.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

from .bench import _flash_attention_4, balanced_orders, median_times, ratio_table
from .bench_kvcache import _fa4_varlen, add_fa4, decode_tensors, graphed

# (batch, keys per sequence): the decode shapes, batch 1 x 8k to 128 x 8k and 1 x 128k
DECODE_SHAPES = ((1, 8192), (8, 8192), (32, 8192), (128, 8192), (1, 131072))
PAGE = 64
HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
AGREEMENT = 0.02


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Host microseconds per call of one loop of ``calls`` calls, then a sync."""
    import torch

    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return elapsed


def host_times(
    contenders: dict[str, Callable[[], object]], calls: int = 100, rounds: int = 31
) -> dict[str, float]:
    """Each contender's median loop (``per_call_us``) over ``rounds`` rounds in balanced
    orders (each first, and after each other, equally often), after a warm-up."""
    import torch

    names = list(contenders)
    for fn in contenders.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {n: [] for n in names}
    orders = balanced_orders(len(names))
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            samples[names[i]].append(per_call_us(contenders[names[i]], calls))
    return {n: statistics.median(s) for n, s in samples.items()}


def host_contenders() -> dict[str, dict[str, Callable[[], object]]]:
    """For each call: {contender: a call with no argument} on tiny tensors."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..runtime import public as fadsl  # the public calls (fadsl.attention, ...)

    dev, bf = "cuda", torch.bfloat16
    q, k, v = (torch.randn(1, 128, 1, HEAD_DIM, device=dev, dtype=bf) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    packed = [torch.randn(256, 4, HEAD_DIM, device=dev, dtype=bf) for _ in range(3)]
    cu = torch.tensor([0, 100, 256], device=dev, dtype=torch.int32)
    batch, pages = 2, 8
    q1 = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device=dev, dtype=bf)
    paged = [
        torch.randn(pages * batch, PAGE, HEADS_KV, HEAD_DIM, device=dev, dtype=bf) for _ in range(2)
    ]
    table = torch.arange(pages * batch, device=dev, dtype=torch.int32).view(batch, pages)
    seqlens = torch.tensor([300, 17], device=dev, dtype=torch.int32)
    new = [torch.randn(batch, 1, HEADS_KV, HEAD_DIM, device=dev, dtype=bf) for _ in range(2)]
    contiguous = [
        torch.randn(batch, 512, HEADS_KV, HEAD_DIM, device=dev, dtype=bf) for _ in range(2)
    ]

    def sdpa(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt)

        return call

    found: dict[str, dict[str, Callable[[], object]]] = {
        "attention": {
            "fadsl": lambda: fadsl.attention(q, k, v),
            "flash": sdpa(SDPBackend.FLASH_ATTENTION),
            "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        },
        "attention_varlen": {
            "fadsl": lambda: fadsl.attention_varlen(*packed, cu, cu, 156, 156),
        },
        "attention_with_kvcache paged": {
            "fadsl": lambda: fadsl.attention_with_kvcache(
                q1, *paged, seqlens, page_table=table, causal=True
            ),
        },
        "attention_with_kvcache paged + 1 new": {
            "fadsl": lambda: fadsl.attention_with_kvcache(
                q1, *paged, seqlens, *new, page_table=table, causal=True
            ),
        },
        "attention_with_kvcache contiguous": {
            "fadsl": lambda: fadsl.attention_with_kvcache(q1, *contiguous, seqlens),
        },
        "append_kv paged": {
            "fadsl": lambda: fadsl.append_kv(*paged, *new, seqlens, table),
        },
    }
    # SDPA FLASH's call in every group too, so that each public call's host time has a
    # ratio to it from the same rounds (the host's pace drifts by tens of per cent between
    # groups and runs on the GPU machine: issue 45's bar is a same-process ratio)
    for name, group in found.items():
        if name != "attention":
            group["flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    dense, varlen = _flash_attention_4(), _fa4_varlen()
    if dense is not None:
        found["attention"]["fa4"] = lambda: dense(q, k, v)
    if varlen is not None:
        found["attention_varlen"]["fa4"] = lambda: varlen(
            *packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=156, max_seqlen_k=156
        )
        found["attention_with_kvcache paged"]["fa4"] = lambda: varlen(
            q1, *paged, page_table=table, seqused_k=seqlens, causal=True
        )
    return found


def run_host(
    calls: int = 100,
    rounds: int = 31,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict:
    """Host microseconds per call of each public call beside its peers (``host_contenders``)."""
    rows = []
    for call, contenders in host_contenders().items():
        usable = {}
        for name, fn in contenders.items():
            try:
                fn()
                usable[name] = fn
            except Exception as err:  # a peer that does not take the shape: not timed
                log(f"  {call}: {name} not timed ({str(err).splitlines()[0][:80]})")
        us = host_times(usable, calls, rounds)
        rows.append({"call": call, "us": us})
        log(f"{call}: " + "  ".join(f"{n} {t:.1f}" for n, t in us.items()) + " us/call (host)")
    return {"kind": "host", "rows": rows}


def run_decode(
    shapes: tuple[tuple[int, int], ...] = DECODE_SHAPES,
    warmup: int = 16,
    runs: int = 64,
    rounds: int | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict:
    """Paged decode through the public call, eager and from a CUDA graph, beside cuDNN
    (contiguous) and FA4 (paged), each eager and graphed: TB/s of K and V read."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..runtime import public as fadsl  # the public calls (fadsl.attention, ...)

    fa4 = _fa4_varlen()
    rows = []
    for batch, length in shapes:
        q, k, v, (k_cache, v_cache), table, seqlens = decode_tensors(
            batch, length, HEADS_Q, HEADS_KV, HEAD_DIM, PAGE, torch.bfloat16
        )
        qt = q.transpose(1, 2)
        scale = HEAD_DIM**-0.5

        def ours(_):
            return fadsl.attention_with_kvcache(
                q, k_cache, v_cache, seqlens, page_table=table, softmax_scale=scale
            )

        def cudnn(_):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, k, v, scale=scale, enable_gqa=True)

        theirs = cudnn(0).transpose(1, 2)
        err = (ours(0).float() - theirs.float()).abs().max().item()
        if not err <= AGREEMENT * theirs.float().abs().max().item():
            raise RuntimeError(f"fadsl's decode differs from cuDNN's by {err:.3g}; not timed")
        eager = {"fadsl": ours, "cudnn": cudnn}
        if fa4 is not None:
            add_fa4(eager, fa4, q, k_cache, v_cache, table, seqlens, scale, log)
        contenders = dict(eager)
        contenders |= {f"{n} graph": graphed(fn) for n, fn in eager.items()}
        ms = median_times(contenders, warmup, runs, rounds)
        kv_bytes = 2 * batch * length * HEADS_KV * HEAD_DIM * k.element_size()
        row = {"batch": batch, "length": length, "ms": ms}
        row["tb_per_s"] = {n: kv_bytes / (t * 1e-3) / 1e12 for n, t in ms.items()}
        rows.append(row)
        log(
            f"batch {batch:3d} x {length:6d} keys: "
            + "  ".join(f"{n} {row['tb_per_s'][n]:5.2f}" for n in contenders)
            + " TB/s of K and V"
        )
    return {"kind": "decode", "rows": rows}


def run(calls: int = 100, rounds: int | None = None, log=None) -> dict:
    """Both parts in one run (the host times, then decode)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    return {
        "host": run_host(calls, rounds or 31, log),
        "decode": run_decode(rounds=rounds, log=log),
    }


def table(result: dict) -> str:
    host = ratio_table(
        "public calls: host microseconds per call (tiny shapes; fadsl's ratio: lower is better "
        "for fadsl where below 1)",
        "call                                   ",
        result["host"]["rows"],
        lambda row: f"{row['call']:<39s}",
        "us",
    )
    decode = ratio_table(
        f"paged decode (bf16, head_dim {HEAD_DIM}, {HEADS_Q}/{HEADS_KV} heads, pages of {PAGE}): "
        "TB/s of K and V, eager and from a CUDA graph",
        "batch x keys     ",
        result["decode"]["rows"],
        lambda row: f"{row['batch']:5d} x {row['length']:6d}  ",
        "tb_per_s",
        digits=2,
    )
    return host + "\n\n" + decode
