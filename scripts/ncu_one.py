"""Run one spec's kernel a few times at (1, 16384, 16, 128) bf16, for Nsight Compute.

Usage (device, after scripts/device.sh installed fadsl into /tmp/site):
  PYTHONPATH=/tmp/site ncu --launch-skip 2 --launch-count 1 -k regex:fa3 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis python3 -P scripts/ncu_one.py SPEC
"""

import sys

import torch

import fadsl

kern = fadsl.load(sys.argv[1], verbose=False)
q, k, v = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
for _ in range(3):
    kern(q, k, v)
torch.cuda.synchronize()
