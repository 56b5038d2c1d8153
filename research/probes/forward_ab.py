"""Development builds of one forward side by side, sustained, in one process: for a spec, each
define set of --sets (";"-separated, "NAME=VALUE ..." each, the first the control, e.g.
FADSL_NOTHING=1) built as its own development build (FlashAttention.use_development_build),
every build's forward timed back to back for --seconds after as long a warm-up (bwd_vs_fa4.py's
`sustained`: the board at its steady clock), in rotated orders over --rounds, on the same
tensors. Prints TF/s (a causal count for causal masks and keeps), the SM clock, the energy a
call and each set's ratio to the control, and whether each set's output equals the control's
bit for bit (a change of tile order or schedule must not move a bit). The forward's twin of
backward_ab.py, whose modifier_inputs it uses (examples/modifiers/ specs run). Made for what
a short median cannot settle: research/dynamic-tile-scheduler.md's development build read
+4.1 % in its trace and -2.3 % in a median of 40 calls.

Usage (a Hopper GPU): python3 -P research/probes/forward_ab.py examples/modifiers/prefix_lm.fa
  --sets "FADSL_NOTHING=1;FADSL_MY_EXPERIMENT=1" [--seqlens 4096,16384] [--seconds 1]
  [--rounds 2] [--heads 16]
An 8-bit spec (e4m3, e5m2) runs on normal inputs cast to its dtype, with unit descales.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

import fadsl  # noqa: E402
from fadsl.runtime.arguments import torch_dtype_of  # noqa: E402
from fadsl.runtime.attention import arch_of  # noqa: E402

from backward_ab import modifier_inputs, print_rounds, rotated_rounds  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--sets", required=True)
    p.add_argument("--seqlens", default="4096,16384")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--heads", type=int, default=None, help="default: 2048 / head_dim")
    args = p.parse_args()
    text = pathlib.Path(args.spec).read_text()
    base = fadsl.load(text, verbose=False)
    name, dtype = base.config.name, base.config.dtypes[0]
    sets = [dict(d.split("=") for d in s.split()) for s in args.sets.split(";")]
    kerns = []
    for i, defines in enumerate(sets):
        kern = fadsl.load(text.replace(f"kernel {name}", f"kernel fab{i}_{name}", 1), verbose=False)
        kern.use_development_build(dtype, arch_of(0), defines)
        kerns.append(kern)
    d = base.config.head_dim
    keep = base.config.modifiers is not None and base.config.modifiers.keep is not None
    causal = base.config.mask.value == "causal" or keep  # (a keep counted as causal work)
    heads = args.heads or 2048 // d
    tdtype = torch_dtype_of(dtype)
    labels = [" ".join(f"{k}={v}" for k, v in s.items()) for s in sets]
    for seqlen in map(int, args.seqlens.split(",")):
        batch = max(1, 16384 // seqlen)
        torch.manual_seed(0)
        eight_bit = dtype.value in ("e4m3", "e5m2")
        q, k, v = (  # drawn in fp32, then cast (8-bit dtypes have no randn)
            torch.randn(batch, seqlen, heads, d, device="cuda").to(tdtype) for _ in range(3)
        )
        extra = modifier_inputs(base, batch, heads, seqlen)
        if eight_bit:  # 8-bit specs: unit descales per (batch, head), as FA3's convention
            ones = torch.ones(batch, heads, device="cuda", dtype=torch.float32)
            extra.update(q_descale=ones, k_descale=ones, v_descale=ones)
        outs = [kern(q, k, v, **extra) for kern in kerns]
        equal = ["yes" if torch.equal(outs[0], o) else "NO" for o in outs]
        calls = [(lambda kern=kern: kern(q, k, v, **extra)) for kern in kerns]
        flops = 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
        results = rotated_rounds(calls, flops, args.seconds, args.rounds)
        print(f"== {name}, {batch} x {seqlen} x {heads} heads")
        print_rounds(results, labels, [f"bitwise {e}" for e in equal])
    return 0


if __name__ == "__main__":
    sys.exit(main())
