"""The `fadsl` command line: check, explain, compile, build, bench and tune a spec; the cache."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from ._version import __version__
from .tools import bench
from .build.spill_check import RegisterCheck, check_registers
from .errors import SpecError
from .passes.verify import VerifyError
from .pipeline import Compiled, compile_source, read_spec

EXIT_OK, EXIT_FAILURE, EXIT_SPEC_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


class UnreadableSpec(Exception):
    """The spec file cannot be read (exit 2, like a bad spec)."""


def _compile(path: str) -> Compiled:
    try:
        source = read_spec(Path(path))
    except OSError as err:
        raise UnreadableSpec(f"fadsl: error: cannot read '{path}': {err.strerror or err}") from None
    return compile_source(source, str(Path(path)))


def _register_check(compiled: Compiled, args: argparse.Namespace) -> RegisterCheck:
    """Compile the kernel (unless told not to) and refuse it if it spills."""
    if args.no_compile:
        return RegisterCheck((), "--no-compile")
    return check_registers(compiled)


def cmd_check(args: argparse.Namespace) -> int:
    from .tools.report import summary

    compiled = _compile(args.spec)
    print(summary(compiled, _register_check(compiled, args)), end="")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from .tools.report import explain_data, explain_text

    compiled = _compile(args.spec)
    registers = _register_check(compiled, args)
    if args.json:
        print(json.dumps(explain_data(compiled, registers), indent=2))
    else:
        print(explain_text(compiled, registers), end="")
    return EXIT_OK


def cmd_compile(args: argparse.Namespace) -> int:
    from .codegen.render import write

    compiled = _compile(args.spec)
    out_dir = Path(args.output)
    if out_dir.exists() and not out_dir.is_dir():
        print(
            f"fadsl compile: the output path '{out_dir}' is a file; -o names a folder",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    for variant in compiled.variants:  # `cluster 2`: the variant unpaired launches run too
        try:
            paths = write(variant.kernel, variant.target, variant.file, out_dir)
        except SpecError as err:  # what a target does not render yet (sm_90a: 8-bit)
            raise SpecError(err.diagnostics, compiled.source) from None
        for path in paths:
            print(f"wrote {path}")
    return EXIT_OK


def cmd_build(args: argparse.Namespace) -> int:
    from .runtime.attention import build_ahead

    compiled = _compile(args.spec)
    if args.arch is None:
        archs = [arch for arch, _ in compiled.target.capabilities.archs]
    else:
        archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    try:
        paths = build_ahead(compiled, archs, Path(args.output))
    except (ValueError, RuntimeError) as err:  # a bad --arch; the compiler's message
        print(f"fadsl build: {err}", file=sys.stderr)
        return EXIT_FAILURE
    for path in paths:
        print(f"wrote {path}")
    return EXIT_OK


def cmd_cache(args: argparse.Namespace) -> int:
    from .build import cache

    folder = cache.cache_dir()
    if args.action == "clear":
        print(f"removed {cache.clear(folder)} files from {folder}")
        return EXIT_OK
    rows = cache.entries(folder)
    print(f"{folder}: {len(rows)} entries")
    for row in rows:
        state = "" if row["ok"] else "  (corrupt: rebuilt on next use)"
        print(
            f"  {row['kernel']:<32} {row['arch']:<7} {row['compiler']:<11} "
            f"{row['bytes']:>8} B  {row['name']}{state}"
        )
    return EXIT_OK


def cmd_bench(args: argparse.Namespace) -> int:
    from .runtime.attention import FlashAttention

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
    compiled = _compile(args.spec)  # a bad spec is reported (exit 2) before the GPU check
    if args.backward and compiled.kernel.backward is None:
        print(
            f"fadsl bench: --backward: {args.spec} has no backward block (add `backward {{}}`)",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    kern = FlashAttention(compiled)
    others = tuple(FlashAttention(_compile(spec)) for spec in args.against or ())
    if args.backward:
        for other, spec in zip(others, args.against or ()):
            if other.compiled.kernel.backward is None:
                print(f"fadsl bench: --backward: {spec} has no backward block", file=sys.stderr)
                return EXIT_FAILURE
    dtype_name = args.dtype or compiled.kernel.config.dtypes[0].value
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
    from .tools import bench_calls

    return _bench_tool(args, bench_calls, rounds=args.rounds)


def _bench_backward(args: argparse.Namespace, kern, heads: int, others: tuple) -> int:
    """`fadsl bench --backward`: the backward pass (fadsl/tools/bench_backward.py), with the
    --against variants timed on the same tensors."""
    from .tools import bench_backward

    return _bench_tool(
        args, bench_backward, kern=kern, seqlens=tuple(args.seqlens), causal=args.causal,
        tokens=args.tokens, heads=heads, dtype_name=args.dtype, against=others,
    )  # fmt: skip


def _bench_varlen(args: argparse.Namespace, kern, heads: int, others: tuple) -> int:
    """`fadsl bench` on a `varlen on` spec: packed batches of mixed lengths, --seqlens the
    longest, the forward or (--backward) the backward (fadsl/tools/bench_varlen.py); with
    --against padded specs, sequences of equal length, each padded kernel on the same tokens."""
    from .tools import bench_varlen

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
    from .tools import bench_kvcache

    if args.against:
        print("fadsl bench: a kv_cache spec is timed alone; leave out --against", file=sys.stderr)
        return EXIT_FAILURE
    return _bench_tool(args, bench_kvcache, kern=kern, rounds=args.rounds, dtype_name=args.dtype)


def cmd_tune(args: argparse.Namespace) -> int:
    from .tools import tune as tuning

    try:
        source = read_spec(Path(args.spec))
    except OSError as err:
        raise UnreadableSpec(f"fadsl: error: cannot read '{args.spec}': {err.strerror or err}")
    knobs = [k.strip() for k in args.knobs.split(",") if k.strip()] if args.knobs else None
    if args.backward:
        return _tune_backward(args, source)
    try:
        if args.list:
            print(tuning.list_variants(source, args.spec, knobs))
            return EXIT_OK
        if args.output is not None and Path(args.output).is_dir():
            raise ValueError(f"-o {args.output} is a folder; -o names the spec file to write")
        result = tuning.tune(
            source,
            file=args.spec,
            seqlens=tuple(args.seqlens),
            dtype=args.dtype,
            causal=args.causal,
            heads=args.heads,
            hidden=args.hidden,
            tokens=args.tokens,
            batch=args.batch,
            budget=args.budget,
            jobs=args.jobs,
            output=args.output,
            knobs=knobs,
            fresh=args.fresh,
            max_rounds=args.max_rounds,
        )
    except tuning.NoGPUError as err:
        print(f"fadsl tune: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except (ValueError, RuntimeError) as err:  # an argument that does not fit; the timing
        print(f"fadsl tune: {err}", file=sys.stderr)
        return EXIT_FAILURE
    print(result.table())
    return EXIT_OK


def _tune_backward(args: argparse.Namespace, source: str) -> int:
    """`fadsl tune --backward`: every admissible variant of the spec's backward block
    compiled and timed (fadsl/tools/tune_backward.py)."""
    from .tools import tune_backward as tuning

    given = [
        f"--{name.replace('_', '-')}"
        for name in ("knobs", "max_rounds", "budget", "batch")
        if getattr(args, name) is not None
    ] + (["--fresh"] if args.fresh else [])
    if given:
        print(
            f"fadsl tune: --backward tries every variant of the backward block and times them "
            f"in one run: leave out {', '.join(given)}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    try:
        if args.list:
            _, variants = tuning.backward_variants(source, args.spec)
            for n, v in enumerate(variants):
                said = "  (the input)" if n == 0 else ""
                said += f"  [refused: {v.reason}]" if v.backward is None else ""
                print(v.label + said)
            return EXIT_OK
        if args.output is not None and Path(args.output).is_dir():
            raise ValueError(f"-o {args.output} is a folder; -o names the spec file to write")
        result = tuning.tune_backward(
            source,
            args.spec,
            seqlens=tuple(args.seqlens),
            dtype=args.dtype,
            causal=args.causal,
            heads=args.heads,
            hidden=args.hidden,
            tokens=args.tokens,
            jobs=args.jobs,
            output=args.output,
            log=lambda s: print(s, file=sys.stderr, flush=True),
        )
    except (ValueError, RuntimeError) as err:  # NoGPUError too
        print(f"fadsl tune: {err}", file=sys.stderr)
        return EXIT_FAILURE
    print(result.table())
    return EXIT_OK


def _seqlens(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'")
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("sequence lengths must be positive")
    return values


def _minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got '{text}'")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of minutes, got {text}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fadsl",
        description="Compile a declarative attention spec (.fa) to a FlashAttention forward kernel.",
    )
    parser.add_argument("--version", action="version", version=f"fadsl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    no_compile = {
        "action": "store_true",
        "dest": "no_compile",
        "help": "don't compile the kernel to check its registers (spills, stack), even if a "
        "CUDA compiler is there",
    }
    check = sub.add_parser(
        "check",
        help="parse and validate a spec, compile it (with nvcc, if there) to refuse register "
        "spills; print its configuration",
    )
    check.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    check.add_argument("--no-compile", **no_compile)
    check.set_defaults(run=cmd_check)

    explain = sub.add_parser(
        "explain", help="show the SMEM plan and the schedule with each sync and its hazards"
    )
    explain.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    explain.add_argument("--no-compile", "--no-nvcc", "--no-ptxas", **no_compile)
    explain.set_defaults(run=cmd_explain)

    comp = sub.add_parser(
        "compile",
        help="write one .cu per dtype (device code only) and the helper headers",
    )
    comp.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    comp.add_argument(
        "-o", "--output", metavar="DIR", default="build", help="output folder (default: build)"
    )
    comp.set_defaults(run=cmd_compile)

    build = sub.add_parser(
        "build",
        help="compile the spec's kernels to cubins ahead of time (no GPU needed)",
    )
    build.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    build.add_argument(
        "--arch",
        default=None,
        metavar="ARCH,...",
        help="architectures, comma-separated (default: every one the spec's target runs on)",
    )
    build.add_argument(
        "-o", "--output", metavar="DIR", default="cubins", help="output folder (default: cubins)"
    )
    build.set_defaults(run=cmd_build)

    cache_cmd = sub.add_parser("cache", help="list or clear the cubin cache ($FADSL_CACHE_DIR)")
    cache_cmd.add_argument("action", choices=["list", "clear"])
    cache_cmd.set_defaults(run=cmd_cache)

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
        type=_seqlens,
        default=list(bench.DEFAULT_SEQLENS),
        metavar="N,N,...",
        help="sequence lengths (default: 512,...,16384)",
    )
    bench_cmd.add_argument("--dtype", choices=["bf16", "fp16"], help="default: the spec's first")
    bench_cmd.add_argument("--causal", action="store_true", help="causal masking")
    bench_cmd.add_argument(
        "--tokens", type=_positive, default=16384, help="batch x seqlen (default 16384)"
    )
    width = bench_cmd.add_mutually_exclusive_group()
    width.add_argument("--heads", type=_positive, help=f"heads (default {bench.DEFAULT_HEADS})")
    width.add_argument(
        "--hidden",
        type=_positive,
        metavar="H",
        help="heads = H / head_dim, as the FlashAttention papers do (hidden 2048)",
    )
    bench_cmd.add_argument("--warmup", type=int, default=32, help="warm-up runs (default 32)")
    bench_cmd.add_argument("--runs", type=_positive, default=128, help="timed runs (default 128)")
    bench_cmd.add_argument(
        "--against",
        metavar="SPEC",
        action="append",
        help="also time this spec's kernel (same head_dim and mask) on the same tensors, as "
        "fadsl:<kernel>; repeatable",
    )
    bench_cmd.add_argument(
        "--rounds",
        type=_positive,
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
    _add_tune(sub)
    return parser


def _add_tune(sub) -> None:
    from .tools.tune import DEFAULT_SEQLENS

    tune = sub.add_parser(
        "tune",
        help="search the spec's knobs (tile, stages, warpgroups, schedule) for the fastest "
        "variant on this GPU; compile in parallel, time against the spec, SDPA and FA4",
        description="Search the spec's knobs for the fastest variant on GPU 0: each round "
        "compiles the best variant's neighbours (the checks, the register model and ptxas "
        "prune what cannot work) and times them against the spec as `fadsl bench` does; the "
        "best are timed again beside PyTorch's FLASH_ATTENTION and CUDNN_ATTENTION backends "
        "and FlashAttention-4. Measurements are cached: a second run answers at once. "
        "Without a GPU the first round is still compiled (into the cubin cache), then it "
        "stops with exit status 1.",
    )
    tune.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    tune.add_argument(
        "--seqlens",
        type=_seqlens,
        default=list(DEFAULT_SEQLENS),
        metavar="N,N,...",
        help="sequence lengths the score averages over (default: "
        f"{','.join(map(str, DEFAULT_SEQLENS))})",
    )
    tune.add_argument("--dtype", choices=["bf16", "fp16"], help="default: the spec's first")
    tune.add_argument(
        "--causal",
        action="store_true",
        default=None,
        help="causal masking (the spec's mask decides; this only confirms it)",
    )
    shape = tune.add_mutually_exclusive_group()
    shape.add_argument(
        "--tokens", type=_positive, default=16384, help="batch x seqlen (default 16384)"
    )
    shape.add_argument("--batch", type=_positive, help="a fixed batch at every seqlen")
    width = tune.add_mutually_exclusive_group()
    width.add_argument("--heads", type=_positive, help=f"heads (default {bench.DEFAULT_HEADS})")
    width.add_argument(
        "--hidden", type=_positive, metavar="H", help="heads = H / head_dim (e.g. 2048)"
    )
    tune.add_argument(
        "--budget",
        type=_minutes,
        metavar="MINUTES",
        help="stop compiling and timing new variants after MINUTES (a fifth of it, at most "
        "90 s, is kept for the final round); default: until the search ends",
    )
    tune.add_argument(
        "-o", "--output", metavar="OUT.fa", help="write the winner's spec (with a header)"
    )
    tune.add_argument(
        "--jobs", type=_positive, help="compile processes (default: the machine's CPUs)"
    )
    tune.add_argument(
        "--knobs", metavar="K,K,...", help="only these knobs (default: all of the target's)"
    )
    tune.add_argument(
        "--max-rounds", type=_positive, metavar="N", help="at most N rounds of neighbours"
    )
    tune.add_argument(
        "--fresh", action="store_true", help="measure again instead of using cached figures"
    )
    tune.add_argument(
        "--backward",
        action="store_true",
        help="tune the spec's backward block instead: every variant of its tile, consumer "
        "order, dQ path and stages that builds without spills, timed on the same tensors "
        "(the backward alone, as `fadsl bench --backward`); the best by geometric mean",
    )
    tune.add_argument(
        "--list",
        action="store_true",
        help="list the first round's variants and what the checks pruned; compile and time "
        "nothing (no GPU needed)",
    )
    tune.set_defaults(run=cmd_tune)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except SpecError as err:
        print(err, file=sys.stderr)
        return EXIT_SPEC_ERROR
    except UnreadableSpec as err:
        print(err, file=sys.stderr)
        return EXIT_SPEC_ERROR
    except VerifyError as err:
        print(
            "fadsl: internal error: the barrier plan failed its independent check; "
            f"please report this with the spec.\n{err}",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
    except OSError as err:  # writing output, or anything else the system refused
        where = f": '{err.filename}'" if err.filename else ""
        print(f"fadsl: error: {err.strerror or err}{where}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # a bug in fadsl: one line, never a traceback
        text = str(err).split("\n", 1)[0][:200]
        print(
            f"fadsl: internal error: {type(err).__name__}: {text} "
            f"(please report this with the spec and 'fadsl {__version__}')",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
