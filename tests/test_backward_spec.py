"""The `backward { ... }` block (docs/backward.md, step 1): grammar, lowering to
``fadsl.ir.Backward``, its defaults, its line in the IR's text form, sm_90a's checks with
located errors, the refusals (sm_80, softcap), and what check and explain say about it.

Error locations are found in the spec text itself (``where``): each test names the token the
caret must sit under, so that a message at the wrong token fails."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from conftest import EXAMPLES, ROOT
from fadsl.build.spill_check import check_registers, find_compiler
from fadsl.cli import main
from fadsl.codegen.render import render_backward
from fadsl.errors import Loc, SpecError
from fadsl.ir import Backward, GradRole, Instr, Level, Role, Scope
from fadsl.ir.backward import read_backward as read_backward_ir
from fadsl.ir.printer import format_kernel
from ir_reader import IRSyntaxError, read_kernel
from fadsl.targets.sm90.backward.report import backward_data, backward_sections
from fadsl.pipeline import compile_file, compile_source
from fadsl.targets.sm90.backward import validate as sm90_backward
from fadsl.targets.sm90.backward.plan_smem import plan_smem
from fadsl.targets.sm90.caps import register_pool, registers_asked
from fadsl.tools.report import explain_data, explain_text, summary

SPECS = ROOT / "tests" / "specs" / "sm90" / "backward"
FULL = SPECS / "fa3_backward.fa"  # every key of the block written out
DEFAULTS = SPECS / "fa3_backward_defaults.fa"  # `backward {}`
SM80 = SPECS / "fa2_backward.fa"
SOFTCAP = SPECS / "fa3_backward_softcap.fa"
FILE = "t.fa"


def full_text() -> str:
    return FULL.read_text()


def where(text: str, line_part: str, token: str | None = None) -> tuple[int, int]:
    """(line, column) of ``token`` (default: the line part itself) on the only line of
    ``text`` that contains ``line_part``."""
    found = [(i, line) for i, line in enumerate(text.split("\n"), 1) if line_part in line]
    assert len(found) == 1, f"{line_part!r} is on {len(found)} lines"
    line_no, line = found[0]
    start = line.index(line_part)
    return line_no, line.index(token or line_part, start) + 1


def errors(text: str) -> list[tuple[int, int, str]]:
    with pytest.raises(SpecError) as info:
        compile_source(text, FILE)
    return [(d.loc.line, d.loc.col, d.message) for d in info.value.diagnostics]


def assert_error(text: str, line_part: str, token: str, message: str) -> None:
    """``text`` is refused with a diagnostic at ``token`` that contains ``message``."""
    line, col = where(text, line_part, token)
    found = errors(text)
    assert any(
        (l, c) == (line, col) and message in m for l, c, m in found
    ), f"no '{message}' at {line}:{col} in {found}"


def variant(old: str, new: str, text: str | None = None) -> str:
    text = full_text() if text is None else text
    assert text.count(old) == 1, old
    return text.replace(old, new)


def block_lines(path) -> dict[str, str]:
    """The paths the spec writes in its backward block, as text (whitespace collapsed)."""
    block = path.read_text().split("  backward {", 1)[1]
    paths = {}
    for line in block.split("\n"):
        m = re.match(r"\s*(\w+):\s+(.*?)\s*$", line.split("#")[0])
        if m:
            paths[m[1]] = " ".join(m[2].split())
    return paths


def settings_of(bwd: Backward) -> dict[str, object]:
    """The block's settings, without where they came from."""
    fields = dataclasses.asdict(bwd)
    return {k: v for k, v in fields.items() if k not in ("loc", "tensors", "key_locs")}


# --- parsing and lowering -------------------------------------------------------------


def test_the_full_block_lowers_to_the_ir():
    text = variant("stages     2                        #", "stages     3  #")
    text = variant("deterministic off", "deterministic on", text)
    text = variant("overlap    off ", "overlap    on \n    early_dv   on ", text)
    text = variant(
        "producer = 24, consumers = 240\n    stages",
        "producer = 24, consumers = 232\n    stages",
        text,
    )
    bwd = compile_source(text, FILE).kernel.backward
    assert settings_of(bwd) == {
        "block_m": 64,
        "block_n": 128,
        "consumers": 2,
        "producer_regs": 24,
        "consumer_regs": 232,
        "stages": 3,
        "deterministic": True,
        "overlap": True,
        "early_dv": True,
        "dv_before_meeting": False,
        "dq_lag": False,
        "dq_first": False,
        "dq_red": False,
        "longest_first": False,
        "dq_writer": False,
        "persistent": False,
        "fused_convert": False,
        "ds_stmatrix": False,
    }
    assert bwd.loc == Loc(FILE, *where(text, "  backward {", "backward"))
    assert bwd.loc_of("stages") == Loc(FILE, *where(text, "stages     3"))
    assert bwd.threads == 384 and bwd.keys_per_consumer == 64


def test_every_path_is_lowered_as_written():
    bwd = compile_file(FULL.relative_to(ROOT)).kernel.backward
    written = block_lines(FULL)
    assert {t.role.value: t.path_text() for t in bwd.tensors} == written
    text = full_text()
    for tensor in bwd.tensors:
        written = f"    {tensor.role.value}:"  # the block's lines are indented by 4
        assert tensor.loc == Loc(
            str(FULL.relative_to(ROOT)), *where(text, written, tensor.role.value)
        )
    dq = bwd.tensor(GradRole.DQ)
    assert [h.instr for h in dq.hops] == [Instr.ST_SHARED, Instr.REDUCE_ADD]
    assert dq.smem_scope is Scope.WARPGROUP
    dk = bwd.tensor(GradRole.DK)
    assert dk.smem_scope is None and [(h.src, h.dst) for h in dk.hops] == [(Level.RF, Level.GMEM)]
    assert bwd.tensor(Role.Q).smem_scope is Scope.CTA


