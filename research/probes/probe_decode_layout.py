"""Where decode's bandwidth goes (issue 31): the same bytes of K and V read in four layouts.

For each (batch, keys) shape, every contender reads the same number of K/V bytes (GQA 32/8,
head_dim 128, bf16, one query row), each as a CUDA-graph replay in balanced orders:
  fadsl:hkv8       the decode spec on a (pages, page, 8, 128) cache: each token's K/V heads
                   interleaved, so a CTA reads 256 of every 2048 bytes
  fadsl:hkv1       the same bytes as 8x the batch with one K/V head (4 query heads): a CTA
                   reads whole 256-byte token rows, pages contiguous
  cudnn:bhsd       SDPA's cuDNN backend on contiguous (batch, heads, keys, head_dim)
  cudnn:bshd       cuDNN on the interleaved (batch, keys, heads, head_dim) layout (a view)
  copy             torch's device-to-device copy of the same K and V bytes (each byte read
                   once and written once; shown as those bytes a second)
  fadsl:hkv8:sN    with PROBE_SPLITS="N ...": num_splits=N given (N pieces a tile; the
                   development build's with PROBE_DEV_ONLY=1); dev:hkv8:sN the development
                   build's beside it, when PROBE_DEFINES is set
  dev:hkv8         with PROBE_DEFINES="NAME=VALUE ...": a development build of the spec with
                   those #defines (FlashAttention.use_development_build); PROBE_DEV_ONLY=1
                   runs it in place of the shipped build (checked against float32 likewise)
PROBE_SHAPES ("1x131072 128x8192"), PROBE_LABELS ("hkv8"), PROBE_BASELINES=0 (no cuDNN, copy),
PROBE_TIMELINE=1: each contender's kernels in one replay (torch.profiler): their times and the
gaps between them, averaged over 20 replays.
The findings of 2026-11-27 (H200) are in research/performance-history.md ("Moved from
docs/performance.md (2026-11-29)"); the latest H200 table is docs/performance.md's (decode).

Usage: python3 -P research/probes/probe_decode_layout.py [SPEC ...]
"""

import gc
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadsl
from fadsl.tools.bench import median_times
from fadsl.tools.bench_kvcache import graphed

SHAPES = [(1, 131072), (8, 16384), (32, 4096), (128, 8192)]
if os.environ.get("PROBE_SHAPES"):  # "1x131072 128x8192"
    SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ["PROBE_SHAPES"].split()]
LABELS = os.environ.get("PROBE_LABELS", "hkv8 hkv1").split()
BASELINES = os.environ.get("PROBE_BASELINES", "1") == "1"
specs = sys.argv[1:] or ["examples/serving/fa3_decode_paged.fa"]
dtype = torch.bfloat16
d = 128


