"""`fadsl tune`: search a spec's knobs (or its backward block's) for the fastest variant on
this GPU (fadsl/tools/tune*.py do the search and the timing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..tools import bench
from .common import EXIT_FAILURE, EXIT_OK, minutes, positive, read_spec_file, seqlens


def add_tune(sub) -> None:
    from ..tools.tune import DEFAULT_SEQLENS

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
        type=seqlens,
        default=list(DEFAULT_SEQLENS),
        metavar="N,N,...",
        help="sequence lengths the score averages over (default: "
        f"{','.join(map(str, DEFAULT_SEQLENS))})",
    )
    tune.add_argument(
        "--dtype", choices=["bf16", "fp16", "e4m3", "e5m2"], help="default: the spec's first"
    )
    tune.add_argument(
        "--causal",
        action="store_true",
        default=None,
        help="causal masking (the spec's mask decides; this only confirms it)",
    )
    shape = tune.add_mutually_exclusive_group()
    shape.add_argument(
        "--tokens", type=positive, default=16384, help="batch x seqlen (default 16384)"
    )
    shape.add_argument("--batch", type=positive, help="a fixed batch at every seqlen")
    width = tune.add_mutually_exclusive_group()
    width.add_argument("--heads", type=positive, help=f"heads (default {bench.DEFAULT_HEADS})")
    width.add_argument(
        "--hidden", type=positive, metavar="H", help="heads = H / head_dim (e.g. 2048)"
    )
    tune.add_argument(
        "--budget",
        type=minutes,
        metavar="MINUTES",
        help="stop compiling and timing new variants after MINUTES (a fifth of it, at most "
        "90 s, is kept for the final round); default: until the search ends",
    )
    tune.add_argument(
        "-o", "--output", metavar="OUT.fa", help="write the winner's spec (with a header)"
    )
    tune.add_argument(
        "--jobs", type=positive, help="compile processes (default: the machine's CPUs)"
    )
    tune.add_argument(
        "--knobs", metavar="K,K,...", help="only these knobs (default: all of the target's)"
    )
    tune.add_argument(
        "--from",
        dest="starts",
        action="append",
        default=[],
        metavar="SPEC",
        help="also start from SPEC's knobs (a spec of the same target, head_dim, mask, "
        "window and dtype width; repeatable): they are screened with the first round, and the "
        "search goes on from the best",
    )
    tune.add_argument(
        "--no-shipped",
        action="store_true",
        help="do not also start from the target's shipped spec for the spec's head_dim and "
        "mask (what fadsl.attention runs; a start by default where its knobs fit the spec)",
    )
    tune.add_argument(
        "--max-rounds", type=positive, metavar="N", help="at most N rounds of neighbours"
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


def cmd_tune(args: argparse.Namespace) -> int:
    from ..tools import tune as tuning

    source = read_spec_file(args.spec)
    knobs = [k.strip() for k in args.knobs.split(",") if k.strip()] if args.knobs else None
    if args.backward:
        return _tune_backward(args, source)
    starts = [(read_spec_file(path), path) for path in args.starts]
    try:
        if args.list:
            print(tuning.list_variants(source, args.spec, knobs))
            return EXIT_OK
        if args.output is not None and Path(args.output).is_dir():
            raise ValueError(f"-o {args.output} is a folder; -o names the spec file to write")
        result = tuning.tune(
            source,
            file=args.spec,
            starts=starts,
            shipped=not args.no_shipped,
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
    from ..tools import tune_backward as tuning

    given = (
        [
            f"--{name.replace('_', '-')}"
            for name in ("knobs", "max_rounds", "budget", "batch")
            if getattr(args, name) is not None
        ]
        + (["--fresh"] if args.fresh else [])
        + (["--from"] if args.starts else [])
        + (["--no-shipped"] if args.no_shipped else [])
    )
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
