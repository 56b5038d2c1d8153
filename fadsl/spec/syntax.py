"""Parse a spec with Lark into a small AST whose every node carries its location.

Syntax errors are reported with a located, human message; independent errors on
different lines are all reported (the parser skips the offending line and goes
on), so a user fixes a file in one round trip, not one error at a time.
"""

from __future__ import annotations

import bisect
import functools
import re
from dataclasses import dataclass
from .._data import data_dir
from typing import Union

import lark
from lark import Lark, Token, Transformer, v_args

from ..errors import DiagnosticSink, Loc, quoted
from ..ir import GradRole, Role
from ..ir import expr as ex

# --- AST ---------------------------------------------------------------------


@dataclass(frozen=True)
class Word:
    text: str
    loc: Loc


@dataclass(frozen=True)
class Number:
    value: int
    loc: Loc
    text: str


@dataclass(frozen=True)
class BlocksDim:
    """An input dimension ``FN(NAME, N)`` as written (``cdiv(seqlen_q, 128)``)."""

    fn: Word
    name: Word
    block: Number


@dataclass(frozen=True)
class Call:
    name: Word
    args: tuple["Atom", ...]
    loc: Loc


Atom = Union[Word, Number, Call]


@dataclass(frozen=True)
class Assign:
    name: Word
    value: Atom
    loc: Loc


Value = Union[Atom, Assign]


@dataclass(frozen=True)
class Setting:
    key: Word
    values: tuple[Value, ...]
    loc: Loc


@dataclass(frozen=True)
class LevelRef:
    name: Word
    scope: Word | None
    loc: Loc


@dataclass(frozen=True)
class HopRef:
    instr: Word
    loc: Loc


@dataclass(frozen=True)
class PathDecl:
    tensor: Word
    levels: tuple[LevelRef, ...]
    hops: tuple[HopRef, ...]
    loc: Loc


@dataclass(frozen=True)
class LoopStep:
    """One mainloop line; ``words`` are its names in order, e.g. S, Q, K, T."""

    form: str  # "move" | "move_next" | "gemm_assign" | "gemm_accumulate" | "compute"
    words: tuple[Word, ...]
    loc: Loc

    def text(self) -> str:
        w = [x.text for x in self.words]
        match self.form:
            case "move":
                return f"{w[0]} -> {w[1]}"
            case "move_next":
                return f"{w[0]}({w[1]}) -> {w[2]}"
            case "gemm_assign":
                return f"{w[0]} = {w[1]} @ {w[2]}^{w[3]}"
            case "gemm_accumulate":
                return f"{w[0]} += {w[1]} @ {w[2]}"
            case "compute":
                return w[0]
            case _:
                raise AssertionError(f"unknown loop step form {self.form}")


@dataclass(frozen=True)
class MainloopDecl:
    steps: tuple[LoopStep, ...]
    loc: Loc


@dataclass(frozen=True)
class BackwardDecl:
    """A `backward { ... }` block: its settings and paths, with the kernel's line syntax."""

    settings: tuple[Setting, ...]
    paths: tuple[PathDecl, ...]
    loc: Loc  # the `backward` keyword


@dataclass(frozen=True)
class InputLine:
    """`input NAME : DTYPE[DIMS]` (a score or mask modifier's tensor), as written."""

    name: Word
    dtype: Word
    dims: tuple[Word | Number | BlocksDim, ...]
    loc: Loc  # the `input` keyword


@dataclass(frozen=True)
class ExprLine:
    """`score EXPR` or `keep EXPR`: the expression as the parser built it (fadsl.ir.expr,
    names unresolved and untyped)."""

    keyword: Word
    expr: ex.Expr
    loc: Loc


@dataclass(frozen=True)
class KernelDecl:
    name: Word
    settings: tuple[Setting, ...]
    paths: tuple[PathDecl, ...]
    mainloops: tuple[MainloopDecl, ...]
    loc: Loc
    backwards: tuple[BackwardDecl, ...] = ()  # a kernel takes one; more are reported
    # score and mask modifiers: `input`, `score` and `keep` lines, in the spec's order
    modifiers: tuple[InputLine | ExprLine, ...] = ()


