"""sm_90a's checks of an 8-bit spec (`dtype e4m3`, `e5m2`; research/fp8-forward.md §3.1).

The FP8 forward reads Q and K as TMA writes them (K-major) but must transpose V in SMEM
(FP8 wgmma has no transpose bit), so V's path names the hop: `V: gmem -tma-> smem[cta]
-transpose-> smem[cta] -wgmma-> rf`; O is written in 16 bits (`output bf16|fp16`). What the
first FP8 kernel leaves out is refused at its key: the backward block
(backward/validate.py), `rescale guarded`, score/keep modifiers, `cluster 2`. The kernel is
built (fadsl/sm90_fp8.cuh) for the plain forward, varlen, a KV cache (contiguous or paged),
pack_gqa, `splits auto` and `tail split_kv`: a split piece's partial is written in the 16-bit
pieces' units (fp8_piece_partial), which `<kernel>_combine` (`splits auto`) or the tile's
last piece (`tail split_kv`, combine_split at a scale of 1) merges as the 16-bit kernels do.
"""

from __future__ import annotations

from ...errors import Loc
from ...ir import Dtype, Level, Rescale, Role
from ...ir.hop import Hop
from ...spec.checks import Checks
from ...spec.syntax import PathDecl

TRANSPOSED_V = "V: gmem -tma-> smem[cta] -transpose-> smem[cta] -wgmma-> rf"
TRANSPOSED_LEVELS = [Level.GMEM, Level.SMEM, Level.SMEM, Level.RF]
# B_c a multiple of this: P V's k32 steps, and Vt's rows of 64 or 128 keys (whole panels)
BLOCK_C_STEP = 64
DEFAULT_OUTPUT = Dtype.BF16


def eight_bit(c: Checks) -> bool:
    """Whether the spec's dtypes (as far as they were read) are 8-bit: one width per line."""
    dtypes = c.values.get("dtype", ())
    return bool(dtypes) and dtypes[0].is_8bit


def out_dtype(c: Checks) -> Dtype | None:
    """Config.out_dtype: the `output` line's, bf16 without it, for 8-bit dtypes only."""
    return c.values.get("output", DEFAULT_OUTPUT) if eight_bit(c) else None


def validate_transpose(
    c: Checks, role: Role, path: PathDecl, levels: list[Level], hop: Hop
) -> bool:
    """A path with a transpose hop: V's, with 8-bit dtypes, in the one shape."""
    if role is not Role.V:
        c.error(
            hop.loc,
            "only V is transposed (P V's B operand, which FP8 wgmma reads K-major only); "
            f"{role.value}'s path has no transpose hop",
        )
        return False
    if levels != TRANSPOSED_LEVELS:
        c.error(path.tensor.loc, f"V with its transpose must go {TRANSPOSED_V[3:]}")
        return False
    dtypes = c.values.get("dtype", ())
    if dtypes and not dtypes[0].is_8bit:
        c.error(
            hop.loc,
            "16-bit wgmma reads V MN-major through the descriptor's transpose bit: "
            "'V: gmem -tma-> smem[cta] -wgmma-> rf' (the transpose hop is for 8-bit dtypes)",
        )
        return False
    return True


def untransposed_v(c: Checks, path: PathDecl) -> bool:
    """V's two-hop path: refused with 8-bit dtypes. True when it passes."""
    if not eight_bit(c):
        return True
    c.error(
        path.tensor.loc,
        "with 8-bit dtypes V is transposed in SMEM (FP8 wgmma reads its B operand K-major "
        f"only, keys contiguous): '{TRANSPOSED_V}'",
    )
    return False


def validate_fp8(c: Checks) -> bool:
    """What the first FP8 forward does not take, each refused at its value."""
    v, ok = c.values, True
    block_c = v["tile"]["B_c"]
    if block_c % BLOCK_C_STEP:
        c.error(
            c.key_locs["B_c"],
            f"B_c = {block_c} with 8-bit dtypes: a multiple of {BLOCK_C_STEP} (P V's k32 "
            "steps, and V transposed in whole 64- or 128-byte rows of keys)",
        )
        ok = False
    if v.get("rescale") is Rescale.GUARDED:
        c.error(
            value_loc(c, "rescale"),
            "rescale guarded lets P reach 2^14, over e4m3's largest 448: with 8-bit dtypes "
            "use 'rescale lazy' or 'rescale every'",
        )
        ok = False
    if c.decl.modifiers:
        c.error(
            c.decl.modifiers[0].loc,
            "score and keep modifiers with 8-bit dtypes are not built yet",
        )
        ok = False
    if v.get("cluster", 1) > 1:
        c.error(
            c.key_locs["cluster_value"],
            f"cluster {v['cluster']} with 8-bit dtypes: the raw V ring could be multicast, but "
            "each CTA's producer warps write their own transposed V; use 'cluster 1'",
        )
        ok = False
    return ok


def value_loc(c: Checks, key: str) -> Loc:
    """Where the spec's `key` line gives its first value (else the key)."""
    for setting in c.decl.settings:
        if setting.key.text == key and setting.key.loc == c.key_locs.get(key):
            return setting.values[0].loc if setting.values else setting.key.loc
    return c.key_locs.get(key, c.decl.loc)
