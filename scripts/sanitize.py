"""Run every example kernel once per dtype at small shapes, tails and causal corners
included (for compute-sanitizer).

Usage: compute-sanitizer --tool racecheck python3 scripts/sanitize.py
"""

import sys
from pathlib import Path

import torch

import fadsl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from gpu_specs import general_specs  # noqa: E402

# (seqlen_q, seqlen_k): whole tiles, ragged tails, and causal rows that see no key.
SHAPES = [(128, 128), (113, 203), (200, 100), (1, 65)]

# The examples, and causal versions of those that load fragment-wise and one block ahead.
SPECS = {p.name: str(p.relative_to(ROOT)) for p in sorted((ROOT / "examples").glob("*.fa"))}
SPECS.update(
    {n: t for n, t in general_specs().items() if n.endswith(("d256_causal", "pipelined_causal"))}
)

for name, spec in SPECS.items():
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
            print(f"{name} {dtype.value} {sq}x{sk}: ran, finite={bool(out.isfinite().all())}")