def test_an_empty_block_takes_every_default():
    """`backward {}` is the full block, whose every key is written at its default."""
    full = compile_file(FULL.relative_to(ROOT)).kernel.backward
    empty = compile_source(variant(full_text().split("  backward {")[1], "}\n}\n"), FILE)
    defaults = empty.kernel.backward
    assert settings_of(defaults) == settings_of(full)
    assert [t.path_text() for t in defaults.tensors] == [t.path_text() for t in full.tensors]
    assert all(t.loc == defaults.loc for t in defaults.tensors)  # defaults: at the block
    assert defaults.key_locs == ()


def test_the_defaults_spec_at_head_dim_64_causal():
    compiled = compile_file(DEFAULTS.relative_to(ROOT))
    assert compiled.kernel.config.head_dim == 64
    assert compiled.kernel.backward is not None
    assert [t.role for t in compiled.kernel.backward.tensors] == list(sm90_backward.PATHS)


def test_the_keyword_stands_alone():
    """`backwards` and `backward_x` are names (unknown keys), not the keyword; the block
    may span lines or be written `backward {}`."""
    text = variant("  backward {", "  backwards 2\n  backward_x on\n  backward {")
    found = errors(text)
    assert (*where(text, "backwards 2", "backwards"), "unknown key 'backwards'") in found
    assert (*where(text, "backward_x on", "backward_x"), "unknown key 'backward_x'") in found
    inline = compile_source(variant("  backward {}", "  backward {  }", DEFAULTS.read_text()), FILE)
    assert inline.kernel.backward is not None


def test_the_block_is_carried_through_every_pass():
    compiled = compile_file(FULL.relative_to(ROOT))
    first = compiled.stages[0][1].backward
    assert first is not None
    assert all(kernel.backward == first for _, kernel in compiled.stages)


def test_forward_only_specs_have_no_backward(example):
    if "backward {" in example.read_text():
        pytest.skip("a training example (its block: test_training_examples_carry_their_block)")
    compiled = compile_file(example.relative_to(ROOT))
    for variant_ in compiled.variants:
        for _, kernel in variant_.stages:
            assert kernel.backward is None
            assert not any(
                line.startswith("backward") for line in format_kernel(kernel).split("\n")
            )


# --- the IR's text form ----------------------------------------------------------------


@pytest.mark.parametrize("spec", [FULL, DEFAULTS], ids=lambda p: p.stem)
def test_print_read_print_keeps_the_backward_line(spec):
    compiled = compile_file(spec.relative_to(ROOT))
    for stage, kernel in compiled.stages:
        text = format_kernel(kernel)
        assert text.split("\n").count(kernel.backward.text()) == 1, stage
        read = read_kernel(text)
        assert format_kernel(read) == text, stage
        assert settings_of(read.backward) == settings_of(kernel.backward)


def test_a_malformed_backward_line_is_refused():
    text = format_kernel(compile_file(FULL.relative_to(ROOT)).kernel)
    with pytest.raises(IRSyntaxError, match="backward B_r=N"):
        read_kernel(text.replace("deterministic=off", "deterministic=maybe"))


# --- sm_90a's checks, each located -----------------------------------------------------

