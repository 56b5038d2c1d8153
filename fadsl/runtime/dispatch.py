"""``fadsl.attention``: attention without writing a spec. It picks the spec a target ships
for the GPU, the head dimension and the mask (``Target.shipped``: the tuned examples), loads
it on first use (built once, then cached like any spec) and calls it."""

from __future__ import annotations

import hashlib
import re

from .. import targets
from .._data import data_dir
from ..frontend.rewrite import rewrite
from ..frontend.settings import MAX_WINDOW, PAGE_SIZES
from .attention import FlashAttention, load
from .kvcache import append_kv

_LOADED: dict[str, FlashAttention] = {}


def _candidates(capability: tuple[int, int]) -> list[targets.Target]:
    """The targets that run on a GPU of ``capability``, the most specific first (a target
    of one architecture before one that runs on every newer GPU)."""
    found = [targets.get(name) for name in targets.names()]
    found = [t for t in found if t.capabilities.runs_on(capability)]
    return sorted(found, key=lambda t: (not t.capabilities.devices[1], t.capabilities.devices[0]))


def shipped_spec(capability: tuple[int, int], head_dim: int, causal: bool) -> str:
    """The example (its name under examples/) that fadsl.attention runs on a GPU of
    ``capability`` for ``head_dim`` and the mask; ValueError naming what no spec covers."""
    candidates = _candidates(capability)
    for target in candidates:
        if (head_dim, causal) in target.shipped:
            return target.shipped[head_dim, causal]
    gpu = f"compute capability {capability[0]}.{capability[1]}"
    if not candidates:
        raise ValueError(f"q is on a GPU of {gpu}; fadsl's kernels need 8.0 or newer")
    covered = sorted({key for t in candidates for key in t.shipped})
    dims = sorted({d for d, c in covered if c == causal})
    mask = "causal=True" if causal else "causal=False"
    raise ValueError(
        f"q.shape[-1] (head_dim) = {head_dim} with {mask}: no shipped spec covers it on a GPU "
        f"of {gpu} (head_dim {', '.join(map(str, dims)) or 'none'} with {mask}); write a spec "
        "for it (examples/ has the shipped ones) and call fadsl.load(spec)"
    )


def attention(
    q, k, v, causal: bool = False, softmax_scale: float | None = None, *, return_lse=False
):
    """softmax(q k^T * softmax_scale [+ causal mask]) v through a shipped spec for q's GPU.

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim) in
    bf16 or fp16 on one CUDA device; heads_q a multiple of heads_kv (GQA, MQA). causal:
    FlashAttention's bottom-right aligned mask. softmax_scale: 1 / sqrt(head_dim) if None.
    Returns out, or (out, lse) with ``return_lse`` (lse: float32, natural log, shape
    (batch, heads_q, seqlen_q)). The same checks and messages as a loaded spec's call.
    """
    import torch

    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    _check_q(q, 4, "batch, seqlen, heads, head_dim")
    name = shipped_spec(torch.cuda.get_device_capability(q.device), q.shape[-1], causal)
    kern = _LOADED.get(name)
    if kern is None:
        text = data_dir("examples").joinpath(f"{name}.fa").read_text()
        kern = _LOADED[name] = load(text, verbose=False)
    return kern(q, k, v, softmax_scale, return_lse=return_lse)


# Serving calls (issue 31): the target's serving spec for the head dimension, with the lines a
# call decides (mask, softcap, the cache's layout, query-head packing, splits) rewritten; each
# variant loaded once (then built once and cached like any spec).
MAX_NAME = 64  # a kernel name's characters (the front end's limit)
_SERVING_LOADED: dict[tuple[str, tuple[tuple[str, str], ...]], FlashAttention] = {}


def shipped_serving_spec(kind: str, capability: tuple[int, int], head_dim: int) -> str:
    """The serving spec (its name under examples/serving/) for ``kind`` ("varlen" or
    "kvcache") on a GPU of ``capability``; ValueError naming what the shipped ones cover."""
    candidates = _candidates(capability)
    for target in candidates:
        name = target.shipped_serving.get((kind, head_dim))
        if name is not None:
            return name
    covered = sorted({d for t in candidates for k, d in t.shipped_serving if k == kind})
    gpu = f"compute capability {capability[0]}.{capability[1]}"
    call = "attention_varlen" if kind == "varlen" else "attention_with_kvcache"
    raise ValueError(
        f"q.shape[-1] (head_dim) = {head_dim}: fadsl.{call} ships no spec for it on a GPU of "
        f"{gpu} (head_dim {', '.join(map(str, covered)) or 'none'}); write a spec for it "
        "(examples/serving/ has the shipped ones) and call fadsl.load(spec)"
    )


