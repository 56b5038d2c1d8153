"""Print the consumers' mainloops of sm_90a specs as ptxas built them (fadsl/tools/sass.py).

Usage: python research/probes/sass_loops.py SPEC... [--dtype bf16|fp16] [--define NAME=VALUE]...
For each spec: its cubin for sm_90a (NVRTC, through the cache; with --define a development
build with those defines, e.g. FADSL_EXP_PIN=1 after research/patches/softmax-pin.patch),
disassembled with nvdisasm;
then per mainloop (masked iterations first) its instructions, uniform-datapath ones, wgmma,
2^x, and the softmax instructions issued before the P V wait (the softmax/P V overlap).
Needs no GPU.
"""

from __future__ import annotations

import argparse
import sys

import fadsl
from fadsl.build import cache
from fadsl.tools import sass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--dtype", default=None, help="bf16 or fp16 (default: the spec's first)")
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE, repeatable")
    args = parser.parse_args()
    tool = sass.nvdisasm()
    if tool is None:
        print("nvdisasm not found: install the CUDA toolkit or `pip install nvidia-cuda-nvdisasm`")
        return 2
    print(
        f"{'spec':<28} {'loop':<9} {'instrs':>6} {'uniform':>7} {'HGMMA':>5} {'MUFU':>4} {'overlap':>7}"
    )
    for spec in args.specs:
        kern = fadsl.load(spec, verbose=False)
        dtypes = [d for d in kern.config.dtypes if args.dtype in (None, d.value)]
        if not dtypes:
            print(f"{spec}: does not compile {args.dtype}")
            return 2
        if args.define:
            defines = dict(d.split("=", 1) for d in args.define)
            request = kern.request(dtypes[0], "sm_90a")
            cubin = cache.development_build(request, defines).cubin
        else:
            cubin = kern.cubin(dtypes[0], "sm_90a").cubin
        text = sass.disassemble(cubin, tool)
        for loop in sass.mainloops(text):
            overlap = sass.softmax_overlap(loop)
            print(
                f"{kern.config.name:<28} {loop.label:<9} {len(loop.instructions):>6} "
                f"{loop.uniform:>7} {loop.count('HGMMA'):>5} {loop.count('MUFU.EX2'):>4} "
                f"{'-' if overlap is None else overlap:>7}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
