"""A/B of a `cluster 2` spec in one run: the launch as shipped (pairs where
fadsl.targets.sm90.host.launch.launch_cluster pairs, else the cluster-free variant `<name>_alone`), the pair
kernel itself where the shipped launch runs the variant (`FlashAttention.alone = None`), and
the hand-written cluster-free twin (research/performance-history.md, 2026-11-23 and 2026-11-24).

Usage (a Hopper GPU): python research/probes/cluster_ab.py [bf16|fp16] [SPEC] [CLUSTER_OFF_SPEC]
"""

import sys

import fadsl
from fadsl.tools import bench

dtype = sys.argv[1] if len(sys.argv) > 1 else "bf16"
spec = sys.argv[2] if len(sys.argv) > 2 else "examples/fa3_hopper.fa"
off = sys.argv[3] if len(sys.argv) > 3 else "tests/specs/bench/fa3_hopper_cluster_off.fa"
shipped = fadsl.load(spec)
pair_kernel = fadsl.load(spec)
pair_kernel.alone = None
print("fadsl: as shipped; the first variant: the pair kernel alone where not paired; then off")
result = bench.run(
    shipped,
    seqlens=(2048, 4096, 8192, 16384),
    dtype_name=dtype,
    against=(pair_kernel, fadsl.load(off)),
)
print(bench.table(result), flush=True)
