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

from conftest import ROOT
from fadsl.cli import main
from fadsl.errors import Loc, SpecError
from fadsl.ir import Backward, GradRole, Instr, Level, Role, Scope
from fadsl.ir.backward import read_backward as read_backward_ir
from fadsl.ir.printer import format_kernel
from ir_reader import IRSyntaxError, read_kernel
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
        "dkv_tma": False,
        "prefetch_kv": False,
        "dv_out_first": False,
        "peel_dead": False,
        "late_v": False,
        "dq_chains": 1,
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
    ("deterministic off", "stage 3", "stage 3", "stage", "unknown key 'stage' in the backward block; it takes 'tile', 'warpgroups', 'registers', 'stages', 'deterministic', 'overlap', 'early_dv', 'dv_before_meeting', 'longest_first', 'dq_writer', 'dq_lag', 'dq_first', 'fused_convert', 'prefetch_kv', 'dv_out_first', 'peel_dead', 'late_v', 'scheduler' and 'dq_chains' (did you mean 'stages'?)"),
    ("deterministic off", "mask causal", "mask causal", "mask", "'mask' is a setting of the kernel, not of its backward block"),
    ("deterministic off", "stages 3", "stages 3", "stages", "duplicate key 'stages' in the backward block (first set at line"),
    ("dV:  rf -st.global-> gmem", "dW:  rf -st.global-> gmem", "dW:", "dW", "unknown tensor 'dW' in the backward block; it moves Q, K, V, dO, LSE, D, P, dS, dQ, dK and dV"),
    ("LSE: gmem -bulk->", "LSE: gmem -tma->", "LSE: gmem -tma->", "tma", "'tma' does not move LSE gmem -> smem in the backward; 'bulk' does (LSE: gmem -bulk-> smem[cta] -ld.shared-> rf)"),
    ("D:   gmem -bulk-> smem[cta] -ld.shared->", "D:   gmem -bulk-> smem[cta] -wgmma->", "D:   gmem", "wgmma", "'wgmma' does not move D smem -> rf in the backward; 'ld.shared' does"),
    ("dQ:  rf -st.shared-> smem[warpgroup]", "dQ:  rf -st.shared-> smem[cta]", "dQ:  rf", "cta", "dQ lives in smem[warpgroup] in the backward: each consumer warpgroup stages its share in fp32"),
    ("dS:  rf -st.shared-> smem[cta]", "dS:  rf -st.shared-> smem[warpgroup]", "dS:  rf", "warpgroup", "dS lives in smem[cta] in the backward"),
    ("dK:  rf -st.global-> gmem", "dK:  rf -st.shared-> smem[warpgroup] -tma-> gmem", "dK:  rf -st.shared", "st.shared", "'st.shared' does not move dK rf -> smem in the backward; 'stmatrix' does (dK: rf -stmatrix-> smem[warpgroup] -tma-> gmem)"),
    ("dK:  rf -st.global-> gmem", "dK:  rf -st.global-> smem[warpgroup] -wgmma-> rf", "dK:  rf", "dK", "dK must go rf -st.global-> gmem in the backward (each consumer warpgroup stores its rows once, after the last m-block), or rf -stmatrix-> smem[warpgroup] -tma-> gmem"),
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
