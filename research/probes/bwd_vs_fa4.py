"""The backward beside FlashAttention-4's and cuDNN's on the same tensors, sustained: TF/s,
SM clock, power and energy per call for each contender (is the gap the power cap, or the
clocks a backward needs?), and a mode that runs one profiled backward per contender for
Nsight Compute.

Usage (GPU machine, FA4 installed for its column; issue 44):
  python3 -P bwd_vs_fa4.py examples/fa3_hopper.fa --seqlen 16384 [--seconds 2 --rounds 2]
  ncu --profile-from-start off ... python3 -P bwd_vs_fa4.py SPEC --ncu   (fadsl, cuDNN, FA4 in turn)

Each contender runs its backward back to back for ``--seconds`` (after a warm-up of the same
length, which brings the board to its steady clock), in rotated orders over ``--rounds``; the
SM clock and power are sampled through NVML (fadsl/tools/clocks) and the board's energy
counter read before and after. TF/s per GHz separates the kernel's clocks from the cap's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import statistics
import sys
import time

for cand in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parents[2]):
    if (cand / "fadsl").is_dir():
        sys.path.insert(0, str(cand))
        break


def energy_reader():
    """The board's energy counter in joules (nvmlDeviceGetTotalEnergyConsumption), or None."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) != 0:
            return None
        mj = ctypes.c_ulonglong()

        def read() -> float | None:
            ok = lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) == 0
            return mj.value / 1000.0 if ok else None

        return read if read() is not None else None
    except (OSError, AttributeError):
        return None


def contenders(spec: str, seqlen: int, hidden: int, tokens: int):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fadsl
    from fadsl.tools.bench import _flash_attention_4

    kern = fadsl.load(spec)
    causal = kern.config.mask.value == "causal"
    d = kern.config.head_dim
    heads, batch = hidden // d, max(1, tokens // seqlen)
    shape = (batch, seqlen, heads, d)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    calls = {}

    def grad_call(out, leaves, grad):
        return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    calls["fadsl"] = grad_call(kern(*leaves), leaves, dout)
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
    calls["cudnn"] = grad_call(o, (qt, kt, vt), dout.transpose(1, 2))
    fa4 = _flash_attention_4()
    if fa4 is not None:
        l4 = [t.clone().requires_grad_() for t in (q, k, v)]
        o4 = fa4(*l4, causal=causal)
        o4 = o4[0] if isinstance(o4, tuple) else o4
        calls["fa4"] = grad_call(o4, l4, dout)
    flops = 2.5 * 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
    return (
        calls,
        flops,
        dict(spec=spec, seqlen=seqlen, batch=batch, heads=heads, head_dim=d, causal=causal),
    )


def sustained(call, seconds: float, sampler, energy):
    import torch

    call()
    torch.cuda.synchronize()
    n = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:  # warm-up to the steady clock
        call()
        n += 1
        if n % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    per_batch = max(1, n // 4)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if sampler:
        sampler.start()
    e0 = energy() if energy else None
    begin.record()
    calls = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(per_batch):
            call()
        calls += per_batch
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    e1 = energy() if energy else None
    readings = sampler.stop() if sampler else []
    ms = begin.elapsed_time(end) / calls
    return ms, readings, (None if e0 is None or e1 is None else (e1 - e0) / calls)


def kernel_budget(name: str, call) -> str:
    """One line: each kernel of a backward call, median microseconds (scripts/
    backward_budget.py's device_times), and their sum. (The profiler adds host time between
    the launches, so the call's span under it says nothing of the gaps.)"""
    from scripts.backward_budget import device_times

    times = device_times(call, role=lambda kernel: kernel[:48], calls=7)
    cells = "; ".join(f"{k} {us:.1f}" for k, us in sorted(times.items(), key=lambda kv: -kv[1]))
    return f"{name:6s} kernels {sum(times.values()):8.1f} us: {cells}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--seqlen", type=int, default=16384)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--ncu",
        action="store_true",
        help="one backward per contender between cudaProfilerStart and Stop",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="each contender's kernels (torch.profiler): median microseconds per call",
    )
    p.add_argument("--json")
    args = p.parse_args()

    import torch

    from fadsl.tools import clocks

    calls, flops, shape = contenders(args.spec, args.seqlen, args.hidden, args.tokens)
    if args.ncu:  # the autograd engine launches from its own thread: NVTX ranges (per thread)
        # miss its kernels, so the profiler's start and stop (per context) bracket each call
        for name, call in calls.items():
            for _ in range(3):
                call()
        torch.cuda.synchronize()
        for name, call in calls.items():
            print(f"ncu: {name}", flush=True)
            torch.cuda.profiler.start()
            call()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        return 0
    if args.kernels:
        for name, call in calls.items():
            print(kernel_budget(name, call), flush=True)
        return 0
    read = clocks.nvml_reader()
    sampler = clocks.Sampler(read, interval=0.005) if read else None
    energy = energy_reader()
    names = list(calls)
    results: dict[str, list] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        order = order if r % 2 == 0 else order[::-1]
        for name in order:
            ms, readings, joules = sustained(calls[name], args.seconds, sampler, energy)
            s = clocks.summarize(readings)
            results[name].append(
                dict(
                    ms=ms,
                    tflops=flops / (ms * 1e-3) / 1e12,
                    mhz=s.sm_mhz if s else None,
                    watts=s.power_w if s else None,
                    capped=s.power_capped if s else None,
                    joules=joules,
                )
            )
    print(json.dumps(shape))
    summary = {}
    for name in names:
        rs = results[name]
        tf = statistics.median(x["tflops"] for x in rs)
        mhz = statistics.median(x["mhz"] for x in rs) if rs[0]["mhz"] else float("nan")
        w = statistics.median(x["watts"] for x in rs) if rs[0]["watts"] else float("nan")
        cap = (
            statistics.median(x["capped"] for x in rs)
            if rs[0]["capped"] is not None
            else float("nan")
        )
        j = statistics.median(x["joules"] for x in rs) if rs[0]["joules"] else float("nan")
        summary[name] = dict(tflops=tf, mhz=mhz, watts=w, capped=cap, joules_per_call=j, runs=rs)
        print(
            f"{name:6s} {tf:7.1f} TF/s  {mhz:6.0f} MHz  {w:5.0f} W  cap {100 * cap:3.0f}%  "
            f"{tf / (mhz / 1000):6.1f} TF/s/GHz  {1000 * j:8.1f} mJ/call  "
            f"{flops / 1e12 / j if j == j else float('nan'):6.2f} TFLOP/J"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(shape=shape, summary=summary), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
