"""sm_90a's own settings keys (Target.settings): the warp specialisation (warpgroups,
registers), the consumers' order (pingpong, overlap), the tile scheduler, the rescale mode,
the split tail, clusters, Q slots, softcap, varlen, the KV cache, PackGQA, splits and the
8-bit kernels' output type. Each
reads its value on its own (fadsl/spec/readers.py); what the values mean together is
validate.py's to check."""

from __future__ import annotations

from typing import Callable

from ...errors import one_of
from ...ir import Dtype, Rescale
from ...spec.checks import Checks, clip, show
from ...spec.readers import assigns, count, on_off, single, word_choice
from ...spec.syntax import Call, Number, Setting, Word

TMA_SWIZZLE = "128B"  # `swizzle 128B`: the swizzle TMA writes and wgmma reads
SOFTCAP_RANGE = (1, 1000)  # `softcap N`'s N (and a score modifier's N * tanh(s / N))


def q_slots(c: Checks, setting: Setting) -> int | None:
    """`q_slots N` (sm_90a): Q in a ring of N tiles; with 2 the producer loads the next
    tile's Q while this tile's runs."""
    return count(c, setting, 1, 2)


def ctas_per_sm(c: Checks, setting: Setting) -> int | None:
    """`ctas_per_sm N` (sm_90a): the CTAs of the attention kernel an SM holds at once (its
    __launch_bounds__' minimum, which halves the registers a thread launches with at 2; the
    setmaxnreg split and the SMEM plan must fit N times); 1 without the line."""
    if setting.values:
        c.key_locs["ctas_per_sm_value"] = setting.values[0].loc
    return count(c, setting, 1, 2)


def cluster(c: Checks, setting: Setting) -> int | None:
    """`cluster N` (sm_90a): CTAs per cluster, which share the tiles in smem[cluster]
    (1: none; 2: each CTA loads half of every K/V block and multicasts it into both)."""
    value = single(c, setting)
    if isinstance(value, Number) and value.value > 2:
        c.error(
            value.loc,
            f"cluster {clip(value.text)}: only pairs of CTAs are supported (an H100 runs 66 "
            "clusters of 2 CTAs on all its 132 SMs, but only 30 of 4)",
        )
        return None
    return count(c, setting, 1, 2)


def softcap(c: Checks, setting: Setting) -> int | None:
    """`softcap N` (sm_90a): scores capped by N tanh(s softmax_scale / N) before the softmax
    (Gemma 2, Grok: 30 or 50); off without the line."""
    return count(c, setting, *SOFTCAP_RANGE)


def varlen(c: Checks, setting: Setting) -> bool | None:
    """`varlen on` (sm_90a): the kernel takes packed batches of sequences of any lengths
    (cu_seqlens, FlashAttention's varlen convention); off without the line."""
    if setting.values:
        c.key_locs["varlen_value"] = setting.values[0].loc  # the target's checks point at it
    return word_choice(c, setting, {"on": True, "off": False})


PAGE_SIZES = (16, 32, 64, 128, 256)


def kv_cache(c: Checks, setting: Setting) -> int | None:
    """`kv_cache contiguous` (0: a (batch, capacity, heads, head_dim) cache per call) or
    `kv_cache paged(N)` (N rows a page, 16 to 256, a power of two: a page table per batch),
    sm_90a: K and V read from a cache with per-batch lengths (cache_seqlens)."""
    value = single(c, setting)
    if value is None:
        return None
    c.key_locs["kv_cache_value"] = value.loc
    if isinstance(value, Word) and value.text == "contiguous":
        return 0
    if isinstance(value, Call) and value.name.text == "paged":
        if len(value.args) != 1 or not isinstance(value.args[0], Number):
            c.error(value.loc, "'paged' takes one number: the rows of a page, 'paged(64)'")
            return None
        size = value.args[0]
        if size.value not in PAGE_SIZES:
            c.error(
                size.loc,
                f"page size {clip(size.text)}: expected {one_of([str(n) for n in PAGE_SIZES])} "
                "(whole 8-row swizzle periods, TMA boxes of at most 256 rows)",
            )
            return None
        return size.value
    c.error(value.loc, f"'kv_cache' expects 'contiguous' or 'paged(N)', not {show(value)}")
    return None


