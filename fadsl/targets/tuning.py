"""What `fadsl tune` may change in a target's specs, as data (``Target.tune_space``).

A target lists its knobs (the schedule settings that change speed, not meaning: never the
head_dim, the mask or the dtypes) with the values worth trying, says how to read a compiled
spec's values back and which setting lines a set of values makes. fadsl/tools/variants.py
rewrites a spec's setting lines from that and lets the real front end and checks judge each
variant; the rules here only add what those checks cannot know before a compile (a register
pattern that ptxas is known to spill).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..ir import Config

Values = Mapping[str, Any]  # knob name -> value, as the knob lists it


@dataclass(frozen=True)
class Knob:
    """One tunable setting."""

    name: str  # as tables and messages show it: "B_c", "stages"
    values: tuple[Any, ...]  # in order: the tuner tries neighbours along it
    # How a variant's name spells a changed value: "c{}" makes fa3_hopper_c176.
    code: str
    # A change reaches at most this many steps along ``values`` at a time (B_c: 112 -> 96 or
    # 128, 80 or 144); None: any value (switches, small lists).
    reach: int | None = None

    def spell(self, value: Any) -> str:
        return self.code.format(value)


@dataclass(frozen=True)
class TuneSpace:
    knobs: tuple[Knob, ...]
    # A compiled spec's value of each knob (the spec's defaults included).
    read: Callable[[Config], dict[str, Any]]
    # The setting lines a set of values makes, {key: value text}, given the input spec's Config
    # (settings that follow a knob, such as sm_90a's register split, keep the input's choice
    # while their knob does).
    settings: Callable[[Values, Config], dict[str, str]]
    # The SMEM scope each tensor's path must name for these values ({"K": "cluster"}); the
    # paths are otherwise left as the spec writes them.
    scopes: Callable[[Values], dict[str, str]] = lambda values: {}
    # Why a variant that the checks accept is still known to spill (measured cases, cited),
    # or None: such variants are not compiled.
    likely_spills: Callable[[Config], str | None] | None = None
    # When a one-knob change fails the checks, these knobs are moved (one at a time, nearest
    # value first) to find the closest variant that passes: 2 -> 3 consumers at B_c 192 has
    # too few registers, 3 consumers at B_c 128 fits.
    repair: tuple[str, ...] = ()

    def knob(self, name: str) -> Knob:
        for knob in self.knobs:
            if knob.name == name:
                return knob
        raise KeyError(name)

    def restricted(self, names: tuple[str, ...]) -> TuneSpace:
        """The same space with only the knobs ``names`` (a small search: tests, or --knobs)."""
        unknown = set(names) - {k.name for k in self.knobs}
        if unknown:
            raise KeyError(", ".join(sorted(unknown)))
        kept = tuple(k for k in self.knobs if k.name in names)
        return TuneSpace(
            knobs=kept,
            read=self.read,
            settings=self.settings,
            scopes=self.scopes,
            likely_spills=self.likely_spills,
            repair=tuple(r for r in self.repair if r in names),
        )


@dataclass(frozen=True)
class BackwardCandidate:
    """One backward block `fadsl tune --backward` tries: the block's setting lines ({key:
    value text}) and paths ({tensor: path text, or None for the default path}) written over
    the input's (fadsl/frontend/rewrite.py's rewrite_backward), and its name in the tuner's
    table (the name of the block it compiles to replaces it once it compiles)."""

    label: str
    settings: Mapping[str, str]
    paths: Mapping[str, str | None]


@dataclass(frozen=True)
class BackwardTuneSpace:
    """What `fadsl tune --backward` may change in a target's backward blocks
    (``Target.backward_tune_space``): never the mask, the dtypes or `deterministic` (a
    promise, not a speed)."""

    # Every block worth trying for the input's compiled block, given whether the spec's mask
    # is causal; the target's checks refuse what cannot be built.
    candidates: Callable[[Any, bool], tuple[BackwardCandidate, ...]]
    # A compiled block's name in the table (a candidate's, once it compiled)
    label: Callable[[Any], str]
    # The knobs that tell two compiled blocks apart (the same block is timed once)
    knobs: Callable[[Any], tuple]