# (old line part, new line part, the line part and token the error sits at, message)
LOCATED = [
    ("B_r = 64, B_c = 128 ", "B_r = 128, B_c = 128 ", "    tile       B_r = 128", "128", "B_r = 128 needs head_dim 64: S^T and dP^T of 128 queries beside dK and dV of head_dim 128"),
    ("B_r = 64, B_c = 128 ", "B_r = 96, B_c = 128 ", "    tile       B_r = 96", "96", "B_r = 96: the backward steps through the queries 64 at a time (one wgmma M), at head_dim 64 128 at a time (64 per consumer warpgroup), or at head_dim 128 80 at a time (dQ transposed)"),
    ("B_r = 64, B_c = 128 ", "B_r = 80, B_c = 128 ", "dS:  rf -st.shared", "st.shared", "'st.shared' does not move dS rf -> smem in the backward; 'stmatrix' does (dS: rf -stmatrix-> smem[cta] -wgmma-> rf)"),
    ("deterministic off", "early_dv on", "early_dv on", "early_dv", "early_dv on reorders the overlapped consumer: it needs 'overlap on' in the backward block"),
    ("deterministic off", "dv_before_meeting on", "dv_before_meeting on", "dv_before_meeting", "dv_before_meeting on reorders the overlapped consumer: it needs 'overlap on' in the backward block"),
    ("deterministic off", "overlap on\n    early_dv on\n    dv_before_meeting on", "dv_before_meeting on", "dv_before_meeting", "dv_before_meeting on and early_dv on each say where dV is issued (before the meeting at dS^T, or before dS): choose one"),
    ("dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem", "dQ:  rf -red.add-> smem[warpgroup]", "dQ:  rf -red.add", "dQ", "dQ must go rf -st.shared-> smem[warpgroup] -reduce.add-> gmem in the backward (each consumer warpgroup stages its share in fp32 for a bulk reduce-add into the fp32 accumulator), or rf -red.add-> gmem"),
    ("dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem", "dQ:  rf -st.global-> gmem", "dQ:  rf -st.global", "st.global", "'st.global' does not move dQ rf -> gmem in the backward; 'red.add' does"),
    ("B_r = 64, B_c = 128 ", "B_r = 64, B_c = 64 ", "B_c = 64 ", "64", "B_c = 64: the backward's B_c is 64 x consumers = 128"),
    ("producer = 1, consumers = 2\n    registers", "producer = 1, consumers = 3\n    registers", "consumers = 3", "3", "consumers = 3: the backward kernel has 2 consumer warpgroups"),
    ("producer = 1, consumers = 2\n    registers", "producer = 2, consumers = 2\n    registers", "warpgroups producer = 2", "2", "producer = 2: one producer warpgroup issues every load"),
    ("stages     2                        #", "stages     4 #", "stages     4", "4", "stages 4: the backward's Q and dO rings take 2 or 3 slots"),
    ("producer = 24, consumers = 240\n    stages", "producer = 64, consumers = 240\n    stages", "producer = 64", "64", "the backward's producer takes setmaxnreg 24 to 56, a multiple of 8, not 64"),
    ("producer = 24, consumers = 240\n    stages", "producer = 24, consumers = 244\n    stages", "consumers = 244", "244", "the backward's consumers take setmaxnreg 24 to 240, a multiple of 8, not 244"),
    ("producer = 24, consumers = 240\n    stages", "producer = 24, consumers = 248\n    stages", "consumers = 248", "248", "not 248"),
    ("deterministic off", "deterministic maybe", "deterministic maybe", "maybe", "unknown deterministic 'maybe'; expected 'on' or 'off'"),
    ("deterministic off", "stage 3", "stage 3", "stage", "unknown key 'stage' in the backward block; it takes 'tile', 'warpgroups', 'registers', 'stages', 'deterministic', 'overlap', 'early_dv', 'dv_before_meeting', 'longest_first', 'dq_writer', 'dq_lag', 'dq_first', 'fused_convert' and 'scheduler' (did you mean 'stages'?)"),
    ("deterministic off", "mask causal", "mask causal", "mask", "'mask' is a setting of the kernel, not of its backward block"),
    ("deterministic off", "stages 3", "stages 3", "stages", "duplicate key 'stages' in the backward block (first set at line"),
    ("dV:  rf -st.global-> gmem", "dW:  rf -st.global-> gmem", "dW:", "dW", "unknown tensor 'dW' in the backward block; it moves Q, K, V, dO, LSE, D, P, dS, dQ, dK and dV"),
    ("LSE: gmem -bulk->", "LSE: gmem -tma->", "LSE: gmem -tma->", "tma", "'tma' does not move LSE gmem -> smem in the backward; 'bulk' does (LSE: gmem -bulk-> smem[cta] -ld.shared-> rf)"),
    ("D:   gmem -bulk-> smem[cta] -ld.shared->", "D:   gmem -bulk-> smem[cta] -wgmma->", "D:   gmem", "wgmma", "'wgmma' does not move D smem -> rf in the backward; 'ld.shared' does"),
    ("dQ:  rf -st.shared-> smem[warpgroup]", "dQ:  rf -st.shared-> smem[cta]", "dQ:  rf", "cta", "dQ lives in smem[warpgroup] in the backward: each consumer warpgroup stages its share in fp32"),
    ("dS:  rf -st.shared-> smem[cta]", "dS:  rf -st.shared-> smem[warpgroup]", "dS:  rf", "warpgroup", "dS lives in smem[cta] in the backward"),
    ("dK:  rf -st.global-> gmem", "dK:  rf -st.shared-> smem[cta] -tma-> gmem", "dK:  rf -st.shared", "dK", "dK must go rf -st.global-> gmem in the backward"),
    ("dO:  gmem -tma-> smem[cta] -wgmma-> rf", "dO:  gmem -tma-> smem[cta]", "dO:  gmem", "dO", "dO must go gmem -tma-> smem[cta] -wgmma-> rf in the backward"),
    ("dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem", "dQ:  rf -red.add-> gmem\n    dq_writer on", "dq_writer on", "dq_writer", "dq_writer on hands each consumer's staged dQ to a writer warp for its bulk reduce-add; dQ's path here adds from registers"),
    ("deterministic off", "dq_writer maybe", "dq_writer maybe", "maybe", "unknown dq_writer 'maybe'; expected 'on' or 'off'"),
    ("smem[warpgroup] -reduce.add->", "smem[warpgroup] -reduce->", "-reduce->", "reduce", "unknown instruction 'reduce' (did you mean 'reduce.add'?)"),
    ("dV:  rf -st.global-> gmem", "dV:  rf[tile] -st.global-> gmem", "dV:  rf[tile]", "tile", "only smem takes a bracket (its sharing scope), not rf"),
    ("dS:  rf -st.shared-> smem[cta]", "dS:  rf -st.shared-> smem", "dS:  rf", "smem", "smem needs a sharing scope: smem[warpgroup] or smem[cta] or smem[cluster]"),
    ("dV:  rf -st.global-> gmem", "dV   rf -st.global-> gmem", "dV   rf", " ", "missing ':' after 'dV': a path is written 'dV: rf -INSTR-> ...'"),
    ("  }\n}", "  }\n  backward {}\n}", "  backward {}", "backward", "a kernel has one backward block (the first is at line"),
    ("head_dim   128", "head_dim   96", "head_dim   96", "96", "the backward block needs head_dim 64, 128 or 256"),
    ("  rescale    lazy", "  rescale    lazy\n  deterministic on", "deterministic on", "deterministic", "unknown key 'deterministic' (a setting of the backward block: put it inside 'backward { ... }')"),
    ("  rescale    lazy", "  rescale    lazy\n  dQ: rf -st.shared-> smem[warpgroup] -tma-> gmem", "  dQ: rf -st.shared-> smem[warpgroup] -tma-> gmem", "dQ", "unknown tensor 'dQ'; a kernel moves Q, K, V and O (dQ's path goes inside the 'backward { ... }' block)"),
]  # fmt: skip


@pytest.mark.parametrize(
    "old, new, line_part, token, message", LOCATED, ids=[case[4][:40] for case in LOCATED]
)
def test_each_mistake_is_located(old, new, line_part, token, message):
    assert_error(variant(old, new), line_part, token, message)


HDIM64 = ROOT / "examples" / "fa3_hdim64.fa"


def hdim64_staged(tile: str) -> str:
    """examples/fa3_hdim64.fa with dQ staged, `dq_writer on` (on the grid: `scheduler
    persistent` refuses it) and the backward tile ``tile``."""
    text = HDIM64.read_text()
    for old, new in (
        ("    tile       B_r = 128, B_c = 128 ", f"    tile       {tile} "),
        ("    scheduler  persistent\n", "    scheduler  grid\n"),
        ("    dq_lag     on\n", "    dq_lag     off\n"),  # (it adds dQ from registers)
        ("    dq_first   on\n", "    dq_first   off\n"),  # (which orders the lag)
        ("dQ: rf -red.add-> gmem ", "dQ: rf -st.shared-> smem[warpgroup] -reduce.add-> gmem\n    dq_writer on "),
    ):  # fmt: skip
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def test_the_dq_writer_needs_shares_of_its_own():
    """Split by keys (head_dim 64 at B_r 64) both consumers add into all of dQ: refused at the
    key; by queries (B_r 128) and at head_dim 128 in either mode it is admitted."""
    message = "dq_writer on: at head_dim 64 with B_r = 64 dQ is split by keys"
    assert_error(hdim64_staged("B_r = 64, B_c = 128"), "dq_writer on", "dq_writer", message)
    bwd = compile_source(hdim64_staged("B_r = 128, B_c = 128"), FILE).kernel.backward
    assert bwd.dq_writer and not bwd.dq_red
    for det in ("off", "on"):
        text = variant("deterministic off", f"deterministic {det}\n    dq_writer on")
        bwd = compile_source(text, FILE).kernel.backward
        assert bwd.dq_writer and bwd.deterministic == (det == "on")
        assert bwd.text().endswith(" dq_writer=on")
        assert read_backward_ir(bwd.text(), bwd.loc).dq_writer


