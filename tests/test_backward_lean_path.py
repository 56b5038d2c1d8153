"""The backward's lean path (bwd_lean_path, emit/sm90/include/fadsl/sm90_bwd_block.cuh) in the
SASS of the shipped backward kernels, on the CPU (NVRTC, nvdisasm): each product's wgmma
descriptors built once and moved per k16 step, not rebuilt from an address at every step
(the address masked with 0x3fc00 and shifted, about once an operand a wgmma), and where the
warpgroup index is warp-uniform, no descriptor moved from a vector register (R2UR).
Measured where it was extended to modifier kernels, packed sequences, the dQ writer warps
and head_dim 256's split consumers (NVRTC 13.5, 2026-12-02, docs/backward.md "Beside FA4"):
document_causal's common path 695 -> 529 instructions, fa3_varlen_causal's 704 -> 532, the
deterministic writer block of fa3_hdim64_causal 733 -> 577, fa3_hdim256's m-block loop
1,047 -> 774 (static)."""

from __future__ import annotations

import pytest

from conftest import ROOT
from fadsl.build.nvrtc import nvrtc_available

SPECS = sorted((ROOT / "examples" / "modifiers").glob("*.fa")) + [
    ROOT / "examples" / f"{name}.fa" for name in ("fa3_causal", "fa3_hdim256", "fa3_hdim256_causal")
]
SPECS += [
    ROOT / "examples" / "serving" / f"{name}.fa"
    for name in ("fa3_varlen_causal", "fa3_varlen_hdim64")
]
# dQ writer warps (deterministic mode's blocks): training variants (tests/test_gpu_backward.py)
WRITERS = [
    "fa3_hdim64_causal+deterministic+dq_writer-dqred",
    "fa3_causal+deterministic+dq_writer-dqred",
]


def name_of(spec) -> str:
    return spec if isinstance(spec, str) else spec.stem


def m_block_loop(spec):
    """The main backward kernel's m-block loop (bf16, sm_90a) and the kernel's Cfg text, for
    a spec file or a training variant's name."""
    import fadsl
    from fadsl.ir import Dtype
    from fadsl.tools import sass
    from training_specs import training_spec

    tool = sass.nvdisasm()
    if tool is None or not nvrtc_available():
        pytest.skip("needs NVRTC and nvdisasm")
    text = training_spec(spec) if isinstance(spec, str) else spec.read_text()
    kern = fadsl.load(text, verbose=False)
    kernels = kern._backward_kernels()
    listing = sass.disassemble(kernels.cubin(Dtype("bf16"), "sm_90a").cubin, tool)
    body = sass.function(listing, f"{kern.config.name}_bwd_bf16")
    # (the m-block loop; not the retry paths of waits, whose branch back is after EXIT)
    loops = [x for x in sass.loops(body) if x.count("HGMMA") and not x.count("EXIT")]
    inner = sass.innermost(loops)
    assert len(inner) == 1, f"{len(inner)} innermost loops with wgmma: which is the m-block's?"
    (loop,) = inner
    cfg = kernels.source(Dtype("bf16")).split("struct Cfg", 1)[1].split("};", 1)[0]
    return loop, cfg


# A kernel off the lean path (a softcap: it spilled there), where each k16 step rebuilds its
# descriptors: the control that the count below sees what it is meant to
REBUILT = ROOT / "tests" / "specs" / "sm90" / "backward" / "fa3_backward_softcap.fa"


@pytest.mark.nvcc
@pytest.mark.parametrize(
    "spec", SPECS + WRITERS + [REBUILT], ids=map(name_of, SPECS + WRITERS + [REBUILT])
)
def test_the_m_block_loop_builds_each_descriptor_once(spec):
    """A descriptor built from its address masks it (make_smem_desc's & 0x3FFFF, which ptxas
    prints as a LOP3 with 0x3fc.. where it knows the low bits: the tiles are 1024-byte
    aligned) and shifts it: about once an operand a wgmma where rebuilt per k16 step, once
    an operand a product where moved by desc_advance (NVRTC 13.5, 2026-12-02)."""
    loop, _ = m_block_loop(spec)
    rebuilt = sum("0x3fc" in text for text in loop.instructions)
    # 6-12 where built once (a product's operands), 32-102 where rebuilt per k16 step
    assert (rebuilt <= 12) == (spec != REBUILT), (rebuilt, loop.count("HGMMA"))
    assert rebuilt >= 3, rebuilt  # (the pattern still matches how ptxas prints the mask)


# (not packed sequences, prefix_lm_alibi's score with a keep, or head_dim 256's split consumers)
OFF_UNIFORM = (
    "fa3_varlen_causal",
    "fa3_varlen_hdim64",
    "prefix_lm_alibi",
    "fa3_hdim256",
    "fa3_hdim256_causal",
)
UNIFORM = [p for p in SPECS if p.stem not in OFF_UNIFORM] + WRITERS


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", UNIFORM, ids=map(name_of, UNIFORM))
def test_a_warp_uniform_index_keeps_the_descriptors_in_uniform_registers(spec):
    """With the warpgroup index warp-uniform ptxas keeps the descriptors in uniform
    registers: no R2UR of them (48 an m-block without). Packed sequences (examples/serving/),
    a score with a keep (prefix_lm_alibi) and head_dim 256's split consumers keep the
    thread's index: the uniform one spilled there (bwd_uniform_warpgroup)."""
    loop, cfg = m_block_loop(spec)
    assert "kVarlen = true" not in cfg and not ("kScore = true" in cfg and "kKeep = true" in cfg)
    assert loop.count("R2UR") <= 2, (loop.count("R2UR"), loop.count("HGMMA"))
