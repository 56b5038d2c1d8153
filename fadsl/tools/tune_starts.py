"""`fadsl tune`'s starting points besides the input: other specs' knobs applied to it (``--from``)
and, by default, the target's shipped spec for the input's problem (what fadsl.attention runs
for its head_dim and mask): a climb from the input alone stops on the first hill, and the
shipped spec is where earlier tunings ended."""

from __future__ import annotations

from ..errors import SpecError
from ..ir import Mask
from .._data import data_dir
from ..targets import target_of
from .variants import Base, Variant, spelled, values_key

# What a start must share with the input (its knobs are the rest), and its dtypes' width: a
# spec of another problem would be timed as the input's variant without being one. (Its
# dtypes may differ otherwise: the variant keeps the input's.)
SAME_PROBLEM = ("head_dim", "mask", "window")


def start_points(base: Base, starts: list[tuple[str, str]]) -> list[Variant]:
    """The input with each start's knob values (those of ``base.space``: all of the target's,
    or ``--knobs``'), judged as any variant; a start equal to the input is dropped. Raises
    SpecError for a bad start spec, ValueError for one of another problem or whose knobs the
    input's checks refuse."""
    variants: list[Variant] = []
    for start in starts:
        text, file = start
        other = Base.of(text, file)
        if target_of(other.compiled.kernel) is not target_of(base.compiled.kernel):
            raise ValueError(
                f"--from {file}: target {other.config.target}, the input's is "
                f"{base.config.target}; a start is a spec of the input's target"
            )
        for field in SAME_PROBLEM:
            mine, theirs = getattr(base.config, field), getattr(other.config, field)
            if mine != theirs:
                raise ValueError(
                    f"--from {file}: {field} {spelled(theirs)}, the input's is {spelled(mine)}; a "
                    f"start shares the input's {', '.join(SAME_PROBLEM)} (only its knobs differ)"
                )
        if other.config.dtypes[0].is_8bit != base.config.dtypes[0].is_8bit:
            raise ValueError(
                f"--from {file}: dtype {spelled(other.config.dtypes)}, the input's is "
                f"{spelled(base.config.dtypes)}; a start has the input's width (8 or 16 bits)"
            )
        values = dict(base.values)
        values.update({k.name: other.values[k.name] for k in base.space.knobs})
        if values_key(values) == values_key(base.values):
            continue
        variant, _, why = base.judge(values)
        if variant is None:
            raise ValueError(f"--from {file}: its knobs on {base.config.name}: {why}")
        variants.append(variant)
    return variants


def shipped_starts(base: Base) -> list[Variant]:
    """The target's shipped specs for the input's head_dim and mask (``Target.shipped`` or
    ``shipped_fp8``, and ``shipped_short``'s or ``shipped_fp8_short``'s), as starts; one of another problem (a window,
    other dtypes) or whose knobs the input refuses is left out: these starts are offered, not
    asked for."""
    config = base.config
    if config.mask not in (Mask.NONE, Mask.CAUSAL) or config.window is not None:
        return []
    target = target_of(base.compiled.kernel)
    key = (config.head_dim, config.mask is Mask.CAUSAL)
    eight = config.dtypes[0].is_8bit
    table = target.shipped_fp8 if eight else target.shipped
    short = target.shipped_fp8_short if eight else target.shipped_short
    names = [table.get(key)] + [name for k, (_, name) in short.items() if k == key]
    variants = []
    for name in filter(None, names):
        text = data_dir("examples").joinpath(f"{name}.fa").read_text()
        try:
            variants += start_points(base, [(text, f"examples/{name}.fa")])
        except (ValueError, SpecError):
            continue
    return variants
