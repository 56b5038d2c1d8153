"""Score and mask modifiers (issue 41) in the sm_90a kernel: the C++ an expression becomes
(fadsl/targets/cuda_expr.py), the template's slots, the built-in softcap written as an
expression compiled as the built-in (the same CUDA, the same SASS), and every modifier
example built by NVRTC without spills."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from fadsl.build.nvrtc import nvrtc_available
from fadsl.build.resources import can_compile, ptxas_usage
from fadsl.codegen.render import render
from fadsl.ir.expr import Dim, InputDecl, ExprType, VarKind
from fadsl.pipeline import compile_file, front_end
from fadsl.targets.cuda_expr import CudaExpr
from test_modifiers_front import modifiers, spec

MODIFIER_EXAMPLES = sorted((ROOT / "examples" / "modifiers").glob("*.fa"))
SOFTCAP = ROOT / "tests" / "specs" / "sm90" / "fa3_softcap.fa"
SOFTCAP_AS_SCORE = ROOT / "tests" / "specs" / "sm90" / "modifiers_softcap.fa"


def cuda(score: str, inputs: str = "") -> str:
    m = modifiers(f"{inputs}\n  score {score}" if inputs else f"score {score}")
    names = {k: k.value for k in VarKind}
    sizes = {d: f"size_{d.value}" for d in Dim}
    return CudaExpr(names, sizes, m.inputs, lambda i: f"in{i}").render(m.score, ExprType.F32)


@pytest.mark.parametrize(
    "score, code",
    [
        ("s + 1", "s + 1.f"),
        ("s * (kv_idx - q_idx)", "s * static_cast<float>(kv_idx - q_idx)"),
        ("s - (1 - s)", "s - (1.f - s)"),
        ("(s - 1) - 2", "s - 1.f - 2.f"),
        ("s / 2.5 / (3 + kv_idx)", "s / 2.5f / static_cast<float>(3 + kv_idx)"),
        ("-(-s)", "-(-s)"),
        ("s - -2", "s - -2.f"),
        ("where(q_idx < 3 and not kv_idx == 2, s, 0.5)", "q_idx < 3 && !(kv_idx == 2) ? s : 0.5f"),
        ("where(q_idx // 4 == kv_idx % 3, s, 0)",
         "fadsl::modifiers::floordiv(q_idx, 4) == fadsl::modifiers::floormod(kv_idx, 3) ? s : 0.f"),
        ("clamp(s, -2, 3)", "fminf(fmaxf(s, -2.f), 3.f)"),
        ("max(q_idx, kv_idx) + abs(s) + abs(h - 2)",
         "static_cast<float>(fadsl::modifiers::imax(q_idx, kv_idx)) + fabsf(s) + static_cast<float>(fadsl::modifiers::iabs(h - 2))"),
        ("tanh(s) + exp(-abs(s)) + log(1 + abs(s)) + floor(s)",
         "fadsl::modifiers::tanh(s) + expf(-fabsf(s)) + logf(1.f + fabsf(s)) + static_cast<float>(__float2int_rd(s))"),
        ("seqlen_k - seqlen_q + s", "static_cast<float>(size_seqlen_k - size_seqlen_q) + s"),
        ("1e-3 * s + 30.", "1e-3f * s + 30.f"),
    ],
)  # fmt: skip
def test_an_expression_becomes_the_cpp_it_means(score, code):
    assert cuda(score) == code


def test_loads_are_row_major_over_the_declared_dims():
    code = cuda(
        "s + t[h, kv_idx, 3] + u[b]", "input t : f32[heads, seqlen_k, 4]\n  input u : i32[batch]"
    )
    assert code == (
        "s + fadsl::modifiers::load<float>(in0, ((h) * size_seqlen_k + kv_idx) * 4 + 3) + "
        "static_cast<float>(fadsl::modifiers::load<int>(in1, b))"
    )


def sources(path):
    c = compile_file(path.relative_to(ROOT))
    return render(c.kernel, c.target, c.file)


def test_alibi_is_one_fma_a_score_in_natural_units():
    bf16, _ = sources(ROOT / "examples" / "modifiers" / "alibi_causal.fa")
    text = bf16.text
    assert "float v0;  // slopes[h]" in text
    assert "return {fadsl::modifiers::load<float>(P.inputs[0], h)};" in text
    assert "return s + u.v0 * static_cast<float>(kv_idx - q_idx);" in text
    # the softmax takes the modified scores in natural units
    assert "const float scale_log2 = 1.4426950408889634f;" in text
    assert "P.base.softmax_scale * 1.4426950408889634f" not in text
    # where softcap is applied: after S, before the mask, in the first block and the loop;
    # and again where guarded's rare path recomputes S
    body = text.split("consumer warpgroups")[1]
    assert body.count("apply_score<Cfg>(s, P, uniforms, site);") == 2
    first = body.index("apply_score<Cfg>")
    assert first < body.index("mask_scores<Cfg>") < body.index("online_softmax<Cfg>")
    assert (
        "softmax_redo<Cfg>(s, m, l, scale, scale_log2, smem_q_wg, k_slot(ring_slot(ring_base + it)), warp, lane, score_of<Cfg>(P, uniforms, site));"
        in text
    )
    assert "static constexpr bool kScore = true;" in text and "kKeep" not in text


def _without_names(text: str, name: str) -> list[str]:
    lines = text.replace(name, "KERNEL").split("\n")
    return [l for l in lines[1:] if "the built-in softcap written out" not in l]


def test_the_softcap_written_as_a_score_is_the_built_in_softcaps_kernel():
    for builtin, written in zip(sources(SOFTCAP), sources(SOFTCAP_AS_SCORE)):
        assert "score 50 * tanh(s / 50)`: the built-in softcap written out" in written.text
        assert "static constexpr float kSoftcap = 50.f;" in written.text
        assert "SpecModifiers" not in written.text
        assert _without_names(builtin.text, "fa3_softcap") == _without_names(
            written.text, "modifiers_softcap"
        )


def test_a_softcap_of_another_shape_is_a_score():
    """Only N tanh(s / N), N a softcap the built-in takes, is compiled as it."""
    for score in ("50 * tanh(s / 40)", "2000 * tanh(s / 2000)", "50 * tanh(s * 50)"):
        kernel = front_end(spec(f"score {score}"), "a.fa")
        from fadsl.targets.sm90.modifiers import context

        found = context(kernel.config)
        assert found["modifier_softcap"] == 0 and found["score"] is not None, score


@pytest.mark.nvcc
@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (cuda-bindings)")
def test_the_softcap_written_as_a_score_has_the_built_in_softcaps_sass(tmp_path):
    from fadsl.build.nvrtc import compile_cubin
    from fadsl.tools.sass import disassemble, nvdisasm

    tool = nvdisasm()
    if tool is None:
        pytest.skip("needs nvdisasm")
    listings = []
    for path, name in ((SOFTCAP, "fa3_softcap"), (SOFTCAP_AS_SCORE, "modifiers_softcap")):
        source = sources(path)[0]
        built = compile_cubin(source.text, source.filename, source.kernel_name, "sm_90a", tmp_path)
        sass = disassemble(built.cubin, tool).replace(name, "KERNEL")
        listings.append(
            [" ".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", l).split()) for l in sass.split("\n")]
        )
    assert listings[0] == listings[1]


@pytest.mark.nvcc
@pytest.mark.skipif(not can_compile(), reason="needs NVRTC (cuda-bindings) or nvcc")
@pytest.mark.parametrize("spec_path", MODIFIER_EXAMPLES, ids=[p.stem for p in MODIFIER_EXAMPLES])
def test_the_modifier_examples_build_without_spills(spec_path):
    for source in sources(spec_path):
        usage = ptxas_usage(source, "sm_90a")
        where = f"{source.filename}: {usage}"
        assert usage["warnings"] == 0, where
        assert usage["spill_store_bytes"] == usage["spill_load_bytes"] == 0, where
        assert usage["stack_bytes"] == 0, where
