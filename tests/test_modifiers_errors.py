"""Every refusal of a score or mask modifier (issue 41), located at its token: the message, its
line and column (`file:line:col: message` and a caret under the column, as every spec error).

The modifier lines sit on line 10 of test_modifiers_front.BASE (one line per '\\n'); each case
gives the line of its error relative to that, its column and a part of its message."""

from __future__ import annotations

import pytest

from fadsl.errors import SpecError
from fadsl.pipeline import compile_source, front_end
from test_modifiers_front import BASE, spec

FIRST = 10  # the line of BASE's modifier slot

CASES = {
    # --- names and functions
    "unknown_name": ("score s + slope", 0, 13, "unknown name 'slope'; an expression reads s, b,"),
    "misspelt_name": ("score s + kv_id", 0, 13, "unknown name 'kv_id' (did you mean 'kv_idx'?)"),
    "score_in_keep": ("keep s > 0", 0, 8, "'keep' cannot read the score 's': a mask decided by"),
    "input_without_index": (
        "input t : f32[heads]\n  score s + t",
        1,
        13,
        "input 't' is a tensor: read one element, t[...] (1 index)",
    ),
    "function_as_name": ("score s + exp", 0, 13, "'exp' is a function: call it, exp(...)"),
    "unknown_input": (
        "input slopes : f32[heads]\n  score s + slope[h] + slopes[h]",
        1,
        13,
        "unknown input 'slope' (did you mean 'slopes'?); declare it",
    ),
    "variable_with_index": (
        "score s + h[0]",
        0,
        13,
        "'h' is not an input: only inputs take indices",
    ),
    "unknown_function": (
        "score s + expp(s)",
        0,
        13,
        "unknown function 'expp' (did you mean 'exp'?)",
    ),
    "input_called": (
        "input t : f32[heads]\n  score s + t(h)",
        1,
        13,
        "'t' is an input: index it with brackets, t[...]",
    ),
    "arity": ("score s + min(s)", 0, 13, "min() takes 2 arguments, got 1"),
    "where_arity": ("score where(s > 0, s)", 0, 9, "where() takes 3 arguments"),
    # --- indices
    "index_count": (
        "input t : f32[heads, 32]\n  score s + t[h]",
        1,
        13,
        "input 't' has 2 dimensions (t : f32[heads, 32]), but is read with 1 index",
    ),
    "index_reads_score": (
        "input t : f32[heads]\n  score s + t[floor(s)]",
        1,
        15,
        "index 1 of 't' reads the score 's': the address of a load would depend on the "
        "scores (data-dependent control)",
    ),
    "float_index": (
        "input t : f32[heads]\n  score s + t[h / 2]",
        1,
        15,
        "index 1 of 't' is a float ('h / 2'); an index is an i32",
    ),
    "bool_index": (
        "input t : f32[heads]\n  score s + t[h > 2]",
        1,
        15,
        "index 1 of 't' is a truth value",
    ),
    "index_outside": (
        "input t : f32[heads, 32]\n  score s + t[h, kv_idx - q_idx]",
        1,
        18,
        "index 2 of 't' may fall outside [0, 32): 'kv_idx - q_idx' ranges over "
        "[-seqlen_q + 1, seqlen_k - 1]; clamp it, clamp(kv_idx - q_idx, 0, 31)",
    ),
    "index_past_its_size": (
        "input t : f32[seqlen_q]\n  score s + t[q_idx + 1]",
        1,
        15,
        "index 1 of 't' may fall outside [0, seqlen_q): 'q_idx + 1' ranges over [1, seqlen_q]",
    ),
    "index_of_another_size": (
        "input t : f32[seqlen_q]\n  score s + t[kv_idx]",
        1,
        15,
        "may fall outside [0, seqlen_q): 'kv_idx' ranges over [0, seqlen_k - 1]",
    ),
    # --- functions that can make inf or NaN
    "exp_unbounded": ("score exp(s)", 0, 13, "exp() of 's' may overflow to inf"),
    "exp_too_large": ("score s + exp(min(s, 90))", 0, 17, "exp() of 'min(s, 90)' may overflow"),
    "log_of_anything": ("score log(s)", 0, 13, "log() of 's' may be -inf or NaN"),
    "log2_of_zero": ("score s + log2(abs(s))", 0, 18, "log2() of 'abs(s)' may be -inf or NaN"),
    "division_by_zero": (
        "score s / (kv_idx - q_idx)",
        0,
        14,
        "the divisor 'kv_idx - q_idx' may be 0",
    ),
    "floordiv_by_zero": ("keep kv_idx // h == 0", 0, 18, "the divisor 'h' may be 0"),
    "mod_of_floats": ("score s % 2", 0, 9, "'%' takes integers, but 's % 2' has a float operand"),
    # --- types
    "score_is_bool": (
        "score s > 0",
        0,
        9,
        "'score' must be a number, but 's > 0' is a truth value",
    ),
    "keep_is_number": ("keep kv_idx - q_idx", 0, 8, "'keep' must be a truth value"),
    "not_of_number": ("keep not q_idx", 0, 8, "'not' takes a truth value, but 'q_idx' is a number"),
    "minus_of_bool": ("score -(s > 0)", 0, 9, "'-' takes a number, but 's > 0' is a truth value"),
    "and_of_numbers": ("keep q_idx and kv_idx > 0", 0, 8, "'and' takes truth values, but 'q_idx'"),
    "compare_bool_and_number": ("keep (q_idx > 0) < 3", 0, 8, "'<' compares two numbers"),
    "add_bool": (
        "score s + (q_idx > 0)",
        0,
        14,
        "'+' takes numbers, but 'q_idx > 0' is a truth value",
    ),
    "bool_argument": ("score max(s, q_idx > 0)", 0, 16, "max() takes numbers"),
    "where_condition": ("score where(s, s, 0)", 0, 15, "where()'s condition must be a truth value"),
    "where_branches": (
        "score where(s > 0, s, q_idx > 0)",
        0,
        9,
        "where()'s two values must both be numbers or both truth values",
    ),
    "int_too_large": ("score s + 3000000000", 0, 13, "3000000000 is too large for an i32"),
    "float_too_large": ("score s + 1e39", 0, 13, "1e39 is too large for an f32"),
    # --- declarations
    "unused_input": (
        "input t : f32[heads]\n  score s",
        0,
        9,
        "input 't' is declared but neither 'score' nor 'keep' reads it",
    ),
    "reserved_input_name": (
        "input h : f32[heads]\n  score s",
        0,
        9,
        "'h' is a name expressions already read",
    ),
    "input_twice": (
        "input t : f32[heads]\n  input t : f32[batch]\n  score s + t[h]",
        1,
        9,
        "input 't' is declared twice (first on line 10)",
    ),
    "input_dtype": ("input t : f64[heads]\n  score s", 0, 13, "unknown input dtype 'f64'"),
    "input_dim": (
        "input t : f32[head]\n  score s + t[0]",
        0,
        17,
        "unknown dimension 'head' (did you mean 'heads'?)",
    ),
    "input_dim_zero": ("input t : f32[0]\n  score s", 0, 17, "a constant dimension is 1 to"),
    "second_score": (
        "score s\n  score s + 1",
        1,
        3,
        "a second 'score' line (the first is on line 10)",
    ),
    "second_keep": (
        "keep q_idx >= 0\n  keep kv_idx >= 0",
        1,
        3,
        "a second 'keep' line (the first is on line 10); a kernel takes one: combine them with and",
    ),
    "inputs_alone": ("input t : f32[heads]", 0, 3, "inputs are read by 'score' or 'keep' lines"),
    # --- arithmetic out of range at every sequence length (shorter ones: test_modifiers_overflow)
    "int_overflow": (
        "score s + h * b",
        0,
        13,
        "'h * b' may overflow an i32: it reaches 4.295e+09 with sequence lengths up to 1 and "
        "batch and heads up to 65535, and an int wraps silently",
    ),
    "int_overflow_of_constants": ("keep 65536 * 65536 > q_idx", 0, 8, "'65536 * 65536' may"),
    "float_overflow": (
        "score s + 2.0 * 1e38 * 10.0",
        0,
        13,
        "'2.0 * 1e38 * 10.0' may overflow to inf: it reaches 2e+39, past fp32's largest",
    ),
}


