"""Diagnostic: per-launch fixed cost (batch scaling) and the whole-kernel tile timeline."""

import gzip
import json
import os
import statistics
import struct
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadsl
from fadsl import tiletrace
from fadsl.runtime import arch_of

out_dir = os.environ.get("OUT", "/tmp/out")
spec = sys.argv[1]
seqlens = [int(x) for x in sys.argv[2].split(",")]
plain = fadsl.load(spec, verbose=False)
traced = fadsl.load(spec, verbose=False)
cfg = plain.config
dtype = cfg.dtypes[0]
traced.use_development_build(dtype, arch_of(0), {"FADSL_TILE_TRACE": 1})
module = traced.module(dtype, 0)
layout = tiletrace.Layout.of_header()
heads = 2048 // cfg.head_dim


def timeit(fn, n=40, warm=15):
    for _ in range(warm):
        fn()
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(n)
    ]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


result = {"spec": spec, "rows": []}
for seqlen in seqlens:
    base_batch = max(1, 16384 // seqlen)
    for batch in (base_batch // 2, base_batch, 2 * base_batch):
        if batch < 1:
            continue
        q, k, v = (
            torch.randn(batch, seqlen, heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
            for _ in range(3)
        )
        views = [t.transpose(1, 2) for t in (q, k, v)]
        out = torch.empty_like(q)

        def f():
            plain(q, k, v, out=out)

        def c():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(*views)

        def t():
            traced(q, k, v, out=out)

        times = {"fadsl": [], "cudnn": [], "traced": []}
        order = [("fadsl", f), ("cudnn", c), ("traced", t)]
        for r in range(4):
            seq = order if r % 2 == 0 else order[::-1]
            for name, fn in seq:
                times[name].append(timeit(fn))
        row = {
            "seqlen": seqlen,
            "batch": batch,
            **{n: statistics.median(v) for n, v in times.items()},
        }
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        if batch == base_batch:
            for _ in range(30):
                t()
            torch.cuda.synchronize()
            module.zero_global("fadsl_tile_trace")
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            t()
            e.record()
            torch.cuda.synchronize()
            raw = module.read_global("fadsl_tile_trace")
            with gzip.open(f"{out_dir}/trace_{cfg.name}_{seqlen}.bin.gz", "wb") as fh:
                fh.write(raw)
            print(f"traced launch {s.elapsed_time(e):.4f} ms", flush=True)
            result[f"traced_launch_ms_{seqlen}"] = s.elapsed_time(e)
json.dump(result, open(f"{out_dir}/timeline_{cfg.name}.json", "w"), indent=1)
print(json.dumps({"layout": [layout.ctas, layout.warpgroups, layout.steps, layout.marks]}))