# --- Parsing -----------------------------------------------------------------

# Names a person reads instead of Lark's terminal names; literal terminals
# (braces, arrows, keywords) are shown as their text.
_TOKEN_NAMES = {
    "NAME": "a name",
    "INSTR": "an instruction name",
    "INT": "a number",
    "SIZE": "a size such as 128B",
    "_NL": "end of line",
    "$END": "end of file",
    "KERNEL": "'kernel'",
    "MAINLOOP": "'mainloop'",
    "BACKWARD": "'backward'",
    "INPUT": "'input'",
    "SCORE": "'score'",
    "KEEP": "'keep'",
    "AND": "'and'",
    "OR": "'or'",
    "NOT": "'not'",
    "FLOAT": "a number",
}


@functools.cache
def _parser() -> Lark:
    grammar = data_dir("grammar").joinpath("fadsl.lark").read_text()
    # cache=True: Lark keeps the analysed grammar in the temp folder, keyed by its hash (a
    # warm start then skips building the parse table).
    return Lark(
        grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False, cache=True
    )


def _token_name(name: str) -> str:
    if name in _TOKEN_NAMES:
        return _TOKEN_NAMES[name]
    literals = {t.name: t.pattern.value for t in _parser().terminals if t.pattern.type == "str"}
    return f"'{literals[name]}'" if name in literals else name.lower()


# Words that start a modifier line, as a setting's key does: "a name" speaks for them in a
# list of what a line may start with (so that the list stays short enough to show).
_LINE_KEYWORDS = {"INPUT", "SCORE", "KEEP"}


def _expected(names: set[str]) -> str:
    if "NAME" in names:
        names = names - _LINE_KEYWORDS
    shown = sorted({_token_name(n) for n in names if not n.startswith("__IGNORE")})
    if not shown or len(shown) > 6:
        return ""
    if len(shown) == 1:
        return f"; expected {shown[0]}"
    return "; expected " + ", ".join(shown[:-1]) + " or " + shown[-1]


def quote_char(char: str) -> str:
    """A character as a person should see it in a message."""
    if char == "\ufffd":
        return "bytes that are not valid UTF-8 (shown as U+FFFD)"
    if char == "\ufeff":
        return "a UTF-8 byte-order mark (save the file without one)"
    if not char.isprintable() or not char.strip():
        return f"character U+{ord(char):04X}"
    return f'character "{char}"' if char in "'\\" else f"character '{char}'"


def _lines(text: str) -> list[str]:
    """Lines as Lark counts them: only \\n ends a line."""
    return text.split("\n")


def _end_of(text: str) -> tuple[int, int]:
    """Line and column just past the last non-blank line's text."""
    lines = _lines(text)
    line = max((i for i, t in enumerate(lines, 1) if t.strip()), default=1)
    return line, len(lines[line - 1].rstrip("\r")) + 1


# A path line without its colon: the forward's tensors and the backward block's.
_FORWARD_TENSORS = tuple(r.value for r in Role)
_PATH_WITHOUT_COLON = re.compile(
    rf"(\s*)({'|'.join((*_FORWARD_TENSORS, *(g.value for g in GradRole)))})\s+(gmem|smem|rf)\b"
)


_HOP_HINT = "a hop is written '-INSTR->', e.g. '-cp.async->'"
_MODIFIER_LINE = re.compile(r"\s*(score|keep)\b")


