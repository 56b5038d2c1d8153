"""Time a spec's backward (fadsl.tools.bench_backward) from the command line, on the device:
python3 scripts/bench_backward.py SPEC [--causal] [--seqlens 1024,4096,16384] [--hidden 2048]
(heads = hidden / head_dim, FlashAttention's benchmark shape)."""

import argparse
import json

import fadsl
from fadsl.tools import bench_backward

parser = argparse.ArgumentParser()
parser.add_argument("spec")
parser.add_argument("--causal", action="store_true")
parser.add_argument("--seqlens", default="1024,4096,16384")
parser.add_argument("--hidden", type=int, default=2048)
parser.add_argument("--json")
args = parser.parse_args()
kern = fadsl.load(args.spec, verbose=False)
result = bench_backward.run(
    kern,
    tuple(int(s) for s in args.seqlens.split(",")),
    args.causal,
    heads=args.hidden // kern.config.head_dim,
)
print(bench_backward.table(result))
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
