"""Gradients of a score's learnable inputs (issue 41), on the CPU: the score's derivative by
each read of an input against torch autograd, the inputs that cannot learn (and why,
located), the backward's learnable variant (its source, its flags, the spec's own sources
untouched, NVRTC builds without spills) and a float64 model of what the kernel adds
(dS' = P (dP - D) times the derivative, at the read's index) against autograd through an
explicit attention. The runtime: tests/test_modifiers_learnable_runtime.py; the GPU:
tests/test_gpu_modifiers_learnable.py."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import ROOT
from fadsl.build.spill_check import find_compiler
from fadsl.codegen.render import render_backward
from fadsl.passes.modifiers.input_grads import learnable
from fadsl.pipeline import compile_source
from fadsl.runtime.learnable import learn_variant
from modifier_eval import evaluate
from test_modifiers_backward import cfg_of, with_lines
from test_modifiers_front import modifiers

MODIFIERS = ROOT / "examples" / "modifiers"
ALIBI = (MODIFIERS / "alibi_causal.fa").read_text()
PREFIX_ALIBI = (MODIFIERS / "prefix_lm_alibi.fa").read_text()
T5 = (MODIFIERS / "t5_bias_causal.fa").read_text()


# --- the derivative by an input's read, as torch autograd's -----------------------------


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize(
    "lines, read, torch_fn",
    [
        # (lines, the read, the score in torch of (s, w, kv_idx - q_idx) with w the read)
        (
            "input w : f32[heads]\nscore s + w[h] * (kv_idx - q_idx)",
            "w[h]",
            lambda s, w, d: s + w * d,
        ),
        (
            "input w : f32[heads]\nscore tanh(s + w[h]) * 3",
            "w[h]",
            lambda s, w, d: torch.tanh(s + w) * 3,
        ),
        ("input w : f32[heads]\nscore s * w[h]", "w[h]", lambda s, w, d: s * w),
        ("input w : f32[heads]\nscore s + abs(w[h])", "w[h]", lambda s, w, d: s + w.abs()),
        ("input w : f32[heads]\nscore max(s, w[h])", "w[h]", lambda s, w, d: torch.maximum(s, w)),
        (
            "input w : f32[heads]\nscore where(w[h] > 0, s + w[h], s - 2 * w[h] * w[h])",
            "w[h]",
            lambda s, w, d: torch.where(w > 0, s + w, s - 2 * w * w),
        ),
        (
            "input w : f32[heads]\nscore s + exp(min(w[h], 80)) / (1 + abs(kv_idx - q_idx))",
            "w[h]",
            lambda s, w, d: s + torch.exp(torch.clamp(w, max=80)) / (1 + d.abs()),
        ),
    ],
)
def test_the_derivative_by_an_input_is_torchs(lines, read, torch_fn):
    m = modifiers(lines)
    (grad,) = [g for g in m.input_grads if f"{g.input}[{g.index_text()}]" == read]
    for s_value, w_value, q, kv in [(0.3, -0.7, 5, 2), (-1.0, 0.0, 0, 0), (2.0, 1.25, 3, 9)]:
        s, w = _t(s_value), _t(w_value).requires_grad_()
        (want,) = torch.autograd.grad(torch_fn(s, w, _t(kv - q)), w)
        env = {"s": s_value, "b": 0, "h": 0, "q_idx": q, "kv_idx": kv}
        got = evaluate(grad.derivative, env, {"w": lambda h: w_value})
        assert math.isclose(got, want.item(), abs_tol=1e-12), (lines, got, want.item())


def test_two_reads_of_one_input_are_two_variables():
    """w[h, q_idx % 4] * w[h, kv_idx % 4]: each read's derivative is the other's value (the
    kernel adds both, each at its own index: the chain rule's sum where they coincide)."""
    m = modifiers("input w : f32[heads, 4]\nscore s + w[h, q_idx % 4] * w[h, kv_idx % 4]")
    by_index = {g.index_text(): g for g in m.input_grads}
    assert set(by_index) == {"h, q_idx % 4", "h, kv_idx % 4"}
    table = {(0, 1): 0.5, (0, 3): -2.0}
    env = {"s": 0.0, "b": 0, "h": 0, "q_idx": 5, "kv_idx": 7}
    reads = {"w": lambda h, i: table[h, i]}
    assert evaluate(by_index["h, q_idx % 4"].derivative, env, reads) == -2.0
    assert evaluate(by_index["h, kv_idx % 4"].derivative, env, reads) == 0.5


# --- which inputs learn -------------------------------------------------------------------


def test_the_examples_float_inputs_learn():
    for text, name in ((ALIBI, "slopes"), (PREFIX_ALIBI, "slopes"), (T5, "bias")):
        m = compile_source(text, "x.fa").kernel.config.modifiers
        assert learnable(m, name).ok
    m = compile_source(PREFIX_ALIBI, "x.fa").kernel.config.modifiers
    assert "integer has no gradient" in learnable(m, "prefix").why


@pytest.mark.parametrize(
    "lines, why",
    [
        (
            "input t : f32[heads]\nkeep kv_idx - q_idx < t[h]",
            "is read only by keep, and a mask has no gradient",
        ),
        ("input w : f32[heads]\nscore s + floor(w[h])", "rounds input 'w' down"),
        ("input w : f32[heads]\nscore s * w[h]", "reads s, which the backward no longer holds"),
        (
            "input w : f32[heads]\ninput t : f32[heads, 8]\nscore s + t[h, clamp(floor(w[h]), 0, 7)]",
            "reads input 'w' in its index, which has no derivative",
        ),
    ],
)
def test_an_input_that_cannot_learn_says_why_at_its_token(lines, why):
    m = modifiers(lines)
    found = learnable(m, "t" if "keep" in lines else "w")
    assert not found.ok and why in found.why and found.loc is not None


# --- the backward's learnable variant -----------------------------------------------------


def variant(text: str, learn: tuple[str, ...], name: str = "spec.fa"):
    """The runtime's learnable variant (learn_variant: the target's learn_lines too) and its
    backward sources."""
    compiled = learn_variant(compile_source(text, name), learn)
    return compiled, render_backward(compiled.kernel, compiled.target, compiled.file)


def test_alibi_sums_its_slope_per_warp_and_t5_scatters_its_table():
    _, (alibi, _) = variant(ALIBI, ("slopes",))
    cfg = cfg_of(alibi.text)
    assert "kLearn = true" in cfg
    assert "static constexpr int kLearnUniform = 1;" in alibi.text
    assert "static constexpr int kLearnScatter = 0;" in alibi.text
    assert "static constexpr bool kLearnClamped = false;" in alibi.text  # kv_idx - q_idx: finite
    assert "const float f = 1.0f * static_cast<float>(kv_idx - q_idx);" in alibi.text
    assert "sums[0] += g * f;" in alibi.text
    assert "bwd_learn_add_warp(P.input_grads + (h), sums[0], lane);" in alibi.text
    _, (t5, _) = variant(T5, ("bias",))
    assert "static constexpr int kLearnUniform = 0;" in t5.text
    assert "static constexpr int kLearnScatter = 1;" in t5.text
    assert "static constexpr bool kLearnClamped = true;" in t5.text  # its index reads q_idx, kv_idx
    assert "const int at = (h) * 32 + " in t5.text
    assert "if (g != 0.f) atomicAdd(P.input_grads + at, g * f);" in t5.text


def test_the_variant_corrects_d_rounding_per_row():
    """D's correction (fadsl/sm90_bwd_learn.cuh): per query row the sum of dS' and each
    read's W, into P.learn_rows, then the `_learn` kernel's -eps W at the row's reference
    element: summed over a CTA's rows for a uniform read, row by row for a scattered one."""
    _, (alibi, _) = variant(ALIBI, ("slopes",))
    assert "static constexpr int kLearnRow = 1 + kLearnUniform + kLearnScatter;" in alibi.text
    assert "row[1] += p * f;" in alibi.text  # W: every score of a uniform read
    assert "learn_refs" not in alibi.text
    assert "if (fix[1] != 0.f) atomicAdd(P.input_grads + (h), fix[1]);  // slopes[h]" in alibi.text
    assert "alibi_causal_bwd_bf16_learn(const __grid_constant__ BwdParamsSm90 P) {\n" in alibi.text
    assert "  bwd_learn_fix<Cfg>(P);" in alibi.text
    _, (t5, _) = variant(T5, ("bias",))
    assert "static __device__ __forceinline__ void learn_refs(" in t5.text
    assert "ref[0] = (h) * 32 + " in t5.text
    assert "if (at == ref[0]) row[1] += p * f;" in t5.text  # W: the scores at the reference
    assert "if (fix[1] != 0.f) atomicAdd(P.input_grads + ((h) * 32 + " in t5.text
    header = (ROOT / "emit" / "sm90" / "include" / "fadsl" / "sm90_bwd_learn.cuh").read_text()
    for piece in ("bwd_learn_add_rows", "red_add_v4_f32(at, row[0][0], row[0][1]", "bwd_learn_ref"):
        assert piece in header


def test_a_b_r_80_block_learns_at_b_r_64_and_its_own_stays():
    """prefix_lm_alibi's block is B_r 80 (dQ transposed): its learnable variant spilled there
    (learn.py's learn_backward_lines), so the variant is the spec with B_r 64, through the
    pipeline again; the spec's own backward keeps B_r 80."""
    own = compile_source(PREFIX_ALIBI, "prefix_lm_alibi.fa")
    compiled, (source, _) = variant(PREFIX_ALIBI, ("slopes",), "prefix_lm_alibi.fa")
    assert own.kernel.backward.block_m == 80 and compiled.kernel.backward.block_m == 64
    assert compiled.kernel.backward.block_n == own.kernel.backward.block_n == 128
    assert "B_r = 64 queries per m-block" in source.text and "kLearn = true" in source.text
    assert compiled.kernel.config.name == own.kernel.config.name
    for text, learn in ((ALIBI, ("slopes",)), (T5, ("bias",))):  # B_r 64: the spec's own block
        spec = compile_source(text, "x.fa")
        assert learn_variant(spec, learn).kernel.backward is spec.kernel.backward


def test_two_learnable_inputs_share_the_buffer_in_declared_order():
    text = with_lines(
        ALIBI,
        "  input      slopes : f32[heads]\n  input      bias : f32[heads, 4]\n"
        "  score      s + slopes[h] * (kv_idx - q_idx) + bias[h, kv_idx % 4]\n",
    )
    _, (source, _) = variant(text, ("slopes", "bias"))
    assert "//   slopes : f32[heads]: from element 0" in source.text
    assert "//   bias : f32[heads, 4]: from element P.heads_q" in source.text
    assert "const int at = P.heads_q + (h) * 4 + " in source.text
    # one row float each: the sum of dS', slopes' W, bias's W
    assert "static constexpr int kLearnUniform = 1;" in source.text
    assert "static constexpr int kLearnScatter = 1;" in source.text
    assert "if (at == ref[0]) row[2] += p * f;" in source.text
    assert "if (fix[2] != 0.f) atomicAdd(P.input_grads + (P.heads_q + (h) * 4 + " in source.text


@pytest.mark.parametrize("path", sorted(MODIFIERS.glob("*.fa")), ids=lambda p: p.stem)
def test_the_specs_own_backward_has_no_learnable_code(path):
    """kLearn is the runtime's variant only: the spec's own backward (its golden source under
    generated/, tests/test_codegen.py) is what it was, byte for byte."""
    compiled = compile_source(path.read_text(), str(path.relative_to(ROOT)))
    for source in render_backward(compiled.kernel, compiled.target, compiled.file):
        assert "kLearn" not in source.text and "input_grads" not in source.text
        assert (ROOT / "generated" / source.filename).read_text() == source.text


LEARNABLE = {
    "alibi_causal": (ALIBI, ("slopes",)),
    "prefix_lm_alibi": (PREFIX_ALIBI, ("slopes",)),
    "t5_bias_causal": (T5, ("bias",)),
}


@pytest.mark.nvcc
@pytest.mark.parametrize("name", LEARNABLE)
def test_the_learnable_variant_builds_without_spills(name):
    """Each example's variant as the runtime builds it (learn_variant), both dtypes: no
    spill or C7512 in any of its kernels (ptxas reports each; the usage is their largest),
    the `_learn` kernel among them."""
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(why)
    text, learn = LEARNABLE[name]
    _, sources = variant(text, learn, f"{name}.fa")
    assert len(sources) == 2  # bf16 and fp16
    for source in sources:
        assert f"{source.kernel_name}_learn(" in source.text
        usage = compiler(source, "sm_90a")
        assert not (usage.spills or usage.wgmma_serialized), (source.filename, usage)


# --- what the kernel adds, in float64, against autograd ---------------------------------


def t5_bucket(i, j):
    """examples/modifiers/t5_bias_causal.fa's index, in torch (float32 as the kernel)."""
    n = i - j
    big = 16 + torch.floor(torch.log(torch.clamp(n, min=16).float() / 16.0) / math.log(8.0) * 16.0)
    return torch.clamp(torch.where(n < 16, n, big.long()), 0, 31)


def test_the_kernels_sum_is_autograds_gradient_of_the_table():
    """The kernel's formula, score by score: dS' = P (dP - D) with D = rowsum(dO O) - dLSE,
    added at the index the IR's read gives, times the IR's derivative (here 1.0). Causal,
    GQA 2:1, a ragged shape, float64."""
    m = compile_source(T5, "t5.fa").kernel.config.modifiers
    (grad,) = m.input_grads
    gen = torch.Generator().manual_seed(3)
    b, sq, sk, hq, hkv, d = 2, 9, 21, 4, 2, 8
    q = torch.randn(b, hq, sq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, hkv, sk, d, generator=gen, dtype=torch.float64).repeat_interleave(2, 1)
    v = torch.randn(b, hkv, sk, d, generator=gen, dtype=torch.float64).repeat_interleave(2, 1)
    dout = torch.randn(b, hq, sq, d, generator=gen, dtype=torch.float64)
    dlse = torch.randn(b, hq, sq, generator=gen, dtype=torch.float64)
    table = torch.randn(hq, 32, generator=gen, dtype=torch.float64).requires_grad_()
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    scores = q @ k.transpose(-1, -2) * 0.3 + table[:, t5_bucket(i, j)]
    scores = scores.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    p = torch.softmax(scores, -1)
    out = p @ v
    ((out * dout).sum() + (lse * dlse).sum()).backward()

    p = p.detach()
    d_row = (dout * out.detach()).sum(-1) - dlse
    ds = p * (dout @ v.transpose(-1, -2) - d_row[..., None])
    model = torch.zeros(hq, 32, dtype=torch.float64)
    for h in range(hq):
        for qi in range(sq):
            for kj in range(sk):
                env = {"s": 0.0, "b": 0, "h": h, "q_idx": qi, "kv_idx": kj}
                row, col = (evaluate(x, env) for x in grad.indices)
                model[row, col] += ds[:, h, qi, kj].sum() * evaluate(grad.derivative, env)
    assert torch.allclose(model, table.grad, atol=1e-12, rtol=1e-10)
