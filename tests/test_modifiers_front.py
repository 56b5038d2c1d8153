"""Score and mask modifiers (issue 41), the front end: the grammar's `input`, `score` and
`keep` lines, the typed IR check_modifiers makes of them, the printer, the derivative, the IR's
text form and what `fadsl check` and `fadsl explain` show. Every error message:
tests/test_modifiers_errors.py."""

from __future__ import annotations

import json
import math
import re

import pytest

from conftest import ROOT
from fadsl.cli import main
from fadsl.ir.expr import Binary, BinOp, ExprType, Load, Var, VarKind, text
from fadsl.ir.printer import format_kernel
from fadsl.pipeline import front_end
from fadsl.spec.syntax import parse
from modifier_eval import evaluate

# A forward-only sm_90a spec with a slot for modifier lines.
BASE = """kernel mods {
  target     sm_90a
  dtype      bf16, fp16
  head_dim   128
  tile       B_r = 128, B_c = 128
  warpgroups producer = 1, consumers = 2
  registers  producer = 24, consumers = 240
  stages     2
  mask       none
  %s
  Q: gmem -tma-> smem[warpgroup] -wgmma->    rf
  K: gmem -tma-> smem[cta]       -wgmma->    rf
  V: gmem -tma-> smem[cta]       -wgmma->    rf
  O: rf -stmatrix-> smem[warpgroup] -tma->   gmem
  swizzle    128B
}
"""


def spec(lines: str) -> str:
    return BASE % lines


def modifiers(lines: str, check_inputs: bool = True):
    """The checked modifiers of BASE with ``lines`` (without ``check_inputs``, input lines
    that no expression names are left out)."""
    if not check_inputs:
        kept = []
        for line in lines.split("\n"):
            name = re.match(r"\s*input\s+(\w+)", line)
            body = " ".join(x for x in lines.split("\n") if not x.strip().startswith("input"))
            if name is None or re.search(rf"\b{name.group(1)}\b", body):
                kept.append(line)
        lines = "\n".join(kept)
    return front_end(spec(lines), "mods.fa").config.modifiers


def test_the_lines_parse_into_located_expressions():
    decl = parse(spec("input slopes : f32[heads]\n  score s + slopes[h] * (kv_idx - q_idx)"))
    inp, score = decl.modifiers
    assert (inp.name.text, inp.dtype.text, [d.text for d in inp.dims]) == (
        "slopes",
        "f32",
        ["heads"],
    )
    assert score.keyword.text == "score" and score.loc.line == 11
    add = score.expr
    assert isinstance(add, Binary) and add.op is BinOp.ADD and add.loc.col == 9
    assert text(add) == "s + slopes[h] * (kv_idx - q_idx)"


@pytest.mark.parametrize(
    "source, printed",
    [
        ("s + 1 * 2 - 3", "s + 1 * 2 - 3"),
        ("s - (1 - 2)", "s - (1 - 2)"),
        ("(s - 1) - 2", "s - 1 - 2"),
        ("s / (2 * 3)", "s / (2 * 3)"),
        ("-(s + 1)", "-(s + 1)"),
        ("--s", "--s"),
        ("where(not (q_idx < 3 or kv_idx > 2) and h == 1, s, 0.5)",
         "where(not (q_idx < 3 or kv_idx > 2) and h == 1, s, 0.5)"),
        ("where((q_idx < 3) == (kv_idx < 2), s, 1e-3)", "where((q_idx < 3) == (kv_idx < 2), s, 1e-3)"),
        ("max(s, 2) // 1", None),  # refused: '//' takes ints (the printer is not reached)
    ],
)  # fmt: skip
def test_the_printer_keeps_the_meaning_with_the_fewest_parentheses(source, printed):
    if printed is None:
        with pytest.raises(Exception, match="takes integers"):
            modifiers(f"score {source}")
        return
    m = modifiers(f"score {source}")
    assert text(m.score) == printed
    again = modifiers(f"score {text(m.score)}")  # what it prints parses back to itself
    assert text(again.score) == printed


def test_types_are_inferred_as_python_would():
    m = modifiers(
        "input t : i32[heads, 4]\n  input w : f32[seqlen_k]\n"
        "  score s + t[h, 3] // 2 + w[kv_idx] * floor(s) + (q_idx % 3) / 2"
    )
    types = {text(n): n.type for n in _nodes(m.score)}
    assert types["t[h, 3] // 2"] is ExprType.I32
    assert types["floor(s)"] is ExprType.I32  # rounds down to an int
    assert types["w[kv_idx] * floor(s)"] is ExprType.F32
    assert types["q_idx % 3 / 2"] is ExprType.F32  # '/' is a true division
    assert m.score.type is ExprType.F32
    keep = modifiers("keep kv_idx <= q_idx and not h == 2").keep
    assert keep.type is ExprType.BOOL
    assert all(n.type is not None for n in _nodes(keep))


def _nodes(e):
    from fadsl.ir.expr import walk

    return list(walk(e))


