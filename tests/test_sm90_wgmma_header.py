"""emit/sm90/include/fadsl/sm90_wgmma.cuh: up to date with its generator
(emit/sm90/gen_wgmma.py), and every wrapper names every accumulator register."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SM90 = ROOT / "emit" / "sm90"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_wgmma", SM90 / "gen_wgmma.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wgmma_header_matches_its_generator():
    gen = _generator()
    assert gen.OUT.read_text() == gen.render(), "run python3 emit/sm90/gen_wgmma.py"


def test_wgmma_wrappers_name_every_accumulator_register():
    text = _generator().render()
    for n in (40, 64, 80, 128, 176, 256):
        block = text[text.index(f"struct Wgmma<{n}>") :]
        block = block[: block.index("};")]
        regs = n // 2
        # SS: regs outputs, then desc_a, desc_b, scale_d, trans_a, trans_b
        assert f"m64n{n}k16.f32.bf16.bf16 {{%0, " in block
        assert f"%{regs - 1}}}, %{regs}, %{regs + 1}, p, 1, 1, %{regs + 3}, %{regs + 4};" in block
        # RS: regs outputs, 4 A registers, desc_b, scale_d, trans_b
        assert (
            f"%{regs - 1}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p"
            in block
        )
        assert block.count(f'"+f"(d[{regs - 1}])') == 4 and f"d[{regs}]" not in block


def test_wgmma8_header_matches_its_generator():
    gen = _generator()
    assert gen.OUT8.read_text() == gen.render8(), "run python3 emit/sm90/gen_wgmma.py"
    assert gen.WIDTHS8 == [64, 96, 128, 160, 192, 224, 256]


def test_wgmma8_wrappers_are_k32_without_transpose_operands():
    """m64nNk32 with each operand's own 8-bit type, every accumulator named once per asm,
    and the 16-bit wrappers' transpose immediates absent (PTX allows them for .f16/.bf16 only)."""
    text = _generator().render8()
    for n in (64, 128, 192, 256):
        block = text[text.index(f"struct Wgmma8<{n}>") :]
        block = block[: block.index("\n};")]
        regs = n // 2
        for ta in ("e4m3", "e5m2"):
            for tb in ("e4m3", "e5m2"):
                instr = f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.{ta}.{tb} {{%0, "
                assert block.count(instr) == 2  # ss and rs
                assert f"is_same_v<TA, {ta}> && cuda::std::is_same_v<TB, {tb}>" in block
        # SS: regs outputs, desc_a, desc_b, the scale-d predicate, imm-scale-a/b only
        assert f"%{regs - 1}}}, %{regs}, %{regs + 1}, p, 1, 1; }}" in block
        assert f"setp.ne.b32 p, %{regs + 2}, 0;" in block
        # RS: regs outputs, 4 A registers (four 8-bit values each), desc_b, scale_d
        assert (
            f"%{regs - 1}}}, {{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, p, 1, 1; }}"
            in block
        )
        assert f"setp.ne.b32 p, %{regs + 5}, 0;" in block
        assert block.count(f'"+f"(d[{regs - 1}])') == 8 and f"d[{regs}]" not in block
        assert "k16" not in block and "kTrans" not in block and '"n"(' not in block
    assert "struct e4m3" in text and "struct e5m2" in text
