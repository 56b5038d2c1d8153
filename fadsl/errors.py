"""Source locations and the one error type a bad spec may raise.

Every diagnostic is rendered as ``path:line:col: message``; after the messages of
one line comes that source line, once, with a caret under each column, so that an
editor can jump to it and a person can see it without opening the file. The
output stays small whatever the input: at most ``MAX_SHOWN`` messages (the rest
are counted), messages and source lines cut to a readable width.
"""

from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

MAX_SHOWN = 20  # diagnostics printed; the others are counted in one last line
LINE_WIDTH = 100  # columns of a source line shown around its carets
MESSAGE_WIDTH = 400  # characters of one message (messages quote the spec's words)
WORD_WIDTH = 40  # characters of a spec's word quoted in a message


@dataclass(frozen=True, order=True)
class Loc:
    """A position in a spec file: 1-based line and column."""

    file: str
    line: int
    col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    loc: Loc
    message: str


class SpecError(Exception):
    """One or more located problems in a spec; ``str()`` renders them (the first
    ``MAX_SHOWN``, with a count of the rest)."""

    def __init__(self, diagnostics: Sequence[Diagnostic], source: str = "") -> None:
        self.diagnostics = tuple(sorted(diagnostics, key=lambda d: d.loc))
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        shown = self.diagnostics[:MAX_SHOWN]
        lines = self.source.split("\n")  # as the parser counts lines: only \n ends one
        out: list[str] = []
        for (_file, line), group in itertools.groupby(
            shown, key=lambda d: (d.loc.file, d.loc.line)
        ):
            group = list(group)
            out += [f"{d.loc}: {_cut(d.message, MESSAGE_WIDTH)}" for d in group]
            if 1 <= line <= len(lines) and lines[line - 1].strip():
                out += _excerpt(lines[line - 1], [d.loc.col for d in group])
        hidden = len(self.diagnostics) - len(shown)
        if hidden:
            out.append(f"{shown[-1].loc.file}: {hidden} more error{'s' * (hidden > 1)} not shown")
        return "\n".join(out)


def _excerpt(line: str, cols: list[int]) -> list[str]:
    """The source line and a caret under each column, cut to ``LINE_WIDTH`` around the
    first caret."""
    text = line.rstrip("\r").expandtabs(1)  # columns count a tab as one
    cols = sorted({max(c, 1) - 1 for c in cols})
    start = 0
    if len(text) > LINE_WIDTH:
        start = max(0, min(cols[0] - LINE_WIDTH // 3, len(text) - LINE_WIDTH))
    end = start + LINE_WIDTH
    prefix = "..." if start else ""
    suffix = "..." if end < len(text) else ""
    shift = len(prefix) - start
    carets = [c + shift for c in cols if start <= c <= end]
    if not carets:
        return []
    caret_line = [" "] * (max(carets) + 1)
    for c in carets:
        caret_line[c] = "^"
    return [f"    {prefix}{text[start:end]}{suffix}", "    " + "".join(caret_line)]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def quoted(text: str) -> str:
    """A word of the spec as a message quotes it, cut to a readable length."""
    if len(text) <= WORD_WIDTH:
        return text
    return f"{text[:WORD_WIDTH - 10]}... ({len(text)} characters)"


class DiagnosticSink:
    """Collects independent problems so that all of them are reported at once."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._diagnostics: dict[Diagnostic, None] = {}  # insertion-ordered set

    @property
    def diagnostics(self) -> tuple[Diagnostic, ...]:
        return tuple(self._diagnostics)

    def __len__(self) -> int:
        return len(self._diagnostics)

    def error(self, loc: Loc, message: str) -> None:
        self._diagnostics[Diagnostic(loc, message)] = None

    def raise_if_any(self) -> None:
        if self._diagnostics:
            raise SpecError(self.diagnostics, self.source)


def closest(word: str, choices: Iterable[str]) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def suggest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' when a choice is close to ``word``, else ''."""
    close = closest(word, choices)
    return f" (did you mean '{close}'?)" if close else ""


def one_of(choices: Iterable[str]) -> str:
    quoted = [f"'{c}'" for c in choices]
    if len(quoted) <= 2:
        return " or ".join(quoted)
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


class BuildError(RuntimeError):
    """The compiler rejected a generated kernel (its message and the source's path), or a
    built kernel cannot run as planned."""
