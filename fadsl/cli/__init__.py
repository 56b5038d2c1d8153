"""The `fadsl` command line: check, explain, compile, build, bench and tune a spec; the cache."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from .._version import __version__
from ..build.spill_check import RegisterCheck, check_registers
from ..errors import SpecError
from ..passes.verify import VerifyError
from ..pipeline import Compiled
from .bench import add_bench
from .common import (
    EXIT_FAILURE,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_SPEC_ERROR,
    UnreadableSpec,
    compile_spec,
)
from .tune import add_tune


def _register_check(compiled: Compiled, args: argparse.Namespace) -> RegisterCheck:
    """Compile the kernel (unless told not to) and refuse it if it spills."""
    if args.no_compile:
        return RegisterCheck((), "--no-compile")
    return check_registers(compiled)


def cmd_check(args: argparse.Namespace) -> int:
    from ..tools.report import summary

    compiled = compile_spec(args.spec)
    print(summary(compiled, _register_check(compiled, args)), end="")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from ..tools.report import explain_data, explain_text

    compiled = compile_spec(args.spec)
    registers = _register_check(compiled, args)
    if args.json:
        print(json.dumps(explain_data(compiled, registers), indent=2))
    else:
        print(explain_text(compiled, registers), end="")
    return EXIT_OK


def cmd_compile(args: argparse.Namespace) -> int:
    from ..codegen.render import write

    compiled = compile_spec(args.spec)
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
    from ..runtime.attention import build_ahead

    compiled = compile_spec(args.spec)
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
    from ..build import cache

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
    add_bench(sub)
    add_tune(sub)
    return parser


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
