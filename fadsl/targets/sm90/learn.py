"""The sm_90a backward's slots for learnable inputs (issue 41): the gradients of the float
inputs a score reads (ALiBi's slopes, a bias table), for the variant of a spec's backward
the runtime builds when such an input requires grad (``Modifiers.learn``).

Each read ``x[idx]`` the score makes of a learnable input (differentiate_inputs's
InputGrad) becomes, per score the consumer holds, an add of dS' x d score / d x[idx] into
the input's fp32 gradient at ``idx`` (dS' = P (dP - D), the gradient of the modified score,
fadsl/sm90_bwd_learn.cuh). Two kinds of read, by their index:

- uniform (``slopes[h]``: the index reads no query row or key, so it is one element for a
  CTA's every score, b and h being the CTA's): summed in a register across the CTA's
  m-blocks, then over the warp by shuffles, one red.global.add.f32 per warp at the end;
- scattered (``bias[h, kv_idx - q_idx + 64]``): one red.global.add.f32 per score that has a
  nonzero dS' (masked scores and the padding rows and keys of partial tiles add nothing).

The gradients live in one fp32 buffer, ``P.input_grads``: the learnable inputs' elements
in declared order, each row-major, zeroed by the host before the kernel.

D's rounding (D from the 16-bit O) leaves each query row's dS' summing to dLSE_i + eps_i,
not to dLSE_i, and an input's sum multiplies eps_i by the row's factors (docs/numerics.md,
"Learnable inputs: D's rounding"). So the variant also sums, per query row into ``P.learn_rows``
(learn_row_floats a row: the row's dS', then per read the row's P x factor at its reference
element), and its fourth kernel, ``_learn``, adds -eps_i W per row: exact for uniform reads,
the reference element's share for scattered ones (fadsl/sm90_bwd_learn.cuh).
"""

from __future__ import annotations

from typing import Any

from ...ir.backward import Backward
from ...ir.expr import Binary, BinOp, Expr, ExprType, Fn, FnCall, Load, Modifiers, text
from ...ir.expr import tile_uniform, walk
from ..cuda_expr import CudaExpr
from .backward.routes import TRANSPOSED_BLOCK_M
from .backward.validate import BLOCK_M


def learn_row_floats(m: Modifiers) -> int:
    """Floats per query row of the variant's ``P.learn_rows`` (SpecModifiers::kLearnRow):
    the row's sum of dS', then one per learnable read (its W, fadsl/sm90_bwd_learn.cuh)."""
    return 1 + sum(1 for g in m.input_grads if g.input in m.learn)


def learn_backward_lines(bwd: Backward) -> tuple[dict[str, str], dict[str, str | None]]:
    """The backward block's setting and path lines (rewrite_backward's) the learnable
    variant takes in place of the spec's: at B_r 80 (dQ transposed) B_r 64, whose dS path
    the block's `rf -stmatrix-> smem[cta]` names too. prefix_lm_alibi's variant spilled 16
    bytes at B_r 80 before D's correction (NVRTC 13.0, the H200's, 2026-11-30) and 16-68 with
    it (bf16 and fp16, NVRTC 13.0 and 13.5); at B_r 64 none (tests/test_modifiers_learnable.py).
    Else none: the spec's own block."""
    if bwd.block_m != TRANSPOSED_BLOCK_M:
        return {}, {}
    return {"tile": f"B_r = {BLOCK_M}, B_c = {bwd.block_n}"}, {}


def learn_factors(m: Modifiers) -> list[Expr]:
    """The derivatives the variant evaluates (their tile-uniform loads go to Uniforms)."""
    return [g.derivative for g in m.input_grads if g.input in m.learn and g.derivative is not None]


def learn_slots(m: Modifiers, render: CudaExpr, plain: CudaExpr) -> dict[str, Any]:
    """The template's ``learn`` slot: ``inputs`` (each learnable input and where its
    gradient starts in the buffer), ``uniform`` and ``scatter`` (each read's C++ factor and
    offset into the buffer)."""
    base: dict[str, str] = {}
    offset = "0"
    lines = []
    for decl in m.inputs:
        if decl.name not in m.learn:
            continue
        base[decl.name] = offset
        size = " * ".join(plain.size(d) for d in decl.dims)
        lines.append(f"{decl.text()}: from element {offset}")
        offset = size if offset == "0" else f"{offset} + {size}"
    uniform, scatter = [], []
    for g in m.input_grads:
        if g.input not in m.learn:
            continue
        assert g.derivative is not None  # (the runtime asks only for learnable inputs)
        read = Load(g.input, g.indices, g.loc)
        start = base[g.input]
        where = plain.offset(read)
        slot = {
            "source": f"{g.input}[{g.index_text()}]",
            "derivative": text(g.derivative),
            "factor": render.render(g.derivative, ExprType.F32),
            "offset": where if start == "0" else f"{start} + {where}",
        }
        (uniform if all(tile_uniform(x) for x in g.indices) else scatter).append(slot)
    factors = [g.derivative for g in m.input_grads if g.input in m.learn]
    clamped = bool(scatter) or not all(_finite_anywhere(d) for d in factors)
    return {"inputs": lines, "uniform": uniform, "scatter": scatter, "clamped": clamped}


# What a derivative may compute and stay finite at any index: the padding rows and keys of
# a partial tile (dS' = 0 there) need no clamped index unless a read or a function with a
# restricted domain (a division, a log, an exp's overflow) would make 0 x it NaN.
_SAFE_FNS = frozenset({Fn.ABS, Fn.MIN, Fn.MAX, Fn.CLAMP, Fn.TANH})
_SAFE_OPS = frozenset(op for op in BinOp if op not in (BinOp.DIV, BinOp.FLOORDIV, BinOp.MOD))


def _finite_anywhere(e: Expr) -> bool:
    for n in walk(e):
        if isinstance(n, Load) and not tile_uniform(n):
            return False
        if isinstance(n, Binary) and n.op not in _SAFE_OPS:
            return False
        if isinstance(n, FnCall) and n.fn not in _SAFE_FNS:
            return False
    return True
