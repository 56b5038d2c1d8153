"""Golden tests for diagnostics: every spec in tests/specs/bad must be refused with
exactly the text in its .expected file.

Each ``NAME.fa`` is a small variation of examples/fa2_kernel1.fa with one problem
(a few have several independent problems, on different lines, that must all be
reported at once). ``NAME.expected`` holds ``str(err)`` followed by one newline,
with the file named as ``tests/specs/bad/NAME.fa``, whatever the current
directory. To add a case, write the .fa, run the compiler on it, read the
message critically (location and wording), and save it as the .expected.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fadsl.errors import SpecError
from fadsl.pipeline import compile_source

BAD = Path(__file__).parent / "specs" / "bad"
SPECS = sorted(BAD.glob("*.fa"))


def test_corpus_is_there() -> None:
    assert len(SPECS) >= 30, f"expected at least 30 bad specs in {BAD}, found {len(SPECS)}"


def test_every_expected_has_a_spec() -> None:
    orphans = [p.name for p in BAD.glob("*.expected") if not p.with_suffix(".fa").exists()]
    assert not orphans, f".expected files without a .fa: {orphans}"


@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_bad_spec_is_refused_with_expected_message(spec: Path, golden) -> None:
    source = spec.read_text(encoding="utf-8")
    with pytest.raises(SpecError) as info:
        compile_source(source, f"tests/specs/bad/{spec.name}")
    golden.check(spec.with_suffix(".expected"), str(info.value) + "\n")
