"""A float32 model of the sm_90a online softmax (fadsl/sm90.cuh, fadsl/sm90_guard.cuh).

The model follows the kernel's arithmetic for a batch of warps, each 16 query rows of the
wgmma accumulator layout: a row's B_c scores of a block are spread over the 4 threads of its
quad, thread t holding keys 8j + 2t + e (j < B_c / 8, e < 2) and adding its P up in that
order; the row max and the guarded path's largest P are quad reductions; the guarded path's
decisions are warp-uniform (__any_sync over the 16 rows and 4 threads). The MUFU
approximations are modelled by their exact values rounded to fp32 with subnormal results
flushed to 0 (ex2.approx.ftz gives inf from 128 up), fmaf by one rounding of the exact
result, and P's 16-bit conversion by round-to-nearest-even.

O is modelled by its weights: O = W V, W holding each key's P (16-bit) times every later
scale, so that the output's weights W / L can be compared with a float64 softmax key by key.

Blocks are visited as the kernel visits them, from the last key block to the first; the
first block a tile (or a split piece) visits and the blocks that need a mask run the full
online softmax, the rest the mode's (``Mode.GUARDED``: without the row max).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

F32, F64 = torch.float32, torch.float64
TINY = 2.0**-126  # the smallest normal fp32
RESCALE_SLACK = 8.0  # FwdConfig::kRescaleSlack
GUARDED_MOVE_SUM = 2.0**120  # kGuardedMoveSum
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


class Mode(enum.Enum):
    EVERY = "every"
    LAZY = "lazy"
    GUARDED = "guarded"


def f32(x: float) -> float:
    """x rounded to fp32."""
    return torch.tensor(x, dtype=F32).item()


def scale_log2(softmax_scale: float) -> float:
    """The kernel's c: softmax_scale (fp32) times log2(e) (fp32), rounded to fp32."""
    return f32(f32(softmax_scale) * f32(LOG2E))


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Subnormal fp32 results flushed to (signed) 0, as .ftz does."""
    return torch.where(x.abs() < TINY, torch.zeros_like(x), x)


def ex2(x: torch.Tensor) -> torch.Tensor:
    """ex2.approx.ftz.f32: 2^x, inf from 128 up, results below 2^-126 flushed to 0."""
    return _flush(torch.exp2(_flush(x).to(F64)).to(F32))


def rcp(x: torch.Tensor) -> torch.Tensor:
    """rcp.approx.ftz.f32."""
    return _flush((1.0 / _flush(x).to(F64)).to(F32))


def lg2(x: torch.Tensor) -> torch.Tensor:
    """lg2.approx.ftz.f32 (subnormal inputs read as 0: -inf)."""
    return torch.log2(_flush(x).to(F64)).to(F32)


def fma(a, b, c) -> torch.Tensor:
    """fmaf(a, b, c): one rounding of the exact a b + c (float64 holds a product of two fp32
    exactly; the sum's double rounding is below the model's tolerance)."""
    a, b, c = (torch.as_tensor(t, dtype=F32) for t in (a, b, c))
    return (a.to(F64) * b.to(F64) + c.to(F64)).to(F32)


def move_factor(m, c: float, ref: torch.Tensor) -> torch.Tensor:
    """2^(m c - ref), a reference's move, as the kernels take it: from the rounded m c that
    the P were taken against (``__fmul_rn``), minus the new reference, in fp32."""
    mc = torch.as_tensor(m, dtype=F32) * torch.tensor(c, dtype=F32)  # -inf stays -inf
    return ex2(mc - ref)


def round16(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cvt.rn.{bf16,f16}x2.f32: P as the P V wgmma reads it."""
    return x.to(dtype).to(F32)


