"""A/B/C: the example against hand-edited prototypes (.carry/<name>.cu), same tensors.

Usage: python .carry/proto_ab2.py SEQLENS ROUNDS NAME...
Checks each against float32, traces each (tile marks) at the first seqlen, then a balanced
bench at hidden 2048."""

import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import fadsl
from fadsl import bench, cache, tiletrace
from fadsl.compiler import compile_cubin
from fadsl.runtime import arch_of

seqlens = tuple(int(x) for x in sys.argv[1].split(","))
rounds = int(sys.argv[2])
names = sys.argv[3:]
arch = arch_of(0)
spec = "examples/fa3_hdim64.fa"
base = fadsl.load(spec, verbose=False)
dt = base.config.dtypes[0]
D = base.config.head_dim


def proto(name: str, defines: str = ""):
    proto_spec = os.environ.get("PROTO_SPEC", spec)
    text = Path(proto_spec).read_text()
    old_name = text.split("kernel ", 1)[1].split()[0]
    text = text.replace(f"kernel {old_name}", f"kernel fa3_{name}", 1)
    kern = fadsl.load(text, verbose=False)
    req = kern.request(dt, arch)
    src = defines + Path(f".carry/{name}.cu").read_text().replace(
        "fa3_hdim64_bf16", f"fa3_{name}_bf16"
    ).replace("KERNEL_NAME", f"fa3_{name}_bf16")
    where = Path(tempfile.mkdtemp())
    built = compile_cubin(src, req.filename, req.kernel, arch, where)
    kern._entries[dt, arch] = cache.Entry(built.cubin, built.log, {}, where / "dev")
    return kern


contenders = [proto(n) for n in names]


def ref(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())


bad = 0
for b, sq, sk, h in [
    (8, 2048, 2048, 4),
    (1, 4096, 4096, 32),
    (2, 1000, 777, 3),
    (3, 384, 4500, 5),
    (1, 33000, 300, 2),
    (1, 128, 128, 1),
]:
    torch.manual_seed(sq + sk)
    q, k, v = (torch.randn(b, s_, h, D, device="cuda", dtype=torch.bfloat16) for s_ in (sq, sk, sk))
    r = ref(q, k, v)
    for kern in [base, *contenders]:
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, sq), float("nan"), device="cuda")
        kern(q, k, v, out=out)
        err = (out.float() - r).abs().max().item()
        ok = err < 2e-2 and torch.isfinite(out).all().item()
        bad += not ok
        print(
            f"check {kern.config.name} {(b, sq, sk, h)}: max err {err:.2e} {'ok' if ok else 'FAIL'}"
        )
if bad:
    sys.exit(1)

heads = 2048 // D
seqlen = seqlens[0]
batch = max(1, 16384 // seqlen)
layout = tiletrace.Layout.of_header()
q, k, v = (
    torch.randn(batch, seqlen, heads, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)
)
for label, kern in [
    ("example", None),
    *[(n, proto(n, "#define FADSL_TILE_TRACE 1\n")) for n in names],
]:
    if kern is None:
        kern = fadsl.load(spec, verbose=False)
        kern.use_development_build(dt, arch, {"FADSL_TILE_TRACE": 1})
    module = kern.module(dt, 0)
    for _ in range(30):
        kern(q, k, v)
    torch.cuda.synchronize()
    module.zero_global("fadsl_tile_trace")
    kern(q, k, v)
    torch.cuda.synchronize()
    timeline = tiletrace.phases(layout.unpack(module.read_global("fadsl_tile_trace")), layout)
    print(f"--- {label}")
    print(
        tiletrace.report(timeline, math.ceil(seqlen / base.config.block_c))
        if timeline
        else "no complete tile"
    )
res = bench.run(
    base,
    seqlens=seqlens,
    dtype_name=dt.value,
    heads=heads,
    against=tuple(contenders),
    rounds=rounds,
)
print(bench.table(res))
