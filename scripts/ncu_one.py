"""Run one spec's kernel a few times at (1, 16384, 16, 128) bf16, for Nsight Compute; with
--backward, its backward (the forward once, then three backward calls) at (1, 16384,
2048 / head_dim, head_dim), hidden 2048.

Usage (device, after scripts/device.sh installed fadsl into /tmp/site):
  PYTHONPATH=/tmp/site ncu --launch-skip 2 --launch-count 1 -k regex:fa3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis python3 -P scripts/ncu_one.py SPEC
  PYTHONPATH=/tmp/site ncu --launch-skip 1 --launch-count 1 -k regex:'_bwd_bf16$' \
      --section SpeedOfLight python3 -P scripts/ncu_one.py --backward SPEC
"""

import sys

import torch

import fadsl

backward = sys.argv[1] == "--backward"
kern = fadsl.load(sys.argv[-1], verbose=False)
d = kern.config.head_dim if backward else 128
shape = (1, 16384, 2048 // d if backward else 16, d)
q, k, v = (
    torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in "qkv"
)
if backward:
    out = kern(q, k, v)
    dout = torch.randn_like(out)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
else:
    for _ in range(3):
        kern(q, k, v)
torch.cuda.synchronize()
