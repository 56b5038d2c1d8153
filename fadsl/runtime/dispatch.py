"""Which kernel a public call runs (fadsl/runtime/public.py): the spec a target ships for the
GPU, the head dimension and the mask (``Target.shipped``: the tuned examples), and for the
serving calls the variant of the target's serving spec that the call's mask, softcap and
cache select; each loaded on first use (built once, then cached like any spec), and each
choice remembered, so that a call after the first finds its kernel with one lookup."""

from __future__ import annotations

import functools
import hashlib
import re

from .. import targets
from .._data import data_dir
from ..errors import SpecError
from ..frontend.rewrite import rewrite, rewrite_backward
from ..frontend.settings import MAX_WINDOW
from ..pipeline import front_end
from .attention import FlashAttention, load

_LOADED: dict[str, FlashAttention] = {}


@functools.cache
def _candidates(capability: tuple[int, int]) -> tuple[targets.Target, ...]:
    """The targets that run on a GPU of ``capability``, the most specific first (a target
    of one architecture before one that runs on every newer GPU); found once per GPU."""
    found = [targets.get(name) for name in targets.names()]
    found = [t for t in found if t.capabilities.runs_on(capability)]
    key = lambda t: (not t.capabilities.devices[1], t.capabilities.devices[0])  # noqa: E731
    return tuple(sorted(found, key=key))


def shipped_spec(
    capability: tuple[int, int], head_dim: int, causal: bool, seqlen_q: int | None = None
) -> str:
    """The example (its name under examples/) that fadsl.attention runs on a GPU of
    ``capability`` for ``head_dim``, the mask and (where the target ships a spec for short
    queries, ``Target.shipped_short``) ``seqlen_q``; ValueError naming what no spec covers."""
    candidates = _candidates(capability)
    for target in candidates:
        if (head_dim, causal) in target.shipped:
            found = target.shipped[head_dim, causal]
            return _short_or(found, target.shipped_short.get((head_dim, causal)), seqlen_q)
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


def _short_or(name: str, short: tuple[int, str] | None, seqlen_q) -> str:
    """``short``'s spec (a ``shipped_short`` entry: longest seqlen_q, name) where seqlen_q is
    at most its limit, else ``name``."""
    # (a comparison, not int(): under torch.compile a symbolic size guards on it only)
    if short is not None and seqlen_q is not None and seqlen_q <= short[0]:
        return short[1]
    return name


def attention_kernel(
    q, causal: bool, window_size=(-1, -1), softcap=0.0, deterministic: bool = False
) -> FlashAttention:
    """The shipped spec's kernel for q's GPU, head dimension, mask and query length (a spec
    for short queries where the target ships one), loaded once (then built once and cached
    like any spec); with a sliding window, a softcap or ``deterministic`` (a backward whose
    gradients are bitwise the same run to run), its variant (attention_variant), chosen once
    per (device, spec, mask, window, softcap, deterministic)."""
    # int(head_dim): under torch.compile(dynamic=True) a size is a SymInt; the kernel is
    # chosen by its value (a guard), as a spec's own head_dim is fixed; seqlen_q is only
    # compared with the short spec's limit (shipped_spec)
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    capability, head_dim = device_capability(q.device), int(q.shape[-1])
    name = shipped_spec(capability, head_dim, causal, q.shape[1])
    check_deterministic(deterministic, window_size, softcap)
    if window == (-1, -1) and type(softcap) in (int, float) and softcap == 0 and not deterministic:
        return _shipped(name)
    key = ("attention", q.device, name, *_typed(causal, window, softcap, deterministic))

    def choose() -> FlashAttention:
        base = data_dir("examples").joinpath(f"{name}.fa").read_text()
        serving_settings(causal, window_size, softcap)  # (checked first: its own messages)
        try:
            variant, text = attention_variant(
                name, base, causal, window_size, softcap, deterministic=deterministic
            )
            return load(text, verbose=False)
        except (SpecError, ValueError) as err:  # e.g. a target without a window or softcap
            first = err.diagnostics[0].message if getattr(err, "diagnostics", None) else str(err)
            asked = f"window_size={tuple(window_size)}, softcap={softcap}"
            raise ValueError(
                f"{'deterministic=True' if deterministic else asked}: the shipped spec {name} "
                f"cannot take them on this GPU ({first})"
            ) from None

    return _chosen(key, choose)