def test_a_second_path_is_located():
    text = variant("dV:  rf -st.global-> gmem", "dK:  rf -st.global-> gmem")
    lines = text.split("\n")
    first = lines.index("    dK:  rf -st.global-> gmem") + 1
    second = lines.index("    dK:  rf -st.global-> gmem", first) + 1
    assert errors(text) == [
        (second, 5, f"tensor 'dK' has two paths in the backward block (first at line {first})")
    ]


def test_the_register_pool_is_the_launch_allocation():
    """128 x 32 + 2 x 128 x 240 is 65536, the SM's registers, but over the 384 x 168 the
    CTA launches with: setmaxnreg.inc would wait forever."""
    text = variant(
        "producer = 24, consumers = 240\n    stages", "producer = 32, consumers = 240\n    stages"
    )
    asked, pool = registers_asked(32, 2, 240), register_pool(384)
    assert asked > pool
    assert_error(
        text,
        "producer = 32, consumers = 240",
        "240",
        f"128 x 32 + 128 x 2 x 240 = {asked} registers, over the CTA's pool of {pool}",
    )


def test_the_smem_plan_must_fit(monkeypatch):
    """No setting the block allows overflows 227 KB today; with a smaller limit the plan's
    total is refused at the stages line."""
    text = variant("stages     2                        #", "stages     3  #")
    total = plan_smem(compile_source(text, FILE).kernel.backward, 128).total
    monkeypatch.setattr(sm90_backward, "SMEM_LIMIT", total - 1)
    assert_error(
        text, "stages     3", "3", f"the backward's SMEM plan needs {total} bytes at head_dim 128"
    )


def test_dq_added_from_registers():
    """`dQ: rf -red.add-> gmem`: no staging in SMEM (the plan's dQ buffer is empty), and the
    deterministic order, which needs the staging, refuses it at the path."""
    text = variant(
        "dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem", "dQ:  rf -red.add-> gmem"
    )
    bwd = compile_source(text, FILE).kernel.backward
    assert bwd.dq_red and "dq=red.add" in bwd.text()
    assert {b.name: b.nbytes for b in plan_smem(bwd, 128).buffers}["dQ"] == 0
    staged = compile_source(full_text(), FILE).kernel.backward
    assert not staged.dq_red and {b.name: b.nbytes for b in plan_smem(staged, 128).buffers}["dQ"]
    det = variant("deterministic off", "deterministic on", text)
    assert_error(det, "dQ:  rf -red.add", "dQ", "deterministic on needs dQ staged")


def test_head_dim_64_takes_b_r_128_split_by_queries():
    """B_r = 128 at head_dim 64: each consumer computes dQ for its own 64 queries; dS^T is
    two 64-query panels; a third stage no longer fits 227 KB."""
    text = variant("head_dim   128", "head_dim   64")
    text = variant("B_r = 64, B_c = 128 ", "B_r = 128, B_c = 128 ", text)
    kernel = compile_source(text, FILE).kernel
    assert kernel.backward.block_m == 128
    data = explain_data(compile_source(text, FILE))["backward"]
    assert any(
        "by queries (each consumer its own 64 of the 128" in s
        for s in data["roles"][1]["per_m_block"]
    )
    sizes = {b["buffer"]: b["bytes"] for b in data["smem"]}
    assert sizes["dS"] == 2 * 128 * 128 * 2 and sizes["dQ"] == 2 * 64 * 64 * 4
    three = variant("stages     2                        #", "stages     3  #", text)
    total = plan_smem(dataclasses.replace(kernel.backward, stages=3), 64).total
    assert total > sm90_backward.SMEM_LIMIT
    assert_error(
        three, "stages     3", "3", f"the backward's SMEM plan needs {total} bytes at head_dim 64"
    )


def test_head_dim_128_takes_b_r_80_with_dq_transposed():
    """B_r = 80 at head_dim 128 (FlashAttention-3's non-causal tile): dQ^T = K^T dS^T, each
    consumer one 64-column panel of head_dim; dS goes rf -stmatrix-> smem (queries as rows);
    3 stages fit only without dQ's staging; head_dim 64 refuses it."""
    text = variant("B_r = 64, B_c = 128 ", "B_r = 80, B_c = 128 ")
    text = variant("dS:  rf -st.shared->", "dS:  rf -stmatrix->", text)
    kernel = compile_source(text, FILE).kernel
    assert kernel.backward.block_m == 80
    data = explain_data(compile_source(text, FILE))["backward"]
    assert any("transposed: dQ^T = K^T dS^T" in s for s in data["roles"][1]["per_m_block"])
    sizes = {b["buffer"]: b["bytes"] for b in data["smem"]}
    assert sizes["dS"] == 2 * 128 * 80 * 2 and sizes["dQ"] == 2 * 64 * 80 * 4
    assert sizes["Q"] == 2 * 80 * 128 * 2 and sizes["LSE"] == 2 * 80 * 4
    three = variant("stages     2                        #", "stages     3  #", text)
    total = plan_smem(dataclasses.replace(kernel.backward, stages=3), 128).total
    assert total > sm90_backward.SMEM_LIMIT
    assert_error(three, "stages     3", "3", "the backward's SMEM plan needs")
    red = variant(
        "dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem", "dQ:  rf -red.add-> gmem", three
    )
    assert compile_source(red, FILE).kernel.backward.stages == 3
    hdim64 = variant("head_dim   128", "head_dim   64", text)
    assert_error(hdim64, "    tile       B_r = 80", "80", "B_r = 80 needs head_dim 128")


