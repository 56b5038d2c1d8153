"""The memory one forward + backward step of fadsl.distributed holds above its inputs, on one
GPU (a one-rank NCCL group: every exchange a copy), for the all-to-all by groups of heads,
around fadsl.attention's autograd (``attend=``), and for the ring in one group and in four.

    python3 scripts/context_parallel_memory.py [--shapes 16384x16,32768x32] [--repeats 3]

Prints, per shape and form, the step's peak above its inputs (q, k, v and dO) in units of one
of those tensors and in MiB, and the last repeat's wall time (one step, not a timing:
scripts/bench_context_parallel.py times the forms across ranks). causal, head_dim 128, bf16.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

import fadsl
import fadsl.distributed as fcp

FORMS = ("groups 1", "groups 2", "groups 4", "groups 8", "attend", "ring", "ring groups 4")


def _step(form: str, leaves, dout) -> None:
    if form.startswith("ring"):
        chunks = 4 if form.endswith("4") else 1
        out = fcp.ring_attention(*leaves, causal=True, layout="contiguous", head_chunks=chunks)
    elif form == "attend":
        out = fcp.ulysses_attention(
            *leaves, attend=lambda a, b, c: fadsl.attention(a, b, c, causal=True)
        )
    else:
        out = fcp.ulysses_attention(*leaves, causal=True, head_chunks=int(form.split()[1]))
    torch.autograd.grad(out, leaves, dout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="16384x16,32768x32", help="SEQLENxHEADS,...")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    where = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{where}/init", rank=0, world_size=1)
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        for shape in args.shapes.split(","):
            seqlen, heads = (int(x) for x in shape.split("x"))
            q, k, v, dout = (
                torch.randn(1, seqlen, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(4)
            )
            tensor_bytes = q.numel() * q.element_size()
            for form in FORMS:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                for _ in range(args.repeats):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    start = time.perf_counter()
                    _step(form, leaves, dout)
                    torch.cuda.synchronize()
                    ms = (time.perf_counter() - start) * 1e3
                    peak = torch.cuda.max_memory_allocated() - before
                print(
                    f"seqlen {seqlen} heads {heads} {form}: step peak above inputs "
                    f"{peak / tensor_bytes:.2f} tensors ({peak / 2**20:.0f} MiB), {ms:.2f} ms",
                    flush=True,
                )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
