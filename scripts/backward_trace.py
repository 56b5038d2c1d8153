"""Where the sm_90a backward's time goes m-block by m-block, on the GPU (fadsl/sm90_bwd_trace.cuh).

Usage (a Hopper GPU): python3 -P scripts/backward_trace.py SPEC [--seqlen 4096] [--hidden 2048]
    [--tokens 16384]
Builds the spec's backward with FADSL_BWD_TRACE (its own cubin; the cache's is untouched),
runs the backward three times, then once with the timelines zeroed, and prints the medians
over every consumer warpgroup's m-blocks (fadsl/tools/bwdtrace.py): each phase of an m-block,
the producer's waits, and per CTA its start, m-blocks, epilogue and the gap to the next CTA
on its SM.
"""

from __future__ import annotations

import argparse
import sys

import torch

import fadsl
from fadsl.runtime.arguments import torch_dtype_of
from fadsl.runtime.attention import arch_of
from fadsl.tools import bwdtrace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    kern = fadsl.load(args.spec, verbose=False)
    cfg = kern.config
    dtype = cfg.dtypes[0]
    heads = args.hidden // cfg.head_dim
    batch = max(1, args.tokens // args.seqlen)
    backward = kern._backward_kernels()
    backward.use_development_build(dtype, arch_of(0), {"FADSL_BWD_TRACE": 1})
    torch_dtype = torch_dtype_of(dtype)
    shape = (batch, args.seqlen, heads, cfg.head_dim)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch_dtype, requires_grad=True) for _ in range(3)
    )
    dout = torch.randn(shape, device="cuda", dtype=torch_dtype)
    out = kern(q, k, v)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    main_kernel = backward.modules(dtype, 0, arch_of(0))[""]
    for name in ("fadsl_bwd_trace", "fadsl_bwd_ctas"):
        main_kernel.zero_global(name)
    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    torch.cuda.synchronize()
    layout = bwdtrace.BackwardTraceLayout.of_target(kern.compiled.target)
    found = bwdtrace.budget(
        layout.unpack_steps(main_kernel.read_global("fadsl_bwd_trace")),
        layout.unpack_ctas(main_kernel.read_global("fadsl_bwd_ctas")),
        layout,
        kern.compiled.kernel.backward.consumers,
    )
    if found is None:
        print("no m-block has every mark")
        return 1
    bwd = kern.compiled.kernel.backward
    print(
        f"{cfg.name} backward {dtype.value}: seqlen {args.seqlen}, batch {batch}, heads {heads}, "
        f"B_r {bwd.block_m} x B_c {bwd.block_n}"
    )
    print(bwdtrace.report(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