def test_every_mistake_is_reported_at_once():
    text = variant("B_r = 64, B_c = 128 ", "B_r = 32, B_c = 128 ")
    text = variant("stages     2                        #", "stages     5 #", text)
    text = variant("LSE: gmem -bulk->", "LSE: gmem -tma->", text)
    text = variant("  mask       none", "  mask       casual", text)  # the kernel's own line
    found = errors(text)
    assert len(found) == 4, found
    lines = {line for line, _, _ in found}
    assert lines == {
        where(text, "B_r = 32")[0],
        where(text, "stages     5")[0],
        where(text, "LSE: gmem")[0],
        where(text, "mask       casual")[0],
    }


# --- refusals --------------------------------------------------------------------------


def test_sm80_refuses_the_block_at_its_keyword():
    text = SM80.read_text()
    assert errors(text) == [
        (
            *where(text, "  backward {", "backward"),
            "sm_80 has no backward pass yet; the backward block needs target sm_90a",
        )
    ]


def test_longest_first_is_for_the_causal_mask_and_reaches_the_config():
    """`longest_first on` launches every head's n-block 0 first: with the causal mask it is in
    the IR's text (read back equal) and the Cfg; without it every CTA does the same work, so
    it is refused at its key."""
    text = variant("deterministic off", "deterministic off\n    longest_first on")
    assert_error(
        text, "longest_first on", "longest_first", "longest_first on orders CTAs by their work"
    )
    causal = variant("  mask       none", "  mask       causal", text)
    compiled = compile_source(causal, FILE)
    assert compiled.kernel.backward.longest_first
    line = compiled.kernel.backward.text()
    assert line.endswith(" longest_first=on")
    assert read_backward_ir(line, compiled.kernel.backward.loc).longest_first
    source, *_ = render_backward(compiled.kernel, compiled.target, FILE)
    assert "static constexpr bool kLongestFirst = true;" in source.text.split("struct Cfg", 1)[1]


def test_varlen_trains_without_ordered_adds_or_longest_first():
    """`varlen on` with a backward block compiles (the Cfg says kVarlen, the main kernel's
    grid comment the packed slots); `deterministic on` and `longest_first on` are refused
    at their keys, since packed batches run neither."""
    text = variant("  mask       none", "  mask       causal\n  varlen     on")
    compiled = compile_source(text, FILE)
    source, *_ = render_backward(compiled.kernel, compiled.target, FILE)
    assert "static constexpr bool kVarlen = true;" in source.text.split("struct Cfg", 1)[1]
    assert "cdiv(tokens_k, 128) + sequences" in source.text
    explained = "\n".join(backward_sections(backward_data(compiled.kernel)))
    assert "  varlen     packed sequences: a CTA per n-block slot" in explained
    padded = compile_source(variant("  mask       none", "  mask       causal"), FILE)
    assert "varlen" not in "\n".join(backward_sections(backward_data(padded.kernel)))
    plain, *_ = render_backward(padded.kernel, padded.target, FILE)
    assert "kVarlen" not in plain.text.split("struct Cfg", 1)[1]
    for key, message in (
        ("deterministic", "deterministic on is for padded batches"),
        ("longest_first", "longest_first on is for padded batches"),
    ):
        switched = (
            "deterministic on" if key == "deterministic" else f"deterministic off\n    {key} on"
        )
        assert_error(variant("deterministic off", switched, text), f"{key} on", key, message)


def test_softcap_and_windows_reach_the_backwards_config():
    """The forward's softcap and sliding window are compile-time constants of the backward's
    Cfg too (P recomputed from the capped scores, the window's m-blocks and masks); at B_r
    80 the softcap's 1 - tanh^2 registers spill, and the spill check says so at the block."""
    compiled = compile_source(SOFTCAP.read_text(), FILE)
    source, *_ = render_backward(compiled.kernel, compiled.target, FILE)
    assert "static constexpr float kSoftcap = 50.f;" in source.text
    assert "kWindowLeft" not in source.text.split("struct Cfg", 1)[1]
    window = variant("  mask       none", "  mask       causal, window(256)", SOFTCAP.read_text())
    compiled = compile_source(window.replace("  softcap    50\n", ""), FILE)
    source, *_ = render_backward(compiled.kernel, compiled.target, FILE)
    cfg = source.text.split("struct Cfg", 1)[1]
    assert "kWindowLeft = 256;" in cfg and "kWindowRight = 0;" in cfg and "kSoftcap" not in cfg
    assert "mask causal, window(256)" in source.text
    two_sided = variant("  mask       none", "  mask       window(100, 30)", SOFTCAP.read_text())
    compiled = compile_source(two_sided, FILE)
    source, *_ = render_backward(compiled.kernel, compiled.target, FILE)
    cfg = source.text.split("struct Cfg", 1)[1]
    assert "kWindowLeft = 100;" in cfg and "kWindowRight = 30;" in cfg and "kSoftcap = 50.f" in cfg


def test_softcap_at_b_r_80_is_refused_for_its_spills():
    compiler, name = find_compiler()
    if compiler is None:
        pytest.skip(name)
    block = (
        "  backward {\n    tile B_r = 80, B_c = 128\n    overlap on\n"
        "    dS: rf -stmatrix-> smem[cta] -wgmma-> rf\n    dQ: rf -red.add-> gmem\n  }\n"
    )
    text = SOFTCAP.read_text().replace("  backward {}\n", block)
    with pytest.raises(SpecError) as err:
        check_registers(compile_source(text, FILE), compiler, name)
    assert "the backward's kernels spill" in str(err.value)


