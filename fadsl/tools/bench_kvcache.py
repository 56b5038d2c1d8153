"""`fadsl bench` on a `kv_cache` spec: decode steps (one query row per sequence), timed as the
bytes of K and V read per second, against SDPA's cuDNN and FLASH backends on the same keys in
a contiguous (batch, heads_kv, length, head_dim) layout and FlashAttention-4 on the same
paged cache (``flash_attn.cute.flash_attn_varlen_func`` with a page table), where installed.

Each shape (batch, length): every sequence holds ``length`` keys; q is (batch, 1, heads_q,
head_dim); a paged spec's page table is a random permutation of the pages. fadsl's output is
checked against cuDNN's (else FLASH's) before timing. Each contender's call is captured in a
CUDA graph and replayed, as a server runs its decode steps (so that the host's time per call,
tens of microseconds against a few for a short cache, is not what is timed); contenders run
in balanced orders (bench.py's Williams design), warm-up first, median of the rounds' medians.
"""

from __future__ import annotations

import sys
from typing import Callable

from ..runtime.attention import FlashAttention
from .bench import _backends, median_times, ratio_table

# (batch, keys per sequence): batch 1 to 128, 4k to 128k keys, at most 1M keys in all
DEFAULT_SHAPES = (
    (1, 4096), (1, 32768), (1, 131072), (8, 16384), (8, 131072), (32, 4096), (32, 32768),
    (128, 4096), (128, 8192),
)  # fmt: skip
AGREEMENT = 0.02


def _fa4_varlen() -> Callable | None:
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def decode_tensors(batch, length, heads_q, heads_kv, head_dim, page, dtype, device="cuda"):
    """One decode step's tensors: q (batch, 1, heads_q, head_dim); the keys and values as
    SDPA reads them, (batch, heads_kv, length, head_dim); the same keys in the spec's cache,
    paged through a random permutation of the pages (page > 0; rows past a sequence's end
    zero) or contiguous (page 0, table None); and the lengths. Returns (q, k, v, (k_cache,
    v_cache), table, seqlens)."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(batch, 1, heads_q, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    if not page:
        return q, k, v, tuple(t.transpose(1, 2).contiguous() for t in (k, v)), None, seqlens
    per = -(-length // page)
    order = torch.randperm(batch * per, device=device)
    table = order.view(batch, per).to(torch.int32).contiguous()
    caches = []
    for src in (k, v):
        dst = torch.empty(batch * per, page, heads_kv, head_dim, device=device, dtype=dtype)
        flat = F.pad(src.transpose(1, 2), (0, 0, 0, 0, 0, per * page - length))
        dst[order] = flat.reshape(batch * per, page, heads_kv, head_dim)
        caches.append(dst)
    return q, k, v, tuple(caches), table, seqlens


def add_fa4(contenders: dict, fa4, q, k_cache, v_cache, table, seqlens, scale, log) -> None:
    """FA4's paged decode (``fa4``: flash_attn_varlen_func) added to ``contenders`` as "fa4"
    where it takes the shape (else logged, not timed)."""

    def fa4_call(_):
        return fa4(q, k_cache, v_cache, page_table=table, seqused_k=seqlens, softmax_scale=scale)

    try:
        fa4_call(0)
        contenders["fa4"] = fa4_call
    except Exception as err:
        log(f"  fa4: not timed ({str(err).splitlines()[0][:80]})")


def run(
    kern: FlashAttention,
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES,
    heads_q: int = 32,
    heads_kv: int = 8,
    warmup: int = 16,
    runs: int = 64,
    rounds: int | None = None,
    dtype_name: str | None = None,
    graphs: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    name = dtype_name or kern.config.dtypes[0].value
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    d = kern.config.head_dim
    page = kern.config.features.kv_cache
    scale = d**-0.5
    fa4 = _fa4_varlen()
    rows = []
    for batch, length in shapes:
        q, k, v, (k_cache, v_cache), table, seqlens = decode_tensors(
            batch, length, heads_q, heads_kv, d, page, dtype
        )
        out = torch.empty_like(q)
        contenders: dict[str, Callable[[int], object]] = {
            "fadsl": lambda _: kern.kvcache(q, k_cache, v_cache, seqlens, table, out=out)
        }
        contenders["fadsl"](0)
        qt = q.transpose(1, 2)
        checked = False
        for backend_name, backend in _backends().items():

            def sdpa(_, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(qt, k, v, scale=scale, enable_gqa=True)

            try:
                theirs = sdpa(0).transpose(1, 2)
            except RuntimeError as err:
                log(f"  {backend_name}: not timed ({str(err).splitlines()[0][:80]})")
                continue
            if not checked:
                err = (out.float() - theirs.float()).abs().max().item()
                if not err <= AGREEMENT * theirs.float().abs().max().item():
                    raise RuntimeError(
                        f"fadsl's decode differs from {backend_name}'s by {err:.3g}; not timed"
                    )
                checked = True
            contenders[backend_name] = sdpa
        if fa4 is not None and page:
            add_fa4(contenders, fa4, q, k_cache, v_cache, table, seqlens, scale, log)
        if graphs:
            contenders = {n: graphed(fn) for n, fn in contenders.items()}
        names = list(contenders)
        ms = median_times(contenders, warmup, runs, rounds)
        kv_bytes = 2 * batch * length * heads_kv * d * k.element_size()
        row = {
            "batch": batch,
            "length": length,
            "ms": ms,
        }
        row["tb_per_s"] = {n: kv_bytes / (ms * 1e-3) / 1e12 for n, ms in row["ms"].items()}
        rows.append(row)
        log(
            f"batch {batch:3d} x {length:6d} keys: "
            + "  ".join(f"{n} {row['tb_per_s'][n]:5.2f}" for n in names)
            + " TB/s of K and V"
        )
    return {
        "kernel": kern.config.name,
        "graphs": graphs,
        "page_size": page,
        "heads": [heads_q, heads_kv],
        "dtype": name,
        "rows": rows,
    }


def graphed(fn: Callable[[int], object]) -> Callable[[int], object]:
    """``fn`` captured in a CUDA graph (as a server runs its decode steps): a call replays it,
    so that the host's time per call is not what is timed."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)  # warm: built, loaded, allocated outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(0)
    return lambda _: graph.replay()


def table(result: dict) -> str:
    return ratio_table(
        f"{result['kernel']} decode (page {result['page_size'] or 'contiguous'}, heads "
        f"{result['heads'][0]}/{result['heads'][1]}, {result['dtype']}): TB/s of K and V read"
        + (", each call a CUDA graph replay" if result["graphs"] else ""),
        "batch  keys    ",
        result["rows"],
        lambda row: f"{row['batch']:5d}  {row['length']:6d}  ",
        "tb_per_s",
        digits=2,
    )