def shipped_fp8_spec(
    capability: tuple[int, int], head_dim: int, causal: bool, dtype, seqlen_q: int | None = None
) -> str:
    """The 8-bit example (its name under examples/) that fadsl.attention runs on 8-bit q of
    ``dtype`` on a GPU of ``capability`` (``Target.shipped_fp8``, or ``shipped_fp8_short``'s
    where ``seqlen_q`` is at most its limit); ValueError naming the unsupported combination
    and the head_dims there are."""
    candidates = _candidates(capability)
    for target in candidates:
        name = target.shipped_fp8.get((head_dim, causal))
        if name is not None:
            return _short_or(name, target.shipped_fp8_short.get((head_dim, causal)), seqlen_q)
    gpu = f"compute capability {capability[0]}.{capability[1]}"
    mask = "causal=True" if causal else "causal=False"
    dims = sorted({d for t in candidates for d, c in t.shipped_fp8 if c == causal})
    needs = "" if dims else "; " + _fp8_targets()
    raise ValueError(
        f"q is {dtype} with q.shape[-1] (head_dim) = {head_dim} and {mask}: no shipped 8-bit "
        f"spec covers it on a GPU of {gpu} (8-bit head_dim {', '.join(map(str, dims)) or 'none'}"
        f" with {mask}{needs})"
    )


def _fp8_targets() -> str:
    """Which targets ship 8-bit specs, and the GPUs they run on (asked of the targets)."""
    shipping = [targets.get(n) for n in targets.names() if targets.get(n).shipped_fp8]
    gpus = [
        f"{t.name}, compute capability {t.capabilities.devices[0][0]}.{t.capabilities.devices[0][1]}"
        + ("" if t.capabilities.devices[1] else " or newer")
        for t in shipping
    ]
    return "8-bit q, k and v need " + (" or ".join(gpus) if gpus else "a target that ships them")


def fp8_attention_kernel(q, causal: bool, out_dtype) -> FlashAttention:
    """The shipped 8-bit spec's kernel for q's GPU, dtype, head dimension, mask and query
    length (a spec for short queries where the target ships one), its variant with `output
    fp16` for out_dtype torch.float16 (bf16 the default); chosen once per (device, spec,
    out_dtype)."""
    from .fp8_calls import check_out_dtype, out_dtypes

    capability, head_dim = device_capability(q.device), int(q.shape[-1])
    name = shipped_fp8_spec(capability, head_dim, causal, q.dtype, q.shape[1])
    key = ("fp8", q.device, name, out_dtype)

    def choose() -> FlashAttention:
        word = out_dtypes()[check_out_dtype(out_dtype)]
        if word == "bf16":  # the examples' own output
            return _shipped(name)
        return _shipped_variant(name, {"output": word}, f"{name}_out_{word}")

    return _chosen(key, choose)


def fp8_varlen_kernel(q, causal: bool, out_dtype, max_seqlen_q=None) -> FlashAttention:
    """fadsl.attention_varlen's kernel on 8-bit q: the shipped 8-bit spec for q's GPU, head
    dimension and mask with `varlen on` (the short queries' spec where ``max_seqlen_q``, an
    int, is within its limit: the host never reads the lengths, so without it the long
    one), `tail whole`, and `output fp16` for out_dtype torch.float16; chosen once per
    (device, head_dim, mask, out_dtype, the limits max_seqlen_q is within)."""
    from .fp8_calls import check_out_dtype, out_dtypes

    seqlen = max_seqlen_q if type(max_seqlen_q) is int else None
    key = ("fp8 varlen", q.device, int(q.shape[-1]), *_typed(causal, out_dtype))
    key += (fp8_short_limits_within(seqlen),)

    def choose() -> FlashAttention:
        capability, head_dim = device_capability(q.device), int(q.shape[-1])
        name = shipped_fp8_spec(capability, head_dim, causal, q.dtype, seqlen)
        word = out_dtypes()[check_out_dtype(out_dtype)]
        # (a spec's tail split is for launches of equal tiles: varlen's run longest first)
        settings = {"varlen": "on", "tail": "whole"}
        if word != "bf16":
            settings["output"] = word
        variant = f"{name}_varlen" + ("" if word == "bf16" else f"_out_{word}")
        return _shipped_variant(name, settings, variant)

    return _chosen(key, choose)


@functools.cache
def _fp8_short_limits() -> tuple[int, ...]:
    """Every target's short-query limits of its 8-bit specs (Target.shipped_fp8_short)."""
    found = {
        limit for n in targets.names() for limit, _ in targets.get(n).shipped_fp8_short.values()
    }
    return tuple(sorted(found))


