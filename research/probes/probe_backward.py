"""The backward beside a development build of itself, on the same tensors, in one run.

For a spec with a backward block, times the backward alone (autograd of an output whose
forward ran once, as `fadsl bench --backward`) of the shipped build and of a development
build with PROBE_DEFINES ("NAME=VALUE ...", #defines before the source), balanced orders,
median; prints TF/s (2.5 x the forward's FLOPs) and the development build's ratio. Hidden
2048 (heads = 2048 / head_dim). Options (environment):
  PROBE_CHECK=1      the development build's gradients against the shipped build's first
                     (unchecked otherwise: an experiment may leave work out on purpose)
  PROBE_DEV_FIRST=1  the development build's forward runs (and its module loads) first
  PROBE_REALLOC=N    the shipped build alone N times first, its workspaces allocated afresh
                     before each (empty_cache, then a pad of PROBE_PAD_MB, default 3, more
                     each time)
  PROBE_PIN_DQ_ACCUM=1  every call reuses one fp32 dQ accumulator (the others still move)
  PROBE_PIN="I ..."  every call reuses its I-th allocation (_pin_allocations says which)
Run a control (a define nothing reads, e.g. FADSL_NOTHING=1) beside any experiment: at
head_dim 64, 1 x 16384 the same code ranged 0.93-1.09 over processes, and one build 372-403
TF/s from one 20-call window to the next, in the same sequence whatever was allocated where
(time, not placement: research/performance-history.md, 2026-11-27, decode's last per cent, item 20).

The headers keep no experiment's switch (tests/test_verify_backward_header.py checks that the
header makes exactly the proven plan's calls, under conditions it knows): an experiment is
a local edit guarded by its define, kept out of the commit (research/performance-history.md,
2026-11-27, decode's last per cent, items 13, 15 and 17, say what each changed).

Usage (a Hopper GPU): PROBE_DEFINES="FADSL_MY_EXPERIMENT=1" python3 -P
research/probes/probe_backward.py [SPEC] [--seqlens 2048,16384]
"""

from __future__ import annotations

import argparse
import os

import torch

import fadsl
from fadsl.runtime.arguments import torch_dtype_of
from fadsl.runtime.attention import arch_of
from fadsl.tools.bench import median_times

REAL_EMPTY = torch.empty  # the probe's own allocations bypass PROBE_PIN's counting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default="examples/fa3_hdim64.fa")
    parser.add_argument("--seqlens", default="2048,16384")
    args = parser.parse_args()
    text = open(args.spec).read()
    kern = fadsl.load(text, verbose=False)
    name = kern.config.name
    dev = fadsl.load(text.replace(f"kernel {name}", "kernel probe_dev", 1), verbose=False)
    dtype = kern.config.dtypes[0]
    defines = dict(d.split("=") for d in os.environ.get("PROBE_DEFINES", "").split())
    dev._backward_kernels().use_development_build(dtype, arch_of(0), defines)
    d = kern.config.head_dim
    causal = kern.config.mask.value == "causal"
    heads = 2048 // d
    torch_dtype = torch_dtype_of(dtype)
    print(f"== {name} backward, {defines or 'no defines'}", flush=True)
    for seqlen in map(int, args.seqlens.split(",")):
        batch = max(1, 16384 // seqlen)
        shape = (batch, seqlen, heads, d)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=torch_dtype, requires_grad=True)
            for _ in range(3)
        )
        dout = torch.randn(shape, device="cuda", dtype=torch_dtype)
        order = [("fadsl", kern), ("dev", dev)]
        if os.environ.get("PROBE_DEV_FIRST") == "1":  # the development build's forward first
            order.reverse()
        outs = dict(sorted({n: f(q, k, v) for n, f in order}.items()))
        fwd = 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
        pad = None
        if os.environ.get("PROBE_CHECK") == "1":  # the development build's gradients too
            ours, theirs = (
                torch.autograd.grad(outs[n], (q, k, v), dout, retain_graph=True)
                for n in ("fadsl", "dev")
            )
            for g, a, b in zip("qkv", ours, theirs):
                err = (a.float() - b.float()).abs().max().item() / a.float().abs().max().item()
                print(f"  d{g}: development build against shipped, max error {err:.2e} of max")
        contenders = {
            n: (lambda _, o=o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
            for n, o in outs.items()
        }
        if os.environ.get("PROBE_PIN_DQ_ACCUM") == "1":
            block_m = kern.compiled.kernel.backward.block_m
            _pin_dq_accum(batch, heads, -(-seqlen // block_m) * block_m * d)
        if os.environ.get("PROBE_PIN"):
            _pin_allocations(contenders["fadsl"], set(map(int, os.environ["PROBE_PIN"].split())))
        for trial in range(int(os.environ.get("PROBE_REALLOC", "0"))):
            # the shipped build alone, its workspaces allocated afresh behind a pad each time
            del pad  # the previous trial's (None at first)
            torch.cuda.empty_cache()
            step = int(os.environ.get("PROBE_PAD_MB", "3"))
            pad = REAL_EMPTY(trial * step << 20, dtype=torch.uint8, device="cuda")  # unpinned
            alone = median_times({"fadsl": contenders["fadsl"]}, 4, 16)["fadsl"]
            print(
                f"    fresh workspaces {trial} (pad {trial * step} MB): {2.5 * fwd / (alone * 1e-3) / 1e12:6.1f} TF/s"
            )
        ms = median_times(contenders, 4, 16)
        tfs = {n: 2.5 * fwd / (t * 1e-3) / 1e12 for n, t in ms.items()}
        cells = "  ".join(f"{n} {t:6.1f}" for n, t in tfs.items())
        print(f"  {batch} x {seqlen}: {cells} TF/s  dev/fadsl {tfs['dev'] / tfs['fadsl']:.3f}")


def _pin_dq_accum(batch: int, heads: int, floats: int) -> None:
    """PROBE_PIN_DQ_ACCUM=1: every backward call gets the same fp32 dQ accumulator (its
    preprocess zeroes it), so that PROBE_REALLOC moves every workspace but that one."""
    real_empty = torch.empty
    pinned = {}

    def empty(*shape, **kw):
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if kw.get("dtype") is torch.float32 and tuple(dims) == (batch, heads, floats):
            if "t" not in pinned:
                pinned["t"] = real_empty(*shape, **kw)
            return pinned["t"]
        return real_empty(*shape, **kw)

    torch.empty = empty


def _pin_allocations(call, which: set[int]) -> None:
    """PROBE_PIN="I ...": the I-th torch.empty / torch.empty_like call of each backward call
    (in the order of fadsl/targets/sm90/backward/host.py's run: 0 LSE, 1 D, 2 the dQ
    accumulator, 3 dq, 4 dk, 5 dv with MHA) returns the same tensor every call, so that
    PROBE_REALLOC moves the others only. The calls per backward are counted on a first call."""
    real = {"empty": torch.empty, "empty_like": torch.empty_like}
    count, pinned, per_call = [0], {}, [0]

    def wrapped(name):
        def alloc(*args, **kwargs):
            i = count[0] % per_call[0] if per_call[0] else count[0]
            count[0] += 1
            if per_call[0] and i in which:
                if i not in pinned:
                    pinned[i] = real[name](*args, **kwargs)
                return pinned[i]
            return real[name](*args, **kwargs)

        return alloc

    torch.empty, torch.empty_like = wrapped("empty"), wrapped("empty_like")
    call(0)
    torch.cuda.synchronize()
    per_call[0], count[0] = count[0], 0
    print(f"    {per_call[0]} allocations a backward call; pinned: {sorted(which)}")


if __name__ == "__main__":
    main()
