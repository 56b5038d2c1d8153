"""A/B of a `cluster 2` kernel in one run: as built (the launch mode read at run time), the
same kernel with the mode fixed at compile time (FADSL_CLUSTER_CTAS=2, a development build)
and its cluster-free twin (docs/performance.md, session 11, runs 7-8).

Usage (a Hopper GPU): python scripts/cluster_ab.py [bf16|fp16] [SPEC] [CLUSTER_OFF_SPEC]
"""

import sys

import fadsl
from fadsl import bench
from fadsl.ir import Dtype
from fadsl.runtime import arch_of

dtype = sys.argv[1] if len(sys.argv) > 1 else "bf16"
spec = sys.argv[2] if len(sys.argv) > 2 else "examples/fa3_hopper.fa"
off = sys.argv[3] if len(sys.argv) > 3 else "bench/specs/fa3_hopper_cluster_off.fa"
built = fadsl.load(spec)
fixed = fadsl.load(spec)
fixed.use_development_build(Dtype(dtype), arch_of(0), {"FADSL_CLUSTER_CTAS": 2})
print("fadsl: the launch mode read at run time; the first variant: fixed at 2; then off")
result = bench.run(
    built,
    seqlens=(2048, 4096, 8192, 16384),
    dtype_name=dtype,
    against=(fixed, fadsl.load(off)),
    rounds=5,
)
print(bench.table(result), flush=True)
