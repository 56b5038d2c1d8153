"""One small backward call per training example (tests/test_gpu_backward.py's specs), for
compute-sanitizer: python3 scripts/sanitize_backward.py [REGEX] (from scripts/device.sh backward;
REGEX: only the specs whose names it matches). SANITIZE_BATCH=N runs a batch of N (default
1; 12 gives the persistent scheduler more tiles than an H100 or H200 has SMs, so each CTA
loops)."""

import os
import re
import sys

import torch

sys.path.insert(0, "tests")
import test_gpu_backward_variants as windowed  # noqa: E402
from test_gpu_backward import (
    FORWARDS,
    FORWARDS_256,
    FUSED_256,
    PLAIN,
    VARIANTS,
    kernel,
)  # noqa: E402

ONLY = re.compile(sys.argv[1] if len(sys.argv) > 1 else "")
NAMES = FORWARDS + PLAIN + VARIANTS + ("fa3_hopper+deterministic-dqred+s2",)
NAMES += ("fa3_hopper+deterministic+dq_writer-dqred+s2",)  # the writer warps' ordered adds
NAMES += FORWARDS_256 + FUSED_256  # head_dim 256: the consumers split head_dim
NAMES += tuple(windowed.VARIANTS) + tuple(windowed.DETERMINISTIC)  # windows and softcap
for name in NAMES:
    if not ONLY.search(name):
        continue
    kern = (
        windowed.kernel(name)
        if name in windowed.VARIANTS | windowed.DETERMINISTIC
        else kernel(name)
    )
    d = kern.config.head_dim
    q, k, v, dout = (
        torch.randn(
            int(os.environ.get("SANITIZE_BATCH", "1")), n, h, d, device="cuda", dtype=torch.bfloat16
        )
        for n, h in ((200, 4), (300, 2), (300, 2), (200, 4))
    )
    leaves = [t.requires_grad_() for t in (q, k, v)]
    kern(*leaves).backward(dout)
    torch.cuda.synchronize()
    print(name, "ok", [float(t.grad.float().abs().sum()) for t in leaves])