def pack_gqa(c: Checks, setting: Setting) -> bool | None:
    """`pack_gqa on` (sm_90a, with kv_cache): the query heads of a K/V head share its tiles'
    rows, so that a decode step's few query rows fill a tile."""
    if setting.values:
        c.key_locs["pack_gqa_value"] = setting.values[0].loc
    return word_choice(c, setting, {"on": True, "off": False})


def splits(c: Checks, setting: Setting) -> bool | None:
    """`splits auto` (sm_90a, with kv_cache): every tile's K/V blocks split into pieces over
    the SMs (the count from the launch's shape, or the call's num_splits), their partials
    added up by a combine kernel; `splits off`: whole tiles."""
    if setting.values:
        c.key_locs["splits_value"] = setting.values[0].loc
    return word_choice(c, setting, {"auto": True, "off": False})


def warpgroups(c: Checks, setting: Setting) -> dict[str, int] | None:
    """`warpgroups producer = 1, consumers = N` (sm_90a's warp specialisation)."""
    return assigns(c, setting, ("producer", "consumers"), 1, 4)


def registers(c: Checks, setting: Setting) -> dict[str, int] | None:
    """`registers producer = N, consumers = N`: setmaxnreg per thread of each role."""
    return assigns(c, setting, ("producer", "consumers"), 1, 1024)


def scheduler(c: Checks, setting: Setting) -> bool | None:
    """`scheduler persistent` (about one CTA per SM, looping over tiles) or `grid` (one CTA
    per tile): True when persistent."""
    return word_choice(c, setting, {"persistent": True, "grid": False})


def rescale(c: Checks, setting: Setting) -> Rescale | None:
    """`rescale every` (O and l rescaled after each block, as FlashAttention-2/3), `lazy`
    (only when a row's max grows past 2^8 of the max it keeps) or `guarded` (lazy, and no
    row max after a tile's first block while the row sums show none is needed)."""
    return word_choice(c, setting, {mode.value: mode for mode in Rescale})


def tail(c: Checks, setting: Setting) -> bool | None:
    """`tail whole` (every tile runs all its K/V blocks) or `split_kv` (the launch's last,
    part-full round of tiles split over their K/V blocks across the idle CTAs, the last
    piece to finish combining them): True when split."""
    if setting.values:
        c.key_locs["tail_value"] = setting.values[0].loc  # the target's checks point at it
    return word_choice(c, setting, {"whole": False, "split_kv": True})


def output(c: Checks, setting: Setting) -> Dtype | None:
    """`output bf16|fp16` (sm_90a, 8-bit dtypes): the type O is written in, from its fp32
    accumulator; bf16 without the line."""
    value = single(c, setting)
    if value is None:
        return None
    c.key_locs["output_value"] = value.loc  # validate refuses it for 16-bit dtypes
    if isinstance(value, Word) and value.text in (Dtype.E4M3.value, Dtype.E5M2.value):
        c.error(
            value.loc,
            f"output {value.text}: O is written in 16 bits, 'bf16' or 'fp16' (an 8-bit O "
            "would round away what its fp32 accumulator holds)",
        )
        return None
    return word_choice(c, setting, {d.value: d for d in (Dtype.BF16, Dtype.FP16)})


SETTINGS: dict[str, Callable[[Checks, Setting], object]] = {
    "q_slots": q_slots,
    "ctas_per_sm": ctas_per_sm,
    "warpgroups": warpgroups,
    "registers": registers,
    "pingpong": on_off,
    "overlap": on_off,
    "scheduler": scheduler,
    "rescale": rescale,
    "tail": tail,
    "cluster": cluster,
    "softcap": softcap,
    "varlen": varlen,
    "kv_cache": kv_cache,
    "pack_gqa": pack_gqa,
    "splits": splits,
    "output": output,
}
