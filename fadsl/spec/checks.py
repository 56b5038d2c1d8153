"""What the lowering's parts share: where diagnostics go and what has been seen so far.

The settings (lower_settings), the paths (lower_paths), the mainloop order
(lower_order) and a target's own checks (fadsl/targets/<t>/validate) are plain
functions over one ``Checks``; each reports through it, so that independent
problems are all reported at once. The backward block has a ``Checks`` of its own for its
settings (they reuse the kernel's keys: tile, stages ...), reporting to the same sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import DiagnosticSink, Loc, quoted
from ..ir import BackwardTensor, GradRole, Role
from .syntax import Assign, BackwardDecl, Call, KernelDecl, Number, PathDecl, Word


@dataclass
class Checks:
    decl: KernelDecl
    sink: DiagnosticSink
    partial: bool  # syntax errors removed lines: don't report missing things
    values: dict[str, object] = field(default_factory=dict)  # the settings that passed
    # Names a did-you-mean already pointed at: not reported again as missing.
    suggested: set[object] = field(default_factory=set)
    key_locs: dict[str, Loc] = field(default_factory=dict)
    missing_tensors: list[str] = field(default_factory=list)

    def error(self, loc: Loc, message: str) -> None:
        self.sink.error(loc, message)

    def missing(self, loc: Loc, message: str) -> None:
        if not self.partial:
            self.error(loc, message)

    def scope_loc(self, role: Role) -> Loc:
        """Where ``role``'s path names its SMEM sharing scope (or the path, or the kernel)."""
        for path in self.decl.paths:
            if path.tensor.text == role.value:
                for level in path.levels:
                    if level.scope is not None:
                        return level.scope.loc
                return path.loc
        return self.decl.loc


@dataclass
class BackwardBlock:
    """A spec's backward block as the front end read it, for the target to check and to
    complete with its defaults (``Target.validate_backward``): the settings that passed their
    own checks (``checks.values``, located in ``checks.key_locs``, apart from the kernel's)
    and the paths whose levels and instructions exist, each with its declaration."""

    decl: BackwardDecl
    checks: Checks  # the block's settings; reports to the kernel's sink
    paths: dict[Role | GradRole, tuple[BackwardTensor, PathDecl]]

    @property
    def loc(self) -> Loc:
        """The block's `backward` keyword."""
        return self.decl.loc

    @property
    def values(self) -> dict[str, object]:
        return self.checks.values

    @property
    def key_locs(self) -> dict[str, Loc]:
        return self.checks.key_locs


def show(value: object) -> str:
    """A setting's value as a message quotes it."""
    match value:
        case Word(text=text):
            return f"'{quoted(text)}'"
        case Number(text=text):
            return f"the number {clip(text)}"
        case Call(name=name):
            return f"'{quoted(name.text)}(...)'"
        case Assign(name=name):
            return f"'{quoted(name.text)} = ...'"
        case _:
            raise AssertionError(f"unknown value {value!r}")


def clip(text: str) -> str:
    return text if len(text) <= 20 else text[:8] + "..." + f" ({len(text)} digits)"


def and_list(items) -> str:
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
