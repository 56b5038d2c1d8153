"""A float32 model of the FP8 forward's online softmax (research/fp8-forward.md §3.5, §4).

It follows tests/softmax_model.py (the 16-bit kernel's: a batch of warps of 16 rows, a
row's keys spread over its quad's 4 threads, the MUFU approximations and fmaf as there)
and changes what the FP8 kernel changes:

- c' = softmax_scale log2(e) q_descale k_descale, one fp32 product per tile; a c' that is not
  a positive normal fp32 makes every row of the tile NaN (``poison_rows``);
- the offset: the reference is R = m c' - 8 (``__fsub_rn(__fmul_rn(m, c'), 8)``; 0 for a row
  still at -inf), so P = 2^(x - R) puts the row's largest key at 2^8 (FA3's ``Max_offset``);
  a move's factor is 2^(R_old - R_new) from the two rounded references;
- the lazy slack is 0.8: the reference stays while (mx - m) c' <= 0.8, so P <= 2^8.8 < 448;
- P V reads P rounded to e4m3 (``cvt.rn.satfinite.e4m3x2.f32``: finite and infinite values
  clamp to +-448, NaN stays NaN); the row sum l adds the fp32 P;
- the output's weights are v_descale / l times the e4m3 P, LSE = (m c' + log2 l - 8) ln 2;
- the row max is fmaxf's: a NaN score does not move it (its P is NaN, and so is the row).

Blocks are visited from the last key block to the first, as the kernel does; `every` and
`lazy` are the FP8 kernel's modes (`rescale guarded` is refused with 8-bit dtypes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from softmax_model import F32, F64, LN2, LOG2E, Mode, TINY, WarpState, ex2, f32, fma, thread_layout

OFFSET = 8.0  # log2 of the largest key's P: FA3's Max_offset
RESCALE_SLACK = 0.8  # lazy: P <= 2^(8 + 0.8) = 445.7 < 448
E4M3_MAX = 448.0
E4M3_NORMAL = 2.0**-6  # the smallest normal e4m3
E4M3_FLUSH = 2.0**-10  # half the smallest subnormal (2^-9): at or below it P rounds to 0


@dataclass(frozen=True)
class Numerics:
    """The constants a test may change to see the design's choice matter."""

    offset: float = OFFSET
    slack: float = RESCALE_SLACK
    # the move's old reference as the P were taken against it (rounded, with the offset);
    # False: m_old c' - R_new without the offset (the 16-bit kernel's factor)
    offset_in_move: bool = True


DESIGN = Numerics()


def scale_log2(softmax_scale: float, q_descale: float = 1.0, k_descale: float = 1.0) -> float:
    """c' as the kernel folds it: (softmax_scale log2(e)) q_descale k_descale in fp32."""
    c = f32(f32(softmax_scale) * f32(LOG2E))
    return f32(f32(c * f32(q_descale)) * f32(k_descale))


def good_scale(c: float) -> bool:
    """c' a positive normal fp32 (else the tile's rows are poisoned)."""
    return math.isfinite(c) and c >= TINY


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """cvt.rn.satfinite.e4m3x2.f32, read back as fp32: beyond +-448 (inf included) clamps."""
    clamped = torch.where(x.isnan(), x, x.clamp(-E4M3_MAX, E4M3_MAX))
    return clamped.to(torch.float8_e4m3fn).to(F32)


def reference(m: torch.Tensor, c: float, numerics: Numerics = DESIGN) -> torch.Tensor:
    """R = __fsub_rn(__fmul_rn(m, c'), offset); 0 for a row still at -inf."""
    mc = m * torch.tensor(c, dtype=F32)
    return torch.where(m == -math.inf, torch.zeros_like(m), mc - numerics.offset)


def old_reference(m: torch.Tensor, c: float, numerics: Numerics) -> torch.Tensor:
    """The reference the earlier P were taken against, as the move recomputes it (-inf for a
    row at -inf: its factor is 0, and its l and O are 0 anyway)."""
    mc = m * torch.tensor(c, dtype=F32)
    return mc - numerics.offset if numerics.offset_in_move else mc


def row_max(s: torch.Tensor) -> torch.Tensor:
    """fmaxf over the thread's values, then the quad: NaN never wins."""
    return torch.where(s.isnan(), torch.full_like(s, -math.inf), s).amax(dim=(2, 3))


