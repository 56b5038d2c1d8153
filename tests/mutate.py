"""Seeded mutants of valid specs for the fuzz tests: token-, line- and character-level
edits, unicode, huge numbers, very long lines and many lines, and random text.

``mutants(seed, count)`` yields the same ``count`` inputs for the same seed, so that a
failure is reproduced by its seed and index alone.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
SEEDS = tuple(
    p.read_text(encoding="utf-8")
    for p in sorted((ROOT / "examples").glob("*.fa"))
    + sorted((ROOT / "examples" / "serving").glob("*.fa"))
    + sorted((ROOT / "tests/specs/bench").glob("*.fa"))
    # an FP8 spec (rendered since step 4 of research/fp8-forward.md): its vocabulary
    + [ROOT / "tests/specs/fp8/fa3_fp8_hdim256_eager.fa"]
)

# Names (with dots, as instructions have), numbers, the two-character operators,
# runs of whitespace, and any other single character: "".join(tokens) == text.
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|[0-9]+|->|\+=|\s+|.", re.S)


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)


SEED_TOKENS = sorted({t for seed in SEEDS for t in tokenize(seed)})
SEED_LINES = sorted({line for seed in SEEDS for line in seed.split("\n")})
UNICODE = [
    "\u00e9",  # é
    "\u00d7",  # ×
    "\u2192",  # →
    "\u00a0",  # no-break space
    "\u200b",  # zero-width space
    "\u200f",  # right-to-left mark
    "\u0301",  # combining acute accent
    "\u2028",  # line separator
    "\u0085",  # next line
    "\ufeff",  # byte-order mark
    "\ufffd",  # replacement character
    "\uff11\uff12\uff18",  # full-width 128
    "\u0661\u0662",  # Arabic-Indic digits
    "\U0001f600",  # emoji
    "\U0001d400",  # mathematical bold A
    "\x00",
    "\x0b",
    "\x0c",
    "\x1b[31m",
    "\r",
    "\r\n",
    "\t",
]
SPECIAL = [
    "",
    "\n",
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
    "kernel",
    "mainloop",
    "smem[cta]",
    "rf[frag]",
    "K(next) -> smem",
    "xor(3, 3, 4)",
    "xor()",
    "f(" * 50,
]
HUGE = ["4294967296", "18446744073709551616", "1" + "0" * 30, "9" * 19, "9" * 4301]


def _piece(rng: random.Random) -> str:
    """A short replacement: a token of the seeds, a special one, unicode, or random text."""
    kind = rng.randrange(5)
    if kind == 0:
        return rng.choice(SEED_TOKENS)
    if kind == 1:
        return rng.choice(SPECIAL)
    if kind == 2:
        return rng.choice(UNICODE)
    if kind == 3:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(1, 12)))
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 12))).decode(
        "utf-8", errors="replace"
    )


# --- token level ---------------------------------------------------------------


def _tokens(
    edit: Callable[[random.Random, list[str]], None],
) -> Callable[[random.Random, str], str]:
    def mutate(rng: random.Random, text: str) -> str:
        tokens = tokenize(text)
        if tokens:
            edit(rng, tokens)
        return "".join(tokens)

    mutate.__name__ = edit.__name__
    return mutate


@_tokens
def token_delete(rng, tokens):
    del tokens[rng.randrange(len(tokens))]


@_tokens
def token_duplicate(rng, tokens):
    i = rng.randrange(len(tokens))
    tokens.insert(i, tokens[i])


@_tokens
def token_swap(rng, tokens):
    i, j = rng.randrange(len(tokens)), rng.randrange(len(tokens))
    tokens[i], tokens[j] = tokens[j], tokens[i]


@_tokens
def token_replace(rng, tokens):
    tokens[rng.randrange(len(tokens))] = _piece(rng)


@_tokens
def token_insert(rng, tokens):
    tokens.insert(rng.randrange(len(tokens) + 1), _piece(rng))


@_tokens
def huge_number(rng, tokens):
    numbers = [i for i, t in enumerate(tokens) if t.isdigit()]
    if numbers:
        tokens[rng.choice(numbers)] = rng.choice(HUGE)


@_tokens
def nested_call(rng, tokens):
    depth = rng.randrange(1, 800)
    i = rng.randrange(len(tokens))
    tokens[i] = "f(" * depth + tokens[i] + ")" * depth


# --- line level ----------------------------------------------------------------


def _lines(edit: Callable[[random.Random, list[str]], None]) -> Callable[[random.Random, str], str]:
    def mutate(rng: random.Random, text: str) -> str:
        lines = text.split("\n")
        edit(rng, lines)
        return "\n".join(lines)

    mutate.__name__ = edit.__name__
    return mutate


@_lines
def line_delete(rng, lines):
    del lines[rng.randrange(len(lines))]


@_lines
def line_duplicate(rng, lines):
    i = rng.randrange(len(lines))
    lines.insert(i, lines[i])


@_lines
def line_swap(rng, lines):
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]


@_lines
def line_from_another_spec(rng, lines):
    lines.insert(rng.randrange(len(lines) + 1), rng.choice(SEED_LINES))


@_lines
def line_join(rng, lines):
    if len(lines) > 1:
        i = rng.randrange(len(lines) - 1)
        lines[i : i + 2] = [lines[i] + rng.choice(["", " ", ", "]) + lines[i + 1]]


@_lines
def many_lines(rng, lines):
    i = rng.randrange(len(lines))
    lines[i : i + 1] = [lines[i]] * rng.randrange(50, 20000)


@_lines
def long_line(rng, lines):
    unit = "".join(_piece(rng) for _ in range(rng.randrange(1, 4))) or "x"
    i = rng.randrange(len(lines))
    lines[i] += unit * rng.randrange(100, 20000)


# --- character level -----------------------------------------------------------


def char_delete(rng: random.Random, text: str) -> str:
    if not text:
        return text
    i = rng.randrange(len(text))
    return text[:i] + text[i + 1 :]


def char_insert(rng: random.Random, text: str) -> str:
    i = rng.randrange(len(text) + 1)
    char = rng.choice(UNICODE) if rng.randrange(2) else chr(rng.randrange(32, 127))
    return text[:i] + char + text[i:]


def char_replace(rng: random.Random, text: str) -> str:
    if not text:
        return text
    i = rng.randrange(len(text))
    return (
        text[:i]
        + chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)]))
        + text[i + 1 :]
    )


def char_case(rng: random.Random, text: str) -> str:
    if not text:
        return text
    i = rng.randrange(len(text))
    return text[:i] + text[i].swapcase() + text[i + 1 :]


MUTATIONS = (
    token_delete,
    token_duplicate,
    token_swap,
    token_replace,
    token_insert,
    huge_number,
    nested_call,
    line_delete,
    line_duplicate,
    line_swap,
    line_from_another_spec,
    line_join,
    many_lines,
    long_line,
    char_delete,
    char_insert,
    char_replace,
    char_case,
)


def mutant(rng: random.Random) -> str:
    """One input: mostly a seed spec with 1 to 5 mutations, sometimes random text."""
    roll = rng.random()
    if roll < 0.03:
        return "".join(_piece(rng) for _ in range(rng.randrange(200)))
    if roll < 0.05:
        return "kernel k {\n" + "".join(_piece(rng) for _ in range(rng.randrange(100))) + "\n}\n"
    text = rng.choice(SEEDS)
    for _ in range(rng.randrange(1, 6)):
        if len(text) > 1 << 21:  # 2 MB: far past the size limit already
            break
        text = rng.choice(MUTATIONS)(rng, text)
    return text


def mutants(seed: int, count: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(count):
        yield mutant(rng)
