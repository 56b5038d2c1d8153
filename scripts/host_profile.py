"""Host time per call of each public call at a tiny shape, beside SDPA FLASH (the calls of
`fadsl bench --calls`, fadsl/tools/bench_calls.py, each on its own), then with --compile
whether each traces under torch.compile(fullgraph=True), and with --profile where a call's
host time goes: cProfile of 200 calls, the top functions by own time. A repeated call
launches through its signature's plan (fadsl/runtime/plans.py); --first times fadsl's calls
as the first of their signature (the plans forgotten before each: the checked path) beside
them. Run on the GPU machine: python3 -P scripts/host_profile.py [--first] [--compile]
[--profile]."""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch

from fadsl.tools.bench_calls import host_contenders, host_times


def first_call(fn):
    """``fn`` with the launch plans forgotten before it (each call then the first of its
    signature)."""
    from fadsl.runtime import planned

    def call():
        planned.clear()
        return fn()

    return call


def main() -> None:
    found = {}
    for call, contenders in host_contenders().items():
        found[f"{call}: fadsl"] = contenders["fadsl"]
        if "--first" in sys.argv:
            found[f"{call}: fadsl, first of its signature"] = first_call(contenders["fadsl"])
        if "flash" in contenders:
            found[f"{call}: sdpa_flash"] = contenders["flash"]
    for name, us in host_times(found, rounds=7).items():
        print(f"host us/call {name}: {us:.1f}", flush=True)
    if "--compile" in sys.argv:
        for name, fn in found.items():
            if "first of its signature" in name:
                continue  # (the same call as the one before it, plans forgotten)
            torch._dynamo.reset()
            try:
                torch.compile(fn, fullgraph=True)()
                print(f"fullgraph {name}: ok")
            except Exception as exc:  # the first lines of why
                print(f"fullgraph {name}: {type(exc).__name__}: {str(exc)[:300]!r}")
    if "--profile" in sys.argv:
        for name, fn in found.items():
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"== {name}: 200 calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
