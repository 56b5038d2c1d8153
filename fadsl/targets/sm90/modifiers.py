"""Score and mask modifiers (issue 41) on sm_90a: what the forward kernel takes, and the
template's slots for them.

The kernel applies `score` where it applies the built-in softcap (fadsl/sm90_modifiers.cuh:
after S = Q K^T is in registers, before the mask and the row max), in natural units
(``s = S softmax_scale``; the modified S stays in them, and the softmax's factor becomes
``log2 e``); `keep` as -inf in the blocks its tile rule (derive_sparsity) classes PARTIAL,
the EMPTY ones trimmed off each end of a tile's blocks (keep_work) and the FULL ones run
unmasked. The expressions are rendered by fadsl/targets/cuda_expr.py into a struct of the
generated kernel, ``SpecModifiers``, whose functions the header calls.

A score written as the built-in softcap, ``N * tanh(s / N)`` (N a whole number, 1 to 1000,
as `softcap N` takes), is compiled as the built-in: the same CUDA, so the same results bit
for bit (tests/test_modifiers_codegen.py compares the sources).
"""

from __future__ import annotations

from typing import Any

from ...errors import Loc
from ...ir import Config
from ...ir.expr import Binary, BinOp, FnCall, Const, Dim, Expr, ExprType, Fn, Load, Modifiers, Var
from ...ir.expr import VarKind, children, text, tile_uniform, walk
from ...spec.checks import Checks
from ...spec.syntax import ExprLine, InputLine
from ..cuda_expr import CudaExpr
from .backward.plan_smem import SPLIT_HEAD_DIM
from .learn import learn_factors, learn_slots
from .settings import SOFTCAP_RANGE

_SIZES = {
    Dim.BATCH: "P.base.batch",
    Dim.HEADS: "P.base.heads_q",
    Dim.HEADS_KV: "P.base.heads_kv",
    Dim.SEQLEN_Q: "P.base.seqlen_q",
    Dim.SEQLEN_K: "P.base.seqlen_k",
}
_NAMES = {
    VarKind.SCORE: "s",
    VarKind.BATCH: "b",
    VarKind.HEAD: "h",
    VarKind.Q_IDX: "q_idx",
    VarKind.KV_IDX: "kv_idx",
    VarKind.Q_LO: "q_lo",
    VarKind.Q_HI: "q_hi",
    VarKind.KV_LO: "kv_lo",
    VarKind.KV_HI: "kv_hi",
}


def validate_modifiers(c: Checks) -> bool:
    """What the sm_90a kernels do not take with modifiers yet, at the modifier's line (the
    backward's: at its block)."""
    lines = c.decl.modifiers
    if not lines:
        return True
    v, ok = c.values, True
    score = next((x for x in lines if isinstance(x, ExprLine) and x.keyword.text == "score"), None)
    keep = next((x for x in lines if isinstance(x, ExprLine) and x.keyword.text == "keep"), None)
    first = next((x for x in lines if not isinstance(x, InputLine)), lines[0])
    for key, what in (
        ("varlen", "varlen on (b and q_idx of a packed sequence)"),
        ("kv_cache", "kv_cache (per-batch cache lengths)"),
        ("pack_gqa", "pack_gqa on (rows of several heads in one tile)"),
    ):
        if v.get(key) not in (None, False, -1):
            c.error(first.loc, f"score and keep modifiers with {what} are not built yet")
            ok = False
    if score is not None and v.get("softcap"):
        c.error(
            score.loc,
            "a score modifier and 'softcap' do not combine: write the cap into the score, "
            f"e.g. score {v['softcap']} * tanh(s / {v['softcap']})",
        )
        ok = False
    if c.decl.backwards and v.get("head_dim") == SPLIT_HEAD_DIM:
        c.error(
            c.decl.backwards[0].loc,
            "the backward of score and keep at head_dim 256 is not built yet (its consumers "
            "split head_dim: fadsl/sm90_bwd_split.cuh computes P without the modifiers); "
            "remove the backward block (the kernel is then forward-only), or use head_dim "
            "64 or 128",
        )
        ok = False
    if keep is not None:
        used = {
            "window": "window" in v,
            "cluster": v.get("cluster", 1) > 1,
            "tail": v.get("tail", False),
        }
        for key, why in (
            ("window", "write the window into keep, e.g. keep kv_idx >= q_idx + seqlen_k - "
             "seqlen_q - LEFT and kv_idx <= q_idx + seqlen_k - seqlen_q + RIGHT"),
            ("cluster", "a cluster's CTAs share every K/V block, but keep skips blocks per "
             "tile: use 'cluster 1'"),
            ("tail", "split pieces cut a tile's blocks by count, but keep skips blocks: use "
             "'tail whole'"),
        ):  # fmt: skip
            if used[key]:
                c.error(keep.loc, f"keep with '{key}' is not built yet: {why}")
                ok = False
    return ok


def softcap_idiom(score) -> int | None:
    """N where the score is the built-in softcap written out, ``N * tanh(s / N)``."""
    match score:
        case Binary(
            op=BinOp.MUL,
            a=Const(value=outer),
            b=FnCall(
                fn=Fn.TANH,
                args=(Binary(op=BinOp.DIV, a=Var(kind=VarKind.SCORE), b=Const(value=inner)),),
            ),
        ):
            low, high = SOFTCAP_RANGE
            if outer == inner and outer == int(outer) and low <= outer <= high:
                return int(outer)
    return None


# The backward's params (BwdParamsSm90, sm90_bwd.cuh) hold the sizes flat, and heads_kv as
# heads_q / group.
_BWD_SIZES = {
    Dim.BATCH: "P.batch",
    Dim.HEADS: "P.heads_q",
    Dim.HEADS_KV: "(P.heads_q / P.group)",
    Dim.SEQLEN_Q: "P.seqlen_q",
    Dim.SEQLEN_K: "P.seqlen_k",
}