def fp8_short_limits_within(seqlen: int | None) -> tuple[bool, ...]:
    """Which of the short-query limits ``seqlen`` is within (None: none): all that a choice
    of spec by shipped_fp8_spec reads of it."""
    return tuple(seqlen is not None and seqlen <= limit for limit in _fp8_short_limits())


def _shipped_variant(name: str, settings: dict[str, str], variant: str) -> FlashAttention:
    """The example ``name`` with its setting lines ``settings`` rewritten, as the kernel
    ``variant``, loaded once."""
    kern = _LOADED.get(variant)
    if kern is None:
        base = data_dir("examples").joinpath(f"{name}.fa").read_text()
        kern = _LOADED[variant] = load(rewrite(base, settings, {}, variant), verbose=False)
    return kern


def _shipped(name: str) -> FlashAttention:
    kern = _LOADED.get(name)
    if kern is None:
        text = data_dir("examples").joinpath(f"{name}.fa").read_text()
        kern = _LOADED[name] = load(text, verbose=False)
    return kern


def check_deterministic(deterministic, window_size, softcap) -> None:
    """A call's ``deterministic`` flag: a bool, and only with the plain masks (the
    deterministic twins have no window or softcap yet)."""
    if deterministic is False:
        return
    if type(deterministic) is not bool:
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    if window != (-1, -1) or softcap:
        raise ValueError(
            f"deterministic=True with window_size={window_size}, softcap={softcap}: "
            "deterministic backward blocks are built for the plain masks (no window, no "
            "softcap) so far"
        )


def attention_variant(
    name: str, base: str, causal: bool, window_size, softcap, deterministic: bool = False
) -> tuple[str, str]:
    """(name, text) of the shipped spec ``base`` with a call's mask and softcap
    (serving_settings, which checks them) and the lines its target needs beside them
    (``Target.variant_lines``; sm_90a: `cluster 1` with K and V per CTA and `tail whole`
    for a window, 2 consumer warpgroups and a B_r 64 backward for a softcap, the ordered
    dQ adds' backward block for ``deterministic``)."""
    settings = serving_settings(causal, window_size, softcap)
    text = _with_lines(name, base, settings, causal, forward=True, deterministic=deterministic)
    return _named(name, settings, deterministic), text


def _named(name: str, settings: dict[str, str], deterministic: bool) -> str:
    return variant_name(name, {**settings, **({"bwd": "deterministic"} if deterministic else {})})


def serving_variant(name: str, settings: dict[str, str]) -> str:
    """The text of the serving spec ``name`` (examples/serving/) with a call's lines; with a
    softcap its backward block as its target needs it (``Target.variant_lines``)."""
    base = data_dir("examples").joinpath("serving", f"{name}.fa").read_text()
    causal = settings["mask"].startswith("causal")
    return _with_lines(name, base, settings, causal, forward=False)


def _with_lines(
    name: str,
    base: str,
    settings: dict[str, str],
    causal: bool,
    forward: bool,
    deterministic: bool = False,
) -> str:
    """``base`` with the call's ``settings`` and the target's variant lines (the forward's
    too where ``forward``: the serving specs take the call's lines alone there)."""
    variant = _named(name, settings, deterministic)
    windowed, capped = "window" in settings["mask"], "softcap" in settings
    lines = None
    if windowed or capped or deterministic:  # (else the call's lines, the spec not parsed)
        kernel = front_end(base, f"{name}.fa")
        hook = targets.get(kernel.config.target).variant_lines
        if hook is None and deterministic:
            raise ValueError(f"target {kernel.config.target} has no deterministic backward")
        lines = hook(kernel, windowed, capped, causal, deterministic) if hook else None
    if lines is None:
        return rewrite(base, settings, {}, variant)
    text = rewrite(
        base,
        {**settings, **(lines.settings if forward else {})},
        dict(lines.scopes) if forward else {},
        variant,
    )
    if lines.backward:
        text = rewrite_backward(text, dict(lines.backward), dict(lines.backward_paths), variant)
    return text


_CAPABILITY: dict[int, tuple[int, int]] = {}


