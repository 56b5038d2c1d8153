"""Golden tests of `fadsl check` and `fadsl explain` (text and --json) for every example.

The register check is given, not run (a compiler's counts vary by version): every
dtype and architecture reports the same made-up usage, so that the registers line and
the resources table are printed and compared too."""

import json

from conftest import ROOT

from fadsl.build.spill_check import KernelUsage, RegisterCheck, Usage
from fadsl.pipeline import compile_file
from fadsl.tools.report import explain_data, explain_text, summary

USAGE = Usage(registers=128)


def registers_of(compiled) -> RegisterCheck:
    rows = tuple(
        KernelUsage(dtype, arch, USAGE)
        for dtype in compiled.kernel.config.dtypes
        for arch, _family in compiled.target.capabilities.archs
    )
    return RegisterCheck(rows, "test compiler")


def test_check_and_explain(example, golden):
    compiled = compile_file(example.relative_to(ROOT))
    registers = registers_of(compiled)
    where = ROOT / "tests" / "golden" / "report"
    golden.check(where / f"{example.stem}.check.txt", summary(compiled, registers))
    golden.check(where / f"{example.stem}.explain.txt", explain_text(compiled, registers))
    data = json.dumps(explain_data(compiled, registers), indent=2) + "\n"
    golden.check(where / f"{example.stem}.explain.json", data)


def test_check_and_explain_without_a_compiler(example, golden):
    compiled = compile_file(example.relative_to(ROOT))
    where = ROOT / "tests" / "golden" / "report"
    text = summary(compiled) + explain_text(compiled)
    golden.check(where / f"{example.stem}.no_compile.txt", text)
