"""The spec matrix the general GPU tests build: head dims x masks, from the swizzled example."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE = (ROOT / "examples" / "fa2_swizzled.fa").read_text()
SWIZZLE = {64: "xor(3, 3, 3)", 96: "none", 128: "xor(3, 3, 4)"}  # 96-element rows: no XOR swizzle


def general_specs() -> dict[str, str]:
    specs = {}
    for head_dim, swizzle in SWIZZLE.items():
        for mask in ("none", "causal"):
            name = f"general_d{head_dim}_{mask}"
            text = BASE.replace("kernel fa2_swizzled", f"kernel {name}")
            text = text.replace("head_dim 128", f"head_dim {head_dim}")
            text = text.replace("swizzle xor(3, 3, 4)", f"swizzle {swizzle}")
            specs[name] = text.replace("mask     none", f"mask     {mask}")
    return specs
