"""Run every example kernel once per dtype at small shapes, tails and causal corners
included (for compute-sanitizer).

Usage: compute-sanitizer --tool racecheck python3 scripts/sanitize.py
"""

from pathlib import Path

import torch

import fadsl

ROOT = Path(__file__).resolve().parent.parent
# (seqlen_q, seqlen_k): whole tiles, ragged tails, and causal rows that see no key.
SHAPES = [(128, 128), (113, 203), (200, 100), (1, 65)]

for spec in sorted((ROOT / "examples").glob("*.fa")):
    kern = fadsl.load(spec, verbose=False)
    d = kern.config.head_dim
    for dtype in kern.config.dtypes:
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype.value]
        for sq, sk in SHAPES:
            q = torch.randn(1, sq, 2, d, device="cuda", dtype=torch_dtype)
            k = torch.randn(1, sk, 1, d, device="cuda", dtype=torch_dtype)
            v = torch.randn(1, sk, 1, d, device="cuda", dtype=torch_dtype)
            out, lse = kern(q, k, v, return_lse=True)
            torch.cuda.synchronize()
            print(f"{spec.name} {dtype.value} {sq}x{sk}: ran, finite={bool(out.isfinite().all())}")
