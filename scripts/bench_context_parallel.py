"""Context parallelism timed across ranks: fadsl.distributed's ring (zigzag shards) and
all-to-all beside torch's own ``context_parallel`` over SDPA (FLASH and cuDNN backends) on the
same shards, one training step's attention (forward and backward) and the forward alone.

    torchrun --nproc-per-node 2 scripts/bench_context_parallel.py [--seqlens 16384,65536]
        [--heads 16] [--head-dim 128] [--batch 1] [--causal 1] [--runs 10] [--rounds 0]
        [--head-chunks N]

Every contender sees the same tensors; each is timed in balanced orders (a Williams design,
fadsl/tools/bench.py), the same order on every rank; a timing is the slowest rank's (CUDA
events, all_reduce MAX), the median over runs and rounds. TF/s per GPU = the whole
sequence's attention FLOPs (4 B S^2 H d, half with the causal mask; x 3.5 for forward and
backward) / time / ranks. torch's ``context_parallel`` shards with its head-tail load
balancer, which is the zigzag order fadsl's ring takes, so both run on equal work per rank.
``--cpu`` runs fadsl's ring and all-to-all with the fp32 reference step on a gloo group (a
smoke test of this script; no figures).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

import fadsl.distributed as fcp
from fadsl.tools.bench import balanced_orders

ONE_GPU = "fadsl one GPU"  # the whole sequence on one GPU (each rank runs it alone)


def _timer(device):
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def begin():
            start.record()

        def finish():
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return begin, finish
    t0 = [0.0]

    def begin_cpu():
        t0[0] = time.perf_counter()

    def finish_cpu():
        return (time.perf_counter() - t0[0]) * 1e3

    return begin_cpu, finish_cpu


def _time(fn, device, warmup: int, runs: int) -> float:
    """The slowest rank's median milliseconds of ``fn``."""
    for _ in range(warmup):
        fn()
    begin, finish = _timer(device)
    samples = []
    for _ in range(runs):
        dist.barrier()
        begin()
        fn()
        samples.append(finish())
    ms = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def _fadsl_contenders(q, k, v, dout, rank, world, causal, step, head_chunks=None):
    """name -> (forward-only call, forward+backward call) on zigzag (ring) or contiguous
    (all-to-all) shards of the same tensors."""
    calls = {}
    zig = [fcp.shard_zigzag(t, rank, world).detach() for t in (q, k, v, dout)]
    ring_in = [t.requires_grad_() for t in zig[:3]]

    def ring():
        return fcp.ring_attention(*ring_in, causal=causal, step=step)

    def ring_step():
        torch.autograd.grad(ring(), ring_in, zig[3])

    calls["fadsl ring"] = (ring, ring_step)
    if q.shape[2] % world == 0 and k.shape[2] % world == 0:
        cont = [t.chunk(world, dim=1)[rank].contiguous() for t in (q, k, v, dout)]
        a2a_in = [t.requires_grad_() for t in cont[:3]]

        def a2a():  # (head_chunks None: the automatic groups of heads)
            return fcp.ulysses_attention(*a2a_in, causal=causal, step=step, head_chunks=head_chunks)

        def a2a_step():
            torch.autograd.grad(a2a(), a2a_in, cont[3])

        calls["fadsl all-to-all"] = (a2a, a2a_step)
    return calls


def _one_gpu_contender(q, k, v, dout, causal, step):
    """The whole sequence on each GPU alone (fadsl.attention; with --cpu, torch's attention
    in fp32): the throughput context parallelism is measured against."""
    import torch.nn.functional as F

    import fadsl

    whole = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        if step is None:
            return fadsl.attention(*whole, causal=causal)
        o = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in whole), is_causal=causal, enable_gqa=True
        )
        return o.transpose(1, 2)

    def full():
        torch.autograd.grad(fwd(), whole, dout)

    return {ONE_GPU: (fwd, full)}


