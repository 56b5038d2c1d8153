"""The FP8 forward's vocabulary and front end (research/fp8-forward.md §3.1, §7 step 1): the
8-bit dtypes, the `output` key, V's transpose hop, the targets' dtypes as data, and the 8-bit
variants sm_90a renders. The located refusals are golden files (tests/specs/bad/bad_fp8_*)."""

from __future__ import annotations

from dataclasses import replace

from conftest import ROOT
from ir_reader import read_kernel
from fadsl import targets
from fadsl.errors import DiagnosticSink
from fadsl.frontend.lower import lower
from fadsl.ir import Dtype, Hop, Instr, Level, Role, Scope
from fadsl.ir.printer import format_kernel
from fadsl.codegen.render import render
from fadsl.pipeline import compile_file, compile_source
from fadsl.spec.syntax import parse_recovering
from fadsl.targets.sm90.validate import consumer_registers, smem_bytes

SPEC = (ROOT / "tests/specs/fp8/fa3_fp8_hdim256_eager.fa").read_text()


def _lowered(source: str):
    sink = DiagnosticSink(source)
    decl = parse_recovering(source, "fp8.fa", sink)
    lowered = lower(decl, sink)
    assert not sink.diagnostics, [d.message for d in sink.diagnostics]
    return lowered


def test_the_8bit_dtypes():
    assert [d.value for d in Dtype if d.is_8bit] == ["e4m3", "e5m2"]
    assert (Dtype.E4M3.nbytes, Dtype.E5M2.nbytes, Dtype.BF16.nbytes, Dtype.FP16.nbytes) == (
        1,
        1,
        2,
        2,
    )
    assert [d.ptx_type for d in Dtype] == ["bf16", "f16", "e4m3", "e5m2"]
    assert Dtype.E4M3.cuda_type == "uint8_t" and Dtype.BF16.cuda_type == "__nv_bfloat16"


def test_targets_declare_their_dtypes_and_sm90a_the_transpose_hop():
    sm80, sm90 = (targets.get(name).capabilities for name in ("sm_80", "sm_90a"))
    assert sm80.dtypes == (Dtype.BF16, Dtype.FP16)
    assert sm90.dtypes == (Dtype.BF16, Dtype.FP16, Dtype.E4M3, Dtype.E5M2)
    assert sm90.hop_instrs[(Level.SMEM, Level.SMEM)] == (Instr.TRANSPOSE,)
    assert (Level.SMEM, Level.SMEM) not in sm80.hop_instrs


def test_an_8bit_spec_lowers_to_its_dtypes_output_and_transposed_v():
    lowered = _lowered(SPEC)
    cfg = lowered.config
    assert cfg.dtypes == (Dtype.E4M3, Dtype.E5M2) and cfg.out_dtype is Dtype.BF16
    v = next(t for t in lowered.tensors if t.role is Role.V)
    assert [(h.src, h.dst, h.instr) for h in v.hops] == [
        (Level.GMEM, Level.SMEM, Instr.TMA),
        (Level.SMEM, Level.SMEM, Instr.TRANSPOSE),
        (Level.SMEM, Level.RF, Instr.WGMMA),
    ]
    assert v.smem_scope is Scope.CTA and (v.hops[1].loc.line, v.hops[1].loc.col) == (15, 29)
    assert v.path_text() == "gmem -tma-> smem[cta] -transpose-> smem[cta] -wgmma-> rf"


def test_output_defaults_to_bf16_and_takes_fp16():
    without = SPEC.replace("  output     bf16", "")
    assert _lowered(without).config.out_dtype is Dtype.BF16
    fp16 = SPEC.replace("output     bf16", "output     fp16")
    assert _lowered(fp16).config.out_dtype is Dtype.FP16


def test_16bit_kernels_have_no_output_type():
    kernel = compile_file(ROOT / "examples/fa3_hopper.fa").kernel
    assert kernel.config.out_dtype is None
    assert " output=" not in format_kernel(kernel)


def test_sm90a_renders_the_8bit_forward_serving_and_tail_split():
    """Since step 4 (2026-11-30) the plain FP8 forward's CUDA is built, `varlen on` since
    2026-12-04, a KV cache (pack_gqa, `splits auto`) and the tail split the same day: each
    renders one kernel per 8-bit dtype; only the tail split's merges its pieces in the
    kernel, at a scale of 1 (the 16-bit pieces' units)."""
    merged = "combine_split<Cfg>(P, w, wg, o, m, l, 1.f, threadIdx.x % 128)"
    variants = [(SPEC, False)]
    for line in ("varlen     on", "kv_cache   contiguous", "kv_cache   paged(64)"):
        variants.append((SPEC.replace("  mask", f"  {line}\n  mask", 1), False))
    variants.append(((ROOT / "tests/specs/fp8/fa3_fp8_tail_split.fa").read_text(), True))
    for source, tail in variants:
        compiled = compile_source(source, "fp8.fa")
        assert compiled.kernel.config.dtypes == (Dtype.E4M3, Dtype.E5M2)
        texts = [s.text for s in render(compiled.kernel, compiled.target, compiled.file)]
        assert len(texts) == 2
        assert all((merged in t) == tail for t in texts)


def test_print_read_print_keeps_a_three_hop_path_and_the_output_type():
    """A hand-made 8-bit kernel: fa3_hopper's IR with 8-bit dtypes, an output type and V's
    transpose (the compiled ones: tests/test_fp8_plan.py)."""
    kernel = compile_file(ROOT / "examples/fa3_hopper.fa").kernel
    v = kernel.tensor(Role.V)
    gmem_smem, smem_rf = v.hops
    transpose = Hop(Level.SMEM, Level.SMEM, Instr.TRANSPOSE, smem_rf.loc)
    v8 = replace(v, hops=(gmem_smem, transpose, smem_rf))
    kernel = replace(
        kernel,
        config=replace(kernel.config, dtypes=(Dtype.E4M3,), out_dtype=Dtype.FP16),
        tensors=tuple(v8 if t.role is Role.V else t for t in kernel.tensors),
    )
    text = format_kernel(kernel)
    assert "dtypes=e4m3 " in text and text.split("\n")[0].endswith(" output=fp16")
    smem = f"smem[{v.smem_scope.value}]"
    assert f"tensor V: gmem -tma-> {smem} -transpose-> {smem} -wgmma-> rf\n" in text
    back = read_kernel(text)
    assert format_kernel(back) == text
    assert back.tensor(Role.V).hops[1].instr is Instr.TRANSPOSE
    assert back.config.out_dtype is Dtype.FP16


def test_8bit_budgets():
    """§3.2's table: K, V and Vt rings of 1-byte tiles; P as 8-bit quads."""
    assert smem_bytes(128, 128, 256, 2, fp8=True) == 230_520
    assert smem_bytes(128, 128, 256, 2) == smem_bytes(128, 128, 256, 2, 1, False)
    p_fp8 = [n for what, n in consumer_registers(256, 128, True, fp8=True) if "P " in what]
    p_16bit = [n for what, n in consumer_registers(256, 128, True) if "P " in what]
    assert (p_fp8, p_16bit) == ([16], [32])
    assert sum(n for _, n in consumer_registers(256, 128, True, fp8=True)) == 232
