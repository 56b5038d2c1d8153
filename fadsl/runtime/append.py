"""``append_kv``: write new tokens' keys and values into a KV cache after each batch's
``cache_seqlens[b]`` keys, with one guarded kernel (emit/common/append_kv.cu).

The lengths and the page table stay on the device: nothing here reads them back, so the
append never waits for the GPU and a CUDA graph captures it with the decode step. The kernel
checks them instead. A token whose position ``cache_seqlens[b] + t`` is past its batch's
capacity (the cache's rows, or max_pages x page_size), a batch whose length is negative, and
a page-table entry outside the cache are not written at all: nothing lands out of bounds and
no device-side assert fires, since one malformed request must not end the process's CUDA
context (and with it every other request a server holds). A batch appended partly past its
capacity gets the tokens that fit. The attention call after it (the kernel checks the
lengths the same way) makes the rows of a batch whose length is outside 0 .. capacity NaN,
and those of every tile that reads a page outside the cache, so the error shows where it
happened and nowhere else.

``seqlens_out`` (optional) receives ``cache_seqlens + seqlen_new`` on the device, saturated
at 2^31 - 1 so that an overflowing length stays out of range (a negative one is copied
as it is); it must not overlap ``cache_seqlens``, which the kernel's CTAs read while it is
written.
"""

from __future__ import annotations

import functools
import struct
import threading

from .._data import cache_dir, data_dir
from ..build import cache
from ..build.nvrtc import compile_cubin
from ..targets.archs import arch_for
from ..targets.launch import current_stream

KERNEL = "fadsl_append_kv"
THREADS = 128
MAX_GRID_Y = 65535  # the kernel loops over the batches past it

# AppendKvParams (emit/common/append_kv.cu): 7 pointers, 12 long long, 5 int, 4 bytes of
# padding to the struct's 8-byte alignment; 176 bytes. tests/test_append_kv.py checks every
# offset against the CUDA struct. elem_bytes (the copy's unit without 16-byte vectors) is a
# long long so that vector16 stays the last int, 8-byte aligned with the padding after it:
# a plan writes it as an 8-byte field (SOURCES below).
PARAMS = struct.Struct("<7Q12q5i4x")
PARAMS_FIELDS = (
    *("k_new", "v_new", "k_cache", "v_cache", "seqlens", "page_table", "seqlens_out"),
    *(f"{t}_{d}_stride" for t in ("k_new", "v_new") for d in ("batch", "row")),
    *(f"{t}_{d}_stride" for t in ("k_cache", "v_cache") for d in ("batch", "row")),
    *("page_table_stride", "capacity", "num_pages", "elem_bytes"),
    *("row_bytes", "new_tokens", "page_size", "batch", "vector16"),
)

_MODULES: dict[int, object] = {}  # device index -> the loaded kernel
_LOCK = threading.Lock()


@functools.cache
def source() -> str:
    """The kernel's source, read once (from the installed package's data, or the checkout)."""
    return data_dir("emit").joinpath("common").joinpath("append_kv.cu").read_text()


def request(arch: str) -> cache.Request:
    return cache.Request(
        kernel=KERNEL,
        filename="append_kv.cu",
        text=source(),
        headers="",
        normalised="append_kv",
        arch=arch,
    )


def cubin(arch: str) -> bytes:
    """The kernel's cubin for ``arch``, from fadsl's cache (built once if missing)."""
    text = source()
    entry = cache.get_or_build(
        request(arch),
        build=lambda: compile_cubin(text, "append_kv.cu", KERNEL, arch, cache_dir()),
        announce=False,
    )
    return entry.cubin


def _module(index: int):
    """The kernel loaded and prepared on device ``index`` (once per device)."""
    import torch

    from .driver import Module

    with _LOCK:
        module = _MODULES.get(index)
        if module is None:
            binary = cubin(arch_for(torch.cuda.get_device_capability(index)))
            with torch.cuda.device(index):
                module = Module(binary, KERNEL, 0, THREADS)
                module.prepare(index)
            _MODULES[index] = module
    return module


def _tensor(name: str, t, what: str) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be a 4-D tensor {what}, got shape {tuple(t.shape)}")


def _rows_contiguous(t) -> bool:
    """Whether each (heads_kv, head_dim) row is one contiguous run (size-1 dims' strides do
    not matter)."""
    heads, dim = t.shape[2], t.shape[3]
    return (dim == 1 or t.stride(3) == 1) and (heads == 1 or t.stride(2) == dim)


