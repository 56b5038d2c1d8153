"""Programs of the sm_90a headers built for this machine with nvcc and run here: the tests
that hold a header's integer functions (block ranges, dQ places and counts, chunks, launch
order, stmatrix addresses) to their definitions without a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from fadsl.codegen.render import write_headers


def run_host_program(root: Path, name: str, program: str, stdin: str | None = None) -> str:
    """``program`` (C++ that includes "fadsl/sm90_bwd.cuh" and the like) written into
    ``root`` beside the headers, built with ``nvcc -std=c++17`` and run with ``stdin``: its
    standard output. Skips the test where there is no nvcc."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    write_headers(root, "sm90")
    source, binary = root / f"{name}.cu", root / name
    source.write_text(program)
    command = ["nvcc", "-std=c++17", "-I", str(root), "-o", str(binary), str(source)]
    subprocess.run(command, check=True, capture_output=True)
    run = subprocess.run([str(binary)], input=stdin, check=True, capture_output=True, text=True)
    return run.stdout