def refusal(lines: str, text: str | None = None) -> SpecError:
    with pytest.raises(SpecError) as info:
        front_end(text if text is not None else spec(lines), "mods.fa")
    return info.value


@pytest.mark.parametrize("name", CASES)
def test_each_refusal_is_located_at_its_token(name):
    lines, line, col, message = CASES[name]
    err = refusal(lines)
    found = [(d.loc.line, d.loc.col, d.message) for d in err.diagnostics]
    assert any(
        (l, c) == (FIRST + line, col) and message in m for l, c, m in found
    ), f"wanted {FIRST + line}:{col} '{message}', got {found}"


def test_a_refusal_shows_the_line_and_a_caret():
    err = refusal("input t : f32[heads, 32]\n  score s + t[h, kv_idx - q_idx]")
    assert str(err).split("\n")[1:] == [
        "      score s + t[h, kv_idx - q_idx]",
        "                     ^",
    ]


def test_independent_problems_are_reported_at_once():
    err = refusal("score exp(s) + foo\n  keep s > 0")
    assert [(d.loc.line, d.loc.col) for d in err.diagnostics] == [(10, 13), (10, 18), (11, 8)]


def test_a_modifier_error_and_a_setting_error_come_together():
    text = spec("score s + foo").replace("stages     2", "stages     0")
    messages = [d.message for d in refusal("", text).diagnostics]
    assert any("foo" in m for m in messages) and any("stages" in m for m in messages)


