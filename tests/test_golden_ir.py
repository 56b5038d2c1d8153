"""Golden tests of the printed IR after each pass, for every example."""

from conftest import ROOT

from fadsl.pipeline import compile_file
from fadsl.ir.printer import format_kernel


def test_ir_after_each_pass(example, golden):
    compiled = compile_file(example.relative_to(ROOT))
    for stage, kernel in compiled.stages:
        golden.check(
            ROOT / "tests" / "golden" / "ir" / f"{example.stem}.{stage}.txt", format_kernel(kernel)
        )
