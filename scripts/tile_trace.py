"""Where an sm_90a kernel's time goes tile by tile, on the GPU (fadsl/sm90_trace.cuh).

Usage (a Hopper GPU): python scripts/tile_trace.py SPEC [--seqlen 2048] [--hidden 2048]
    [--tokens 16384] [--dtype bf16]
Builds the spec's kernel with FADSL_TILE_TRACE (its own cubin; the cache's is untouched),
runs it three times, then once with the timeline zeroed, and prints the medians over every
consumer warpgroup's tiles (fadsl/tools/tiletrace.py): the waits before the first S, the first
softmax, the mainloop, the last turn and P V, O to SMEM, the store's issue, and the gap to
the next tile, in us and in mainloop blocks.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import fadsl
from fadsl.runtime.arguments import torch_dtype_of
from fadsl.tools import tiletrace
from fadsl.ir import Dtype
from fadsl.targets.sm90.host.launch import launch_cluster
from fadsl.runtime.attention import arch_of


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    kern = fadsl.load(args.spec, verbose=False)
    cfg = kern.config
    dtype = Dtype(args.dtype) if args.dtype else cfg.dtypes[0]
    heads = args.hidden // cfg.head_dim
    batch = max(1, args.tokens // args.seqlen)
    # `cluster 2`: the kernel this shape launches (the pair kernel, or its variant alone)
    alone = kern.alone and launch_cluster(kern.compiled.kernel, args.seqlen, args.seqlen) == 1
    kern.use_development_build(dtype, arch_of(0), {"FADSL_TILE_TRACE": 1})
    traced = kern.alone if alone else kern
    module = traced.module(dtype, 0)
    torch_dtype = torch_dtype_of(dtype)
    q, k, v = (
        torch.randn(batch, args.seqlen, heads, cfg.head_dim, device="cuda", dtype=torch_dtype)
        for _ in range(3)
    )
    for _ in range(3):
        kern(q, k, v)
    torch.cuda.synchronize()
    module.zero_global("fadsl_tile_trace")
    kern(q, k, v)
    torch.cuda.synchronize()
    layout = tiletrace.TraceLayout.of_target(kern.compiled.target)
    timeline = tiletrace.phases(layout.unpack(module.read_global("fadsl_tile_trace")), layout)
    if timeline is None:
        print("no tile has every mark: is this an sm_90a spec?")
        return 1
    blocks = math.ceil(args.seqlen / cfg.block_c)
    print(
        f"{cfg.name} {dtype.value}: seqlen {args.seqlen}, batch {batch}, heads {heads}, "
        f"tiles of {cfg.block_r} x {cfg.block_c}"
    )
    print(tiletrace.report(timeline, blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
