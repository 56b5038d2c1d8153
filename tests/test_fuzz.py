"""Fuzz the front end: whatever text it is given, the compiler either compiles it or
raises SpecError with located diagnostics. Nothing else may escape.

The inputs are mutations of valid specs (tokens deleted, duplicated, swapped or
replaced; random bytes, text, control characters, emoji and huge numbers inserted;
very long lines) and wholly random text and binary data.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fadsl.errors import SpecError
from fadsl.pipeline import compile_source

FILE = "fuzz/spec.fa"

EXAMPLE = (Path(__file__).parent.parent / "examples" / "fa2_kernel1.fa").read_text(encoding="utf-8")

# The example with an explicit (valid, reordered) mainloop.
WITH_MAINLOOP = EXAMPLE.replace(
    "  swizzle none\n}",
    """  swizzle none

  mainloop {
    K -> smem
    V -> smem      # V's copy overlaps S = Q @ K^T and softmax
    K -> rf
    S = Q @ K^T
    softmax
    V -> rf
    O += P @ V
  }
}""",
)

SMALL_D64 = """kernel small_d64 {
  target     sm_80
  dtype      fp16
  head_dim   64
  tile       B_r = 32, B_c = 32
  warps      2
  mask       none
  stages     1
  smem_alias any
  swizzle    xor(3, 3, 3)
  Q: gmem -cp.async-> smem[warp] -ldmatrix-> rf
  K: gmem -cp.async-> smem[cta] -ldmatrix-> rf
  V: gmem -cp.async-> smem[cta] -ldmatrix.trans-> rf
  O: rf -st.shared-> smem[warp] -st.global-> gmem
}
"""

ONE_WARP = """kernel one_warp {
  target sm_80
  dtype bf16
  head_dim 96
  tile B_r = 16, B_c = 16
  warps 1
  smem_alias off
  Q: gmem -cp.async-> smem[warp] -ldmatrix-> rf
  K: gmem -cp.async-> smem[warp] -ldmatrix-> rf
  V: gmem -cp.async-> smem[warp] -ldmatrix.trans-> rf
  O: rf -st.shared-> smem[warp] -st.global-> gmem
}
"""

SEEDS = (EXAMPLE, WITH_MAINLOOP, SMALL_D64, ONE_WARP)

# Names (with dots, as instructions have), numbers, the two-character operators,
# runs of whitespace, and any other single character: "".join(tokens) == text.
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|[0-9]+|->|\+=|\s+|.", re.S)


def tokenize(text: str) -> list[str]:
    tokens = _TOKEN.findall(text)
    assert "".join(tokens) == text
    return tokens


SEED_TOKENS = sorted({t for seed in SEEDS for t in tokenize(seed)})
SPECIAL_TOKENS = [
    "",
    "\n",
    "\r",
    "\r\n",
    "\t",
    "\x0b",
    "\x0c",
    "\x00",
    "\x1b[31m",
    "\x85",
    "\u2028",
    "\ufeff",
    "\ufffd",
    "\U0001f600",  # emoji
    "\u00e9",
    "\u2192",
    "\u00d7",
    "-",
    "-->",
    ">",
    "=>",
    ":",
    "::",
    "{",
    "}",
    "[",
    "]",
    "(",
    ")",
    ",",
    "=",
    "@",
    "^",
    "#",
    "'",
    '"',
    "\\",
    ";",
    "0",
    "-1",
    "1e3",
    "0x40",
    str(10**30),
    str(2**64),
    "kernel",
    "mainloop",
    "smem[cta]",
    "xor(3, 3, 3)",
    "xor()",
]

any_text = st.text(max_size=40)
replacement = st.one_of(st.sampled_from(SEED_TOKENS), st.sampled_from(SPECIAL_TOKENS), any_text)


def _index(draw, tokens: list[str], extra: int = 0) -> int:
    return draw(st.integers(0, max(len(tokens) - 1 + extra, 0)))


def _delete(draw, tokens):
    if tokens:
        del tokens[_index(draw, tokens)]
    return tokens


def _duplicate(draw, tokens):
    if tokens:
        i = _index(draw, tokens)
        tokens.insert(i, tokens[i])
    return tokens


def _swap(draw, tokens):
    if tokens:
        i, j = _index(draw, tokens), _index(draw, tokens)
        tokens[i], tokens[j] = tokens[j], tokens[i]
    return tokens


def _replace(draw, tokens):
    if tokens:
        tokens[_index(draw, tokens)] = draw(replacement)
    return tokens


def _insert_text(draw, tokens):
    tokens.insert(_index(draw, tokens, extra=1), draw(replacement))
    return tokens


def _insert_bytes(draw, tokens):
    data = draw(st.binary(min_size=1, max_size=40))
    tokens.insert(_index(draw, tokens, extra=1), data.decode("utf-8", errors="replace"))
    return tokens


def _huge_number(draw, tokens):
    numbers = [i for i, t in enumerate(tokens) if t.isdigit()]
    if numbers:
        big = draw(
            st.one_of(
                st.just(str(10**30)),
                st.integers(min_value=2**31).map(str),
                st.integers(20, 6000).map(lambda n: "9" * n),
            )
        )
        tokens[draw(st.sampled_from(numbers))] = big
    return tokens


def _long_line(draw, tokens):
    unit = draw(st.lists(replacement, min_size=1, max_size=3).map("".join))
    tokens.insert(_index(draw, tokens, extra=1), unit * draw(st.integers(100, 5000)))
    return tokens


def _nest(draw, tokens):
    """Wrap a token in many nested calls: f(f(f(...x...)))."""
    if tokens:
        i = _index(draw, tokens)
        depth = draw(st.integers(1, 600))
        tokens[i] = "f(" * depth + tokens[i] + ")" * depth
    return tokens


MUTATIONS = (
    _delete,
    _duplicate,
    _swap,
    _replace,
    _insert_text,
    _insert_bytes,
    _huge_number,
    _long_line,
    _nest,
)


@st.composite
def mutated_specs(draw) -> str:
    tokens = tokenize(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 5))):
        tokens = draw(st.sampled_from(MUTATIONS))(draw, tokens)
    return "".join(tokens)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")  # as fadsl.pipeline.read_spec does


specs = st.one_of(
    mutated_specs(),
    mutated_specs(),
    mutated_specs(),
    mutated_specs(),
    st.just(""),
    st.text(max_size=500),
    st.binary(max_size=500).map(_decode),
    st.text(max_size=500).map(lambda body: "kernel k {\n" + body + "\n}\n"),
)

_HEADER = re.compile(re.escape(FILE) + r":[1-9][0-9]*:[1-9][0-9]*: \S")
_CARET = re.compile(r" *\^")


def check(source: str) -> None:
    """Compile ``source``; a SpecError must render as located diagnostics."""
    try:
        compile_source(source, FILE)
    except SpecError as err:
        rendered = str(err)
        assert rendered, "SpecError renders as an empty string"
        assert err.diagnostics, "SpecError without diagnostics"
        lines = rendered.split("\n")
        headers, i = 0, 0
        while i < len(lines):
            assert _HEADER.match(lines[i]), f"not a '{FILE}:line:col: message' line: {lines[i]!r}"
            headers += 1
            i += 1
            if i < len(lines) and lines[i].startswith("    "):
                # The source line, then a caret under the column.
                assert i + 1 < len(lines) and _CARET.fullmatch(lines[i + 1]), rendered
                i += 2
        assert headers == len(err.diagnostics), rendered


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs)
@example("")
@example("# nothing but a comment\n")
@example(EXAMPLE.replace("head_dim 128", f"head_dim {10**30}"))
@example(EXAMPLE.replace("warps    4", "warps    " + "\x00"))
@example("\ufeff" + EXAMPLE)
def test_compile_succeeds_or_raises_located_spec_error(source: str) -> None:
    check(source)


# Inputs found to make something other than SpecError escape; each must be refused
# with located diagnostics like any other bad spec.
REPRODUCERS = {
    # int() refuses more than 4300 digits: lark.exceptions.VisitError (ValueError).
    "number_over_4300_digits": "kernel k {\n  warps " + "9" * 4301 + "\n}\n",
    # The AST transformer recurses once per nesting level: RecursionError.
    "deeply_nested_call": "kernel k {\n  swizzle " + "x(" * 1000 + ")" * 1000 + "\n}\n",
}


@pytest.mark.parametrize("name", sorted(REPRODUCERS))
def test_known_reproducers(name: str) -> None:
    check(REPRODUCERS[name])
