"""Run the kv-cache specs (examples/serving/fa3_decode*.fa, tests/specs/sm90/fa3_decode*.fa) once per dtype on ragged cache
lengths (0, 1, page edges, a long one) with split pieces, for compute-sanitizer.

Usage: compute-sanitizer --tool racecheck python3 -P scripts/sanitize_kvcache.py
"""

from pathlib import Path

import torch

import fadsl
from fadsl.runtime.arguments import torch_dtype_of

ROOT = Path(__file__).resolve().parent.parent
LENGTHS = [0, 1, 63, 64, 65, 700, 2000]

for path in sorted((ROOT / "examples" / "serving").glob("fa3_decode*.fa")) + sorted(
    (ROOT / "tests" / "specs" / "sm90").glob("fa3_decode*.fa")
):
    kern = fadsl.load(str(path), verbose=False)
    page = kern.config.ext.kv_cache
    for dtype in kern.config.dtypes:
        torch_dtype = torch_dtype_of(dtype)
        batch, capacity = len(LENGTHS), 2048
        seqlens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
        table = None
        if page:
            per_batch = capacity // page
            k = torch.randn(batch * per_batch, page, 2, 128, device="cuda", dtype=torch_dtype)
            table = torch.arange(batch * per_batch, dtype=torch.int32, device="cuda").view(
                batch, -1
            )
        else:
            k = torch.randn(batch, capacity, 2, 128, device="cuda", dtype=torch_dtype)
        v = torch.randn_like(k)
        q = torch.randn(batch, 2, 8, 128, device="cuda", dtype=torch_dtype)
        out, lse = kern.kvcache(q, k, v, seqlens, table, num_splits=3, return_lse=True)
        torch.cuda.synchronize()
        assert not out.isnan().any() and not lse.isnan().any(), path.stem
        print(f"{path.stem} {dtype.value}: ok")
