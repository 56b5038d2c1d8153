"""`fadsl bench`: time a spec's kernel (forward, backward, varlen, kv cache) or the public calls
beside PyTorch's SDPA backends and FlashAttention-4 (fadsl/tools/bench*.py do the timing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..tools import bench
from .common import EXIT_FAILURE, EXIT_OK, compile_spec, positive, seqlens


def add_bench(sub) -> None:
    bench_cmd = sub.add_parser(
        "bench",
        help="time the kernel against PyTorch's FLASH_ATTENTION and CUDNN_ATTENTION backends",
    )
    bench_cmd.add_argument(
        "spec", metavar="SPEC", nargs="?", help="path to a .fa spec (none with --calls)"
    )
    bench_cmd.add_argument(
        "--calls",
        action="store_true",
        help="time the public calls instead (no SPEC): host microseconds per call of "
        "fadsl.attention, attention_varlen, attention_with_kvcache and append_kv beside SDPA "
        "and FlashAttention-4, and paged decode eager and from a CUDA graph beside cuDNN and FA4",
    )
    bench_cmd.add_argument(
        "--seqlens",
        type=seqlens,
        default=list(bench.DEFAULT_SEQLENS),
        metavar="N,N,...",
        help="sequence lengths (default: 512,...,16384)",
    )
    bench_cmd.add_argument(
        "--dtype", choices=["bf16", "fp16", "e4m3", "e5m2"], help="default: the spec's first"
    )
    bench_cmd.add_argument("--causal", action="store_true", help="causal masking")
    bench_cmd.add_argument(
        "--tokens", type=positive, default=16384, help="batch x seqlen (default 16384)"
    )
    width = bench_cmd.add_mutually_exclusive_group()
    width.add_argument("--heads", type=positive, help=f"heads (default {bench.DEFAULT_HEADS})")
    width.add_argument(
        "--hidden",
        type=positive,
        metavar="H",
        help="heads = H / head_dim, as the FlashAttention papers do (hidden 2048)",
    )
    bench_cmd.add_argument("--warmup", type=int, default=32, help="warm-up runs (default 32)")
    bench_cmd.add_argument("--runs", type=positive, default=128, help="timed runs (default 128)")
    bench_cmd.add_argument(
        "--against",
        metavar="SPEC",
        action="append",
        help="also time this spec's kernel (same head_dim and mask) on the same tensors, as "
        "fadsl:<kernel>; repeatable",
    )
    bench_cmd.add_argument(
        "--rounds",
        type=positive,
        default=None,
        help="time every contender this many times, in balanced orders (each first equally "
        "often, each after each other equally often: a contender's clock depends on what ran "
        "before it), and report the median of its medians (default: one full design, as many "
        "rounds as contenders, twice that when odd)",
    )
    bench_cmd.add_argument(
        "--backward",
        action="store_true",
        help="time the backward pass instead (a spec with a backward block): TF/s = 2.5 x the "
        "forward's FLOPs / time, against the SDPA backends' and FlashAttention-4's backward",
    )
    bench_cmd.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    bench_cmd.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    bench_cmd.set_defaults(run=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..runtime.attention import FlashAttention

    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before the run, not after it)
        except ImportError:
            print(
                "fadsl bench: --plot needs matplotlib: pip install 'fadsl[bench]'",
                file=sys.stderr,
            )
            return EXIT_FAILURE

    if args.calls or args.spec is None:
        return _bench_calls(args)
    compiled = compile_spec(args.spec)  # a bad spec is reported (exit 2) before the GPU check
    if args.backward and compiled.kernel.backward is None:
        print(
            f"fadsl bench: --backward: {args.spec} has no backward block (add `backward {{}}`)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    kern = FlashAttention(compiled)
    others = tuple(FlashAttention(compile_spec(spec)) for spec in args.against or ())
    if args.backward:
        for other, spec in zip(others, args.against or ()):
            if other.compiled.kernel.backward is None:
                print(f"fadsl bench: --backward: {spec} has no backward block", file=sys.stderr)
                return EXIT_FAILURE
    dtype_name = args.dtype or compiled.kernel.config.dtypes[0].value
    compiles = [d.value for d in compiled.kernel.config.dtypes]
    if dtype_name not in compiles:  # (every path below times the spec in this dtype)
        print(
            f"fadsl bench: --dtype {dtype_name}: the spec compiles {', '.join(compiles)}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    try:
        bench.variants(kern, others, dtype_name)  # they time the same problem
    except ValueError as err:
        print(f"fadsl bench: {err}", file=sys.stderr)
        return EXIT_FAILURE
    heads = bench.DEFAULT_HEADS if args.heads is None else args.heads
    if args.hidden is not None:
        head_dim = compiled.kernel.config.head_dim
        if args.hidden % head_dim:
            print(
                f"fadsl bench: --hidden {args.hidden} is not a multiple of the "
                f"spec's head_dim {head_dim}",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        heads = args.hidden // head_dim
    try:
        import torch
    except ImportError:
        print("fadsl bench: needs PyTorch", file=sys.stderr)
        return EXIT_FAILURE
    if not torch.cuda.is_available():
        print("fadsl bench: needs a CUDA GPU, and none is visible", file=sys.stderr)
        return EXIT_FAILURE
    if kern.is_varlen:
        return _bench_varlen(args, kern, heads, others)
    if args.backward:
        return _bench_backward(args, kern, heads, others)
    if kern.is_kvcache:
        return _bench_kvcache(args, kern)
    try:
        result = bench.run(
            kern,
            seqlens=tuple(args.seqlens),
            dtype_name=dtype_name,
            causal=args.causal,
            tokens=args.tokens,
            heads=heads,
            warmup=args.warmup,
            runs=args.runs,
            against=others,
            rounds=args.rounds,
        )
    except (ValueError, RuntimeError) as err:
        print(f"fadsl bench: {err}", file=sys.stderr)
        return EXIT_FAILURE
    print(bench.table(result))
    if args.json:
        bench.write_json(result, Path(args.json))
    if args.plot:
        bench.plot(result, Path(args.plot))
    return EXIT_OK


def _bench_tool(args: argparse.Namespace, tool, **options) -> int:
    """Run one of fadsl/tools' bench_* modules (``tool.run(kern, **options)``), print its
    table and write its JSON where asked; its ValueError or RuntimeError is the message."""
    import json

    try:
        result = tool.run(**options)
    except (ValueError, RuntimeError) as err:
        print(f"fadsl bench: {err}", file=sys.stderr)
        return EXIT_FAILURE
    print(tool.table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return EXIT_OK


def _bench_calls(args: argparse.Namespace) -> int:
    """`fadsl bench --calls`: the public calls' host time and decode, eager and graphed
    (fadsl/tools/bench_calls.py)."""
    if not args.calls:
        print("fadsl bench: give a SPEC, or --calls to time the public calls", file=sys.stderr)
        return EXIT_FAILURE
    if args.spec is not None:
        print("fadsl bench: --calls times the shipped specs: give no SPEC", file=sys.stderr)
        return EXIT_FAILURE
    if args.backward or args.against or args.plot:
        print("fadsl bench: --calls takes none of --backward, --against, --plot", file=sys.stderr)
        return EXIT_FAILURE
    try:
        import torch
    except ImportError:  # (a dependency, but the message should not be a traceback)
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("fadsl bench: --calls needs a CUDA GPU", file=sys.stderr)
        return EXIT_FAILURE
    from ..tools import bench_calls

    return _bench_tool(args, bench_calls, rounds=args.rounds)


def _bench_backward(args: argparse.Namespace, kern, heads: int, others: tuple) -> int:
    """`fadsl bench --backward`: the backward pass (fadsl/tools/bench_backward.py), with the
    --against variants timed on the same tensors."""
    from ..tools import bench_backward

    return _bench_tool(
        args, bench_backward, kern=kern, seqlens=tuple(args.seqlens), causal=args.causal,
        tokens=args.tokens, heads=heads, dtype_name=args.dtype, against=others,
    )  # fmt: skip


def _bench_varlen(args: argparse.Namespace, kern, heads: int, others: tuple) -> int:
    """`fadsl bench` on a `varlen on` spec: packed batches of mixed lengths, --seqlens the
    longest, the forward or (--backward) the backward (fadsl/tools/bench_varlen.py); with
    --against padded specs, sequences of equal length, each padded kernel on the same tokens."""
    from ..tools import bench_varlen

    cfg = kern.config
    if cfg.window or cfg.features.softcap or args.causal != (cfg.mask.value == "causal"):
        print(
            "fadsl bench: a varlen spec is timed with its own mask, causal or none (pass "
            "--causal exactly for a causal spec); windows and softcap are not benched",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return _bench_tool(
        args, bench_varlen, kern=kern, max_seqlens=tuple(args.seqlens), causal=args.causal,
        tokens=args.tokens, heads=heads, rounds=args.rounds, dtype_name=args.dtype,
        backward=args.backward, against=others,
    )  # fmt: skip


def _bench_kvcache(args: argparse.Namespace, kern) -> int:
    """`fadsl bench` on a `kv_cache` spec: decode steps, TB/s of K and V read, against cuDNN,
    FLASH and FA4 (fadsl/tools/bench_kvcache.py)."""
    from ..tools import bench_kvcache

    if args.against:
        print("fadsl bench: a kv_cache spec is timed alone; leave out --against", file=sys.stderr)
        return EXIT_FAILURE
    return _bench_tool(args, bench_kvcache, kern=kern, rounds=args.rounds, dtype_name=args.dtype)
