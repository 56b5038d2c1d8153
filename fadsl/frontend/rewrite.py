"""Spec text rewritten setting by setting: the kernel renamed, kernel-level setting lines
replaced or added, a path's SMEM scope swapped, everything else (comments, layout, nested
blocks) as written. `fadsl tune` writes its variants with it (fadsl/tools/variants.py), and
fadsl.attention_varlen / attention_with_kvcache derive a call's spec from a shipped one."""

from __future__ import annotations

import re
from typing import Callable, Mapping

_KERNEL_LINE = re.compile(r"^(?P<head>\s*kernel\s+)(?P<name>[A-Za-z_]\w*)")
_SETTING_LINE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<key>[A-Za-z_]\w*)(?P<gap>[ \t]+)(?P<value>[^#\r\n]*?)"
    r"(?P<pad>[ \t]*)(?P<comment>#[^\r\n]*)?(?P<eol>\r?\n?)$"
)
_PATH_LINE = re.compile(r"^[ \t]*(?P<tensor>[A-Za-z_]\w*)[ \t]*:")
_SMEM_SCOPE = re.compile(r"smem\[\s*\w+\s*\](?P<space>[ \t]*)")


def rewrite(source: str, settings: Mapping[str, str], scopes: Mapping[str, str], name: str) -> str:
    """``source`` with the kernel-level setting lines ``settings`` (key -> value text)
    replaced, or added after the kernel's last setting line where the spec has none (so never
    inside or after a nested block), the SMEM scope of the kernel-level paths of ``scopes``
    (tensor -> scope) replaced, and the kernel renamed. Comments keep their column where the
    new value leaves room."""
    lines = source.splitlines(keepends=True)
    pending = dict(settings)
    depth = 0  # 1: the kernel's own lines; 2 and more: a nested block (mainloop, backward)
    value_column, indent = None, "  "
    last_setting = closing = None
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if depth == 0:
            match = _KERNEL_LINE.match(line)
            if match:
                lines[i] = match["head"] + name + line[match.end() :]
        elif depth == 1 and code.strip() == "}":
            closing = i
        elif depth == 1:
            path = _PATH_LINE.match(line)
            setting = _SETTING_LINE.match(line) if path is None else None
            if path is not None and path["tensor"] in scopes:
                lines[i] = _SMEM_SCOPE.sub(_scope_swap(scopes[path["tensor"]]), line, count=1)
            elif setting is not None and "{" not in setting["value"]:
                last_setting = i
                if value_column is None:  # new lines line up with the first setting
                    indent = setting["indent"]
                    value_column = len(setting["indent"] + setting["key"] + setting["gap"])
                key = setting["key"]
                if key in pending:
                    lines[i] = _replaced(setting, pending.pop(key))
        depth += code.count("{") - code.count("}")
    if pending:
        at = last_setting + 1 if last_setting is not None else closing
        if at is None:
            raise ValueError(f"no kernel body to add {', '.join(pending)} to")
        if not lines[at - 1].endswith("\n"):
            lines[at - 1] += "\n"
        lines[at:at] = [_new_line(k, v, indent, value_column) for k, v in pending.items()]
    return "".join(lines)


def _scope_swap(scope: str) -> Callable[[re.Match], str]:
    """The new ``smem[scope]``, the spaces after it adjusted so the next hop keeps its column."""

    def swap(match: re.Match) -> str:
        new = f"smem[{scope}]"
        width = len(match[0])
        space = match["space"]
        return new + (" " * max(1, width - len(new)) if space else "")

    return swap


def _replaced(setting: re.Match, value: str) -> str:
    """The setting line with ``value``; its comment, which spoke of the input's value, says
    so ("# was 2: K/V ring slots")."""
    head = setting["indent"] + setting["key"] + setting["gap"]
    if not setting["comment"]:
        return head + value + setting["eol"]
    column = len(head + setting["value"] + setting["pad"])
    pad = " " * max(1, column - len(head + value))
    said = setting["comment"][1:].strip()
    comment = f"# was {setting['value'].strip()}" + (f": {said}" if said else "")
    return head + value + pad + comment + setting["eol"]


def _new_line(key: str, value: str, indent: str, value_column: int | None) -> str:
    head = indent + key
    width = (value_column or len(head) + 1) - len(head)
    return head + " " * max(1, width) + value + "\n"


_BACKWARD_OPEN = re.compile(r"^[ \t]*backward[ \t]*\{")


def rewrite_backward(
    source: str, settings: Mapping[str, str], paths: Mapping[str, str | None], name: str
) -> str:
    """``source`` with the backward block's setting lines ``settings`` (key -> value text)
    replaced or added at the block's top, its path lines ``paths`` (tensor -> the path's
    text after the colon, or None: the line taken out, the tensor back to its default)
    replaced, added or removed, and the kernel renamed. `fadsl tune --backward` writes its
    variants with it. A spec without a backward block is refused (ValueError)."""
    lines = rewrite(source, {}, {}, name).splitlines(keepends=True)
    opened = next((i for i, line in enumerate(lines) if _BACKWARD_OPEN.match(line)), None)
    if opened is None:
        raise ValueError("the spec has no backward block: nothing of the backward to vary")
    pending, pending_paths = dict(settings), dict(paths)
    depth, indent, value_column, i = 0, None, None, opened
    while i < len(lines):
        line = lines[i]
        code = line.split("#", 1)[0]
        if i > opened and depth == 1:
            path = _PATH_LINE.match(line)
            setting = _SETTING_LINE.match(line) if path is None else None
            if path is not None and path["tensor"] in pending_paths:
                text = pending_paths.pop(path["tensor"])
                if text is None:
                    del lines[i]
                    continue
                gap = line[path.end() :][
                    : len(line[path.end() :]) - len(line[path.end() :].lstrip())
                ]
                lines[i] = line[: path.end()] + (gap.strip("\r\n") or " ") + text + "\n"
            elif setting is not None and setting["key"] in pending:
                lines[i] = _replaced(setting, pending.pop(setting["key"]))
            if (path or setting) and indent is None:
                indent = (path or setting)[0][: len(line) - len(line.lstrip())]
                if setting is not None:
                    value_column = len(setting["indent"] + setting["key"] + setting["gap"])
        depth += code.count("{") - code.count("}")
        if i > opened and depth == 0:  # the block's closing brace
            break
        i += 1
    indent = indent or "    "
    added = [_new_line(k, v, indent, value_column) for k, v in pending.items()]
    added += [f"{indent}{t}: {text}\n" for t, text in pending_paths.items() if text is not None]
    lines[opened + 1 : opened + 1] = added
    return "".join(lines)
