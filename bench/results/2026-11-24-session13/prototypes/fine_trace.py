"""Run .carry/h64t.cu (fine marks) at hidden 2048 and dump proto_trace."""

import gzip
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import fadsl
from fadsl import cache
from fadsl.compiler import compile_cubin
from fadsl.runtime import arch_of

out_dir = os.environ.get("OUT", "/tmp/out")
arch = arch_of(0)
spec = "examples/fa3_hdim64.fa"
text = Path(spec).read_text().replace("kernel fa3_hdim64", "kernel fa3_h64t", 1)
kern = fadsl.load(text, verbose=False)
dt = kern.config.dtypes[0]
req = kern.request(dt, arch)
src = Path(".carry/h64t.cu").read_text().replace("fa3_hdim64_bf16", "fa3_h64t_bf16")
where = Path(tempfile.mkdtemp())
built = compile_cubin(src, req.filename, req.kernel, arch, where)
kern._entries[dt, arch] = cache.Entry(built.cubin, built.log, {}, where / "dev")
plain = fadsl.load(spec, verbose=False)
module = kern.module(dt, 0)
for seqlen in [int(x) for x in sys.argv[1].split(",")]:
    batch = 16384 // seqlen
    q, k, v = (
        torch.randn(batch, seqlen, 32, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    out = torch.empty_like(q)
    for label, f in (("plain", plain), ("marked", kern), ("plain", plain), ("marked", kern)):
        for _ in range(20):
            f(q, k, v, out=out)
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(40)
        ]
        for s, e in ev:
            s.record()
            f(q, k, v, out=out)
            e.record()
        torch.cuda.synchronize()
        print(
            seqlen,
            label,
            f"{statistics.median(s.elapsed_time(e) for s, e in ev):.4f} ms",
            flush=True,
        )
    for _ in range(30):
        kern(q, k, v, out=out)
    torch.cuda.synchronize()
    module.zero_global("proto_trace")
    kern(q, k, v, out=out)
    torch.cuda.synchronize()
    with gzip.open(f"{out_dir}/fine_{seqlen}.bin.gz", "wb") as fh:
        fh.write(module.read_global("proto_trace"))
