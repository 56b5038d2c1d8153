"""Prototype A/B (hand-edited sources): contenders built from .carry sources, same tensors."""

import math
import sys
import tempfile
from pathlib import Path

import torch

import fadsl
from fadsl import bench, cache
from fadsl.compiler import compile_cubin
from fadsl.ir import Dtype
from fadsl.runtime import arch_of

arch = arch_of(0)
dt = Dtype("bf16")
base = fadsl.load(sys.argv[3] if len(sys.argv) > 3 else "examples/fa3_hopper.fa", verbose=False)
D = base.config.head_dim


def proto(spec: str, name: str, source: str, old_name: str):
    text = Path(spec).read_text()
    old_kernel = text.split("kernel ", 1)[1].split()[0]
    kern = fadsl.load(text.replace(f"kernel {old_kernel}", f"kernel {name}", 1), verbose=False)
    req = kern.request(dt, arch)
    src = Path(source).read_text().replace(old_name, f"{name}_bf16")
    where = Path(tempfile.mkdtemp())
    built = compile_cubin(src, req.filename, req.kernel, arch, where)
    kern._entries[dt, arch] = cache.Entry(built.cubin, built.log, {}, where / "dev")
    return kern


contenders = [
    fadsl.load(".carry/fa3_h64w.fa", verbose=False),
    proto(".carry/fa3_h64w.fa", "fa3_h64wp", ".carry/h64w/p.cu", "fa3_h64w_bf16"),
]


def ref(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())


bad = 0
shapes = [
    (1, 128, 128, 1),
    (2, 1000, 777, 3),
    (8, 2048, 2048, 16),
    (1, 4096, 4096, 16),
    (3, 384, 4500, 5),
    (1, 33000, 300, 2),
    (4, 8192, 8192, 4),
]
for b, sq, sk, h in shapes:
    torch.manual_seed(sq + sk)
    q = torch.randn(b, sq, h, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, h, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, h, D, device="cuda", dtype=torch.bfloat16)
    r = ref(q, k, v)
    for kern in contenders:
        out = torch.full_like(q, float("nan"))
        kern(q, k, v, out=out)
        err = (out.float() - r).abs().max().item()
        ok = err < 2e-2 and torch.isfinite(out).all().item()
        bad += not ok
        print(
            f"check {kern.config.name} {(b, sq, sk, h)}: max err {err:.2e} {'ok' if ok else 'FAIL'}"
        )
if bad:
    sys.exit(1)
seqlens = tuple(int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2048,4096,8192").split(","))
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
res = bench.run(
    base,
    seqlens=seqlens,
    dtype_name="bf16",
    heads=2048 // D,
    against=tuple(contenders),
    rounds=rounds,
)
print(bench.table(res))