def serving_settings(causal: bool, window_size, softcap) -> dict[str, str]:
    """The setting lines (key -> value) a serving call sets on its shipped spec: the mask
    and softcap (0: none). ``window_size`` (left, right) as FlashAttention takes it: -1 an
    unbounded side, the right side 0 with causal (as FlashAttention sets it), a one-sided
    window the spec's MAX_WINDOW keys on its open side."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)
    ):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if not all(-1 <= side <= MAX_WINDOW for side in window_size):
        raise ValueError(
            f"window_size must hold -1 (unbounded) or sizes 0 to {MAX_WINDOW}, got "
            f"{tuple(window_size)}"
        )
    if causal:
        mask = "causal" if left < 0 else f"causal, window({left})"
    elif left < 0 and right < 0:
        mask = "none"
    else:
        sides = (MAX_WINDOW if side < 0 else side for side in window_size)
        mask = "window({}, {})".format(*sides)
    settings = {"mask": mask}
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a number, got {type(softcap).__name__}")
    if softcap:
        if not 1 <= softcap <= 1000 or softcap != int(softcap):  # (inf and NaN fail the range)
            raise ValueError(f"softcap must be 0 or a whole number from 1 to 1000, got {softcap}")
        settings["softcap"] = str(int(softcap))
    return settings


def kvcache_settings(k_cache, page_table, heads_q: int, windowed: bool) -> dict[str, str]:
    """A kv-cache call's cache lines: `kv_cache paged(N)` with N = k_cache.shape[1] when a
    page table comes (else contiguous); PackGQA where the group of query heads divides a
    64-row tile; splits; neither with a sliding window (not built with one)."""
    import torch

    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("k_cache must be a 4-D tensor (batch or pages, rows, heads_kv, head_dim)")
    if page_table is None:
        layout = "contiguous"
    else:
        page = k_cache.shape[1]
        if page not in PAGE_SIZES:
            raise ValueError(
                f"k_cache.shape[1] (the page size) = {page}: the shipped kv-cache spec takes "
                f"pages of {', '.join(map(str, PAGE_SIZES))} keys"
            )
        layout = f"paged({page})"
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv if heads_kv and heads_q % heads_kv == 0 else 0
    pack = group > 0 and 64 % group == 0 and not windowed
    return {
        "kv_cache": layout,
        "pack_gqa": "on" if pack else "off",
        "splits": "off" if windowed else "auto",
    }


# A causal varlen batch with a sequence this long runs a CTA per tile (`scheduler grid`):
# the persistent CTAs' static pairs of q blocks balance one sequence's tiles but not tiles of
# sequences of different lengths, which the hardware's dynamic hand-out does. H100, 2026-11-27,
# 32768-token mixes, lengths uniform in [L/8, L] (docs/performance.md): L = 16384 grid 648-654 /
# persistent 617-622 TF/s (FA4 616-640), L = 4096 576 / 554-599, L = 1024 313 / 363-368.
# Measured on an H100 only, and keyed on the longest sequence alone: one long sequence among
# many short ones (where grid lost at L = 1024) switches it too, unmeasured.
LONG_CAUSAL_ROWS = 8192


def varlen_schedule(mask: str, max_seqlen_q) -> dict[str, str]:
    """The scheduler line a varlen call sets: grid for a causal mask (no window) when the
    longest sequence has LONG_CAUSAL_ROWS query rows or more; else the spec's own (none set,
    also when max_seqlen_q is not given: finding it would wait for the device)."""
    long = isinstance(max_seqlen_q, int) and max_seqlen_q >= LONG_CAUSAL_ROWS
    return {"scheduler": "grid"} if mask == "causal" and long else {}


def _serving_kernel(kind: str, q, settings: dict[str, str]) -> FlashAttention:
    import torch

    name = shipped_serving_spec(kind, torch.cuda.get_device_capability(q.device), q.shape[-1])
    key = (name, tuple(sorted(settings.items())))
    kern = _SERVING_LOADED.get(key)
    if kern is None:
        base = data_dir("examples").joinpath("serving", f"{name}.fa").read_text()
        text = rewrite(base, settings, {}, variant_name(name, settings))
        kern = _SERVING_LOADED[key] = load(text, verbose=False)
    return kern


def variant_name(base: str, settings: dict[str, str]) -> str:
    """``base`` with its settings spelled after it, in the settings' order, kernel names'
    64 characters at most: fa3_decode_paged_causal_window_512_paged_64 (PackGQA as `pack`,
    splits as `splits`, off ones left out); a longer one ends in a hash of the settings."""
    words = []
    for key, value in settings.items():
        if key == "mask" and value == "none":
            words.append("nomask")
        elif key in ("pack_gqa", "splits"):
            words.append({"pack_gqa": "pack", "splits": "splits"}[key] if value != "off" else "")
        else:
            words.append(("softcap " if key == "softcap" else "") + value)
    name = "_".join([base, *(re.sub(r"\W+", "_", w).strip("_") for w in words if w)])
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(repr(sorted(settings.items())).encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME - 9]}_{digest}"
    return name


def _check_q(q, dims: int, shape: str) -> None:
    import torch

    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != dims:
        raise ValueError(f"q must be {dims}-d ({shape}), got shape {tuple(q.shape)}")
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    window_size=(-1, -1),
    softcap: float = 0,
    return_lse: bool = False,
):
    """Attention over a packed batch of sequences through a shipped spec (FlashAttention's
    ``flash_attn_varlen_func``): q (tokens_q, heads_q, head_dim), k and v (tokens_k, heads_kv,
    head_dim), bf16 or fp16 on one CUDA device; sequence b at rows cu_seqlens_q[b] ..
    cu_seqlens_q[b + 1] - 1 of q and likewise of k and v (int32 prefix sums on q's device).
    causal: bottom-right aligned per sequence. window_size (left, right): a sliding window,
    -1 unbounded. softcap: scores capped by softcap tanh(s / softcap), 0 none (a whole
    number). Returns the output, or (output, lse) with the LSE (heads_q, tokens_q), float32.
    Each mask / softcap combination is its own kernel, built on its first call; a causal call
    whose max_seqlen_q is LONG_CAUSAL_ROWS or more runs the spec with `scheduler grid` (a
    wrong max_seqlen_q costs speed only: both schedules are exact for any lengths)."""
    _check_q(q, 3, "tokens, heads, head_dim")
    settings = serving_settings(causal, window_size, softcap)
    settings.update(varlen_schedule(settings["mask"], max_seqlen_q))
    kern = _serving_kernel("varlen", q, settings)
    return kern.varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        return_lse=return_lse,
    )


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    k=None,
    v=None,
    *,
    page_table=None,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size=(-1, -1),
    softcap: float = 0,
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """Attention of q against a KV cache through a shipped spec (FlashAttention's
    ``flash_attn_with_kvcache``): q (batch, seqlen_q, heads_q, head_dim); k_cache and v_cache
    contiguous (batch, capacity, heads_kv, head_dim), or paged (pages, page_size, heads_kv,
    head_dim) with page_table (batch, max_pages) int32; cache_seqlens (batch,) int32: the keys
    each batch's cache holds. k and v (batch, seqlen_new, heads_kv, head_dim), if given, are
    written into the caches after those keys (fadsl.append_kv) once every argument has been
    checked, and attended too; cache_seqlens is not advanced (the caller adds seqlen_new, as
    with FlashAttention). causal: bottom-right aligned. window_size, softcap: as
    attention_varlen's. num_splits: pieces per tile (None or 0: as many as fill the SMs in
    one wave; 1: none; a window runs whole tiles). Returns the output, or (output, lse) with
    the LSE (batch, heads_q, seqlen_q), float32. Unlike flash_attn_with_kvcache,
    cache_seqlens comes before k and v: pass what follows them by keyword."""
    _check_q(q, 4, "batch, seqlen, heads, head_dim")
    settings = serving_settings(causal, window_size, softcap)
    windowed = "window" in settings["mask"]
    settings.update(kvcache_settings(k_cache, page_table, q.shape[2], windowed))
    if (k is None) != (v is None):
        raise ValueError("k and v: give the new tokens' keys and values both, or neither")
    if windowed and isinstance(num_splits, int) and num_splits > 1:
        raise ValueError(
            f"num_splits={num_splits} with a sliding window: the windowed kernel runs whole "
            "tiles (splits are not built with a window); leave num_splits None, 0 or 1"
        )
    kern = _serving_kernel("kvcache", q, settings)
    # every argument checked before the new tokens are written into the cache
    kern.check_kvcache_call(
        q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, num_splits, return_lse
    )
    seqlens = cache_seqlens
    if k is not None:
        append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table)
        seqlens = cache_seqlens + k.shape[1]  # (int32 stays int32)
    return kern.kvcache(
        q,
        k_cache,
        v_cache,
        seqlens,
        page_table,
        softmax_scale,
        num_splits=num_splits,
        return_lse=return_lse,
    )
