"""Source locations and the one error type a bad spec may raise.

Every diagnostic is rendered as ``path:line:col: message``, followed by the
source line and a caret under the column, so that an editor can jump to it and
a person can see it without opening the file.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Sequence


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
    """One or more located problems in a spec; ``str()`` renders all of them."""

    def __init__(self, diagnostics: Sequence[Diagnostic], source: str = "") -> None:
        self.diagnostics = tuple(sorted(diagnostics, key=lambda d: d.loc))
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        lines = self.source.split("\n")  # as the parser counts lines: only \n ends one
        blocks = []
        for diag in self.diagnostics:
            block = f"{diag.loc}: {diag.message}"
            if 1 <= diag.loc.line <= len(lines) and lines[diag.loc.line - 1].strip():
                text = lines[diag.loc.line - 1].rstrip("\r").expandtabs(1)
                caret = " " * (max(diag.loc.col, 1) - 1) + "^"
                block += f"\n    {text}\n    {caret}"
            blocks.append(block)
        return "\n".join(blocks)


class DiagnosticSink:
    """Collects independent problems so that all of them are reported at once."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.diagnostics: list[Diagnostic] = []

    def error(self, loc: Loc, message: str) -> None:
        diag = Diagnostic(loc, message)
        if diag not in self.diagnostics:
            self.diagnostics.append(diag)

    def raise_if_any(self) -> None:
        if self.diagnostics:
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
