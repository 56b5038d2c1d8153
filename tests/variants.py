"""Spec variants of the Kernel 1 example, made by editing its text."""

from __future__ import annotations

from conftest import ROOT

KERNEL1 = (ROOT / "examples" / "fa2_kernel1.fa").read_text()

EAGER_ORDER = """  mainloop {
    K -> smem
    V -> smem
    K -> rf
    S = Q @ K^T
    softmax
    V -> rf
    O += P @ V
  }
"""


def variant(
    *,
    alias: str | None = None,
    order: str | None = None,
    mask: str | None = None,
    warps: int | None = None,
    block_r: int | None = None,
    head_dim: int | None = None,
    swizzle: str | None = None,
) -> str:
    text = KERNEL1
    if alias:
        text = text.replace("  swizzle none", f"  swizzle none\n  smem_alias {alias}")
    if order:
        text = text.replace("  swizzle none", "  swizzle none\n" + order)
    if mask:
        text = text.replace("mask     none", f"mask     {mask}")
    if warps:
        text = text.replace("warps    4", f"warps    {warps}")
    if block_r:
        text = text.replace("B_r = 64", f"B_r = {block_r}")
    if head_dim:
        text = text.replace("head_dim 128", f"head_dim {head_dim}")
    if swizzle:
        text = text.replace("swizzle none", f"swizzle {swizzle}")
    return text
