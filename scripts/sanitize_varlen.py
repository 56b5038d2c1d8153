"""Run the varlen specs (examples/serving/fa3_varlen*.fa, and each causal with `scheduler grid`,
as fadsl.attention_varlen runs a long causal batch) once per dtype on a ragged packed batch
with more tiles than SMs (lengths 0, 1, tails, a long one; GQA), for compute-sanitizer.

Usage: compute-sanitizer --tool racecheck python3 -P scripts/sanitize_varlen.py
"""

from pathlib import Path

import torch

import fadsl
from fadsl.runtime.arguments import torch_dtype_of
from fadsl.frontend.rewrite import rewrite

ROOT = Path(__file__).resolve().parent.parent
LENGTHS_Q = [1, 300, 0, 129, 700, 64, 5, 900] * 3
LENGTHS_K = [1, 200, 5, 0, 700, 500, 5, 900] * 3

SPECS = []
for path in sorted((ROOT / "examples" / "serving").glob("fa3_varlen*.fa")):
    text = path.read_text()
    grid = rewrite(text, {"mask": "causal", "scheduler": "grid"}, {}, path.stem + "_causal_grid")
    SPECS += [(path.stem, text), (path.stem + "_causal_grid", grid)]

for name, text in SPECS:
    kern = fadsl.load(text, verbose=False)
    d = kern.config.head_dim
    for dtype in kern.config.dtypes:
        torch_dtype = torch_dtype_of(dtype)
        q = torch.randn(sum(LENGTHS_Q), 8, d, device="cuda", dtype=torch_dtype)
        k = torch.randn(sum(LENGTHS_K), 2, d, device="cuda", dtype=torch_dtype)
        v = torch.randn_like(k)
        cu_q = torch.tensor([0, *torch.tensor(LENGTHS_Q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(LENGTHS_K).cumsum(0).tolist()], dtype=torch.int32)
        out, lse = kern.varlen(q, k, v, cu_q.cuda(), cu_k.cuda(), return_lse=True)
        torch.cuda.synchronize()
        assert not out.isnan().any() and not lse.isnan().any(), name
        print(f"{name} {dtype.value}: ok")
