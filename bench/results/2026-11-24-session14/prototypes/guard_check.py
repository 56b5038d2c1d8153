"""The guarded softmax prototype (.carry/h64guard.cu) against float32 on inputs whose scores
jump between blocks: past the slack (finite rare path) and past 2^128 (recompute path)."""

import math
import sys
import tempfile
from pathlib import Path

import torch

import fadsl
from fadsl import cache
from fadsl.compiler import compile_cubin
from fadsl.runtime import arch_of

arch = arch_of(0)
spec = "examples/fa3_hdim64.fa"


def proto(name):
    text = Path(spec).read_text().replace("kernel fa3_hdim64", f"kernel fa3_{name}", 1)
    kern = fadsl.load(text, verbose=False)
    dt = kern.config.dtypes[0]
    req = kern.request(dt, arch)
    src = Path(f".carry/{name}.cu").read_text().replace("fa3_hdim64_bf16", f"fa3_{name}_bf16")
    where = Path(tempfile.mkdtemp())
    built = compile_cubin(src, req.filename, req.kernel, arch, where)
    kern._entries[dt, arch] = cache.Entry(built.cubin, built.log, {}, where / "dev")
    return kern


def ref(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())


kern = proto(sys.argv[1] if len(sys.argv) > 1 else "h64guard")
base = fadsl.load(spec, verbose=False)
bad = 0
for case, beta, key in [
    ("random", 0.0, 0),
    ("jump 60 at key 0", 20.0, 0),
    ("jump 150 at key 0", 50.0, 0),
    ("jump 3000 at key 0", 1000.0, 0),
    ("jump 3000 at key 1000", 1000.0, 1000),
    ("jump 150 at keys 0..9", 50.0, slice(0, 10)),
]:
    for b, sq, sk, h in [(2, 2048, 2048, 4), (1, 1000, 777, 3), (1, 300, 4500, 2)]:
        torch.manual_seed(sq + sk)
        q, k, v = (torch.randn(b, s_, h, 64, device="cuda") for s_ in (sq, sk, sk))
        u = torch.nn.functional.normalize(torch.randn(64, device="cuda"), dim=0)
        q += 3 * u
        k[:, key if isinstance(key, slice) else min(key, sk - 1)] += beta * u
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        r = ref(q, k, v)
        for kn in (base, kern):
            out = torch.full_like(q, float("nan"))
            kn(q, k, v, out=out)
            err = (out.float() - r).abs().max().item()
            ok = err < 2e-2 and torch.isfinite(out).all().item()
            bad += not ok
            print(
                f"{case:24s} {kn.config.name:12s} {(b, sq, sk, h)}: max err {err:.2e} {'ok' if ok else 'FAIL'}"
            )
sys.exit(1 if bad else 0)
