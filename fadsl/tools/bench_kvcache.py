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

An 8-bit spec (`--dtype e4m3|e5m2`) reads q and its cache quantized by fadsl.fp8.quantize,
a descale per (batch, K/V head); the other contenders read the values it reads, dequantized
to bf16, and fadsl's output is checked against float32 attention of them within
research/fp8-forward.md §4's bound (bench.fp8_bound). Its TB/s count 2 bytes an element as
theirs do (fadsl reads half as many), so that the ratios are of time.
"""

from __future__ import annotations

import sys
from typing import Callable

from ..ir import Dtype
from ..runtime.arguments import torch_dtype_of
from ..runtime.attention import FlashAttention
from .bench import _backends, fp8_bound, median_times, ratio_table

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


def decode_tensors(
    batch, length, heads_q, heads_kv, head_dim, page, dtype, device="cuda", caches: bool = True
):
    """One decode step's tensors: q (batch, 1, heads_q, head_dim); the keys and values as
    SDPA reads them, (batch, heads_kv, length, head_dim); the same keys in the spec's cache,
    paged through a random permutation of the pages (page > 0; rows past a sequence's end
    zero) or contiguous (page 0, table None), or (None, None) without ``caches`` (a caller
    that builds its own from the table); and the lengths. Returns (q, k, v, (k_cache,
    v_cache), table, seqlens)."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(batch, 1, heads_q, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), length, dtype=torch.int32, device=device)
    if not page:
        made = tuple(t.transpose(1, 2).contiguous() for t in (k, v)) if caches else (None, None)
        return q, k, v, made, None, seqlens
    per = -(-length // page)
    table = torch.randperm(batch * per, device=device).view(batch, per).to(torch.int32)
    table = table.contiguous()
    made = tuple(paged(t.transpose(1, 2), table, page) for t in (k, v)) if caches else (None, None)
    return q, k, v, made, table, seqlens


def paged(rows, table, page: int):
    """``rows`` (batch, length, heads_kv, head_dim) as a paged cache through ``table`` (batch,
    pages a sequence): sequence b's page i is page table[b, i]; rows past its end zero."""
    import torch
    import torch.nn.functional as F

    batch, length, heads_kv, head_dim = rows.shape
    per = table.shape[1]
    dst = torch.zeros(batch * per, page, heads_kv, head_dim, device=rows.device, dtype=rows.dtype)
    flat = F.pad(rows.view(torch.uint8) if rows.element_size() == 1 else rows,
                 (0, 0, 0, 0, 0, per * page - length))  # fmt: skip
    dst.view(flat.dtype)[table.reshape(-1).long()] = flat.reshape(batch * per, page, heads_kv, -1)
    return dst


def quantized_step(q, k, v, table, page: int, dtype):
    """An 8-bit decode step from decode_tensors' (float32) tensors: q and the cache quantized
    a descale per (batch, K/V head) (fadsl.fp8.quantize), the other contenders' q, k and v the
    values the kernel reads, dequantized to bf16. Returns (q8, (k8, v8) caches, descales
    (q, k, v), q, k, v in bf16)."""
    import torch

    from ..fp8 import quantize

    heads_kv = k.shape[1]
    q8, qd = quantize(q, dtype, scale_heads=heads_kv)
    k8, kd = quantize(k.transpose(1, 2).contiguous(), dtype)
    v8, vd = quantize(v.transpose(1, 2).contiguous(), dtype)
    group = q.shape[2] // heads_kv
    q16 = (q8.float() * qd.repeat_interleave(group, 1)[:, None, :, None]).to(torch.bfloat16)
    k16, v16 = (
        (t8.float() * d[:, None, :, None]).to(torch.bfloat16).transpose(1, 2)
        for t8, d in ((k8, kd), (v8, vd))
    )
    caches8 = (k8, v8) if not page else tuple(paged(t, table, page) for t in (k8, v8))
    return q8, caches8, (qd, kd, vd), q16, k16, v16


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
    eight = Dtype(name).is_8bit
    dtype = torch_dtype_of(name)
    d = kern.config.head_dim
    page = kern.config.features.kv_cache
    scale = d**-0.5
    fa4 = _fa4_varlen()
    rows = []
    for batch, length in shapes:
        q, k, v, (k_cache, v_cache), table, seqlens = decode_tensors(
            batch, length, heads_q, heads_kv, d, page, torch.float32 if eight else dtype,
            caches=not eight,  # (8 bits: quantized_step pages its own through the table)
        )  # fmt: skip
        descales = {}
        if eight:
            q8, (k8, v8), found, q, k, v = quantized_step(q, k, v, table, page, dtype)
            descales = dict(zip(("q_descale", "k_descale", "v_descale"), found))
            ours = (q8, k8, v8)
            # fa4 reads the dequantized values in its (bf16) cache
            k_cache, v_cache = (
                (
                    t.transpose(1, 2).contiguous()
                    if not page
                    else paged(t.transpose(1, 2), table, page)
                )
                for t in (k, v)
            )
        else:
            ours = (q, k_cache, v_cache)
        out = torch.empty(q.shape, device=q.device, dtype=kern.out_torch_dtype or q.dtype)
        contenders: dict[str, Callable[[int], object]] = {
            "fadsl": lambda _: kern.kvcache(*ours, seqlens, table, out=out, **descales)
        }
        contenders["fadsl"](0)
        qt = q.transpose(1, 2)
        checked = False
        if eight:  # against float32 attention of the values the kernel reads
            ref = F.scaled_dot_product_attention(
                qt.float(), k.float(), v.float(), scale=scale, enable_gqa=True
            ).transpose(1, 2)
            err = (out.float() - ref).abs().max().item()
            if not err <= fp8_bound(v.float().abs().max().item(), ref.abs().max().item()):
                raise RuntimeError(f"fadsl's 8-bit decode misses its bound by {err:.3g}; not timed")
            checked = True
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
        kv_bytes = 2 * batch * length * heads_kv * d * k.element_size()  # (8-bit: bf16's)
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
        + (" (2 bytes an element: fadsl's 8-bit cache holds half)" if result["dtype"] in
           ("e4m3", "e5m2") else "")  # fmt: skip
        + (", each call a CUDA graph replay" if result["graphs"] else ""),
        "batch  keys    ",
        result["rows"],
        lambda row: f"{row['batch']:5d}  {row['length']:6d}  ",
        "tb_per_s",
        digits=2,
    )
