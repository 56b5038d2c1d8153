"""The `fadsl` command line: check, explain, compile and bench a spec."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from . import __version__
from .errors import SpecError
from .pipeline import Compiled, compile_file

EXIT_OK, EXIT_FAILURE, EXIT_SPEC_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


def _compile(path: str) -> Compiled:
    return compile_file(Path(path))


def cmd_check(args: argparse.Namespace) -> int:
    from .report import summary

    print(summary(_compile(args.spec)), end="")
    return EXIT_OK


def cmd_explain(args: argparse.Namespace) -> int:
    from .report import explain_data, explain_text

    compiled = _compile(args.spec)
    if args.json:
        print(json.dumps(explain_data(compiled), indent=2))
    else:
        print(explain_text(compiled), end="")
    return EXIT_OK


def cmd_compile(args: argparse.Namespace) -> int:
    from .codegen import write

    compiled = _compile(args.spec)
    out_dir = Path(args.output)
    for path in write(compiled, out_dir):
        print(f"wrote {path}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fadsl",
        description="Compile a declarative attention spec (.fa) to a FlashAttention forward kernel.",
    )
    parser.add_argument("--version", action="version", version=f"fadsl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    check = sub.add_parser("check", help="parse and validate a spec; print its configuration")
    check.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    check.set_defaults(run=cmd_check)

    explain = sub.add_parser(
        "explain", help="show the SMEM plan and the schedule with each sync and its hazards"
    )
    explain.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    explain.set_defaults(run=cmd_explain)

    comp = sub.add_parser(
        "compile",
        help="write one .cu per dtype (kernel, launcher, torch binding) and the helper header",
    )
    comp.add_argument("spec", metavar="SPEC", help="path to a .fa spec")
    comp.add_argument(
        "-o", "--output", metavar="DIR", default="build", help="output folder (default: build)"
    )
    comp.set_defaults(run=cmd_compile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except SpecError as err:
        print(err, file=sys.stderr)
        return EXIT_SPEC_ERROR
    except OSError as err:
        print(f"fadsl: error: {err.strerror or err}: '{err.filename}'", file=sys.stderr)
        return EXIT_SPEC_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