def device_capability(device) -> tuple[int, int]:
    """The compute capability of a CUDA device (asked once per device)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _CAPABILITY.get(index)
    if found is None:
        found = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return found


# Serving calls (issue 31): the target's serving spec for the head dimension, with the lines a
# call decides (mask, softcap, the cache's layout, query-head packing, splits) rewritten; each
# variant loaded once (then built once and cached like any spec).
MAX_NAME = 64  # a kernel name's characters (the front end's limit)
_SERVING_LOADED: dict[tuple[str, tuple[tuple[str, str], ...]], FlashAttention] = {}


def shipped_serving_spec(kind: str, capability: tuple[int, int], head_dim: int) -> str:
    """The serving spec (its name under examples/serving/) for ``kind`` ("varlen" or
    "kvcache") on a GPU of ``capability``; ValueError naming what the shipped ones cover."""
    return serving_target(kind, capability, head_dim)[1]


def serving_target(
    kind: str, capability: tuple[int, int], head_dim: int
) -> tuple[targets.Target, str]:
    """The target that ships the serving spec for ``kind`` and ``head_dim`` on a GPU of
    ``capability``, and the spec's name; ValueError naming what the shipped ones cover."""
    candidates = _candidates(capability)
    for target in candidates:
        name = target.shipped_serving.get((kind, head_dim))
        if name is not None:
            return target, name
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


def kvcache_settings(
    k_cache, page_table, heads_q: int, windowed: bool, page_sizes: tuple[int, ...]
) -> dict[str, str]:
    """A kv-cache call's cache lines: `kv_cache paged(N)` with N = k_cache.shape[1] (one of
    the serving target's ``page_sizes``) when a page table comes (else contiguous); PackGQA
    where the group of query heads divides a 64-row tile; splits; neither with a sliding
    window (not built with one)."""
    import torch

    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise ValueError("k_cache must be a 4-D tensor (batch or pages, rows, heads_kv, head_dim)")
    if page_table is None:
        layout = "contiguous"
    else:
        page = int(k_cache.shape[1])  # (a SymInt under dynamic shapes: its value)
        if page not in page_sizes:
            raise ValueError(
                f"k_cache.shape[1] (the page size) = {page}: the shipped kv-cache spec takes "
                f"pages of {', '.join(map(str, page_sizes))} keys"
            )
        layout = f"paged({page})"
    heads_kv = int(k_cache.shape[2])
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
# 32768-token mixes, lengths uniform in [L/8, L] (research/performance-history.md, "Moved from
# docs/performance.md (2026-11-29)"): L = 16384 grid 648-654 / persistent 617-622 TF/s (FA4
# 616-640), L = 4096 576 / 554-599, L = 1024 313 / 363-368.
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
    name = shipped_serving_spec(kind, device_capability(q.device), int(q.shape[-1]))
    return _serving_kernel_of(name, settings)


def _serving_kernel_of(name: str, settings: dict[str, str]) -> FlashAttention:
    """The serving spec ``name`` with ``settings`` written in, loaded once."""
    key = (name, tuple(sorted(settings.items())))
    kern = _SERVING_LOADED.get(key)
    if kern is None:
        kern = _SERVING_LOADED[key] = load(serving_variant(name, settings), verbose=False)
    return kern


# A serving call's kernel by what chooses it (the call's Python arguments and q's and the
# cache's static shape): one dict lookup a call once the first call with them has picked it.
# Each value is keyed with its type, so that True never passes for 1 (the slow path refuses it).
_CHOSEN: dict[tuple, FlashAttention] = {}


def _typed(*values) -> tuple:
    return tuple((type(x), _typed(*x) if type(x) is tuple else x) for x in values)


def _chosen(key, choose) -> FlashAttention:
    try:
        kern = _CHOSEN.get(key)
    except TypeError:  # an unhashable argument: the slow path names it
        return choose()
    if kern is None:
        kern = _CHOSEN[key] = choose()
    return kern


def varlen_kernel(q, causal: bool, window_size, softcap, max_seqlen_q) -> FlashAttention:
    """The shipped varlen spec's variant for the mask, softcap and schedule of a call."""
    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    key = ("varlen", q.device, int(q.shape[-1]), *_typed(causal, window, softcap))
    key += (isinstance(max_seqlen_q, int) and max_seqlen_q >= LONG_CAUSAL_ROWS,)

    def choose() -> FlashAttention:
        settings = serving_settings(causal, window_size, softcap)
        settings.update(varlen_schedule(settings["mask"], max_seqlen_q))
        return _serving_kernel("varlen", q, settings)

    return _chosen(key, choose)