@pytest.mark.parametrize(
    "line, col, message",
    [
        ("score s +", 12, "unexpected end of line"),
        ("keep q_idx < kv_idx < 3", 23, "unexpected '<'"),
        ("score s + ,", 13, "unexpected ','"),
    ],
)
def test_syntax_errors_in_an_expression_are_located(line, col, message):
    err = refusal(line)
    (d,) = err.diagnostics
    assert (d.loc.line, d.loc.col) == (FIRST, col) and message in d.message


def with_backward(text: str, block: str = "backward {}") -> str:
    return text.replace("  swizzle    128B\n", f"  swizzle    128B\n  {block}\n")


def test_a_backward_block_with_a_score_that_has_no_derivative_is_refused_at_the_function():
    """floor of the score has no derivative (0 almost everywhere, undefined at the steps):
    the forward compiles, a backward block is refused at floor's token (issue 41, step 4)."""
    text = with_backward(spec("score floor(s * 4) / 4"))
    err = refusal("", text)
    (d,) = err.diagnostics
    assert (d.loc.line, d.loc.col) == (FIRST, 9)
    assert d.message.startswith(
        "the backward block (line 16) multiplies dS by d score / d s, but 'floor(s * 4)' "
        "rounds the score down: its derivative is 0 almost everywhere and undefined at each step"
    )
    assert str(err).split("\n")[1:] == ["      score floor(s * 4) / 4", "            ^"]
    front_end(spec("score floor(s * 4) / 4"), "mods.fa")  # forward-only: fine


def test_a_backward_block_with_modifiers_at_head_dim_256_is_refused_at_its_keyword():
    text = with_backward(spec("score s * 2")).replace("head_dim   128", "head_dim   256")
    text = text.replace("B_r = 128, B_c = 128", "B_r = 128, B_c = 80")
    found = [(d.loc.line, d.loc.col, d.message) for d in refusal("", text).diagnostics]
    assert any(
        (line, col) == (16, 3) and m.startswith("the backward of score and keep at head_dim 256")
        for line, col, m in found
    ), found


def test_a_backward_block_with_modifiers_compiles():
    for lines in (
        "score s * 2",
        "keep kv_idx <= q_idx",
        "score 2 * tanh(s / 2)\n  keep q_idx >= 0",
    ):
        lowered = front_end(with_backward(spec(lines)), "mods.fa")
        assert lowered.backward is not None and lowered.config.modifiers is not None


SM80 = """kernel k {
  target   sm_80
  dtype    bf16
  head_dim 128
  tile     B_r = 64, B_c = 64
  warps    4
  mask     none
  score    s * 2
  Q: gmem -cp.async-> smem[warp] -ldmatrix->       rf
  K: gmem -cp.async-> smem[cta]  -ldmatrix->       rf
  V: gmem -cp.async-> smem[cta]  -ldmatrix.trans-> rf
  O: rf   -st.shared-> smem[warp] -st.global->     gmem
}
"""


def test_sm80_refuses_modifiers():
    (d,) = refusal("", SM80).diagnostics
    assert (d.loc.line, d.loc.col) == (8, 3) and "not built for sm_80 yet" in d.message


@pytest.mark.parametrize(
    "lines, setting, col, message",
    [
        ("score s * 2", "softcap    30", 3, "write the cap into the score, e.g. score 30 * tanh(s / 30)"),
        ("keep kv_idx <= q_idx", "mask       window(8, 0)", 3, "keep with 'window' is not built yet"),
        ("keep kv_idx <= q_idx", "tail       split_kv", 3, "keep with 'tail' is not built yet"),
        ("score s * 2", "varlen     on", 3, "with varlen on (b and q_idx of a packed sequence) are not built"),
    ],
)  # fmt: skip
def test_sm90_refuses_what_its_forward_does_not_take_with_modifiers(lines, setting, col, message):
    text = spec(lines).replace("  mask       none\n", f"  mask       none\n  {setting}\n")
    if setting.startswith("mask"):
        text = spec(lines).replace("  mask       none", f"  {setting}")
    found = [(d.loc.line, d.loc.col, d.message) for d in refusal("", text).diagnostics]
    assert any(c == col and message in m for _, c, m in found), found


def test_cluster_pairs_are_refused_with_keep():
    text = spec("keep kv_idx <= q_idx").replace(
        "  mask       none\n", "  mask       none\n  cluster    2\n  tail       whole\n"
    )
    messages = [d.message for d in refusal("", text).diagnostics]
    assert any("keep with 'cluster' is not built yet" in m for m in messages), messages


def test_a_refused_spec_is_refused_by_the_whole_pipeline_too():
    with pytest.raises(SpecError, match="unknown name 'foo'"):
        compile_source(spec("score s + foo"), "mods.fa")
