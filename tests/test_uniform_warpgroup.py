"""The forward's warp-uniform warpgroup index (fadsl/targets/sm90/emit.py uniform_warpgroup):
only the kernel it was measured faster in takes it (head_dim 256 causal, 16-bit, no window,
softcap, modifiers, packed sequences, cache or split), and that kernel's source shuffles
the index from lane 0 while every other keeps the division."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fadsl.ir import Dtype
from fadsl.pipeline import compile_file, compile_source
from fadsl.targets.sm90.emit import uniform_warpgroup

ROOT = Path(__file__).resolve().parent.parent
SHUFFLED = "const int warpgroup = __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);"
DIVIDED = "const int warpgroup = threadIdx.x / 128;"
SM90_16BIT = [
    p
    for p in sorted((ROOT / "examples").glob("fa3_*.fa"))
    if "fp8" not in p.stem and re.search(r"^\s*target\s+sm_90a", p.read_text(), re.M)
]


@pytest.mark.parametrize("path", SM90_16BIT, ids=[p.stem for p in SM90_16BIT])
def test_only_head_dim_256_causal_takes_it(path):
    cfg = compile_file(path).kernel.config
    assert uniform_warpgroup(cfg, Dtype.BF16) == (path.stem == "fa3_hdim256_causal")


def test_the_generated_sources_say_so():
    for stem, shuffled in (("fa3_hdim256_causal", True), ("fa3_hdim256", False)):
        for dtype in ("bf16", "fp16"):
            text = (ROOT / "generated" / f"{stem}_{dtype}.cu").read_text()
            assert (SHUFFLED in text, DIVIDED in text) == (shuffled, not shuffled), stem


def test_a_window_a_softcap_or_8_bits_keep_the_division():
    text = (ROOT / "examples" / "fa3_hdim256_causal.fa").read_text()
    base = compile_source(text).kernel.config
    assert uniform_warpgroup(base, Dtype.FP16) and not uniform_warpgroup(base, Dtype.E4M3)
    windowed = re.sub(r"^(\s*mask\s+)causal", r"\1window(128, 0)", text, flags=re.M)
    assert not uniform_warpgroup(compile_source(windowed).kernel.config, Dtype.BF16)
    capped = re.sub(r"\}\s*$", "  softcap 30\n}\n", text)
    assert not uniform_warpgroup(compile_source(capped).kernel.config, Dtype.BF16)