def _renderer(
    m: Modifiers, replaced: dict[str, str] | None = None, sizes: dict[Dim, str] = _SIZES
) -> CudaExpr:
    return CudaExpr(_NAMES, sizes, m.inputs, lambda i: f"P.inputs[{i}]", replaced)


def tile_loads(e: Expr) -> list[Expr]:
    """The largest parts of ``e`` that read an input and are the same for all of a tile's
    scores (``slopes[h]``, ``prefix[b]``): the kernel loads them once per tile (Uniforms)
    rather than in the loop over a block's scores. (ptxas spilled 168 bytes when ALiBi's
    slopes[h] was loaded inside the guarded rescale's rare recompute, NVRTC 13.5,
    2026-11-29.)"""
    if tile_uniform(e):
        return [e] if any(isinstance(n, Load) for n in walk(e)) else []
    return [x for child in children(e) for x in tile_loads(child)]


def _where(loc: Loc | None) -> str:
    return "" if loc is None else f" (line {loc.line})"


def score_grad(m: Modifiers) -> Expr | None:
    """The score's derivative by s where the backward multiplies dS by it: None where there
    is no score, or its derivative is the constant 1 (ALiBi, any bias added to s)."""
    d = m.derivative
    if m.score is None or d is None or (isinstance(d, Const) and d.value == 1.0):
        return None
    return d


def context(cfg: Config, sizes: dict[Dim, str] = _SIZES, backward: bool = False) -> dict[str, Any]:
    """The template's modifier slots: ``score`` and ``keep`` (None without them), each with
    the spec's text and its C++ (``score``'s ``distance``: split_distance_term's f, with
    ``score_by_distance``); ``uniforms``, what they read once per tile (tile_loads);
    and ``modifier_softcap``, the cap of a score that is the
    built-in softcap written out (then ``score`` is None: the kernel is the built-in's).
    ``sizes``: the C++ of each size (the forward's params by default); ``backward``: the
    backward's slots too, ``score_grad`` (the derivative dS is multiplied by, or None)."""
    m = cfg.modifiers
    if m is None:
        found = {"score": None, "score_by_distance": False, "keep": None}
        found |= {"modifier_softcap": 0, "modifier_inputs": []}
        return {**found, "score_grad": None, "learn": None} if backward else found
    cap = softcap_idiom(m.score) if m.score is not None else None
    grad = score_grad(m) if backward and not cap else None
    plain = _renderer(m, sizes=sizes)
    uniforms: dict[str, dict[str, str]] = {}  # C++ -> its field
    factors = learn_factors(m) if backward else []
    for e in (x for x in (None if cap else m.score, grad, m.keep, *factors) if x is not None):
        for part in tile_loads(e):
            code = plain.render(part)
            if code not in uniforms:
                kind = {ExprType.F32: "float", ExprType.I32: "int", ExprType.BOOL: "bool"}[
                    part.type
                ]
                uniforms[code] = {
                    "name": f"v{len(uniforms)}",
                    "type": kind,
                    "code": code,
                    "source": text(part),
                }
    tiled = {code: f"u.{u['name']}" for code, u in uniforms.items()}
    render = _renderer(m, tiled, sizes)
    score = None
    if m.score is not None and cap is None:
        score = {
            "source": text(m.score) + _where(m.score_loc),
            "code": render.render(m.score, ExprType.F32),
            "distance": None,
        }
        if m.distance_term is not None:  # f(b, h, d) of s + f: q_idx the distance, kv_idx 0
            at_distance = {**_NAMES, VarKind.Q_IDX: "d", VarKind.KV_IDX: "0"}
            term = CudaExpr(at_distance, sizes, m.inputs, lambda i: f"P.inputs[{i}]", tiled)
            score["distance"] = {
                "source": text(m.distance_term),
                "code": term.render(m.distance_term, ExprType.F32),
            }
    keep = None
    if m.keep is not None:
        rule = m.rule
        keep = {
            "source": text(m.keep) + _where(m.keep_loc),
            "code": render.render(m.keep),
            "full": plain.render(rule.full),  # (once a block: its loads stay)
            "empty": plain.render(rule.empty),
            "full_text": text(rule.full),
            "empty_text": text(rule.empty),
            "exact": rule.exact,
            # a keep that reads inputs per token: its tiles' classes and each q block's list of
            # kept blocks, made by <kernel>_keep_classes, are the call's inputs after the spec's
            "classes": (
                {"input": len(m.inputs), "per_head": rule.per_head} if rule.by_pass else None
            ),
        }
    found = {
        "score": score,
        # (the Cfg's kScoreByDistance: a block of its own in the templates)
        "score_by_distance": score is not None and score["distance"] is not None,
        "keep": keep,
        "modifier_softcap": cap or 0,
        "uniforms": list(uniforms.values()),
        "modifier_inputs": [f"P.inputs[{i}]: {d.text()}" for i, d in enumerate(m.inputs)],
    }
    if backward:
        found["learn"] = learn_slots(m, render, plain) if m.learn else None
        found["score_grad"] = (
            None
            if grad is None
            else {"source": text(grad), "code": render.render(grad, ExprType.F32)}
        )
    return found


def backward_context(cfg: Config) -> dict[str, Any]:
    """The backward template's modifier slots (emit/sm90/bwd_modifiers.cu.j2): context's,
    over BwdParamsSm90's sizes, with ``score_grad``; ``modifiers``, whether the kernel has a
    SpecModifiers struct."""
    found = context(cfg, _BWD_SIZES, backward=True)
    return {**found, "modifiers": found["score"] is not None or found["keep"] is not None}