def paged_cache(k_bhsd, page, table=None):
    """(pages, page, heads, d) holding k_bhsd's keys under ``table`` (default: a random one)."""
    batch, heads, length, _ = k_bhsd.shape
    per = -(-length // page)
    if table is None:
        order = torch.randperm(batch * per, device="cuda")
        table = order.view(batch, per).to(torch.int32).contiguous()
    order = table.view(-1).long()
    cache = torch.empty(batch * per, page, heads, d, device="cuda", dtype=dtype)
    flat = F.pad(k_bhsd.transpose(1, 2), (0, 0, 0, 0, 0, per * page - length))
    cache[order] = flat.reshape(batch * per, page, heads, d)
    return cache, table


def timeline(replay, replays: int = 20) -> str:
    """The kernels of one replay, each 'name mean_us', and the gaps between them (+us)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay(0)
            torch.cuda.synchronize()
    events = sorted(
        # kernels only: a graph replay may also record Memcpy / Memset events
        (e for e in prof.events() if e.device_type.name == "CUDA" and "emcpy" not in e.name),
        key=lambda e: e.time_range.start,
    )
    per = len(events) // replays
    if per == 0 or len(events) % replays:
        return f"({len(events)} kernel events in {replays} replays: not split evenly)"
    cells = []
    for i in range(per):
        mine = events[i::per]
        dur = sum(e.time_range.elapsed_us() for e in mine) / replays
        cells.append(f"{mine[0].name[:28]} {dur:.1f}")
        if i + 1 < per:
            after = events[i + 1 :: per]
            gap = sum(b.time_range.start - a.time_range.end for a, b in zip(mine, after)) / replays
            cells.append(f"+{gap:.1f}")
    return " | ".join(cells) + " us"


for spec in specs:
    kern = fadsl.load(spec, verbose=False)
    dev = None
    if os.environ.get("PROBE_DEFINES"):  # "NAME=VALUE ...": a development build beside it
        text = open(spec).read().replace(f"kernel {kern.config.name}", "kernel probe_dev", 1)
        dev = fadsl.load(text, verbose=False)
        defines = dict(d.split("=") for d in os.environ["PROBE_DEFINES"].split())
        from fadsl.runtime.attention import arch_of

        dev.use_development_build(kern.config.dtypes[0], arch_of(0), defines)
    page = kern.config.ext.kv_cache
    print(f"== {kern.config.name} (page {page or 'contiguous'})", flush=True)
    for batch, length in SHAPES:
        contenders = {}
        for label, b, hq, hkv in (("hkv8", batch, 32, 8), ("hkv1", batch * 8, 4, 1)):
            if label not in LABELS:
                continue
            q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)
            k = torch.randn(b, hkv, length, d, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
            if page:
                kc, table = paged_cache(k, page)
                vc, _ = paged_cache(v, page, table)
            else:
                table = None
                kc = k.transpose(1, 2).contiguous()
                vc = v.transpose(1, 2).contiguous()
            out = torch.empty_like(q)
            main = dev if os.environ.get("PROBE_DEV_ONLY") else kern
            call = lambda _, q=q, kc=kc, vc=vc, s=seqlens, t=table, o=out, main=main: main.kvcache(
                q, kc, vc, s, t, out=o
            )
            call(0)
            ref = F.scaled_dot_product_attention(
                q.transpose(1, 2).float(), k.float(), v.float(), enable_gqa=True
            ).transpose(1, 2)
            err = (out.float() - ref).abs().max().item()
            assert err < 0.02, (label, err)
            contenders[f"fadsl:{label}"] = call
            if dev is not None and main is kern:
                contenders[f"dev:{label}"] = (
                    lambda _, q=q, kc=kc, vc=vc, s=seqlens, t=table, o=out: dev.kvcache(
                        q, kc, vc, s, t, out=o
                    )
                )
            for n in os.environ.get("PROBE_SPLITS", "").split():  # pieces per tile, given
                contenders[f"fadsl:{label}:s{n}"] = (
                    lambda _, q=q, kc=kc, vc=vc, s=seqlens, t=table, o=out, n=int(n), main=main: (
                        main.kvcache(q, kc, vc, s, t, num_splits=n, out=o)
                    )
                )
                if dev is not None and main is kern:
                    contenders[f"dev:{label}:s{n}"] = (
                        lambda _, q=q, kc=kc, vc=vc, s=seqlens, t=table, o=out, n=int(n): (
                            dev.kvcache(q, kc, vc, s, t, num_splits=n, out=o)
                        )
                    )
                    out.fill_(float("nan"))
                    contenders[f"dev:{label}:s{n}"](0)
                    err = (out.float() - ref).abs().max().item()
                    assert err < 0.02, (label, n, err)
            if label == "hkv8" and BASELINES:
                qt = q.transpose(1, 2)
                k_bshd = k.transpose(1, 2).contiguous()
                v_bshd = v.transpose(1, 2).contiguous()

                def cudnn_bhsd(_, qt=qt, k=k, v=v):
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)

                def cudnn_bshd(_, qt=qt, k=k_bshd, v=v_bshd):
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(
                            qt, k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
                        )

                contenders["cudnn:bhsd"] = cudnn_bhsd
                try:
                    cudnn_bshd(0)
                    contenders["cudnn:bshd"] = cudnn_bshd
                except RuntimeError as err:
                    print(f"  cudnn:bshd not timed: {str(err)[:80]}")
                src = torch.cat([k.flatten(), v.flatten()])
                dst = torch.empty_like(src)
                contenders["copy"] = lambda _, s=src, o=dst: o.copy_(s)
        contenders = {n: graphed(fn) for n, fn in contenders.items()}
        ms = median_times(contenders, 8, 32)
        kv_bytes = 2 * batch * length * 8 * d * 2
        cells = "  ".join(f"{n} {kv_bytes / (t * 1e-3) / 1e12:5.2f}" for n, t in ms.items())
        print(f"  {batch:3d} x {length:6d}: {cells} TB/s", flush=True)
        if os.environ.get("PROBE_TIMELINE") == "1":
            for name, fn in contenders.items():
                print(f"    {name:12s} {timeline(fn)}", flush=True)
        # the shape's graphs, tensors and float32 reference freed before the next one
        for name in ("contenders", "call", "ref", "q", "k", "v", "kc", "vc", "out", "qt"):
            globals().pop(name, None)
        for name in ("k_bshd", "v_bshd", "src", "dst"):
            globals().pop(name, None)
        gc.collect()
        torch.cuda.empty_cache()