def test_dv_before_meeting_fits_its_registers_at_b_r_80_and_head_dim_64():
    """dV issued after the dS^T store (FlashAttention-3's order): at fa3_hopper's B_r 80 and
    at head_dim 64 B_r 128 ptxas (NVRTC 13.0) neither spills nor serializes the wgmma, so
    the check passes. Issued before the store (until 2026-11-30) both got note C7512
    (tests/test_spill_check.py: the refusal of a serialized kernel)."""
    compiler, name = find_compiler()
    if compiler is None:
        pytest.skip(name)
    seen = []

    def recording(source, arch):
        usage = compiler(source, arch)
        seen.append((source.kernel_name, usage))
        return usage

    hopper = (ROOT / "examples" / "fa3_hopper.fa").read_text()
    hopper = hopper.replace("    early_dv   off", "    early_dv   off\n    dv_before_meeting on")
    hdim64 = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
    # (the examples' dq_lag issues dV before dQ already, without a meeting)
    hopper, hdim64 = (
        t.replace("    dq_lag     on\n", "    dq_lag     off\n") for t in (hopper, hdim64)
    )
    hdim64 = hdim64.replace("    dq_first   on\n", "    dq_first   off\n")
    hdim64 = hdim64.replace("    overlap    on\n", "    overlap    on\n    dv_before_meeting on\n")
    for text in (hopper, hdim64):
        compiled = compile_source(text, FILE)
        assert compiled.kernel.backward.dv_before_meeting
        assert check_registers(compiled, recording, name).ran
    backward = [usage for kernel, usage in seen if "bwd" in kernel]
    assert len(backward) >= 4, seen  # bf16 and fp16 of each
    assert not any(u.wgmma_serialized or u.spills for u in backward), backward


def test_the_dq_writer_variants_fit_their_registers():
    """`dq_writer on`: the writer warps run after the producer warpgroup's setmaxnreg.dec, and
    no training variant spills (NVRTC 13.5, 2026-11-30); head_dim 64's deterministic writer
    in visit order with dS by st.shared needs setmaxnreg 32/232 (at 24 it spills 8 bytes; the
    example's stmatrix stores fit at 24)."""
    compiler, name = find_compiler()
    if compiler is None:
        pytest.skip(name)
    from test_gpu_backward import training_spec

    names = [f"{e}+{det}dq_writer-dqred" for e in ("fa3_causal", "fa3_hdim64_causal")
             for det in ("", "deterministic+")]  # fmt: skip
    names += ["fa3_hopper+deterministic+dq_writer-dqred+s2", "fa3_hdim64+dq_writer-dqred"]
    names += ["fa3_hdim64+deterministic+dq_writer-dqred+p32"]
    seen = []

    def recording(source, arch):
        usage = compiler(source, arch)
        seen.append((source.kernel_name, usage))
        return usage

    for spec in names:
        compiled = compile_source(training_spec(spec), FILE)
        assert compiled.kernel.backward.dq_writer
        assert check_registers(compiled, recording, name).ran, spec
    backward = [usage for kernel, usage in seen if "bwd" in kernel]
    assert len(backward) >= 2 * len(names) and not any(u.spills for u in backward)
    with pytest.raises(SpecError, match="the backward's kernels spill"):
        spilling = training_spec("fa3_hdim64+deterministic+dq_writer-dqred-ds_stmatrix")
        check_registers(compile_source(spilling, FILE), compiler, name)


def test_a_bad_target_line_still_reports_the_blocks_own_mistakes():
    text = variant("target     sm_90a", "target     sm_91")
    text = variant("deterministic off", "stage 2", text)
    messages = [m for _, _, m in errors(text)]
    assert any(m.startswith("unknown target 'sm_91'") for m in messages)
    assert any(m.startswith("unknown key 'stage' in the backward block") for m in messages)


# --- check and explain -----------------------------------------------------------------


def test_training_examples_carry_their_block():
    """The head_dim 64 and 128 sm_90a examples train (fadsl.attention's specs there)."""
    for name in ("fa3_hopper", "fa3_causal", "fa3_hdim64", "fa3_hdim64_causal"):
        compiled = compile_file(f"examples/{name}.fa")
        bwd = compiled.kernel.backward
        assert bwd is not None and bwd.overlap and not bwd.deterministic
        assert all(kernel.backward == bwd for _, kernel in compiled.stages)
        assert any(
            line.startswith("backward") for line in format_kernel(compiled.kernel).split("\n")
        )


def test_check_mentions_the_backward():
    compiled = compile_file(FULL.relative_to(ROOT))
    lines = summary(compiled).splitlines()
    bwd = compiled.kernel.backward
    line = next(x for x in lines if x.startswith("  backward"))
    assert f"B_r = {bwd.block_m}, B_c = {bwd.block_n}" in line
    assert f"stages {bwd.stages}" in line
    forward = compile_file("tests/specs/sm90/fa3_q_ring.fa")
    assert not any(x.startswith("  backward") for x in summary(forward).splitlines())


def test_explain_json_has_the_backward_section(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["explain", str(FULL.relative_to(ROOT)), "--json", "--no-compile"]) == 0
    data = json.loads(capsys.readouterr().out)["backward"]
    bwd = compile_file(FULL.relative_to(ROOT)).kernel.backward
    plan = plan_smem(bwd, 128)
    assert data["settings"]["stages"] == bwd.stages
    assert data["settings"]["block_n"] == bwd.block_n
    assert [p["tensor"] for p in data["paths"]] == [t.role.value for t in bwd.tensors]
    assert [(b["buffer"], b["offset"], b["bytes"]) for b in data["smem"]] == [
        (b.name, b.offset, b.nbytes) for b in plan.buffers
    ]
    assert data["smem_total"] == plan.total
    used = registers_asked(bwd.producer_regs, bwd.consumers, bwd.consumer_regs)
    assert data["registers"]["used"] == used
    assert data["registers"]["pool"] == register_pool(bwd.threads)
    producer, consumers = data["roles"]
    assert producer["setmaxnreg"] == bwd.producer_regs
    assert consumers["keys_each"] == bwd.block_n // bwd.consumers
    assert any(step.startswith("dQ = dS K") for step in consumers["per_m_block"])
    # the main kernel's syncs, from its plan (fadsl/targets/sm90/backward/protocol.py)
    assert len(data["syncs"]) > 20
    assert all(sync["sync"] for sync in data["syncs"])
    assert sum(1 for sync in data["syncs"] if sync.get("note")) >= 0.8 * len(data["syncs"])


