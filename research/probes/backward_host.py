"""Where a short backward's time goes: the host's share against the GPU's.

`fadsl bench --backward` records a CUDA event before and after each call; when the host
takes longer to issue a call than the GPU to run it, that interval is the host's time. This
probe measures both sides for one spec at one shape (hidden 2048, 16384 tokens, as the
bench): the host's microseconds per ``torch.autograd.grad`` with the GPU held busy (a
``torch.cuda._sleep`` queued ahead, so no call waits for the GPU), the GPU's milliseconds per
call from one pair of events around 20 calls queued behind the sleep (no host gap between
them), the bench's own per-call median, and cProfile's heaviest functions over 50 calls.

Usage (a GPU): python3 -P research/probes/backward_host.py SPEC [SPEC ...] [--seqlen 1024]
[--profile N] (N: cProfile lines, 0 for none)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

import fadsl
from fadsl.runtime.attention import arch_of
from fadsl.tools.bench import _time


def host_us(fn, calls: int = 20, busy: bool = True) -> float:
    """Microseconds of host time per ``fn()``, after a warm-up call; ``busy``: with a
    ~200 ms sleep queued ahead on the GPU, so that no call waits for it."""
    fn()
    torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(300_000_000)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return took


def gpu_us(fn, calls: int = 20) -> float:
    """Microseconds of GPU time per ``fn()``: the calls queued behind a sleep, one event pair
    around them (no host gap between them)."""
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(300_000_000)
    first.record()
    for _ in range(calls):
        fn()
    last.record()
    torch.cuda.synchronize()
    return first.elapsed_time(last) / calls * 1e3


def measure(path: str, seqlen: int, profile_lines: int) -> None:
    from fadsl.runtime.arguments import backward_operands, lse_shape
    from fadsl.targets.launch import current_stream
    from fadsl.targets.sm90.host.tma import tensor_map

    kern = fadsl.load(path, verbose=False)
    d = kern.config.head_dim
    heads, batch = 2048 // d, max(1, 16384 // seqlen)
    q, k, v, dout = (
        torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = kern(*leaves)
    scale = d**-0.5
    # the same backward through the custom op's autograd formula (what eager calls took
    # before fadsl/runtime/eager_grad.py; torch.compile's path)
    out_op, _ = kern._call_op(*leaves, scale, None, True)

    def call(_: int = 0):
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    for _ in range(5):
        call()
    host, gpu = host_us(call), gpu_us(call)
    bench_ms, _ = _time(call, 1, 8, 32)
    print(
        f"{kern.config.name} {batch}x{seqlen}x{heads}x{d}: host {host:.0f} us per call, "
        f"GPU {gpu:.0f} us per call queued, bench {bench_ms * 1e3:.0f} us",
        flush=True,
    )
    kernels = kern._backward_kernels()
    kernels.plans.clear()
    kernels.plans.worth_planning = lambda key: False  # (every call checked)
    checked_host, checked_gpu = host_us(call), gpu_us(call)
    vars(kernels.plans).pop("worth_planning")
    print(
        f"  checked on every call (no launch plan): host {checked_host:.0f} us, GPU {checked_gpu:.0f} us"
    )
    through_op = host_us(lambda: torch.autograd.grad(out_op, leaves, dout, retain_graph=True))
    print(f"  through the custom op: host {through_op:.0f} us per call")
    # the layers' shares: FlashAttention.backward called directly (no autograd, no custom
    # op), the three kernels' launches alone (BackwardKernels.__call__), and the pieces
    # FlashAttention.backward spends before the kernels (each alone, 200 times)
    with torch.no_grad():
        _, lse = kern(q, k, v, return_lse=True)
    kernels = kern._backward_kernels()
    dtype = kern.check_inputs(q, k, v)
    index = q.device.index
    arch = arch_of(index)
    pieces = {
        "check_inputs": lambda: kern.check_inputs(q, k, v),
        "backward_operands": lambda: backward_operands(
            out, lse, dout, None, lse_shape(q), q.device
        ),
        "arch_of": lambda: arch_of(index),
        "torch.cuda.device": lambda: torch.cuda.device(index).__enter__(),
        "current_stream": lambda: current_stream(index),
        "tensor_map (cached)": lambda: tensor_map(q, 64, 128),
        "torch.empty fp32 (b, h, rows x d)": lambda: torch.empty(
            (batch, heads, seqlen * d), device=q.device, dtype=torch.float32
        ),
    }
    for name, fn in pieces.items():
        print(f"    {name}: {host_us(fn, 200, busy=False):.1f} us", flush=True)
    layers = {
        "FlashAttention.backward": lambda: kern.backward(q, k, v, out, lse, dout, None, scale),
        "BackwardKernels.__call__": lambda: kernels(
            dtype, arch, q, k, v, out, lse, dout, None, scale
        ),
        "torch.empty_like x3": lambda: [torch.empty_like(t) for t in (q, k, v)],
    }
    for name, fn in layers.items():
        print(f"  {name}: {host_us(fn):.0f} us per call", flush=True)
    if profile_lines:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(50):
            call()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile_lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+")
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--profile", type=int, default=25)
    args = parser.parse_args()
    for spec in args.specs:
        measure(spec, args.seqlen, args.profile)