def online_softmax(s, m, l, c: float, lazy: bool, numerics: Numerics = DESIGN):
    """One block's softmax for s (warps, 16, 4, B_c / 4). Returns (p, m, l, scale)."""
    mx = torch.maximum(m, row_max(s))
    if lazy:
        keep = ~((mx - m) * torch.tensor(c, dtype=F32) > numerics.slack)  # NaN keeps
        mx = torch.where(keep, m, mx)
    else:
        keep = torch.zeros_like(m, dtype=torch.bool)
    ref = reference(mx, c, numerics)
    scale = torch.where(keep, torch.ones_like(m), ex2(old_reference(m, c, numerics) - ref))
    p = ex2(fma(s, c, -ref[:, :, None, None]))
    total = torch.zeros(p.shape[:3], dtype=F32)
    for i in range(p.shape[3]):
        total = total + p[..., i]  # fp32 adds, in the thread's order
    return p, mx, fma(l, scale[:, :, None], total), scale


@dataclass
class Trace:
    """What the checks read besides the result: the largest fp32 P (before e4m3), and
    whether a finite P was clamped."""

    p_max: float = 0.0
    clamped: bool = False


def softmax_block(state: WarpState, scores, keys, c, mode, numerics, trace) -> WarpState:
    layout = thread_layout(scores.shape[2])
    s = scores[:, :, layout]
    p, m, l, scale = online_softmax(s, state.m, state.l, c, mode is Mode.LAZY, numerics)
    finite = p[p.isfinite()]
    if finite.numel():
        trace.p_max = max(trace.p_max, finite.max().item())
        trace.clamped |= bool((finite > E4M3_MAX).any())
    w = state.w * scale[:, :, None]  # rescale_o
    p8 = to_e4m3(p)
    w[:, :, keys[layout].reshape(-1)] = p8.reshape(p8.shape[0], 16, -1)
    return WarpState(m, l, w)


@dataclass
class Result:
    weights: torch.Tensor  # (warps, 16, keys): O = weights V_dequantized ... times v_descale
    lse: torch.Tensor  # (warps, 16), natural log
    l: torch.Tensor  # (warps, 16): the row sums, in units of the final reference
    trace: Trace