def test_explain_text_has_the_backward_sections():
    compiled = compile_file(FULL.relative_to(ROOT))
    text = explain_text(compiled)
    bwd = compiled.kernel.backward
    for title in ("Backward (", "  settings", "  paths", "  producer", "  consumers"):
        assert title in text
    assert "Backward SMEM map" in text and "Backward syncs (the main kernel's" in text
    for buf in plan_smem(bwd, 128).buffers:
        assert re.search(rf"^  {re.escape(buf.name)} +{buf.offset} +{buf.nbytes}  ", text, re.M)
    used = registers_asked(bwd.producer_regs, bwd.consumers, bwd.consumer_regs)
    assert f"= {used} of the CTA's pool of {register_pool(bwd.threads)}" in text
    for tensor in bwd.tensors:
        assert f"    {tensor.role.value:<4} {tensor.path_text()}" in text


def test_a_forward_only_explain_is_unchanged():
    compiled = compile_file("tests/specs/sm90/fa3_q_ring.fa")
    assert "backward" not in explain_data(compiled)
    assert "Backward" not in explain_text(compiled)


# --- head_dim 256: the consumers split head_dim (sm90_bwd_split.cuh) ---------------------

HDIM256 = ROOT / "examples" / "fa3_hdim256.fa"


def hdim256_text(old: str | None = None, new: str = "") -> str:
    text = HDIM256.read_text()
    if old is not None:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


def test_head_dim_256_takes_the_split_tile():
    """The example's block, and `backward {}` alone: B_r 64, B_c 80, P and dS through SMEM by
    stmatrix, dQ added from registers (the defaults at head_dim 256)."""
    written = compile_file(HDIM256.relative_to(ROOT)).kernel.backward
    start = hdim256_text().index("  backward {")
    bare = compile_source(hdim256_text()[:start] + "  backward {}\n}\n", FILE).kernel.backward
    for bwd in (written, bare):
        assert (bwd.block_m, bwd.block_n, bwd.consumers, bwd.stages) == (64, 80, 2, 2)
        assert bwd.dq_red and not (bwd.deterministic or bwd.overlap or bwd.early_dv)
        paths = {t.role: t.path_text() for t in bwd.tensors}
        for role in (GradRole.P, GradRole.DS):
            assert paths[role] == "rf -stmatrix-> smem[cta] -wgmma-> rf"
        assert paths[GradRole.DQ] == "rf -red.add-> gmem"
        assert [t.role for t in bwd.tensors].index(GradRole.P) + 1 == [
            t.role for t in bwd.tensors
        ].index(GradRole.DS)
    b_c_64 = compile_source(hdim256_text("B_r = 64, B_c = 80 ", "B_r = 64, B_c = 64 "), FILE)
    assert b_c_64.kernel.backward.block_n == 64


def test_head_dim_256_smem_plan():
    """research/backward-hdim256.md's plan: K, V 40 KB each, Q 2 slots, dO a ring of its own
    of 1 slot, P and dS double-buffered, no dQ staging, 5 mbarrier pairs' worth: 223,032
    bytes with the base's slack (B_c 64: 198,456)."""
    bwd = compile_file(HDIM256.relative_to(ROOT)).kernel.backward
    plan = plan_smem(bwd, 256)
    assert [(b.name, b.offset, b.nbytes) for b in plan.buffers] == [
        ("K", 0, 40960),
        ("V", 40960, 40960),
        ("Q", 81920, 65536),
        ("dO", 147456, 32768),
        ("P", 180224, 20480),
        ("dS", 200704, 20480),
        ("dQ", 221184, 0),
        ("LSE", 221184, 512),
        ("D", 221696, 256),
        ("mbarriers", 221952, 56),
    ]
    assert plan.total + 1024 == 223032 <= sm90_backward.SMEM_LIMIT
    assert plan_smem(dataclasses.replace(bwd, block_n=64), 256).total + 1024 == 198456
    source = render_backward(*(lambda c: (c.kernel, c.target, "x.fa"))(compile_file(HDIM256)))[0]
    assert "static constexpr int kOffP = 180224;" in source.text
    assert '#include "fadsl/sm90_bwd_split.cuh"' in source.text
    assert "bwd_consumer_split<Cfg>(P, smem, block, warpgroup - 1);" in source.text


# (old line part, new line part, the line part and token the error sits at, message)
LOCATED_256 = [
    ("B_r = 64, B_c = 80 ", "B_r = 80, B_c = 80 ", "    tile       B_r = 80", "80", "B_r = 80: at head_dim 256 the backward steps through the queries 64 at a time, wgmma's M of S and dP (B_r = 64)"),
    ("B_r = 64, B_c = 80 ", "B_r = 64, B_c = 128 ", "B_c = 128 ", "128", "B_c = 128: at head_dim 256 each of the 2 consumer warpgroups computes S and dP for B_c / 2 keys and holds dK^T and dV^T of all B_c keys for its 128 columns (2 B_c fp32 registers a thread): B_c = 80 or 64 fit in 240 registers"),
    ("deterministic off", "deterministic on", "deterministic on", "deterministic", "deterministic on: its ordered dQ adds go through a staging buffer in SMEM, and at head_dim 256 dQ's staging does not fit beside K, V, Q, dO, P and dS (FlashAttention-3 has no deterministic mode there either); leave it off"),
    ("overlap    off", "overlap    on", "    overlap    on", "overlap", "overlap on: that consumer's order issues dQ before dV and dK; at head_dim 256 dQ^T is computed a panel at a time"),
    ("overlap    off", "early_dv on", "early_dv on", "early_dv", "early_dv on: at head_dim 256 dV^T is the first wgmma issued after P and dS are in SMEM already; leave it off"),
    ("overlap    off", "dq_writer on", "dq_writer on", "dq_writer", "dq_writer on: at head_dim 256 dQ is added from registers, with no staging for a writer warp to reduce-add; leave it off"),
    ("overlap    off", "dv_before_meeting on", "dv_before_meeting on", "dv_before_meeting", "dv_before_meeting on: at head_dim 256 dV^T reads every key's P from SMEM, so it cannot be issued before the warpgroups meet; it is the first wgmma issued after the meeting already; leave it off"),
    ("dQ:  rf -red.add-> gmem", "dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem", "dQ:  rf -st.shared", "dQ", "dQ must go rf -red.add-> gmem in the backward (each consumer thread adds its fp32 share into the accumulator (red.global.add.v4.f32): at head_dim 256 its staging does not fit in SMEM beside K, V, Q, dO, P and dS)"),
    ("dS:  rf -stmatrix->", "dS:  rf -st.shared->", "dS:  rf -st.shared", "st.shared", "'st.shared' does not move dS rf -> smem in the backward; 'stmatrix' does (dS: rf -stmatrix-> smem[cta] -wgmma-> rf)"),
    ("P:   rf -stmatrix-> smem[cta]", "P:   rf -stmatrix-> smem[warpgroup]", "P:   rf", "warpgroup", "P lives in smem[cta] in the backward: at head_dim 256 each consumer warpgroup computes P for its B_c / 2 keys and both read all of it"),
    ("stages     2                        # Q ring", "stages     3                        # Q ring", "stages     3", "3", "the backward's SMEM plan needs 255048 bytes at head_dim 256 (K 40960, V 40960, Q 98304, dO 32768, P 20480, dS 20480, dQ 0, LSE 768, D 256, mbarriers 72), over sm_90a's 232448; use fewer stages"),
]  # fmt: skip


