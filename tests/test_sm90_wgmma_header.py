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
