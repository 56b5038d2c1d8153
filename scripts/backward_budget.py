"""Where a backward call's GPU time goes, kernel by kernel: the preprocess (D, LSE in log2
units, dQ's accumulator zeroed), the main kernel, dQ's conversion (and, under GQA, torch's
sum of dK and dV over the group), for each spec at each length, from the CUDA kernels'
own durations (torch.profiler), medians over a few calls. Hidden 2048, 16384 tokens, bf16.

Usage (a Hopper GPU): python3 -P scripts/backward_budget.py SPEC... [--seqlens 1024,16384]
Prints one line per (spec, seqlen): each kernel's microseconds and share of the call, and
the main kernel's TF/s (2.5 x the forward's FLOPs over the main kernel alone). A spec with
`varlen on` is called on the same batch packed (equal lengths, its varlen() call), so that a
varlen spec beside its padded one shows what packing costs kernel by kernel.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import fadsl

CALLS = 5


def packed_call(kern, batch: int, seqlen: int):
    """The spec's varlen() call over ``batch`` sequences of ``seqlen`` tokens each."""
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, device="cuda", dtype=torch.int32)

    def call(q, k, v):
        flat = [t.flatten(0, 1) for t in (q, k, v)]
        return kern.varlen(*flat, cu, cu, seqlen, seqlen).view(q.shape)

    return call


def device_times(run, role=lambda name: name, calls: int = CALLS) -> dict[str, float]:
    """Median microseconds per call of the kernels ``run()`` launches (after one warm-up
    call), summed by ``role(kernel name)``; research/probes/bwd_vs_fa4.py times FA4's and
    cuDNN's backward with it too."""
    run()  # warm-up: built and loaded
    torch.cuda.synchronize()
    per_call: dict[str, list[float]] = defaultdict(list)
    for _ in range(calls):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        sums: dict[str, float] = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                sums[role(event.name)] += event.device_time  # microseconds
        for kind, us in sums.items():
            per_call[kind].append(us)
    return {kind: statistics.median(times) for kind, times in per_call.items()}


def kernel_times(kern, q, k, v, dout, call=None) -> dict[str, float]:
    """Median microseconds of each kernel the backward launches, by the kernel's role."""
    out = (call or kern)(q, k, v)
    name = kern.config.name

    def role(kind: str) -> str:
        if name in kind and "_bwd_" in kind:
            kind = kind.split("_bwd_")[1]
            return "main" if "_" not in kind else kind.split("_", 1)[1]
        return "torch: " + kind[:40]

    return device_times(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), role)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--seqlens", default="1024,16384")
    args = parser.parse_args()
    for spec in args.specs:
        kern = fadsl.load(spec, verbose=False)
        d = kern.config.head_dim
        causal = kern.config.mask.value == "causal"
        heads = 2048 // d
        for seqlen in map(int, args.seqlens.split(",")):
            batch = max(1, 16384 // seqlen)
            shape = (batch, seqlen, heads, d)
            q, k, v = (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                for _ in range(3)
            )
            dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
            varlen = getattr(kern.config, "varlen", False)
            call = packed_call(kern, batch, seqlen) if varlen else None
            times = kernel_times(kern, q, k, v, dout, call)
            total = sum(times.values())
            fwd = 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
            main_tfs = 2.5 * fwd / (times.get("main", float("nan")) * 1e-6) / 1e12
            cells = "  ".join(
                f"{kind} {us:8.1f} us ({us / total:5.1%})" for kind, us in sorted(times.items())
            )
            print(
                f"{kern.config.name:>18} {batch:3d} x {seqlen:5d}: {cells}  total {total:8.1f} us;"
                f" main alone {main_tfs:6.1f} TF/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
