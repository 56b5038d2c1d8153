"""A small reader of C++ text, for the tests that hold a header's calls to a plan
(tests/backward_header.py): comments, preprocessor lines and jinja tags stripped; a
function's parameters and body; the statements of a block (blocks, if / if constexpr, for,
while, simple statements); a call's arguments."""

from __future__ import annotations

import re


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def strip(text: str) -> str:
    text = re.sub(r"\{([%#]).*?\1\}", "", text, flags=re.S)  # the template's jinja tags
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    return "\n".join(line for line in text.split("\n") if not line.strip().startswith("#"))


def param_name(param: str) -> str:
    """The name a C++ parameter declares: `const float (&dq)[N]` -> dq, `int* p` -> p."""
    return re.findall(r"\w+", re.sub(r"\[[^\]]*\]", "", param))[-1]


def function(text: str, pattern: str) -> tuple[str, str]:
    """(parameters, body) of the first function whose head matches ``pattern``."""
    text = strip(text)
    head = re.search(pattern, text)
    assert head, pattern
    params_at = text.index("(", head.end() - 1)
    params = group(text, params_at)
    at = text.index("{", params_at + len(params) + 2)
    return params, group(text, at, "{", "}")


def group(text: str, at: int, open_: str = "(", close: str = ")") -> str:
    """The text inside the balanced delimiters that open at ``at``."""
    assert text[at] == open_, text[at : at + 40]
    depth = 0
    for n in range(at, len(text)):
        depth += {open_: 1, close: -1}.get(text[n], 0)
        if depth == 0:
            return text[at + 1 : n]
    raise AssertionError("unbalanced")


def statements(text: str) -> list:
    """The statements of a block: ('block', [...]), ('if', cond, constexpr, then, other),
    ('for', head, body), ('while', cond, body) or ('simple', text)."""
    out, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return out
        node, at = _statement(text, at)
        out.append(node)


def _statement(text: str, at: int):
    while text[at].isspace():
        at += 1
    rest = text[at:]
    if rest.startswith("{"):
        inner = group(text, at, "{", "}")
        return ("block", statements(inner)), at + len(inner) + 2
    word = re.match(r"(if|for|while)\b\s*(constexpr\b)?\s*", rest)
    if word:
        at += word.end()
        cond = group(text, at)
        body, at = _statement(text, at + len(cond) + 2)
        if word[1] != "if":
            return (word[1], squash(cond), body), at
        other = re.match(r"\s*else\b", text[at:])
        if not other:
            return ("if", squash(cond), bool(word[2]), body, None), at
        other_body, end = _statement(text, at + other.end())
        return ("if", squash(cond), bool(word[2]), body, other_body), end
    depth, n = 0, at
    while not (text[n] == ";" and depth == 0):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(text[n], 0)
        n += 1
    return ("simple", text[at:n]), n + 1


def split_args(text: str) -> list[str]:
    args, depth, current = [], 0, ""
    for ch in text:
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += ch
    return args + ([current.strip()] if current.strip() else [])