@dataclass
class WarpState:
    """A batch of warps' softmax state: m (warps, 16) per row, l (warps, 16, 4) per thread,
    w (warps, 16, keys) O's weights per key."""

    m: torch.Tensor
    l: torch.Tensor
    w: torch.Tensor

    @staticmethod
    def initial(warps: int, keys: int, device=None) -> "WarpState":
        return WarpState(
            torch.full((warps, 16), -math.inf, dtype=F32, device=device),
            torch.zeros((warps, 16, 4), dtype=F32, device=device),
            torch.zeros((warps, 16, keys), dtype=F32, device=device),
        )


def thread_layout(block_n: int, device=None) -> torch.Tensor:
    """keys[t, i]: the key (within the block) of thread t's i-th value, in the order the
    thread adds them up (j major, then e)."""
    j = torch.arange(block_n // 8, device=device)[:, None]
    e = torch.arange(2, device=device)[None, :]
    return torch.stack([(8 * j + 2 * t + e).reshape(-1) for t in range(4)])


def exp2_row(s: torch.Tensor, ref: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """exp2_row: P = ex2(fma(s, c, -ref)) for s (warps, 16, 4, B_c / 4) and ref (warps, 16),
    and each thread's sum, added up in its order."""
    p = ex2(fma(s, c, -ref[:, :, None, None]))
    total = torch.zeros(p.shape[:3], dtype=F32, device=p.device)
    for i in range(p.shape[3]):
        total = total + p[..., i]  # fp32 adds, in the thread's order
    return p, total


def online_softmax(s, m, l, c: float, lazy: bool):
    """online_softmax: the row max, the move (or lazy's keep), P, l. Returns (p, m, l, scale)."""
    mx = torch.maximum(m, s.amax(dim=(2, 3)))  # fmaxf over the thread's values, then the quad
    if lazy:
        # !((mx - m) c > slack): NaN (both -inf) keeps
        keep = ~((mx - m) * torch.tensor(c, dtype=F32) > RESCALE_SLACK)
        mx = torch.where(keep, m, mx)
    else:
        keep = torch.zeros_like(m, dtype=torch.bool)
    ref = torch.where(mx == -math.inf, torch.zeros_like(mx), mx * torch.tensor(c, dtype=F32))
    scale = torch.where(keep, torch.ones_like(m), move_factor(m, c, ref))
    p, total = exp2_row(s, ref, c)
    l = fma(l, scale[:, :, None], total)
    return p, mx, l, scale


def online_softmax_guarded(s, m, l, c: float, block_n: int):
    """online_softmax_guarded: P against the kept reference, the row sums' check and the
    rare path. Returns (p, m, l, scale, redo): where redo (per warp) is set, m and l are
    untouched and the warp must run softmax_redo (online_softmax on S again)."""
    ref = m * torch.tensor(c, dtype=F32)  # -inf stays -inf: P inf or NaN
    p, total = exp2_row(s, ref, c)
    bound = block_n / 4 * 2.0**RESCALE_SLACK
    trips = (~(total <= bound)).flatten(1).any(dim=1)  # NaN trips
    redo = (~(total <= GUARDED_MOVE_SUM)).flatten(1).any(dim=1)
    top = p.amax(dim=(2, 3))
    moves = trips[:, None] & ~redo[:, None] & (top > 2.0**RESCALE_SLACK)
    m_new = torch.where(moves, fma(lg2(top), rcp(torch.tensor(c, dtype=F32)), m), m)
    cm_new = m_new * torch.tensor(c, dtype=F32)
    inv = torch.where(moves, move_factor(m, c, cm_new), torch.ones_like(m))
    p = p * inv[:, :, None, None]
    total = total * inv[:, :, None]
    l_new = fma(l, inv[:, :, None], total)
    keep = redo[:, None]
    return (
        p,
        torch.where(keep, m, m_new),
        torch.where(keep[:, :, None], l, l_new),
        inv,
        redo,
    )


def softmax_block(state, scores, keys, c, mode, guarded, dtype, stats=None) -> WarpState:
    """One block: scores (warps, 16, B_c) in key order, keys its key indices in w; guarded
    (warps,): the warps that take the guarded softmax (the others the full one). stats (a
    Counter) counts the warps by the path they took."""
    block_n = scores.shape[2]
    layout = thread_layout(block_n, scores.device)
    s = scores[:, :, layout]  # (warps, 16, 4, B_c / 4)
    m, l = state.m, state.l
    # The full online softmax: every mode's first and masked blocks, guarded's redo.
    p, m2, l2, scale = online_softmax(s, m, l, c, lazy=mode is not Mode.EVERY)
    if stats is not None:
        full = ~guarded
        flushed = ((scale == 0) & (m > -math.inf)).any(dim=1) & full
        stats["full"] += int(full.sum())
        stats["full, a scale flushed to 0"] += int(flushed.sum())
    if guarded.any():
        pg, mg, lg, scale_g, redo = online_softmax_guarded(s, m, l, c, block_n)
        if stats is not None:
            moved = (scale_g != 1).any(dim=1) & ~redo & guarded
            stats["guarded redo"] += int((redo & guarded).sum())
            stats["guarded move"] += int(moved.sum())
            stats["guarded kept"] += int((~redo & ~moved & guarded).sum())
        pick = (guarded & ~redo)[:, None]  # redo: softmax_redo, the full softmax on S again
        p = torch.where(pick[:, :, None, None], pg, p)
        m2 = torch.where(pick, mg, m2)
        l2 = torch.where(pick[:, :, None], lg, l2)
        scale = torch.where(pick, scale_g, scale)
    w = state.w * scale[:, :, None]  # rescale_o (lazy's skip multiplies by 1: the same)
    p16 = round16(p, dtype)
    w[:, :, keys[layout].reshape(-1)] = p16.reshape(p16.shape[0], 16, -1)
    return WarpState(m2, l2, w)


def run_blocks(scores, block_n, c, mode, masked, dtype, blocks, stats=None) -> WarpState:
    """The tile loop over the key blocks ``blocks``, in visit order. masked (warps,
    n_blocks): the warps whose block b takes the full online softmax (a mask)."""
    warps, _, keys = scores.shape
    state = WarpState.initial(warps, keys, scores.device)
    for i, b in enumerate(blocks):
        cols = torch.arange(b * block_n, (b + 1) * block_n, device=scores.device)
        guarded = ~masked[:, b] & (mode is Mode.GUARDED and i > 0)
        state = softmax_block(state, scores[:, :, cols], cols, c, mode, guarded, dtype, stats)
    return state


def combine(pieces: list[WarpState], c: float) -> WarpState:
    """combine_split: the pieces' partials in piece order, per thread."""
    m, l, w = pieces[0].m, pieces[0].l, pieces[0].w
    for part in pieces[1:]:
        mx = torch.maximum(m, part.m)
        ref = torch.where(mx == -math.inf, torch.zeros_like(mx), mx * torch.tensor(c, dtype=F32))
        keep, add = move_factor(m, c, ref), move_factor(part.m, c, ref)
        l = fma(l, keep[:, :, None], part.l * add[:, :, None])
        w = fma(w, keep[:, :, None], part.w * add[:, :, None])
        m = mx
    return WarpState(m, l, w)


@dataclass
class Result:
    weights: torch.Tensor  # (warps, 16, keys): O = weights V
    lse: torch.Tensor  # (warps, 16), natural log, -inf for a row that saw no key


def finish(state: WarpState, c: float) -> Result:
    """row_sum_quad, store_lse, normalize_o."""
    l = state.l
    total = (l[..., 0] + l[..., 1]) + (l[..., 2] + l[..., 3])
    lse = torch.where(
        total == 0,
        torch.full_like(total, -math.inf),
        (state.m * torch.tensor(c, dtype=F32) + torch.log2(total)) * torch.tensor(LN2, dtype=F32),
    )
    inv = torch.where(total == 0, torch.zeros_like(total), 1.0 / total)
    return Result(state.w * inv[:, :, None], lse)


def attend(scores, block_n, c, mode, dtype=torch.bfloat16, masked=None, pieces=1, stats=None):
    """The kernel's softmax weights and LSE for scores (warps, 16, keys) (raw, before c; -inf
    where masked), keys a multiple of block_n. masked: per key block (default: the blocks
    holding a -inf), (warps, n_blocks). pieces > 1: the blocks split into that many contiguous pieces (a split
    tile), each run from its own first block, combined in order."""
    scores = scores.to(F32)
    n_blocks = scores.shape[2] // block_n
    if masked is None:
        blocks = scores.unflatten(2, (n_blocks, block_n))
        masked = (blocks == -math.inf).any(dim=3).any(dim=1)
    order = list(range(n_blocks - 1, -1, -1))
    if pieces == 1:
        return finish(run_blocks(scores, block_n, c, mode, masked, dtype, order, stats), c)
    size = -(-n_blocks // pieces)
    parts = [order[i : i + size] for i in range(0, n_blocks, size)]
    states = [run_blocks(scores, block_n, c, mode, masked, dtype, part, stats) for part in parts]
    return finish(combine(states, c), c)


def softmax64(scores: torch.Tensor, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 softmax and LSE (natural log) of scores * softmax_scale; rows with no key:
    weights 0, LSE -inf."""
    x = scores.to(F64) * softmax_scale
    lse = torch.logsumexp(x, dim=-1)
    weights = torch.softmax(x, dim=-1).nan_to_num(0.0)
    return weights, lse


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half an ulp of 1, relative: P's 16-bit rounding."""
    return {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]


def problems(result: Result, scores, softmax_scale: float, dtype) -> list[str]:
    """How the model's weights and LSE miss the float64 softmax of scores * softmax_scale,
    beyond the error bound of docs/numerics.md: relative u (P's 16-bit rounding) + n 2^-23
    (fp32 sums) + |x|max 2^-21 (the reference's fp32 rounding, a few times) + 2^-18 (the
    MUFU approximations), and absolutely 2^-24 (fp16's subnormal P, below 2^-14 of the
    row's total) or 2^-100 (fp32's flush, below 2^-126 of it). Empty when it holds."""
    ref_w, ref_lse = softmax64(scores, softmax_scale)
    x = (scores.to(F64) * softmax_scale * LOG2E).abs()
    xmax = torch.where(x.isfinite(), x, torch.zeros_like(x)).amax(dim=-1)
    n = scores.shape[-1]
    rel = unit_roundoff(dtype) + n * 2.0**-23 + xmax * 2.0**-21 + 2.0**-18
    absolute = 2.0**-24 if dtype == torch.float16 else 2.0**-100
    w = result.weights.to(F64)
    out = []
    bad = (w - ref_w).abs() > rel[..., None] * ref_w + absolute
    if bad.any() or w.isnan().any():
        i = tuple(t[0].item() for t in (bad | w.isnan()).nonzero(as_tuple=True))
        out.append(f"weight {i}: {w[i].item():.6e}, float64 {ref_w[i].item():.6e}")
    empty = ref_lse == -math.inf
    lse = result.lse.to(F64)
    if not torch.equal(lse == -math.inf, empty):
        out.append("LSE -inf exactly for the rows that see no key")
    ok = ~empty & (lse > -math.inf)
    lse_tol = (ref_lse.abs() + 1) * 2.0**-20 + n * 2.0**-22
    bad_lse = ok & ((lse - ref_lse).abs() > lse_tol)
    if bad_lse.any() or lse.isnan().any():
        i = tuple(t[0].item() for t in (bad_lse | lse.isnan()).nonzero(as_tuple=True))
        out.append(f"LSE {i}: {lse[i].item():.9g}, float64 {ref_lse[i].item():.9g}")
    return out