def _step_peak_mb(full, device) -> float:
    """The most memory one forward+backward call of ``full`` holds above what was allocated
    before it (its activations, buffers and gradients), the largest over ranks, in MiB."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    full()
    torch.cuda.synchronize()
    peak = torch.tensor([torch.cuda.max_memory_allocated() - before], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item() / 2**20


def _torch_contenders(q, k, v, dout, world, causal, stack):
    """torch's context_parallel over SDPA, per backend; entered once (it shards the buffers
    in place) and left by ``stack`` at the end."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    mesh = init_device_mesh("cuda", (world,))
    # SDPA's layout (batch, heads, seqlen, d); K/V repeated for GQA (SDPA's FLASH has none)
    group = q.shape[2] // k.shape[2]
    bufs = [
        t.repeat_interleave(group if i in (1, 2) else 1, dim=2).transpose(1, 2).contiguous()
        for i, t in enumerate((q, k, v, dout))
    ]
    stack.enter_context(context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2]))
    leaves = [t.detach().requires_grad_() for t in bufs[:3]]
    calls = {}
    for name, backend in (("torch CP FLASH", SDPBackend.FLASH_ATTENTION),
                          ("torch CP cuDNN", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip

        def fwd(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(*leaves, is_causal=causal)

        def step(fwd=fwd):
            torch.autograd.grad(fwd(), leaves, bufs[3])

        try:
            step()
        except Exception as err:  # a backend that cannot run this shape: said, not timed
            if dist.get_rank() == 0:
                print(f"{name}: not timed ({type(err).__name__}: {str(err).splitlines()[0]})")
            continue
        calls[name] = (fwd, step)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="16384,65536,131072")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=0, help="default: --heads (MHA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--causal", type=int, default=1)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=0, help="0: one whole balanced design")
    parser.add_argument("--cpu", action="store_true", help="gloo and the fp32 reference step")
    parser.add_argument(
        "--head-chunks", type=int, default=None, help="the all-to-all's groups of heads"
    )
    parser.add_argument(
        "--no-one-gpu", action="store_true", help="leave out the whole sequence on one GPU"
    )
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device, dtype, step = torch.device("cpu"), torch.float32, fcp.ReferenceStep()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        device, dtype, step = torch.device("cuda"), torch.bfloat16, None
    causal = bool(args.causal)
    heads_kv = args.kv_heads or args.heads
    for seqlen in map(int, args.seqlens.split(",")):
        g = torch.Generator(device=device).manual_seed(seqlen)
        shape_q = (args.batch, seqlen, args.heads, args.head_dim)
        shape_k = (args.batch, seqlen, heads_kv, args.head_dim)
        q, k, v, dout = (
            torch.randn(s, device=device, dtype=dtype, generator=g)
            for s in (shape_q, shape_k, shape_k, shape_q)
        )
        with contextlib.ExitStack() as stack:
            calls = _fadsl_contenders(q, k, v, dout, rank, world, causal, step, args.head_chunks)
            if not args.no_one_gpu:
                calls |= _one_gpu_contender(q, k, v, dout, causal, step)
            if not args.cpu:
                calls |= _torch_contenders(q, k, v, dout, world, causal, stack)
            names = list(calls)
            orders = balanced_orders(len(names))
            times = {n: {"forward": [], "step": []} for n in names}
            peak_mb = {n: _step_peak_mb(calls[n][1], device) for n in names}
            for r in range(args.rounds or len(orders)):
                for i in orders[r % len(orders)]:
                    fwd, full = calls[names[i]]
                    times[names[i]]["forward"].append(_time(fwd, device, args.warmup, args.runs))
                    times[names[i]]["step"].append(_time(full, device, args.warmup, args.runs))
        flops = 4 * args.batch * seqlen * seqlen * args.heads * args.head_dim
        flops *= 0.5 if causal else 1.0
        if rank == 0:
            print(f"seqlen {seqlen} x batch {args.batch}, {args.heads}/{heads_kv} heads, "
                  f"head_dim {args.head_dim}, {'causal' if causal else 'no mask'}, {world} ranks "
                  "(TF/s per GPU; ms)")  # fmt: skip
            one = statistics.median(times[ONE_GPU]["step"]) if ONE_GPU in times else None
            for n in names:
                f_ms = statistics.median(times[n]["forward"])
                s_ms = statistics.median(times[n]["step"])
                gpus = 1 if n == ONE_GPU else world  # the one-GPU contender: per GPU, alone
                f_tf = flops / (f_ms * 1e-3) / gpus / 1e12
                s_tf = 3.5 * flops / (s_ms * 1e-3) / gpus / 1e12
                speedup = f"   x one GPU {one / s_ms:5.2f}" if one else ""
                print(f"  {n:18s} forward {f_tf:7.1f} ({f_ms:8.2f} ms)   "
                      f"forward+backward {s_tf:7.1f} ({s_ms:8.2f} ms)   "
                      f"step peak {peak_mb[n]:8.0f} MiB{speedup}")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
