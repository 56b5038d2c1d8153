"""The backward of score and mask modifiers (issue 41, step 4), on the CPU: what the backward's
source holds (the SpecModifiers struct, the Cfg's flags), a softcap written as a score giving
the built-in softcap's backward, the derivative at kinks and ties as torch autograd's, the
sync plan of every modifier example's backward proven (the modifiers change no sync), and the
kernels built by NVRTC without spills or serialized wgmma. Errors:
tests/test_modifiers_errors.py; the runtime: tests/test_modifiers_backward_runtime.py; the
GPU: tests/test_gpu_modifiers_backward.py."""

from __future__ import annotations

import math
import re

import pytest
import torch

from block_text import deterministic as deterministic_block, unlagged
from conftest import ROOT
from fadsl.build.spill_check import check_registers, find_compiler
from register_usage import assert_no_spills, kernel_usages
from fadsl.codegen.render import render_backward
from fadsl.errors import SpecError
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward.program import Params
from fadsl.targets.sm90.backward.verify import parameter_space, prove
from modifier_eval import evaluate
from test_backward_spec import where
from test_modifiers_front import modifiers

MODIFIERS = ROOT / "examples" / "modifiers"
EXAMPLES = sorted(MODIFIERS.glob("*.fa"))
SOFTCAP = ROOT / "tests" / "specs" / "sm90" / "backward" / "fa3_backward_softcap.fa"


def backward_source(text: str, name: str = "spec.fa") -> str:
    compiled = compile_source(text, name)
    return render_backward(compiled.kernel, compiled.target, compiled.file)[0].text


def cfg_of(source: str) -> str:
    return source.split("struct Cfg", 1)[1].split("};", 1)[0]


def has_line(text: str, keyword: str) -> bool:
    return re.search(rf"^\s*{keyword}\s", text, re.MULTILINE) is not None


def with_lines(text: str, lines: str) -> str:
    """``text`` with its modifier lines replaced by ``lines`` (after the mask line)."""
    text = re.sub(r"^  (input|score|keep) .*\n", "", text, flags=re.MULTILINE)
    return re.sub(r"^(  mask .*\n)", lambda m: m[1] + lines, text, count=1, flags=re.MULTILINE)


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_each_example_has_a_backward_with_its_modifiers(spec):
    text = spec.read_text()
    source = backward_source(text, spec.name)
    cfg = cfg_of(source)
    assert "using Modifiers = SpecModifiers;" in cfg
    assert ("kScore = true" in cfg) == has_line(text, "score")
    assert ("kKeep = true" in cfg) == has_line(text, "keep")
    assert "kScoreGrad" not in cfg  # ALiBi's derivative is the constant 1
    assert "score and mask modifiers (SpecModifiers)" in source.split("\n")[3]


def test_a_score_with_a_derivative_multiplies_ds_by_it():
    text = with_lines(
        (MODIFIERS / "alibi_causal.fa").read_text(), "  score      20 * tanh(s / 40)\n"
    )
    source = backward_source(text)
    assert "static constexpr bool kScoreGrad = true;" in cfg_of(source)
    assert "// d score / d s = 0.5 * (1.0 - tanh(s / 40) * tanh(s / 40))" in source
    assert "static __device__ __forceinline__ float dscore(" in source


def test_a_softcap_written_as_a_score_is_the_builtin_softcaps_backward():
    builtin = SOFTCAP.read_text()
    written = builtin.replace("  softcap    50\n", "  score      50 * tanh(s / 50)\n")
    assert written != builtin
    strip = lambda s: "\n".join(s.split("\n")[1:])  # noqa: E731 (the spec hash line)
    assert strip(backward_source(written, SOFTCAP.name)) == strip(
        backward_source(builtin, SOFTCAP.name)
    )


@pytest.mark.parametrize("spec", EXAMPLES, ids=[p.stem for p in EXAMPLES])
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_sync_plan_of_each_example_is_proven(spec, deterministic):
    """The modifiers change what a consumer computes between its syncs, never a sync: the
    plan is the one of the block's parameters, which the proof covers (with `deterministic
    on` too: keep then trims no m-block, every n-block of an m-block's range adds)."""
    text = spec.read_text()
    if deterministic:
        text = deterministic_block(text)
    compiled = compile_source(text, spec.name)
    bwd = compiled.kernel.backward
    assert bwd.deterministic == deterministic
    params = Params.of(bwd, compiled.kernel.config.head_dim)
    assert params in parameter_space()
    assert prove(params).params == params
    if deterministic and has_line(
        text, "keep"
    ):  # keep_trim is compiled out (bwd_keep_trim's if constexpr)
        assert "kDeterministic" not in cfg_of(backward_source(text, spec.name))


# --- the derivative at kinks and ties, as torch autograd's -----------------------------