def _syntax_message(err: lark.exceptions.UnexpectedInput, text: str) -> tuple[int, int, str]:
    lines = _lines(text)
    match err:
        case lark.exceptions.UnexpectedCharacters():
            char = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
            message = f"unexpected {quote_char(char)}"
            if char == ">" or (char == "-" and "->" not in lines[err.line - 1]):
                message += "; " + _HOP_HINT
            return err.line, err.column, message
        case lark.exceptions.UnexpectedToken() if err.token.type not in ("$END", "<END-OF-FILE>"):
            token = err.token
            line, col = token.line, token.column
            source_line = lines[line - 1]
            if token.type == "KERNEL":
                return line, col, "only one kernel per file"
            path = _PATH_WITHOUT_COLON.match(source_line)
            if path and token.type != "_NL":
                t = path.group(2)
                example = (
                    "gmem -cp.async->" if t in _FORWARD_TENSORS else f"{path.group(3)} -INSTR->"
                )
                return (
                    line,
                    len(path.group(1)) + len(t) + 1,
                    f"missing ':' after '{t}': a path is written '{t}: {example} ...'",
                )
            if token.value == "-" and source_line[col : col + 1].isdigit():
                return line, col, _negative_number_message(source_line)
            if token.value == ">" and not _MODIFIER_LINE.match(source_line):
                # ('>' is a token of the modifiers' comparisons; in a path, a broken arrow)
                return line, col, f"unexpected {quote_char('>')}; {_HOP_HINT}"
            expected = _expected(set(err.accepts or err.expected))
            if token.type == "_NL":
                # The newline token starts right after the line's text.
                return line, col, "unexpected end of line" + expected
            if "_NL" in (err.accepts or err.expected):
                expected += " (one setting per line)"
            return line, col, f"unexpected '{quoted(token.value)}'" + expected
        case lark.exceptions.UnexpectedToken() | lark.exceptions.UnexpectedEOF():
            line, col = _end_of(text)
            if not text.strip():
                return line, col, "the spec is empty; expected 'kernel NAME { ... }'"
            if all(not t.strip() or t.strip().startswith("#") for t in lines):
                return line, col, "the spec has only comments; expected 'kernel NAME { ... }'"
            return line, col, "unexpected end of file" + _expected(set(err.expected))
        case _:
            raise AssertionError(f"unexpected parser error {type(err).__name__}")


def _negative_number_message(source_line: str) -> str:
    """A '-' before a number: every number of a spec counts something (FlashAttention's
    window_size of -1, no bound, has spellings of its own)."""
    message = "unexpected '-': a spec's numbers are 0 or more"
    if "window" in source_line:
        message += (
            "; a window's LEFT and RIGHT count keys (FlashAttention's -1, no bound: "
            "'mask causal' for (-1, 0), no window for (-1, -1))"
        )
    return message