def kvcache_kernel(q, k_cache, page_table, causal: bool, window_size, softcap) -> FlashAttention:
    """The shipped kv-cache spec's variant for the mask, softcap, cache layout and query-head
    packing of a call."""
    import torch

    window = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    layout = None
    if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4:
        layout = (int(k_cache.shape[1]) if page_table is not None else None, int(k_cache.shape[2]))
    key = ("kvcache", q.device, int(q.shape[-1]), int(q.shape[2]), layout)
    key += _typed(causal, window, softcap)

    def choose() -> FlashAttention:
        settings = serving_settings(causal, window_size, softcap)
        windowed = "window" in settings["mask"]
        target, _ = serving_target("kvcache", device_capability(q.device), int(q.shape[-1]))
        cache = kvcache_settings(k_cache, page_table, int(q.shape[2]), windowed, target.page_sizes)
        return _serving_kernel("kvcache", q, settings | cache)

    return _chosen(key, choose)


# 8-bit kv-cache calls (issue 42): the target's ("kvcache_fp8", 128) spec with q's head_dim
# written in, and B_c where the spec's 256 does not build (fadsl check, NVRTC 13.5,
# 2026-12-04): head_dim 256 at 256 keys needs about 312 registers a consumer thread of 256 and
# 410 KB of SMEM (64 keys: 148 KB, no spills); pages of 16 keys (16 boxes a 256-key block)
# spill 24-28 bytes a thread at head_dim 64 and 128 (128 keys: none).
FP8_KVCACHE_HEAD_DIMS = (64, 128, 256)


def fp8_kvcache_block_c(head_dim: int, page: int | None) -> int | None:
    """B_c for an 8-bit kv-cache call where the spec's own does not build; None: the spec's."""
    if head_dim == 256:
        return 64
    if page == 16:
        return 128
    return None


def fp8_kvcache_kernel(q, k_cache, page_table, causal: bool, out_dtype) -> FlashAttention:
    """fadsl.attention_with_kvcache's kernel on 8-bit q: the target's 8-bit kv-cache spec
    with the call's mask, cache layout and query-head packing (as kvcache_kernel's, no
    window or softcap), q's head_dim and `output fp16` for out_dtype torch.float16; chosen
    once per (device, head_dim, heads, cache layout, mask, out_dtype)."""
    import torch

    from .fp8_calls import check_out_dtype, out_dtypes

    layout = None
    if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4:
        layout = (int(k_cache.shape[1]) if page_table is not None else None, int(k_cache.shape[2]))
    key = ("fp8 kvcache", q.device, int(q.shape[-1]), int(q.shape[2]), layout)
    key += _typed(causal, out_dtype)

    def choose() -> FlashAttention:
        head_dim = int(q.shape[-1])
        if head_dim not in FP8_KVCACHE_HEAD_DIMS:
            raise ValueError(
                f"q.shape[-1] (head_dim) = {head_dim} with 8-bit q: fadsl.attention_with_kvcache"
                f" takes 8-bit head_dim {', '.join(map(str, FP8_KVCACHE_HEAD_DIMS))}"
            )
        settings = serving_settings(causal, (-1, -1), 0)
        capability = device_capability(q.device)
        try:
            target, name = serving_target("kvcache_fp8", capability, 128)
        except ValueError:
            gpu = f"compute capability {capability[0]}.{capability[1]}"
            raise ValueError(
                f"q is {q.dtype}: no 8-bit kv-cache spec runs on a GPU of {gpu}; " + _fp8_targets()
            ) from None
        settings |= kvcache_settings(k_cache, page_table, int(q.shape[2]), False, target.page_sizes)
        settings["head_dim"] = str(head_dim)
        block_c = fp8_kvcache_block_c(head_dim, layout[0] if layout else None)
        if block_c is not None:
            settings["tile"] = f"B_r = 64, B_c = {block_c}"
        word = out_dtypes()[check_out_dtype(out_dtype)]
        if word != "bf16":  # (the spec's own output)
            settings["output"] = word
        return _serving_kernel_of(name, settings)

    return _chosen(key, choose)


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
        elif key in ("head_dim", "output"):
            words.append({"head_dim": "hdim", "output": "out_"}[key] + value)
        elif key == "tile":  # (the serving calls write B_c only)
            words.append("bc" + value.rsplit("=", 1)[1].strip())
        else:
            words.append(("softcap " if key == "softcap" else "") + value)
    name = "_".join([base, *(re.sub(r"\W+", "_", w).strip("_") for w in words if w)])
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(repr(sorted(settings.items())).encode()).hexdigest()[:8]
        name = f"{name[: MAX_NAME - 9]}_{digest}"
    return name
