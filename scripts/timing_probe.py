"""Where does a GPU test's time go? Times each phase of one test case (diagnostic)."""

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
t0 = time.perf_counter()
import fadsl  # noqa: E402
from test_gpu import reference  # noqa: E402


def lap(what, start=[time.perf_counter()]):
    torch.cuda.synchronize()
    now = time.perf_counter()
    print(f"{what:<40} {now - start[0]:8.3f} s", flush=True)
    start[0] = now


lap("imports")
kern = fadsl.load(ROOT / "examples" / "fa2_swizzled.fa", verbose=True)
lap("load (compile pipeline)")
for shape in [(1, 64, 64, 1, 1), (4, 256, 256, 16, 16), (1, 4096, 4096, 2, 2)]:
    b, sq, sk, hq, hkv = shape
    q = torch.randn(b, sq, hq, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, 128, device="cuda", dtype=torch.bfloat16)
    lap(f"{shape} inputs")
    out = kern(q, k, v)
    lap(f"{shape} kernel (first)")
    out = kern(q, k, v)
    lap(f"{shape} kernel (second)")
    ref = reference(q, k, v, 128**-0.5, torch.float32)
    lap(f"{shape} reference fp32")
    low = reference(q, k, v, 128**-0.5, torch.bfloat16)
    lap(f"{shape} reference bf16")
    print("   err", (out.float() - ref).abs().max().item(), (low.float() - ref).abs().max().item())