class _ToAst(Transformer):
    def __init__(self, file: str) -> None:
        super().__init__()
        self.file = file

    def _loc(self, meta_or_token) -> Loc:
        return Loc(self.file, meta_or_token.line, meta_or_token.column)

    def _word(self, token: Token) -> Word:
        return Word(str(token), self._loc(token))

    @v_args(meta=True)
    def kernel(self, meta, children):
        _keyword, name, *items = children
        return KernelDecl(
            self._word(name),
            tuple(i for i in items if isinstance(i, Setting)),
            tuple(i for i in items if isinstance(i, PathDecl)),
            tuple(i for i in items if isinstance(i, MainloopDecl)),
            self._loc(meta),
            tuple(i for i in items if isinstance(i, BackwardDecl)),
            tuple(i for i in items if isinstance(i, (InputLine, ExprLine))),
        )

    @v_args(meta=True)
    def setting(self, meta, children):
        key, *values = children
        return Setting(self._word(key), tuple(values), self._loc(meta))

    def word(self, children):
        return self._word(children[0])

    def blocks_dim(self, children):
        fn, name, block = children
        return BlocksDim(self._word(fn), self._word(name), self.number([block]))

    def number(self, children):
        token = children[0]
        # Python refuses int() of very long digit strings; no knob needs more than 18 digits.
        value = int(token) if len(token) <= 18 else 10**18
        return Number(value, self._loc(token), str(token))

    @v_args(meta=True)
    def call(self, meta, children):
        name, *args = children
        return Call(self._word(name), tuple(args), self._loc(meta))

    @v_args(meta=True)
    def assign(self, meta, children):
        name, value = children
        return Assign(self._word(name), value, self._loc(meta))

    @v_args(meta=True)
    def path(self, meta, children):
        tensor, *rest = children
        levels = tuple(c for c in rest if isinstance(c, LevelRef))
        hops = tuple(c for c in rest if isinstance(c, HopRef))
        return PathDecl(self._word(tensor), levels, hops, self._loc(meta))

    @v_args(meta=True)
    def level(self, meta, children):
        scope = self._word(children[1]) if len(children) > 1 else None
        return LevelRef(self._word(children[0]), scope, self._loc(meta))

    @v_args(meta=True)
    def hop(self, meta, children):
        return HopRef(self._word(children[0]), self._loc(meta))

    @v_args(meta=True)
    def mainloop(self, meta, children):
        _keyword, *steps = children
        return MainloopDecl(tuple(steps), self._loc(meta))

    def backward(self, children):
        keyword, *items = children
        return BackwardDecl(
            tuple(i for i in items if isinstance(i, Setting)),
            tuple(i for i in items if isinstance(i, PathDecl)),
            self._loc(keyword),
        )

    def _step(form):  # noqa: N805 - a small factory of methods
        @v_args(meta=True)
        def method(self, meta, children):
            return LoopStep(form, tuple(self._word(t) for t in children), self._loc(meta))

        return method

    # --- score and mask modifiers
    @v_args(meta=True)
    def input_decl(self, meta, children):
        keyword, name, dtype, *dims = children
        return InputLine(self._word(name), self._word(dtype), tuple(dims), self._loc(keyword))

    def score_decl(self, children):
        keyword, expr = children
        return ExprLine(self._word(keyword), expr, self._loc(keyword))

    keep_decl = score_decl

    def int_const(self, children):
        token = children[0]
        # An i32: larger values are kept as written, for check_modifiers to refuse.
        value = int(token) if len(token) <= 18 else 10**18
        return ex.Const(value, self._loc(token), text=str(token))

    def float_const(self, children):
        token = children[0]
        return ex.Const(float(token), self._loc(token), text=str(token))

    def name(self, children):
        return ex.Name(str(children[0]), self._loc(children[0]))

    def apply(self, children):
        name, *args = children
        return ex.Apply(str(name), tuple(args), self._loc(name))

    def load(self, children):
        name, *indices = children
        return ex.Load(str(name), tuple(indices), self._loc(name))

    @v_args(meta=True)
    def neg(self, meta, children):
        return ex.Unary(ex.UnOp.NEG, children[0], self._loc(meta))

    def not_op(self, children):
        keyword, x = children
        return ex.Unary(ex.UnOp.NOT, x, self._loc(keyword))

    def _binary(op):  # noqa: N805 - a small factory of methods
        @v_args(meta=True)
        def method(self, meta, children):
            a, *_keyword, b = children  # (`and` and `or` keep their keyword token)
            return ex.Binary(op, a, b, self._loc(meta))

        return method

    or_op = _binary(ex.BinOp.OR)
    and_op = _binary(ex.BinOp.AND)
    lt = _binary(ex.BinOp.LT)
    le = _binary(ex.BinOp.LE)
    gt = _binary(ex.BinOp.GT)
    ge = _binary(ex.BinOp.GE)
    eq = _binary(ex.BinOp.EQ)
    ne = _binary(ex.BinOp.NE)
    add = _binary(ex.BinOp.ADD)
    sub = _binary(ex.BinOp.SUB)
    mul = _binary(ex.BinOp.MUL)
    div = _binary(ex.BinOp.DIV)
    floordiv = _binary(ex.BinOp.FLOORDIV)
    mod = _binary(ex.BinOp.MOD)

    move = _step("move")
    move_next = _step("move_next")
    gemm_assign = _step("gemm_assign")
    gemm_accumulate = _step("gemm_accumulate")
    compute = _step("compute")

    def start(self, children):
        return children[0]


def _blank_line(text: str, line: int) -> str:
    lines = text.split("\n")
    lines[line - 1] = " " * len(lines[line - 1])
    return "\n".join(lines)


