"""What the `fadsl` commands share: exit codes, reading and compiling a spec, argument types."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..pipeline import Compiled, compile_source, read_spec

EXIT_OK, EXIT_FAILURE, EXIT_SPEC_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


class UnreadableSpec(Exception):
    """The spec file cannot be read (exit 2, like a bad spec)."""


def read_spec_file(path: str) -> str:
    """The spec at ``path``; one that cannot be read is UnreadableSpec (exit 2)."""
    try:
        return read_spec(Path(path))
    except OSError as err:
        raise UnreadableSpec(f"fadsl: error: cannot read '{path}': {err.strerror or err}") from None


def compile_spec(path: str) -> Compiled:
    return compile_source(read_spec_file(path), str(Path(path)))


def seqlens(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'")
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("sequence lengths must be positive")
    return values


def minutes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of minutes, got '{text}'")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of minutes, got {text}")
    return value


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value