def test_names_resolve_to_variables_sizes_and_loads():
    m = modifiers("input slopes : f32[heads]\n  score s + slopes[h] * seqlen_k")
    kinds = {n.kind for n in _nodes(m.score) if isinstance(n, Var)}
    assert kinds == {VarKind.SCORE, VarKind.HEAD, VarKind.SEQLEN_K}
    (load,) = [n for n in _nodes(m.score) if isinstance(n, Load)]
    assert load.input == "slopes" and load.type is ExprType.F32


@pytest.mark.parametrize(
    "score, derivative",
    [
        ("s + slopes[h] * (kv_idx - q_idx)", "1.0"),
        ("30 * tanh(s / 30)", "1.0 - tanh(s / 30) * tanh(s / 30)"),
        ("2 * s - 1", "2.0"),
        ("exp(min(s, 10)) / 3", None),
        ("where(q_idx > kv_idx, s * s, -s)", None),
        ("abs(s) + clamp(s, -2, 3) + log(1 + abs(s)) + log2(2 + s * s)", None),
        ("max(s, q_idx) - min(s, 0.5 * s)", None),
    ],
)
def test_the_derivative_matches_finite_differences(score, derivative):
    lines = ("input slopes : f32[heads]\n  " if "slopes" in score else "") + f"score {score}"
    m = modifiers(lines)
    if derivative is not None:
        assert text(m.derivative) == derivative
    inputs = {"slopes": lambda h: 0.25 * (h + 1)}
    for s in (-3.3, -0.7, 0.2, 1.9, 4.1):
        env = {"s": s, "b": 1, "h": 2, "q_idx": 5, "kv_idx": 3}
        step = 1e-6
        up = evaluate(m.score, {**env, "s": s + step}, inputs)
        down = evaluate(m.score, {**env, "s": s - step}, inputs)
        want = (up - down) / (2 * step)
        got = evaluate(m.derivative, env, inputs)
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5), (s, got, want)


def test_floor_of_the_score_has_no_derivative_but_compiles():
    m = modifiers("score floor(s * 4) / 4")
    assert m.derivative is None and "rounds the score down" in m.not_differentiable


def test_the_ir_prints_the_modifiers_and_the_hash_tells_specs_apart():
    from fadsl.codegen.render import spec_hash

    one = front_end(spec("score s + 1"), "a.fa")
    two = front_end(spec("score s + 2"), "a.fa")
    assert "modifier score s + 1" in format_kernel(one)
    assert spec_hash(one) != spec_hash(two)
    plain = front_end(spec(""), "a.fa")
    assert "modifier" not in format_kernel(plain)  # (kernels without modifiers as before)


PREFIX_LM_ALIBI = """input prefix : i32[batch]
  input slopes : f32[heads]
  score s + slopes[h] * (kv_idx - q_idx)
  keep kv_idx <= q_idx + seqlen_k - seqlen_q or kv_idx < prefix[b]"""


def test_check_and_explain_show_the_modifiers(capsys, tmp_path):
    path = str(tmp_path / "prefix_lm_alibi.fa")
    (tmp_path / "prefix_lm_alibi.fa").write_text(spec(PREFIX_LM_ALIBI))
    assert main(["check", "--no-compile", path]) == 0
    out = capsys.readouterr().out
    assert "  score     s + slopes[h] * (kv_idx - q_idx)" in out
    assert "  input     prefix : i32[batch]" in out
    assert main(["explain", "--no-compile", path]) == 0
    out = capsys.readouterr().out
    assert "d score / d s = 1.0" in out
    assert "d score / d slopes[h] = 1.0 * (kv_idx - q_idx)" in out  # (slopes' gradient: dS' x it)
    assert (
        "FULL (no mask)          where kv_hi - q_lo <= seqlen_k - seqlen_q or kv_hi < prefix[b]"
        in out
    )
    assert (
        "EMPTY (block skipped)   where kv_lo - q_hi > seqlen_k - seqlen_q and kv_lo >= prefix[b]"
        in out
    )
    assert "    exact: " in out
    assert main(["explain", "--no-compile", "--json", path]) == 0
    data = json.loads(capsys.readouterr().out)["modifiers"]
    assert data["score"] == {
        "expr": "s + slopes[h] * (kv_idx - q_idx)",
        "type": "f32",
        "derivative": "1.0",
        "not_differentiable": None,
        "distance_term": None,  # (ALiBi's term is one multiply: no table)
        "input_grads": [{"read": "slopes[h]", "derivative": "1.0 * (kv_idx - q_idx)", "why": None}],
    }
    assert data["keep"]["exact"] is True and data["inputs"] == [
        "prefix : i32[batch]",
        "slopes : f32[heads]",
    ]


def test_the_example_reads_as_written():
    from fadsl.pipeline import compile_file

    path = ROOT / "examples" / "modifiers" / "alibi_causal.fa"
    m = compile_file(path.relative_to(ROOT)).kernel.config.modifiers
    assert [i.text() for i in m.inputs] == ["slopes : f32[heads]"]
    assert text(m.score) == "s + slopes[h] * (kv_idx - q_idx)" and m.keep is None
