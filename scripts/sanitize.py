"""Run every example kernel once per dtype at a small shape (for compute-sanitizer).

Usage: compute-sanitizer --tool racecheck python3 scripts/sanitize.py
"""

from pathlib import Path

import torch

import fadsl

ROOT = Path(__file__).resolve().parent.parent

for spec in sorted((ROOT / "examples").glob("*.fa")):
    kern = fadsl.load(spec, verbose=False)
    for dtype in kern.config.dtypes:
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype.value]
        shape = (1, 2 * kern.config.block_r, 2, kern.config.head_dim)
        kv = (1, 2 * kern.config.block_c, 2, kern.config.head_dim)
        q = torch.randn(shape, device="cuda", dtype=torch_dtype)
        k = torch.randn(kv, device="cuda", dtype=torch_dtype)
        v = torch.randn(kv, device="cuda", dtype=torch_dtype)
        out = kern(q, k, v)
        torch.cuda.synchronize()
        print(f"{spec.name} {dtype.value}: ran, finite={bool(out.isfinite().all())}")
