"""Readers of a setting's value (``key value`` lines of a spec): one value, a word among
choices, a number in a range, ``key a = N, b = N`` assignments, on/off. Each reports through
``Checks`` with the value's location and returns None on an error. The front end's keys and
each target's own keys (``Target.settings``) are read with them."""

from __future__ import annotations

from ..errors import one_of, quoted, suggest
from .checks import Checks, clip, show
from .syntax import Assign, Call, Number, Setting, Word


def single(c: Checks, setting: Setting) -> Word | Number | Call | Assign | None:
    if len(setting.values) != 1:
        extra = setting.values[1]
        c.error(extra.loc, f"'{setting.key.text}' takes one value")
        return None
    return setting.values[0]


def word_choice(c: Checks, setting: Setting, choices: dict[str, object]) -> object | None:
    value = single(c, setting)
    if value is None:
        return None
    if not isinstance(value, Word):
        c.error(value.loc, f"'{setting.key.text}' expects {one_of(choices)}, not {show(value)}")
        return None
    if value.text not in choices:
        c.error(
            value.loc,
            f"unknown {setting.key.text} '{quoted(value.text)}'; expected {one_of(choices)}"
            + suggest(value.text, choices),
        )
        return None
    return choices[value.text]


def number(c: Checks, value: object, what: str, lo: int, hi: int) -> int | None:
    if not isinstance(value, Number):
        c.error(value.loc, f"{what} must be a number, not {show(value)}")
        return None
    if not lo <= value.value <= hi:
        c.error(value.loc, f"{what} = {clip(value.text)} is out of range ({lo} to {hi})")
        return None
    return value.value


def count(c: Checks, setting: Setting, lo: int, hi: int) -> int | None:
    """`key N`: one number in [lo, hi]; its place kept as `key_value` (the target's checks
    point at the number)."""
    value = single(c, setting)
    if value is None:
        return None
    key = setting.key.text
    c.key_locs[f"{key}_value"] = value.loc
    return number(c, value, key, lo, hi)


def assigns(c: Checks, setting: Setting, names: tuple[str, ...], lo: int, hi: int) -> dict:
    """`key a = N, b = N`: each name once, each a number in [lo, hi]; all or nothing."""
    key = setting.key.text
    form = ", ".join(f"{n} = N" for n in names)
    found: dict[str, int] = {}
    for value in setting.values:
        if not isinstance(value, Assign):
            c.error(value.loc, f"'{key}' expects '{form}', not {show(value)}")
            continue
        name = value.name.text
        if name not in names:
            c.error(
                value.name.loc,
                f"unknown {key} '{name}'; expected {one_of(names)}" + suggest(name, names),
            )
            continue
        if name in found:
            c.error(value.name.loc, f"'{name}' is given twice")
            continue
        read = number(c, value.value, f"{key} {name}", lo, hi)
        if read is not None:
            found[name] = read
            c.key_locs[f"{key}.{name}"] = value.value.loc
    missing = [n for n in names if n not in found]
    if missing and all(isinstance(v, Assign) and v.name.text in names for v in setting.values):
        c.error(setting.key.loc, f"'{key}' is missing '{missing[0]} = N'")
    return found if not missing else None


def on_off(c: Checks, setting: Setting) -> bool | None:
    """`key on` or `key off`: True or False."""
    return word_choice(c, setting, {"on": True, "off": False})
