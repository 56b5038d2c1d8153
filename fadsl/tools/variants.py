"""Variants of a spec for `fadsl tune`: its setting lines rewritten from a target's knobs.

A variant is the input spec's text with some kernel-level setting lines changed (or added
after the last one where the spec relied on a default), the SMEM scope of a path changed
where a knob needs it (sm_90a's `cluster 2`: K and V in smem[cluster]) and the kernel renamed
with a suffix that spells the changes (``fa3_hopper_c176_s3``). Everything else stays as
written: comments (a changed line's comment is kept behind the value it spoke of: "# was 2:
K/V ring slots"), paths, nested blocks (mainloop, backward), the layout. The real front end
and passes judge each variant (``fadsl.pipeline.compile_source`` but its proof: the target's
checks, SMEM and register estimates, the SMEM plan), and the target's ``likely_spills``
prunes register patterns known to spill; ptxas judges the survivors when they are compiled,
each through the whole pipeline (fadsl/tools/tune_build.py).

The search moves from a centre (the input, then the best measured variants) to its
neighbours: one knob changed at a time, ordered knobs by at most ``Knob.reach`` steps. A
change that fails the checks is repaired where one of the target's ``repair`` knobs, moved
to its nearest passing value, makes it pass (3 consumers need a smaller B_c than 2).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

from .._version import __version__
from ..errors import SpecError
from ..frontend.rewrite import rewrite
from ..ir import Config
from ..pipeline import Compiled, compile_source
from ..targets import target_of
from ..targets.tuning import TuneSpace

ValuesKey = tuple[tuple[str, Any], ...]

# The passes a variant is judged without: the proof takes a second a spec and refuses none
# with a SpecError (its failure is a fadsl bug); each variant compiled runs it (tune_build).
UNPROVED = ("verify",)

# Pruning reasons, as the summary counts them.
CHECKS = "the checks"
KNOWN_SPILLS = "the register model (known to spill)"
READ_BACK = "the rewrite did not read back"


def values_key(values: Mapping[str, Any]) -> ValuesKey:
    return tuple(sorted(values.items()))


@dataclass(frozen=True)
class Variant:
    """One candidate spec."""

    name: str  # the kernel's name: the input's, with a suffix that spells the changes
    values: ValuesKey  # every knob's value
    changes: tuple[tuple[str, Any, Any], ...]  # (knob, the input's value, this one's)
    text: str

    @property
    def digest(self) -> str:
        """Names the variant in the measurement cache: its text under this fadsl."""
        return hashlib.sha256(f"{__version__}\0{self.text}".encode()).hexdigest()[:16]

    @property
    def knobs(self) -> dict[str, Any]:
        return dict(self.values)

    def describe(self) -> str:
        if not self.changes:
            return "the input spec"
        return ", ".join(f"{knob} {old} -> {new}" for knob, old, new in self.changes)


@dataclass
class Enumeration:
    """One round's neighbours: those the checks accept, and what was pruned and why."""

    variants: list[Variant] = field(default_factory=list)
    pruned: Counter = field(default_factory=Counter)  # reason -> count
    repaired: int = 0
    # (what was tried, why it was refused), for --list and the tests
    refusals: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Base:
    """The input spec: its text, its compiled configuration and the target's knobs."""

    source: str
    file: str
    compiled: Compiled
    space: TuneSpace
    values: dict[str, Any]

    @property
    def config(self) -> Config:
        return self.compiled.kernel.config

    @classmethod
    def of(cls, source: str, file: str, space: TuneSpace | None = None) -> Base:
        """The input compiled through every pass (a bad input raises its SpecError)."""
        compiled = compile_source(source, file)
        target = target_of(compiled.kernel)
        space = space or target.tune_space
        if space is None:
            raise ValueError(f"target {target.name} has no knobs to tune")
        return cls(compiled.source, file, compiled, space, space.read(compiled.kernel.config))

    def variant(self, values: Mapping[str, Any]) -> Variant:
        """The spec text for ``values``: only the lines whose text changes are touched."""
        space, config = self.space, self.config
        before = space.settings(self.values, config)
        after = space.settings(values, config)
        settings = {key: text for key, text in after.items() if before.get(key) != text}
        old_scopes, new_scopes = space.scopes(self.values), space.scopes(values)
        scopes = {t: s for t, s in new_scopes.items() if old_scopes.get(t) != s}
        changed = [k for k in space.knobs if values[k.name] != self.values[k.name]]
        changes = tuple((k.name, self.values[k.name], values[k.name]) for k in changed)
        suffix = "_".join(k.spell(values[k.name]) for k in changed)
        name = f"{config.name}_{suffix}" if suffix else config.name
        text = rewrite(self.source, settings, scopes, name)
        return Variant(name, values_key(values), changes, text)

    def judge(self, values: Mapping[str, Any]) -> tuple[Variant | None, str, str]:
        """(the variant, "", "") when every pass but the proof accepts it, it reads back as
        ``values`` and no known spill applies; else (None, the kind of refusal, its
        message)."""
        variant = self.variant(values)
        try:
            kernel = compile_source(variant.text, f"{variant.name}.fa", skip=UNPROVED).kernel
        except SpecError as err:
            return None, CHECKS, err.diagnostics[0].message if err.diagnostics else str(err)
        read = self.space.read(kernel.config)
        if read != dict(values):
            differ = ", ".join(
                f"{key} {spelled(read.get(key))} (asked {spelled(values.get(key))})"
                for key in sorted(set(read) | set(values), key=str)
                if read.get(key) != values.get(key)
            )
            return None, READ_BACK, f"{variant.name} reads back with {differ}"
        if self.space.likely_spills is not None:
            why = self.space.likely_spills(kernel.config)
            if why:
                return None, KNOWN_SPILLS, why
        return variant, "", ""


