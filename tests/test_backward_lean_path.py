"""The backward's lean path (bwd_lean_path, emit/sm90/include/fadsl/sm90_bwd_block.cuh) in the
SASS of the shipped backward kernels, on the CPU (NVRTC, nvdisasm): each product's wgmma
descriptors built once and moved per k16 step, not rebuilt from an address at every step
(the address masked with 0x3fc00 and shifted, about once an operand a wgmma), and where the
warpgroup index is warp-uniform, no descriptor moved from a vector register (R2UR).
Measured where it was extended to modifier kernels and packed sequences (NVRTC 13.5,
2026-12-02, docs/backward.md "Beside FA4"): document_causal's common path 695 -> 529
instructions, fa3_varlen_causal's 704 -> 532."""

from __future__ import annotations

import pytest

from conftest import ROOT
from fadsl.build.nvrtc import nvrtc_available

SPECS = sorted((ROOT / "examples" / "modifiers").glob("*.fa")) + [
    ROOT / "examples" / "fa3_causal.fa",
    ROOT / "examples" / "serving" / "fa3_varlen_causal.fa",
    ROOT / "examples" / "serving" / "fa3_varlen_hdim64.fa",
]


def m_block_loop(spec):
    """The main backward kernel's m-block loop (bf16, sm_90a), and the kernel's Cfg text."""
    import fadsl
    from fadsl.ir import Dtype
    from fadsl.tools import sass

    tool = sass.nvdisasm()
    if tool is None or not nvrtc_available():
        pytest.skip("needs NVRTC and nvdisasm")
    kern = fadsl.load(spec.read_text(), verbose=False)
    kernels = kern._backward_kernels()
    listing = sass.disassemble(kernels.cubin(Dtype("bf16"), "sm_90a").cubin, tool)
    body = sass.function(listing, f"{kern.config.name}_bwd_bf16")
    # (the m-block loop; not the retry paths of waits, whose branch back is after EXIT)
    loops = [x for x in sass.loops(body) if x.count("HGMMA") and not x.count("EXIT")]
    (loop,) = sass.innermost(loops)
    cfg = kernels.source(Dtype("bf16")).split("struct Cfg", 1)[1].split("};", 1)[0]
    return loop, cfg


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_the_m_block_loop_builds_each_descriptor_once(spec):
    loop, _ = m_block_loop(spec)
    rebuilt = sum("0x3fc" in text for text in loop.instructions)
    # 6-9 where built once (a product's operands), 32-48 where rebuilt per k16 step
    assert rebuilt <= 12, (rebuilt, loop.count("HGMMA"))


@pytest.mark.nvcc
@pytest.mark.parametrize("spec", SPECS, ids=[p.stem for p in SPECS])
def test_a_warp_uniform_index_keeps_the_descriptors_in_uniform_registers(spec):
    """With the warpgroup index warp-uniform ptxas keeps the descriptors in uniform
    registers: no R2UR of them (48 an m-block without). Packed sequences, and a score with
    a keep, keep the thread's index (the uniform one spilled there)."""
    loop, cfg = m_block_loop(spec)
    uniform = "kVarlen = true" not in cfg and not ("kScore = true" in cfg and "kKeep = true" in cfg)
    assert (loop.count("R2UR") <= 2) == uniform, (loop.count("R2UR"), loop.count("HGMMA"))