@pytest.mark.parametrize(
    "score, torch_fn",
    [
        ("abs(s)", lambda s: s.abs()),
        ("min(s, 0.5)", lambda s: torch.minimum(s, torch.tensor(0.5, dtype=s.dtype))),
        ("max(s, 2 * s - 0.5)", lambda s: torch.maximum(s, 2 * s - 0.5)),
        ("min(2 * s, s + 0.5)", lambda s: torch.minimum(2 * s, s + 0.5)),
        ("clamp(s, -1, 0.5)", lambda s: torch.clamp(s, -1, 0.5)),
        ("clamp(s, s - 1, 2 * s)", lambda s: torch.clamp(s, s - 1, 2 * s)),
        ("where(s > 0.5, s * s, -s)", lambda s: torch.where(s > 0.5, s * s, -s)),
    ],
)
def test_the_derivative_at_kinks_and_ties_is_torchs(score, torch_fn):
    m = modifiers(f"score {score}")
    for value in (-1.0, -0.25, 0.0, 0.5, 1.0, 2.5):
        s = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        (want,) = torch.autograd.grad(torch_fn(s), s)
        env = {"s": value, "b": 0, "h": 0, "q_idx": 0, "kv_idx": 0}
        got = evaluate(m.derivative, env, {})
        assert math.isclose(got, want.item(), abs_tol=1e-12), (score, value, got, want.item())


# --- the kernels build: no spills, no serialized wgmma --------------------------------


VARYING = {
    "tanh_score": "20 * tanh(s / 40)",
    "leaky_score": "where(s > 0, s, 0.5 * s)",
    "poly_score": "s + 0.01 * s * s",
}


def variants() -> dict[str, str]:
    """The examples, and scores with a derivative other than 1 (kScoreGrad: constant, and
    varying score by score), a keep with `deterministic on` and causal and window masks
    written as keep, each at an example's block."""
    found = {p.stem: p.read_text() for p in EXAMPLES}
    alibi = found["alibi_causal"]
    prefix = found["prefix_lm"]
    found["scaled_score"] = with_lines(alibi, "  score      0.5 * s\n")  # kScoreGrad, 0.5
    # derivatives that vary score by score: 1 - tanh^2, a leaky where's, a polynomial's, at
    # alibi's block with dQ added in its own m-block (with dq_lag on they spill: below)
    for name, score in VARYING.items():
        found[name] = with_lines(unlagged(alibi), f"  score      {score}\n")
    found["prefix_deterministic"] = deterministic_block(prefix)
    for name in ("modifiers_causal", "modifiers_window"):
        text = (ROOT / "tests" / "specs" / "sm90" / f"{name}.fa").read_text()
        block = alibi[alibi.index("  # The backward pass") :]
        found[name] = text.rstrip()[:-1].rstrip() + "\n\n" + block
    return found


VARIANTS = variants()


@pytest.mark.nvcc
@pytest.mark.parametrize("name", VARIANTS)
def test_the_backward_builds_without_spills(name):
    seen = kernel_usages(compile_source(VARIANTS[name], f"{name}.fa"))
    backward = [(kernel, usage) for kernel, usage in seen if "_bwd_" in kernel]
    assert len(backward) >= 2, seen  # bf16 and fp16
    assert_no_spills(backward)


@pytest.mark.nvcc
def test_a_spilling_backward_is_refused_at_the_block():
    """A score whose derivative varies beside keep's predicate at B_r 80 (prefix-LM's former
    block) spills (NVRTC 13.5, 2026-11-30: some 500 bytes): the spill check refuses it at the
    backward block, which at B_r 64 (VARIANTS' tanh_score) builds."""
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(why)
    b_r_80 = unlagged(VARIANTS["prefix_lm"]).replace("B_r = 64, B_c = 128", "B_r = 80, B_c = 128")
    text = b_r_80.replace(
        "  keep       kv_idx", "  score      20 * tanh(s / 40)\n  keep       kv_idx"
    )
    assert compile_source(text, "tanh.fa").kernel.backward.block_m == 80
    with pytest.raises(SpecError) as err:
        check_registers(compile_source(text, "tanh.fa"), compiler, why)
    (d,) = err.value.diagnostics
    assert (
        "the backward's kernels spill" in d.message
        and d.loc.line == text.count("\n", 0, text.index("  backward {")) + 1
    )


@pytest.mark.nvcc
def test_a_varying_derivative_at_the_lagged_block_is_told_to_drop_the_lag():
    """tanh's derivative at alibi's block with `dq_lag on` spills (NVRTC 13.5, 2026-12-02):
    the refusal names dq_lag first, at the block, and the same score builds without it
    (test_the_backward_builds_without_spills)."""
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(why)
    alibi = (ROOT / "examples" / "modifiers" / "alibi_causal.fa").read_text()
    text = with_lines(alibi, f"  score      {VARYING['tanh_score']}\n")
    with pytest.raises(SpecError) as raised:
        check_registers(compile_source(text, "tanh.fa"), compiler, why)
    (diagnostic,) = raised.value.diagnostics
    assert "the backward's kernels spill" in diagnostic.message
    assert "; turn dq_lag off, raise the consumers' registers" in diagnostic.message
    assert (diagnostic.loc.line, diagnostic.loc.col) == where(text, "  backward {", "backward")
