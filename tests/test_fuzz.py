"""Fuzz the front end: whatever text it is given, the compiler answers in under 100 KB,
either with a SpecError of located diagnostics within a second, or with a compiled kernel
within three (an accepted sm_90a kernel has its sync plan proven over every tile sequence
verify needs, which grows with stages x consumer warpgroups: about 0.55 s for 3 x 3 on an
idle core). Nothing else may escape (the CLI would turn it into exit 3).

Inputs: seeded mutants of the examples and bench specs (tests/mutate.py: token-, line-
and character-level edits, unicode, huge numbers, very long lines, many lines), and
Hypothesis's random text. CI runs a sample; the slow lane (`pytest -m slow`) runs 10,000
mutants (seed from $FADSL_FUZZ_SEED, default 1). Only the front end and the passes run:
no CUDA compiler.
"""

from __future__ import annotations

import os
import re
import signal
import time
from contextlib import contextmanager

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fadsl.errors import MAX_SHOWN, SpecError
from fadsl.pipeline import compile_source
from fadsl.tools.report import summary
from mutate import SEEDS, mutants

FILE = "fuzz/spec.fa"
TIME_LIMIT_S = 1.0  # a refusal
ACCEPTED_LIMIT_S = 3.0  # a kernel, its sync plan proven
OUTPUT_LIMIT_BYTES = 100_000
HANG_LIMIT_S = 10  # an input still running after this is stopped (and fails)

_HEADER = re.compile(re.escape(FILE) + r":[1-9][0-9]*:[1-9][0-9]*: \S")
_CARETS = re.compile(r" *\^[ ^]*")
_HIDDEN = re.compile(re.escape(FILE) + r": [1-9][0-9]* more errors? not shown")


@contextmanager
def _hang_guard():
    """Stop an input that hangs (SIGALRM: Unix, main thread), so that the test fails
    instead of stalling."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise TimeoutError(f"no answer within {HANG_LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, HANG_LIMIT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _check_rendered(err: SpecError, rendered: str) -> None:
    """Headers 'file:line:col: message', each line's source once with carets under it,
    and a count of the diagnostics not shown."""
    assert rendered and err.diagnostics, "SpecError without diagnostics"
    lines = rendered.split("\n")
    headers, i = 0, 0
    while i < len(lines):
        if _HIDDEN.fullmatch(lines[i]):
            assert i == len(lines) - 1, rendered
            hidden = int(lines[i].split(": ")[1].split()[0])
            assert headers + hidden == len(err.diagnostics), rendered
            return
        assert _HEADER.match(lines[i]), f"not a '{FILE}:line:col: message' line: {lines[i]!r}"
        headers += 1
        i += 1
        if i < len(lines) and lines[i].startswith("    "):
            assert i + 1 < len(lines) and _CARETS.fullmatch(lines[i + 1]), rendered
            i += 2
    assert headers == len(err.diagnostics) <= MAX_SHOWN, rendered


def answer(source: str) -> tuple[str, float]:
    """What `fadsl check` (without the CUDA compiler) prints for ``source``, and how long
    it took; fails on anything but a kernel or located diagnostics."""
    start = time.perf_counter()
    with _hang_guard():
        try:
            output = summary(compile_source(source, FILE))
        except SpecError as err:
            output = str(err)
            _check_rendered(err, output)
    return output, time.perf_counter() - start


def _run(seed: int, count: int) -> dict[str, float]:
    slowest = largest = accepted = 0.0
    start = time.perf_counter()
    for index, source in enumerate(mutants(seed, count)):
        where = f"mutant {index} of seed {seed} (tests/mutate.py: mutants({seed}, {index + 1}))"
        try:
            output, elapsed = answer(source)
        except Exception as exc:
            raise AssertionError(f"{where}: {type(exc).__name__}: {exc}") from exc
        size = len(output.encode())
        assert elapsed < _limit(output), f"{where} took {elapsed:.2f} s"
        assert size < OUTPUT_LIMIT_BYTES, f"{where} printed {size} bytes"
        slowest, largest = max(slowest, elapsed), max(largest, size)
        accepted += output.startswith(f"{FILE}: ok\n")
    stats = {
        "mutants": count,
        "accepted": accepted,
        "seconds": time.perf_counter() - start,
        "slowest_s": slowest,
        "largest_bytes": largest,
    }
    print(f"fuzz seed {seed}: {stats}")
    return stats


def test_mutants_sample() -> None:
    stats = _run(seed=0, count=400)
    assert stats["accepted"] > 0  # the mutator leaves some specs valid


@pytest.mark.slow
def test_ten_thousand_mutants() -> None:
    _run(seed=int(os.environ.get("FADSL_FUZZ_SEED", "1")), count=10_000)


def _limit(output: str) -> float:
    return ACCEPTED_LIMIT_S if output.startswith(f"{FILE}: ok\n") else TIME_LIMIT_S


def _check(source: str) -> None:
    output, elapsed = answer(source)
    assert elapsed < _limit(output) and len(output.encode()) < OUTPUT_LIMIT_BYTES


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    st.one_of(
        st.text(max_size=500),
        st.binary(max_size=500).map(lambda data: data.decode("utf-8", errors="replace")),
        st.text(max_size=500).map(lambda body: "kernel k {\n" + body + "\n}\n"),
        st.sampled_from(SEEDS).flatmap(
            lambda seed: st.integers(0, len(seed)).flatmap(
                lambda i: st.text(max_size=20).map(lambda t: seed[:i] + t + seed[i:])
            )
        ),
    )
)
@example("")
@example("# nothing but a comment\n")
@example("\ufeff" + SEEDS[0])
def test_random_text(source: str) -> None:
    _check(source)


EXAMPLE = SEEDS[0]
# Inputs that once made something other than SpecError escape, or took seconds, or
# printed megabytes; each must be answered like any other bad spec.
REPRODUCERS = {
    # int() refuses more than 4300 digits: lark.exceptions.VisitError (ValueError).
    "number_over_4300_digits": "kernel k {\n  warps " + "9" * 4301 + "\n}\n",
    # The AST transformer recurses once per nesting level: RecursionError.
    "deeply_nested_call": "kernel k {\n  swizzle " + "x(" * 1000 + ")" * 1000 + "\n}\n",
    # 16,000 unknown keys: a list scan per duplicate check took 27 s.
    "sixteen_thousand_bad_lines": EXAMPLE.replace("}\n", "  foo 1\n" * 16000 + "}\n"),
    # Thousands of errors on one 36 KB line, the line echoed per error: 324 MB.
    "thousands_of_errors_on_one_line": EXAMPLE.replace(
        "  swizzle", "  dtype " + ", ".join(["xx"] * 6000) + "\n  swizzle"
    ),
    # The same just under the size limit: every error still found, 20 shown.
    "many_errors_under_the_limit": EXAMPLE.replace("}\n", "  foo 1\n" * 1200 + "}\n"),
    "many_syntax_errors_at_the_end": EXAMPLE.replace(
        "}\n", "  mask none\n" * 1200 + " )\n" * 30 + "}\n"
    ),
    "a_path_of_five_thousand_hops": EXAMPLE.replace(
        "  swizzle", "  Q: gmem" + " -cp.async-> smem[warp]" * 5000 + "\n  swizzle"
    ),
    "cr_only_line_endings": EXAMPLE.replace("\n", "\r"),
    "a_megabyte_of_comment": "#" * (1 << 20) + "\n" + EXAMPLE,
}


@pytest.mark.parametrize("name", sorted(REPRODUCERS))
def test_known_reproducers(name: str) -> None:
    _check(REPRODUCERS[name])