@pytest.mark.parametrize(
    "old, new, line_part, token, message", LOCATED_256, ids=[c[4][:40] for c in LOCATED_256]
)
def test_each_head_dim_256_refusal_is_located(old, new, line_part, token, message):
    assert_error(hdim256_text(old, new), line_part, token, message)


def test_p_stays_in_registers_below_head_dim_256():
    text = variant(
        "    dS:  rf -st.shared",
        "    P:   rf -stmatrix-> smem[cta] -wgmma-> rf\n    dS:  rf -st.shared",
    )
    assert_error(text, "P:   rf -stmatrix", "P", "P stays in registers below head_dim 256")


def test_explain_shows_the_head_dim_256_block():
    data = explain_data(compile_file(HDIM256.relative_to(ROOT)))["backward"]
    producer, consumers = data["roles"]
    assert (consumers["keys_each"], consumers["head_dim_each"]) == (40, 128)
    (streamed,) = [k for k in producer["loads"] if k.startswith("per m-block")]
    assert "dO and D through one of 1" in streamed
    assert any(
        step.startswith("dQ^T = K^T dS^T by head_dim panels") for step in consumers["per_m_block"]
    )
    syncs = [s["sync"] for s in data["syncs"]]
    assert any(s.startswith("mbarrier.arrive do_empty[dO ring slot i % do_stages]") for s in syncs)
    text = explain_text(compile_file(HDIM256.relative_to(ROOT)))
    assert "each computes S and dP for 40 of the n-block's 80 keys" in text
    assert re.search(r"^  P +180224 +20480  ", text, re.M)


def test_dq_lag_is_read_and_refused_where_it_is_not_built():
    """`dq_lag on` (dQ one m-block behind: the consumers never meet) lowers to the IR and back
    in the examples; beside what its order is not built with it is refused at its key, with
    every reason named."""
    hopper = (ROOT / "examples" / "fa3_hopper.fa").read_text()
    bwd = compile_source(hopper, FILE).kernel.backward
    assert bwd.dq_lag and bwd.overlap and bwd.dq_red
    assert " dq_lag=on" in bwd.text() and read_backward_ir(bwd.text(), bwd.loc).dq_lag
    assert bwd.loc_of("dq_lag").line == where(hopper, "dq_lag     on")[0]
    lag = "    dq_lag     on\n"
    refusals = {
        "dQ staged": ("dQ:  rf -red.add-> gmem", "dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem"),
        "overlap off": ("    overlap    on", "    overlap    off"),
        "early_dv on": ("    early_dv   off", "    early_dv   on"),
        "deterministic on": ("    deterministic off", "    deterministic on"),
    }  # fmt: skip
    for reason, (old, new) in refusals.items():
        text = variant(old, new, hopper)
        found = errors(text)
        line, col = where(text, lag.rstrip("\n"), "dq_lag")
        assert any(
            (l, c) == (line, col) and m.startswith("dq_lag on") and reason in m for l, c, m in found
        ), (reason, found)
    # head_dim 64 at B_r 64 splits dQ by keys: no meeting to leave out
    hdim64 = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
    text = variant(
        "    tile       B_r = 128, B_c = 128 ", "    tile       B_r = 64, B_c = 128 ", hdim64
    )
    assert_error(text, "dq_lag     on", "dq_lag", "dQ split by keys")


def test_dq_first_is_read_and_needs_the_lag():
    """`dq_first on` (the lagged dQ issued before dV) lowers to the IR and back in the head_dim
    64 example, and without `dq_lag on` it is refused at its key."""
    hdim64 = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
    bwd = compile_source(hdim64, FILE).kernel.backward
    assert bwd.dq_lag and bwd.dq_first
    assert " dq_lag=on dq_first=on" in bwd.text()
    assert read_backward_ir(bwd.text(), bwd.loc).dq_first
    assert bwd.loc_of("dq_first").line == where(hdim64, "dq_first   on")[0]
    hopper = (ROOT / "examples" / "fa3_hopper.fa").read_text()
    assert not compile_source(hopper, FILE).kernel.backward.dq_first
    text = variant("    dq_lag     on\n", "    dq_lag     off\n", hdim64)
    assert_error(text, "dq_first   on", "dq_first", "it needs `dq_lag on`")


def test_dq_lag_waits_for_a_gpu_run_beside_modifiers():
    """Score and keep modifiers with `dq_lag on` are refused at the key until that order has
    run beside them on a GPU (the lagged consumer makes the same modifier calls)."""
    alibi = (ROOT / "examples" / "modifiers" / "alibi_causal.fa").read_text()
    text = variant("    overlap    on\n", "    overlap    on\n    dq_lag     on\n", alibi)
    assert_error(text, "dq_lag     on", "dq_lag", "score or keep modifiers")