def _int32(name: str, t, length: int, batch_of: str, dims: int = 1) -> None:
    """An int32 tensor of ``dims`` dimensions, ``length`` rows, contiguous last dimension
    (the device is checked with the others')."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32 or t.dim() != dims:
        raise ValueError(
            f"{name} must be a {dims}-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}"
        )
    if t.shape[0] != length:
        raise ValueError(f"{name} has {t.shape[0]} rows; {batch_of}'s batch is {length}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension; pass {name}.contiguous()"
        )


def check_append(
    k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out, names=("k_new", "v_new")
):
    """Every check of an append, each error naming the argument (no memory access: fake
    tensors pass; ``names``: what the caller calls k_new and v_new, attention_with_kvcache
    k and v); returns k_new and v_new with contiguous rows (copies where needed).

    The caches take fadsl's dtypes (arguments.torch_dtypes: bfloat16, float16 and the 8-bit
    float8_e4m3fn, float8_e5m2), k_cache and v_cache the same one, and k_new, v_new must
    have the cache's dtype: the append copies bytes and converts nothing, so the caller
    quantizes new tokens for an 8-bit cache with the cache's descales (FlashAttention-3's
    hopper/ wants k_new in the cache's dtype too, read 2026-12-04)."""
    kn, vn = names
    import torch

    from .arguments import torch_dtypes

    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _tensor(name, t, "(batch, capacity, heads_kv, head_dim) or (pages, page_size, ...)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    accepted = tuple(torch_dtypes())
    if k_cache.dtype not in accepted or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must have the same dtype, one of "
            f"{', '.join(map(str, accepted))}, got {k_cache.dtype} and {v_cache.dtype}"
        )
    if k_cache.shape[2] == 0 or k_cache.shape[3] == 0:
        raise ValueError(f"k_cache has no head or no head_dim (shape {tuple(k_cache.shape)})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _rows_contiguous(t):
            raise ValueError(
                f"{name} is written in place, so each (heads_kv, head_dim) row must be "
                f"contiguous (strides (..., head_dim, 1)), got strides {t.stride()}"
            )
    for name, t in ((kn, k_new), (vn, v_new)):
        _tensor(name, t, "(batch, seqlen_new, heads_kv, head_dim)")
        if t.shape[2:] != k_cache.shape[2:] or t.dtype != k_cache.dtype:
            hint = ""
            if t.dtype != k_cache.dtype and k_cache.element_size() == 1:
                hint = " (quantize the new tokens with the cache's descales first)"
            raise ValueError(
                f"{name} {tuple(t.shape)} {t.dtype} does not match the cache's heads, head_dim and "
                f"dtype {tuple(k_cache.shape[2:])} {k_cache.dtype}{hint}"
            )
    if k_new.shape != v_new.shape:
        raise ValueError(
            f"{kn} and {vn} must have the same shape, got {tuple(k_new.shape)} and "
            f"{tuple(v_new.shape)}"
        )
    batch, new = k_new.shape[0], k_new.shape[1]
    if new >= 2**31:
        raise ValueError(f"{kn} has {new} new tokens; at most 2^31 - 1 a call")
    _int32("cache_seqlens", cache_seqlens, batch, kn)
    if page_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"{kn} has batch {batch} but k_cache has {k_cache.shape[0]}")
    else:
        _int32("page_table", page_table, batch, kn, dims=2)
        if k_cache.shape[1] == 0:
            raise ValueError(f"k_cache has pages of no row (shape {tuple(k_cache.shape)})")
    if seqlens_out is not None:
        _int32("seqlens_out", seqlens_out, batch, kn)
    # devices last (so that the checks above can be tested on any device)
    device = k_cache.device
    named = (
        ("v_cache", v_cache),
        (kn, k_new),
        (vn, v_new),
        ("cache_seqlens", cache_seqlens),
        ("page_table", page_table),
        ("seqlens_out", seqlens_out),
    )
    for name, t in named:
        if t is not None and t.device != device:
            raise ValueError(f"{name} must be on k_cache's device {device}, got {t.device}")
    if device.type != "cuda":
        raise ValueError(f"k_cache must be on a CUDA device, got {device}")
    if seqlens_out is not None and batch > 0:
        gap = seqlens_out.data_ptr() - cache_seqlens.data_ptr()
        if -4 * batch < gap < 4 * batch:
            raise ValueError(
                "seqlens_out must not overlap cache_seqlens (the kernel reads each length "
                "while the new ones are written): pass another tensor"
            )
    if not _rows_contiguous(k_new):
        k_new = k_new.contiguous()
    if not _rows_contiguous(v_new):
        v_new = v_new.contiguous()
    return k_new, v_new


