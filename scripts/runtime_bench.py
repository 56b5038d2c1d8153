"""Host overhead per call at (batch 1, seqlen 128, 1 head, head_dim 128), bf16: fadsl's eager
call against PyTorch's SDPA with the FLASH_ATTENTION backend on the same tensors in the same
process: loops of 100 calls, synchronised between loops so that the launch queue never fills
and the GPU never holds the host back; the median loop, in microseconds per call. Also the
same through torch.compile(fullgraph=True), and the GPU time per call for reference. For an
sm_90a spec also the cost of encoding one TMA descriptor (what a call on tensors it has not
seen pays, four times)."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadsl


def per_call_us(fn, calls: int = 100, repeats: int = 31) -> float:
    """Host microseconds per call: loops short enough that the launch queue never fills (the
    GPU then never holds the host back), synchronised between loops; the median loop."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def gpu_us(fn, calls: int = 100) -> float:
    """GPU microseconds per call (CUDA events around back-to-back calls)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def main(spec: str) -> None:
    kern = fadsl.load(spec)
    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA's (batch, heads, seqlen, d) views
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(qt, kt, vt).transpose(1, 2)
        assert (kern(q, k, v).float() - ref.float()).abs().max().item() < 2e-2
        flash = per_call_us(lambda: F.scaled_dot_product_attention(qt, kt, vt))
        flash_gpu = gpu_us(lambda: F.scaled_dot_product_attention(qt, kt, vt))
    fadsl_us = per_call_us(lambda: kern(q, k, v))
    fadsl_gpu = gpu_us(lambda: kern(q, k, v))
    out = torch.empty_like(q)
    fadsl_out_us = per_call_us(lambda: kern(q, k, v, out=out))
    compiled = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True)
    compiled_us = per_call_us(lambda: compiled(q, k, v))
    print(f"{kern.config.name}: host us/call at (1, 128, 1, 128) bf16: SDPA FLASH {flash:.1f}, fadsl {fadsl_us:.1f} "
          f"(out= {fadsl_out_us:.1f}), fadsl under torch.compile {compiled_us:.1f}; "
          f"fadsl - FLASH = {fadsl_us - flash:+.1f} us; back-to-back per call (GPU-bound if "
          f"above the host time): FLASH {flash_gpu:.1f}, fadsl {fadsl_gpu:.1f} us")  # fmt: skip
    if kern.config.target == "sm_90a":
        from fadsl.targets.sm90.host import tma

        def encode():
            tma._encoded.clear()
            tma.tensor_map(q, 64, kern.config.block_r)

        print(f"{kern.config.name}: one TMA descriptor encoded (cache miss) "
              f"{per_call_us(encode):.1f} us, found (cache hit) "
              f"{per_call_us(lambda: tma.tensor_map(q, 64, kern.config.block_r)):.2f} us")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "examples/fa2_pipelined.fa")
