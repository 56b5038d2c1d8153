"""What moving K, V and Q from L2 into SMEM costs under the power cap, on the GPU.

Usage (a Hopper GPU): python research/probes/energy_probe.py SPEC [--loads 2] [--seqlens 4096,16384]
    [--hidden 2048] [--dtype bf16]
Builds a copy of the spec's kernel with FADSL_TMA_LOADS (fadsl/sm90_ptx.cuh): every TMA load
issued --loads times into the same bytes, so the L2 -> SMEM traffic grows by that factor and
nothing else does. `fadsl bench` then times the kernel and the copy on the same tensors (rounds in
balanced orders), with each one's clock and power. Where the GPU sits at its power
cap, the copy's loss says what that traffic costs in energy, and so what halving it (TMA
multicast over a cluster of two CTAs) could win.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import fadsl
from fadsl.tools import bench
from fadsl.ir import Dtype
from fadsl.runtime.attention import arch_of


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--loads", type=int, default=2)
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    kern = fadsl.load(args.spec, verbose=False)
    cfg = kern.config
    dtype = Dtype(args.dtype) if args.dtype else cfg.dtypes[0]
    text = Path(args.spec).read_text()
    copy = fadsl.load(
        text.replace(f"kernel {cfg.name}", f"kernel {cfg.name}_tma_x{args.loads}", 1),
        verbose=False,
    )
    copy.use_development_build(dtype, arch_of(0), {"FADSL_TMA_LOADS": args.loads})
    result = bench.run(
        kern,
        seqlens=tuple(int(s) for s in args.seqlens.split(",")),
        dtype_name=dtype.value,
        heads=args.hidden // cfg.head_dim,
        against=(copy,),
    )
    print(bench.table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