def pack(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out) -> bytes:
    """The AppendKvParams of checked arguments (strides in bytes)."""
    e = k_cache.element_size()
    strides = byte_strides(k_cache, v_cache, k_new, v_new)
    pointers = (k_new.data_ptr(), v_new.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * e
    vector16 = all(x % 16 == 0 for x in (*pointers, *strides, row_bytes))
    if page_table is None:
        table, table_stride, capacity, pages, page_size = 0, 0, k_cache.shape[1], 0, 0
    else:
        table, table_stride = page_table.data_ptr(), page_table.stride(0)
        page_size, pages = k_cache.shape[1], k_cache.shape[0]
        capacity = page_table.shape[1] * page_size
    return PARAMS.pack(
        *pointers,
        cache_seqlens.data_ptr(),
        table,
        0 if seqlens_out is None else seqlens_out.data_ptr(),
        *strides,
        table_stride,
        capacity,
        pages,
        e,
        row_bytes,
        k_new.shape[1],
        page_size,
        k_new.shape[0],
        int(vector16),
    )


def byte_strides(k_cache, v_cache, k_new, v_new) -> tuple[int, ...]:
    """The batch and row strides of k_new, v_new, k_cache and v_cache, in bytes."""
    e = k_cache.element_size()
    ks, vs, kn, vn = k_cache.stride(), v_cache.stride(), k_new.stride(), v_new.stride()
    return (kn[0] * e, kn[1] * e, vn[0] * e, vn[1] * e, ks[0] * e, ks[1] * e, vs[0] * e, vs[1] * e)


# A plan of the append (fadsl/runtime/plans.py): the addresses in AppendKvParams, in its
# order (the first seven fields, 8 bytes each), then the 16-byte flag, which depends on the
# four tensors' addresses: written as an 8-byte field (the int and the struct's 4 bytes of
# padding after it, zeros).
SOURCES = PARAMS_FIELDS[:7] + ("vector16",)
VECTOR16_OFFSET = struct.calcsize("<7Q12q4i")
assert VECTOR16_OFFSET % 8 == 0 and VECTOR16_OFFSET + 8 == PARAMS.size  # the 8-byte write


def grid(k_new) -> tuple[int, int, int]:
    """A CTA per new token and batch (the kernel loops over the batches past MAX_GRID_Y)."""
    return (k_new.shape[1], min(k_new.shape[0], MAX_GRID_Y), 1)


def plan_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out):
    """The append's launch as a plan (``targets.launch.CallPlan``) of arguments check_append
    has passed (its k_new and v_new), with at least one new token and one batch."""
    from ..targets.launch import AddressSlot, CallPlan, KernelStep

    params = pack(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out)
    given = (True,) * 5 + (page_table is not None, seqlens_out is not None)
    slots = [AddressSlot(8 * i, name) for i, name in enumerate(SOURCES[:7]) if given[i]]
    slots.append(AddressSlot(VECTOR16_OFFSET, "vector16"))
    return CallPlan(params, (KernelStep("", grid(k_new), (THREADS, 1, 1)),), tuple(slots))


def vector16_by_strides(k_cache, v_cache, k_new, v_new) -> bool:
    """Whether the strides and the row allow 16-byte vectors (the addresses must too)."""
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    return all(x % 16 == 0 for x in (*byte_strides(k_cache, v_cache, k_new, v_new), row_bytes))


def append_kv(
    k_cache, v_cache, k_new, v_new, cache_seqlens, page_table=None, seqlens_out=None
) -> None:
    """Write k_new and v_new (batch, seqlen_new, heads_kv, head_dim) into the caches after
    each batch's cache_seqlens[b] keys (FlashAttention-3's AppendKV, as an op beside the
    attention call): contiguous caches (batch, capacity, heads_kv, head_dim), or paged ones
    (pages, page_size, heads_kv, head_dim) through page_table (batch, max_pages) int32.
    Caches of bfloat16, float16, float8_e4m3fn or float8_e5m2; k_new and v_new of the
    cache's dtype (for an 8-bit cache the caller quantizes them with the cache's descales).
    cache_seqlens: (batch,) int32 on the caches' device. One kernel on the current stream,
    with no host sync (a CUDA graph captures it): tokens past a batch's capacity, a negative
    length and page-table entries outside the cache are skipped on the device (see the
    module's docstring). seqlens_out, if given ((batch,) int32, not cache_seqlens itself),
    receives cache_seqlens + seqlen_new; otherwise the caller advances the lengths. With
    no new token (or no batch) nothing is launched."""
    k_new, v_new = check_append(
        k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out
    )
    launch_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out)


def launch_append(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out):
    """append_kv's launch, of arguments check_append has passed (its k_new and v_new)."""
    import torch

    batch, new = k_new.shape[0], k_new.shape[1]
    if batch == 0 or new == 0:
        if seqlens_out is not None and batch:
            seqlens_out.copy_(cache_seqlens)  # on the device: the lengths, unchanged
        return
    index = k_cache.device.index
    module = _MODULES.get(index) or _module(index)
    params = pack(k_cache, v_cache, k_new, v_new, cache_seqlens, page_table, seqlens_out)
    if index == torch.cuda.current_device():
        module.launch(grid(k_new), (THREADS, 1, 1), params, current_stream(index))
    else:
        with torch.cuda.device(index):
            module.launch(grid(k_new), (THREADS, 1, 1), params, current_stream(index))


def module(index: int):
    """The kernel loaded and prepared on device ``index``."""
    return _MODULES.get(index) or _module(index)
