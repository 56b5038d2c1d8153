"""The forward beside a development build of itself (and SDPA's backends and FlashAttention-4
where installed), on the same tensors, in one run: `fadsl bench`'s timing with the development
build as an `--against` contender named fadsl:probe_dev.

PROBE_DEFINES ("NAME=VALUE ...") are #defines before the development build's source; an
experiment is a local edit of a header or template guarded by its define, kept out of the
commit (as research/probes/probe_backward.py's). The development build's output is checked
against float32 like every contender's (a wrong build is not timed).

Usage (a Hopper GPU): PROBE_DEFINES="FADSL_MY_EXPERIMENT=1" python3 -P
research/probes/probe_forward.py SPEC [SPEC ...] [--seqlens 1024,2048,4096,16384]
"""

from __future__ import annotations

import argparse
import os

import fadsl
from fadsl.ir import Mask
from fadsl.runtime.attention import arch_of
from fadsl.tools import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--seqlens", default="1024,2048,4096,16384")
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    defines = dict(d.split("=") for d in os.environ.get("PROBE_DEFINES", "").split())
    for spec in args.specs:
        text = open(spec).read()
        kern = fadsl.load(text, verbose=False)
        name = kern.config.name
        dev = fadsl.load(text.replace(f"kernel {name}", "kernel probe_dev", 1), verbose=False)
        dev.use_development_build(kern.config.dtypes[0], arch_of(0), defines)
        print(f"== {name} forward, {defines or 'no defines'}", flush=True)
        result = bench.run(
            kern,
            seqlens=tuple(int(s) for s in args.seqlens.split(",")),
            causal=kern.config.mask is Mask.CAUSAL,
            heads=args.hidden // kern.config.head_dim,
            against=(dev,),
        )
        print(bench.table(result), flush=True)


if __name__ == "__main__":
    main()