def attend(
    scores,
    block_n: int,
    c: float,
    mode: Mode = Mode.LAZY,
    v_descale: float = 1.0,
    numerics: Numerics = DESIGN,
) -> Result:
    """The FP8 kernel's weights (times v_descale) and LSE for raw scores (warps, 16, keys)
    (Q K^T of the e4m3 values, before c'; -inf where masked), visiting the blocks last to
    first."""
    assert mode is not Mode.GUARDED, "rescale guarded is refused with 8-bit dtypes"
    scores = scores.to(F32)
    warps, _, keys = scores.shape
    state, trace = WarpState.initial(warps, keys), Trace()
    for b in range(keys // block_n - 1, -1, -1):
        cols = torch.arange(b * block_n, (b + 1) * block_n)
        state = softmax_block(state, scores[:, :, cols], cols, c, mode, numerics, trace)
    l = state.l
    total = (l[..., 0] + l[..., 1]) + (l[..., 2] + l[..., 3])
    if not good_scale(c):  # poison_rows: no silent garbage
        nan = torch.full_like(total, math.nan)
        return Result(state.w * nan[:, :, None], nan, total, trace)
    mc = state.m * torch.tensor(c, dtype=F32)
    lse = torch.where(
        total == 0,
        torch.full_like(total, -math.inf),
        (mc + torch.log2(total) - numerics.offset) * torch.tensor(LN2, dtype=F32),
    )
    # inverse_row_sums: v_descale / l, 0 for a row that saw no key
    inv = torch.where(
        total == 0, torch.zeros_like(total), torch.tensor(v_descale, dtype=F32) / total
    )
    return Result(state.w * inv[:, :, None], lse, total, trace)


def piece_partial(state: WarpState, c: float, v_descale: float, scaled: bool = True):
    """fp8_piece_partial (emit/sm90/include/fadsl/sm90_fp8_consumer.cuh): a split piece's
    (weights x v_descale, R = m c' - 8 with -inf kept, l per thread). ``scaled`` False: the
    16-bit pieces' (raw m, weights without v_descale), which a combine of 8-bit pieces must
    not read."""
    if not scaled:
        return state.w, state.m, state.l
    mc = state.m * torch.tensor(c, dtype=F32)
    r = torch.where(state.m == -math.inf, state.m, mc - OFFSET)
    return state.w * torch.tensor(v_descale, dtype=F32), r, state.l


def attend_pieces(
    scores,
    block_n: int,
    c: float,
    splits: int,
    mode: Mode = Mode.LAZY,
    v_descale: float = 1.0,
    combine_scale: float = 1.0,
    scaled: bool = True,
) -> Result:
    """`splits auto` with 8-bit pieces: piece s runs the blocks [s n / splits, (s + 1) n /
    splits) as attend does (last to first), writes piece_partial, and combine_pieces
    (fadsl/sm90_kvcache.cuh) merges the pieces in piece order per thread (merge_piece, at
    ``combine_scale``: 1 for 8-bit kernels), sums the quad, and takes O = o / L and LSE =
    (m combine_scale + log2 L) ln 2. A tile's poisoned rows (a bad c') are NaN as attend's."""
    scores = scores.to(F32)
    warps, _, keys = scores.shape
    n = keys // block_n
    one = torch.tensor(combine_scale, dtype=F32)
    o = m = l = None
    for piece in range(splits):
        state, trace = WarpState.initial(warps, keys), Trace()
        for b in range((piece + 1) * n // splits - 1, piece * n // splits - 1, -1):
            cols = torch.arange(b * block_n, (b + 1) * block_n)
            state = softmax_block(state, scores[:, :, cols], cols, c, mode, DESIGN, trace)
        if not good_scale(c):  # poison_rows
            state = WarpState(state.m, torch.full_like(state.l, math.nan), state.w * math.nan)
        x, part_m, part_l = piece_partial(state, c, v_descale, scaled)
        if o is None:
            o, m, l = x, part_m, part_l
            continue
        mx = torch.maximum(m, part_m)
        ref = torch.where(mx == -math.inf, torch.zeros_like(mx), mx * one)
        keep, add = ex2(m * one - ref), ex2(part_m * one - ref)
        l = fma(l, keep[:, :, None], part_l * add[:, :, None])
        o = fma(o, keep[:, :, None], x * add[:, :, None])
        m = mx
    total = (l[..., 0] + l[..., 1]) + (l[..., 2] + l[..., 3])
    inv = torch.where(total == 0, torch.zeros_like(total), 1.0 / total)
    lse = torch.where(
        total == 0,
        torch.full_like(total, -math.inf),
        (m * one + torch.log2(total)) * torch.tensor(LN2, dtype=F32),
    )
    return Result(o * inv[:, :, None], lse, total, Trace())


def softmax64(scores: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 softmax and LSE of scores * scale (scale = softmax_scale qd kd)."""
    x = scores.to(F64) * scale
    return torch.softmax(x, dim=-1).nan_to_num(0.0), torch.logsumexp(x, dim=-1)


def problems(result: Result, scores, scale: float, v_descale: float = 1.0) -> list[str]:
    """How the weights and LSE miss the float64 softmax beyond §4's bound: each key's weight
    within a relative 2^-4 (e4m3's rounding of a normal P) plus the fp32 terms of the 16-bit
    bound, and absolutely 2^-18 of the row's largest weight (a subnormal or flushed P: half
    of e4m3's 2^-9 spacing in the units of a reference that weighs 2^8, and at most the
    largest weight); LSE as the 16-bit kernel's (it uses the fp32 P). Empty when it holds."""
    ref_w, ref_lse = softmax64(scores, scale)
    ref_w = ref_w * v_descale
    x = (scores.to(F64) * scale * LOG2E).abs()
    xmax = torch.where(x.isfinite(), x, torch.zeros_like(x)).amax(dim=-1)
    n = scores.shape[-1]
    rel = 2.0**-4 + n * 2.0**-23 + xmax * 2.0**-21 + 2.0**-18
    absolute = E4M3_FLUSH * 2.0**-OFFSET * (1 + 2.0**-10) * ref_w.amax(dim=-1)
    w = result.weights.to(F64)
    out = []
    bad = (w - ref_w).abs() > rel[..., None] * ref_w + absolute[..., None]
    if bad.any() or w.isnan().any():
        i = tuple(t[0].item() for t in (bad | w.isnan()).nonzero(as_tuple=True))
        out.append(f"weight {i}: {w[i].item():.6e}, float64 {ref_w[i].item():.6e}")
    lse = result.lse.to(F64)
    empty = ref_lse == -math.inf
    if not torch.equal(lse == -math.inf, empty):
        out.append("LSE -inf exactly for the rows that see no key")
    ok = ~empty & (lse > -math.inf)
    tol = (ref_lse.abs() + 1) * 2.0**-20 + n * 2.0**-22
    bad_lse = ok & ((lse - ref_lse).abs() > tol)
    if bad_lse.any() or lse.isnan().any():
        i = tuple(t[0].item() for t in (bad_lse | lse.isnan()).nonzero(as_tuple=True))
        out.append(f"LSE {i}: {lse[i].item():.9g}, float64 {ref_lse[i].item():.9g}")
    return out