def spelled(value: Any) -> str:
    """A value as a spec writes it: on / off for a flag, an enum's word, a tuple's items
    joined (none when empty)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ", ".join(spelled(v) for v in value) or "none"
    return str(getattr(value, "value", value))


def steps(values: tuple[Any, ...], current: Any, reach: int | None) -> list[Any]:
    """The values one move from ``current`` reaches, nearest first (the lower on a tie). A
    number the list lacks (a spec's B_c of 120) sits between its listed neighbours, each one
    step away."""
    if current in values:
        here = float(values.index(current))
    elif all(isinstance(v, (int, float)) for v in (*values, current)):
        here = sum(v < current for v in values) - 0.5
    else:
        return list(values)
    distance = [math.ceil(abs(i - here)) for i in range(len(values))]
    order = sorted(range(len(values)), key=lambda i: (distance[i], values[i]))
    return [
        values[i] for i in order if values[i] != current and (reach is None or distance[i] <= reach)
    ]


def neighbours(base: Base, centre: Mapping[str, Any], seen: set[ValuesKey]) -> Enumeration:
    """The variants one move from ``centre`` that are not in ``seen`` (which gains every
    values tried), judged by the front end; failed moves repaired where possible."""
    out = Enumeration()
    for knob in base.space.knobs:
        for value in steps(knob.values, centre[knob.name], knob.reach):
            values = dict(centre, **{knob.name: value})
            key = values_key(values)
            if key in seen:
                continue
            seen.add(key)
            variant, kind, why = base.judge(values)
            if variant is None:
                variant = _repair(base, values, knob.name, seen)
                out.pruned[kind] += 1
                out.refusals.append((f"{knob.name} {centre[knob.name]} -> {value}", why))
                if variant is None:
                    continue
                out.repaired += 1
            out.variants.append(variant)
    return out


def _repair(base: Base, values: dict[str, Any], moved: str, seen: set[ValuesKey]):
    """The nearest variant that moving one repair knob makes pass, or None."""
    names = {knob.name for knob in base.space.knobs}
    for name in base.space.repair:
        if name == moved or name not in names:
            continue
        for value in steps(base.space.knob(name).values, values[name], None):
            tried = dict(values, **{name: value})
            key = values_key(tried)
            if key in seen:
                continue
            variant, _, _ = base.judge(tried)
            if variant is not None:
                seen.add(key)
                return variant
    return None