MAX_SYNTAX_ERRORS = 20
# A kernel takes 90 to 140 words and symbols and about 1 KB. Parsing costs some 20 us a token,
# so these limits keep any input's answer well under a second.
MAX_TOKENS = 2000
MAX_CHARS = 256 * 1024
# Each recovery parses again from the top: all attempts together parse at most this many
# tokens before the errors found so far are reported.
RECOVERY_TOKENS = 3 * MAX_TOKENS
_COUNTED = re.compile(r"#[^\n]*|[A-Za-z0-9_.]+|[^\s#A-Za-z0-9_.]")


def spec_text(source: str) -> str:
    """The text the parser reads: CRLF and CR-only line ends become \\n (the only one the
    parser counts), and of an over-long spec only as much as proves it too long (CRLF
    -> \\n at most halves it), so that no step takes time in proportion to a huge input."""
    return source[: 2 * MAX_CHARS + 2].replace("\r\n", "\n").replace("\r", "\n")


def _loc_at(source: str, file: str, pos: int) -> Loc:
    line = source.count("\n", 0, pos) + 1
    return Loc(file, line, pos - (source.rfind("\n", 0, pos) + 1) + 1)


def _token_starts(source: str, file: str, sink: DiagnosticSink) -> list[int] | None:
    """Where each token starts (comments aside), or None, reported, when the text is too
    long for a spec or is binary."""
    if "\x00" in source:
        loc = _loc_at(source, file, source.index("\x00"))
        sink.error(loc, "the spec contains a NUL byte; is it a binary file?")
        return None
    if len(source) > MAX_CHARS:
        sink.error(
            _loc_at(source, file, MAX_CHARS),
            f"the spec is too long: over {MAX_CHARS // 1024} KB (a kernel takes about 1 KB); "
            "is this the right file?",
        )
        return None
    starts = []
    for match in _COUNTED.finditer(source):
        if match.group().startswith("#"):
            continue
        if len(starts) == MAX_TOKENS:
            sink.error(
                _loc_at(source, file, match.start()),
                f"the spec is too long: over {MAX_TOKENS} words and symbols (a kernel takes "
                "about 140); is this the right file?",
            )
            return None
        starts.append(match.start())
    return starts


def _recoverable(text: str, line: int) -> bool:
    """Only lines strictly inside the kernel body are skipped to find more errors;
    skipping the header or the closing brace would only cascade."""
    lines = _lines(text)
    header = next((i for i, t in enumerate(lines, 1) if t.strip().startswith("kernel")), None)
    closing = max((i for i, t in enumerate(lines, 1) if t.strip().startswith("}")), default=None)
    return header is not None and closing is not None and header < line < closing


def parse_recovering(source: str, file: str, sink: DiagnosticSink) -> KernelDecl | None:
    """Parse spec text (as spec_text returns it), adding every syntax error to ``sink``.

    After a syntax error the offending line is blanked and parsing starts over, so
    that errors on other lines are found too (up to MAX_SYNTAX_ERRORS, or until the
    attempts have parsed RECOVERY_TOKENS tokens). Returns the AST of what parsed (with
    the bad lines left out), or None when nothing could be recovered.
    """
    starts = _token_starts(source, file, sink)
    if starts is None:
        return None
    text = source
    blanked: set[int] = set()
    parsed = found = 0
    while True:
        try:
            tree = _parser().parse(text)
        except lark.exceptions.UnexpectedInput as err:
            line, col, message = _syntax_message(err, text)
            sink.error(Loc(file, line, col), message)
            found += 1
            pos = getattr(err, "pos_in_stream", None)
            parsed += bisect.bisect(starts, len(text) if pos is None else pos)
            if found >= MAX_SYNTAX_ERRORS or parsed >= RECOVERY_TOKENS:
                sink.error(Loc(file, line, col), f"(stopping after {found} syntax errors)")
                return None
            if line in blanked or not _recoverable(text, line):
                return None
            blanked.add(line)
            text = _blank_line(text, line)
            continue
        return _ToAst(file).transform(tree)


def parse(source: str, file: str = "<spec>") -> KernelDecl:
    """Parse spec text into a KernelDecl, or raise SpecError with every syntax error."""
    source = spec_text(source)
    sink = DiagnosticSink(source)
    decl = parse_recovering(source, file, sink)
    sink.raise_if_any()
    assert decl is not None
    return decl
