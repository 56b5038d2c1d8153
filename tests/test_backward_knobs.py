"""The backward block's knobs beside each other and the kernel's settings (fadsl/targets/
sm90/backward/knobs.py and validate.py): what each combination is refused with, located, and
the register and spill checks of the variants that fit (the block's grammar and checks:
tests/test_backward_spec.py)."""

from __future__ import annotations

import pytest

from conftest import ROOT
from fadsl.build.spill_check import check_registers, find_compiler
from register_usage import assert_no_spills, kernel_usages
from fadsl.codegen.render import render_backward
from fadsl.errors import SpecError
from fadsl.ir.backward import read_backward as read_backward_ir
from fadsl.targets.sm90.backward.report import backward_data, backward_sections
from fadsl.pipeline import compile_source
from block_text import unlagged
from test_backward_spec import (
    FILE,
    SM80,
    SOFTCAP,
    where,
    errors,
    assert_error,
    variant,
)

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
    seen = []
    hopper = (ROOT / "examples" / "fa3_hopper.fa").read_text()
    hopper = hopper.replace("    early_dv   off", "    early_dv   off\n    dv_before_meeting on")
    hdim64 = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
    # (the examples' dq_lag issues dV before dQ already, without a meeting)
    hopper, hdim64 = (
        t.replace("    dq_lag     on\n", "    dq_lag     off\n") for t in (hopper, hdim64)
    )
    hopper = hopper.replace("    late_v     on\n", "    late_v     off\n")  # (the lag's)
    # (dK and dV by TMA are the lagged consumer's: from registers without the lag)
    hopper = hopper.replace("rf -stmatrix-> smem[warpgroup] -tma-> gmem", "rf -st.global-> gmem")
    hdim64 = hdim64.replace("    dq_first   on\n", "    dq_first   off\n")
    hdim64 = hdim64.replace("    overlap    on\n", "    overlap    on\n    dv_before_meeting on\n")
    for text in (hopper, hdim64):
        compiled = compile_source(text, FILE)
        assert compiled.kernel.backward.dv_before_meeting
        seen += kernel_usages(compiled)
    backward = [(kernel, usage) for kernel, usage in seen if "bwd" in kernel]
    assert len(backward) >= 4, seen  # bf16 and fp16 of each
    assert_no_spills(backward)


def test_the_dq_writer_variants_fit_their_registers():
    """`dq_writer on`: the writer warps run after the producer warpgroup's setmaxnreg.dec, and
    no training variant spills (NVRTC 13.5, 2026-11-30); head_dim 64's deterministic writer
    in visit order with dS by st.shared needed setmaxnreg 32/232 before the writer took the
    lean path (at 24 it spilled 8 bytes; since 2026-12-02 it fits at 24). The refusal is
    checked on that block with the consumers held to 208 registers (552 bytes of spills)."""
    compiler, name = find_compiler()
    if compiler is None:
        pytest.skip(name)
    from training_specs import training_spec

    names = [f"{e}+{det}dq_writer-dqred" for e in ("fa3_causal", "fa3_hdim64_causal")
             for det in ("", "deterministic+")]  # fmt: skip
    names += ["fa3_hopper+deterministic+dq_writer-dqred+s2", "fa3_hdim64+dq_writer-dqred"]
    names += ["fa3_hdim64+deterministic+dq_writer-dqred+p32"]
    # beside `dq_lag on` (fits at 24 / 240, NVRTC 13.5, 2026-12-02)
    names += ["fa3_hdim64+deterministic+dq_writer-dqred+dq_lag"]
    names += ["fa3_causal+deterministic+dq_writer-dqred+dq_lag"]
    names += ["fa3_hdim64+deterministic+dq_writer-dqred-ds_stmatrix"]  # (24 registers: fits)
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
    fits = training_spec("fa3_hdim64+deterministic+dq_writer-dqred-ds_stmatrix")
    held = "registers  producer = 24, consumers = 208"
    spilling = fits.replace("registers  producer = 24, consumers = 240", held)
    assert spilling != fits
    with pytest.raises(SpecError, match="the backward's kernels spill"):
        check_registers(compile_source(spilling, FILE), compiler, name)


def test_a_bad_target_line_still_reports_the_blocks_own_mistakes():
    text = variant("target     sm_90a", "target     sm_91")
    text = variant("deterministic off", "stage 2", text)
    messages = [m for _, _, m in errors(text)]
    assert any(m.startswith("unknown target 'sm_91'") for m in messages)
    assert any(m.startswith("unknown key 'stage' in the backward block") for m in messages)


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


def test_dq_lag_builds_with_the_dq_writer_in_either_mode():
    """`dq_lag on` beside `dq_writer on` (the lagged dQ staged and handed to the writer
    warps, which order the deterministic adds): admitted with and without `deterministic on`,
    the lagged consumer in the kernel; without the writer, a staged dQ and the deterministic
    order stay refused at the key."""
    hopper = (ROOT / "examples" / "fa3_hopper.fa").read_text()
    staged = "dQ:  rf -st.shared-> smem[warpgroup] -reduce.add-> gmem"
    writer = variant("dQ:  rf -red.add-> gmem", staged, hopper)
    writer = variant("    dq_lag     on\n", "    dq_lag     on\n    dq_writer  on\n", writer)
    for mode in ("off", "on"):
        text = variant("    deterministic off", f"    deterministic {mode}", writer)
        text = variant("    stages     3", "    stages     2", text)
        compiled = compile_source(text, FILE)
        bwd = compiled.kernel.backward
        assert bwd.dq_lag and bwd.dq_writer and not bwd.dq_red
        assert bwd.deterministic == (mode == "on")
        main, *_ = render_backward(compiled.kernel, compiled.target, FILE)
        assert "kDqLag = true" in main.text and "kDqWriter = true" in main.text
    alone = variant("    deterministic off", "    deterministic on", hopper)
    alone = variant("dQ:  rf -red.add-> gmem", staged, alone)
    messages = [m for _, _, m in errors(alone) if m.startswith("dq_lag on")]
    assert messages and "deterministic on without dq_writer on" in messages[0]
    assert "dQ staged and reduce-added by the consumers" in messages[0]


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


@pytest.mark.parametrize("example", ["alibi_causal", "document_causal", "prefix_lm"])
def test_dq_lag_builds_beside_modifiers(example):
    """Score and keep modifiers with `dq_lag on` (the lagged consumer makes the overlapped
    one's modifier calls, bwd_probs and bwd_learn): the modifier examples' blocks say it, and
    it reaches the Cfg with the modifiers; off (dK, dV from registers) the Cfg has it off."""
    text = (ROOT / "examples" / "modifiers" / f"{example}.fa").read_text()
    assert "    dq_lag     on\n" in text
    for lag in ("on", "off"):
        found = text if lag == "on" else unlagged(text)  # (what only the lagged block builds)
        compiled = compile_source(found, FILE)
        assert compiled.kernel.backward.dq_lag == (lag == "on")
        source, *_ = render_backward(compiled.kernel, compiled.target, FILE)
        cfg = source.text.split("struct Cfg", 1)[1]
        assert ("static constexpr bool kDqLag = true;" in cfg) == (lag == "on")
        assert "using Modifiers" in cfg
