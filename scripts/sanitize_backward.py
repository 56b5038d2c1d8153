"""One small backward call per training example (tests/test_gpu_backward.py's specs), for
compute-sanitizer: python3 scripts/sanitize_backward.py (from scripts/device.sh backward)."""

import sys

import torch

sys.path.insert(0, "tests")
from test_gpu_backward import FORWARDS, PLAIN, VARIANTS, kernel  # noqa: E402

for name in FORWARDS + PLAIN + VARIANTS + ("fa3_hopper+deterministic-dqred",):
    kern = kernel(name)
    d = kern.config.head_dim
    q, k, v, dout = (
        torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16)
        for n, h in ((200, 4), (300, 2), (300, 2), (200, 4))
    )
    leaves = [t.requires_grad_() for t in (q, k, v)]
    kern(*leaves).backward(dout)
    torch.cuda.synchronize()
    print(name, "ok", [float(t.grad.float().abs().sum()) for t in leaves])
