"""A backward call's wall time against its kernels' (the gap is the host's): examples/modifiers/
document_causal.fa (4 documents of 1024 in 1 x 4096 tokens, 16 heads, head_dim 128, classes
made ahead) and examples/fa3_causal.fa on the same tensors; torch.autograd.grad over a kept
graph, 50 calls, through the checked path on every call and through the signature's launch
plan (fadsl/runtime/backward_plans.py): host microseconds a call (the loop's time before the synchronize), wall
microseconds a call (after it), the kernels' own microseconds (torch.profiler), and
cProfile's heaviest functions of the document call.

Usage (a Hopper GPU): python3 -P research/probes/backward_gap.py"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

import torch

import fadsl

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    kern = fadsl.load((ROOT / "examples/modifiers/document_causal.fa").read_text(), verbose=False)
    plain = fadsl.load((ROOT / "examples/fa3_causal.fa").read_text(), verbose=False)
    n, docs = 4096, 4
    q, k, v, do = (
        torch.randn(1, n, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    ids = (torch.arange(n, device="cuda") // (n // docs)).int().view(1, n)
    named = {"q_doc": ids, "kv_doc": ids.clone()}
    named["keep_classes"] = kern.keep_classes(q, k, **named)
    for label, fn in (
        ("document", lambda l: kern(*l, **named)),
        ("plain causal", lambda l: plain(*l)),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(leaves)
        bwd = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
        kernels = (kern if label == "document" else plain)._backward_kernels()
        for planned in (False, True):  # (the checked path on every call, then the plan)
            kernels.plans.clear()
            if not planned:
                kernels.plans.worth_planning = lambda key: False
            for _ in range(20):
                bwd()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                bwd()
            host = (time.perf_counter() - t) / 50 * 1e6
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / 50 * 1e6
            vars(kernels.plans).pop("worth_planning", None)
            print(
                label, "backward", "planned:" if planned else "checked:", "host us/call",
                round(host, 1), "wall us/call", round(wall, 1), flush=True,
            )  # fmt: skip
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                bwd()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_time_total > 0:
                print(
                    "   ",
                    e.key[:60],
                    "calls",
                    e.count,
                    "us",
                    round(e.device_time_total / e.count, 1),
                )
        if label == "document":
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                bwd()
            pr.disable()
            torch.cuda.synchronize()
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
