"""The guarded append kernel on the GPU (issue 45; fadsl/runtime/append.py,
emit/common/append_kv.cu): appends into contiguous and paged caches, bf16 and fp16, 1 and 37
new tokens, rows the 16-byte path copies and rows it does not (8 and 36 bytes, a base 2 bytes
off 16), strided new tokens, seqlens_out, a CUDA graph, and the launch path after the first
call; 8-bit caches (float8_e4m3fn, float8_e5m2) the same way, poisoned first, with rows the
kernel copies a byte at a time (odd rows, a base 1 byte off 16, new tokens' rows 24 bytes
apart), also through fadsl.append_kv's plan. Each cache lies inside a larger buffer between
guard regions of a sentinel, and after every append the whole buffer is compared bit for bit
with what the kernel's guards allow. Bad inputs (a length past the capacity, one partly past
it, a negative one, page-table entries -1 and past the cache) each run in a fresh process,
which must end with its CUDA context alive; so does an overflowing append through
fadsl.attention_with_kvcache, whose overflowing batch comes back NaN.
`GPU_TESTS=tests/test_gpu_append_kv.py bash scripts/device.sh tests`."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fadsl
from conftest import ROOT
from fadsl.runtime import append

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)

GUARD = 64  # sentinel elements before and after each cache (128 or 64 bytes: 16-byte bases)
SENTINEL = -1234.0
# 8-bit caches: bytes no new token takes (NaN in both float8 dtypes; randn's values convert
# to finite ones), the guards' and the poison every cache row holds before the append, so
# that each written byte changes
SENTINEL_BYTE, POISON_BYTE = 0xFF, 0x7F
BITS = {2: torch.int16, 1: torch.uint8}  # compared bit for bit, by element size
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]
INT_MAX = 2**31 - 1


class Guarded:
    """A cache of ``shape`` inside a buffer of sentinels, ``offset`` elements past GUARD,
    filled with random values (16-bit) or poisoned (8-bit)."""

    def __init__(self, shape, dtype, offset: int = 0, seed: int = 0, device="cuda"):
        self.shape, self.offset = tuple(shape), offset
        n = math.prod(shape)
        self.bits = BITS[torch.empty((), dtype=dtype).element_size()]
        size = (2 * GUARD + offset + n,)
        if self.bits is torch.uint8:
            raw = torch.full(size, SENTINEL_BYTE, dtype=torch.uint8, device=device)
            raw[GUARD + offset : GUARD + offset + n].fill_(POISON_BYTE)
            self.buffer = raw.view(dtype)
        else:
            self.buffer = torch.full(size, SENTINEL, dtype=dtype, device=device)
        self.cache = self.buffer[GUARD + offset : GUARD + offset + n].view(shape)
        if self.bits is not torch.uint8:
            gen = torch.Generator(device=device).manual_seed(seed)
            self.cache.copy_(torch.randn(self.shape, generator=gen, device=device).to(dtype))
        self.before = self.buffer.cpu().clone()

    def expected(self, new, seqlens, table) -> tuple[torch.Tensor, int]:
        """The buffer's bits after appending ``new`` as the kernel's guards allow (on the
        CPU), and how many rows that writes."""
        want = self.before.view(self.bits).clone()
        cache = want[GUARD + self.offset : GUARD + self.offset + math.prod(self.shape)]
        cache = cache.view(self.shape)
        new, written = new.cpu().view(self.bits), 0
        rows = self.shape[1] if table is None else table.shape[1] * self.shape[1]
        pages = None if table is None else table.tolist()
        for b, s in enumerate(seqlens.tolist()):
            for t in range(new.shape[1]):
                pos = s + t
                if s < 0 or pos >= rows:
                    continue
                if table is None:
                    cache[b, pos] = new[b, t]
                else:
                    page = pages[b][pos // self.shape[1]]
                    if not 0 <= page < self.shape[0]:
                        continue
                    cache[page, pos % self.shape[1]] = new[b, t]
                written += 1
        return want, written

    def check(self, new, seqlens, table, what: str) -> None:
        """The buffer is exactly the expected one: the allowed rows written, nothing else
        (guards, other rows, other batches) changed."""
        want, written = self.expected(new, seqlens, table)
        got = self.buffer.cpu().view(self.bits)
        assert torch.equal(got, want), what
        changed = (got != self.before.view(self.bits))[GUARD + self.offset :]
        changed = changed[: self.cache.numel()]
        row = self.shape[2] * self.shape[3]
        assert changed.view(-1, row).any(dim=1).sum().item() == written, what


def make(paged: bool, batch: int, capacity: int, heads: int, dim: int, dtype, offset=0,
         page_size: int = 16, seed: int = 0):  # fmt: skip
    """Guarded k and v caches and (paged) a shuffled page table with 3 pages no batch owns."""
    if not paged:
        shape = (batch, capacity, heads, dim)
        table = None
    else:
        per_batch = -(-capacity // page_size)
        pages = batch * per_batch + 3
        shape = (pages, page_size, heads, dim)
        gen = torch.Generator(device="cuda").manual_seed(seed + 99)
        table = torch.randperm(pages, device="cuda", generator=gen)[: batch * per_batch]
        table = table.view(batch, per_batch).to(torch.int32).contiguous()
    k = Guarded(shape, dtype, offset, seed)
    v = Guarded(shape, dtype, offset, seed + 1)
    return k, v, table


def new_tokens(batch, new, heads, dim, dtype, seed=5):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(batch, new, heads, dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(batch, new, heads, dim, generator=gen, device="cuda").to(dtype)
    return k, v


def vector16(k, v, k_new, v_new, seqlens, table) -> int:
    fields = append.PARAMS.unpack(append.pack(k.cache, v.cache, k_new, v_new, seqlens, table, None))
    return dict(zip(append.PARAMS_FIELDS, fields))["vector16"]


# (heads, head_dim, offset in elements, the 16-byte path expected)
ROWS = {
    "2x64": (2, 64, 0, 1),
    "1x8-16-bytes": (1, 8, 0, 1),
    "1x4-8-bytes": (1, 4, 0, 0),
    "3x6-36-bytes": (3, 6, 0, 0),
    "2x64-base-off-16": (2, 64, 1, 0),
}


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("new", [1, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_append_writes_exactly_the_new_rows(paged, dtype, new, rows):
    heads, dim, offset, vector = ROWS[rows]
    capacity = 64
    k, v, table = make(paged, 3, capacity, heads, dim, dtype, offset)
    # from empty, from 5 keys, and filling the cache exactly to its capacity
    seqlens = torch.tensor([0, 5, capacity - new], dtype=torch.int32, device="cuda")
    k_new, v_new = new_tokens(3, new, heads, dim, dtype)
    assert vector16(k, v, k_new, v_new, seqlens, table) == vector, "the case's copy path"
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table)
    torch.cuda.synchronize()
    k.check(k_new, seqlens, table, "k")
    v.check(v_new, seqlens, table, "v")


# 8-bit rows: (heads, head_dim, offset in elements (bytes), the 16-byte path expected)
ROWS8 = {
    "2x64": (2, 64, 0, 1),
    "1x16-16-bytes": (1, 16, 0, 1),
    "1x8-8-bytes": (1, 8, 0, 0),
    "3x5-15-bytes": (3, 5, 0, 0),
    "1x1-1-byte": (1, 1, 0, 0),
    "2x64-base-off-16-by-1": (2, 64, 1, 0),
    "3x5-base-odd": (3, 5, 3, 0),
}


@pytest.mark.parametrize("rows", list(ROWS8))
@pytest.mark.parametrize("new", [1, 37])
@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_8_bit_append_writes_exactly_the_new_bytes(paged, dtype, new, rows):
    """8-bit tokens into a poisoned 8-bit cache: the kernel copies bytes (16 at a time, or
    one where rows or bases are odd), compared byte for byte with the torch reference."""
    heads, dim, offset, vector = ROWS8[rows]
    capacity = 64
    k, v, table = make(paged, 3, capacity, heads, dim, dtype, offset)
    seqlens = torch.tensor([0, 5, capacity - new], dtype=torch.int32, device="cuda")
    k_new, v_new = new_tokens(3, new, heads, dim, dtype)
    assert vector16(k, v, k_new, v_new, seqlens, table) == vector, "the case's copy path"
    fields = append.PARAMS.unpack(append.pack(k.cache, v.cache, k_new, v_new, seqlens, table, None))
    assert dict(zip(append.PARAMS_FIELDS, fields))["elem_bytes"] == 1
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table)
    torch.cuda.synchronize()
    k.check(k_new, seqlens, table, "k")
    v.check(v_new, seqlens, table, "v")


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_8_bit_new_tokens_with_rows_24_bytes_apart(paged, dtype):
    """16-byte rows whose new tokens lie 24 bytes apart (a row stride not a multiple of 16:
    one byte a step, though rows and bases allow 16)."""
    k, v, table = make(paged, 3, 40, 1, 16, dtype)
    seqlens = torch.tensor([3, 0, 20], dtype=torch.int32, device="cuda")
    wide, _ = new_tokens(3, 7, 1, 24, dtype, seed=8)
    k_new = wide[..., :16]
    _, v_new = new_tokens(3, 7, 1, 16, dtype, seed=9)
    assert k_new.stride(1) == 24 and vector16(k, v, k_new, k_new, seqlens, table) == 0
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table)
    torch.cuda.synchronize()
    k.check(k_new, seqlens, table, "k")
    v.check(v_new, seqlens, table, "v")


def _off_by_one(t):
    """``t``'s values at an address 1 byte past 16-byte alignment."""
    n = t.numel() * t.element_size()
    raw = torch.zeros(n + 16, dtype=torch.uint8, device=t.device)[1 : 1 + n]
    return raw.view(t.dtype).view(t.shape).copy_(t)


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_8_bit_appends_through_fadsl_append_kv_and_its_plan(dtype):
    """fadsl.append_kv plans the call at its second meeting and then rewrites only the
    addresses and the 16-byte flag (8 bytes at VECTOR16_OFFSET): elem_bytes stays 1, and new
    tokens at an odd address are copied a byte at a time."""
    k, v, table = make(True, 3, 64, 2, 64, dtype)
    seqlens = torch.tensor([1, 17, 40], dtype=torch.int32, device="cuda")
    k_new, v_new = new_tokens(3, 2, 2, 64, dtype)
    odd = _off_by_one(k_new)
    assert odd.data_ptr() % 2 == 1 and torch.equal(odd.view(torch.uint8), k_new.view(torch.uint8))
    for new in (k_new, k_new, odd, k_new):  # the second call plans it
        k.buffer.copy_(k.before.cuda())
        v.buffer.copy_(v.before.cuda())
        fadsl.append_kv(k.cache, v.cache, new, v_new, seqlens, table)
        torch.cuda.synchronize()
        k.check(k_new, seqlens, table, "k")
        v.check(v_new, seqlens, table, "v")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_strided_new_tokens(paged):
    """k_new a slice of a longer tensor (its strides in the params), v_new with transposed
    rows (copied first)."""
    k, v, table = make(paged, 3, 40, 2, 32, torch.float16)
    seqlens = torch.tensor([3, 0, 20], dtype=torch.int32, device="cuda")
    longer, _ = new_tokens(3, 11, 2, 32, torch.float16, seed=8)
    k_new = longer[:, 2:9]
    v_new = torch.randn(3, 7, 32, 2, device="cuda").to(torch.float16).transpose(2, 3)
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table)
    torch.cuda.synchronize()
    k.check(k_new, seqlens, table, "k")
    v.check(v_new.contiguous(), seqlens, table, "v")


def test_seqlens_out_advances_and_saturates():
    k, v, table = make(True, 5, 64, 1, 8, torch.bfloat16)
    seqlens = torch.tensor([3, 0, 60, INT_MAX - 1, -5], dtype=torch.int32, device="cuda")
    k_new, v_new = new_tokens(5, 4, 1, 8, torch.bfloat16)
    out = torch.full_like(seqlens, 77)
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table, seqlens_out=out)
    torch.cuda.synchronize()
    assert out.tolist() == [7, 4, 64, INT_MAX, -5]
    assert seqlens.tolist() == [3, 0, 60, INT_MAX - 1, -5], "cache_seqlens is only read"
    k.check(k_new, seqlens, table, "k")
    v.check(v_new, seqlens, table, "v")
    # no new token: nothing launched, the lengths copied
    out.fill_(77)
    empty = k_new[:, :0]
    append.append_kv(k.cache, v.cache, empty, empty, seqlens, table, seqlens_out=out)
    assert out.tolist() == seqlens.tolist()
    # written while the CTAs read cache_seqlens: refused
    with pytest.raises(ValueError, match="seqlens_out must not overlap cache_seqlens"):
        append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table, seqlens_out=seqlens)
    wider = torch.zeros(6, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="seqlens_out must not overlap cache_seqlens"):
        append.append_kv(k.cache, v.cache, k_new, v_new, wider[:5], table, seqlens_out=wider[1:])


def test_a_cuda_graph_captures_the_append():
    """Nothing in the append waits for the device: it is captured and replayed."""
    k, v, table = make(True, 3, 64, 2, 64, torch.bfloat16)
    seqlens = torch.tensor([1, 17, 40], dtype=torch.int32, device="cuda")
    out = torch.zeros_like(seqlens)
    k_new, v_new = new_tokens(3, 2, 2, 64, torch.bfloat16)
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table, seqlens_out=out)  # loaded
    torch.cuda.synchronize()
    k.buffer.copy_(k.before.cuda())
    v.buffer.copy_(v.before.cuda())
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table, seqlens_out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [3, 19, 42]
    k.check(k_new, seqlens, table, "k")
    v.check(v_new, seqlens, table, "v")


def test_after_the_first_call_nothing_is_read_or_built(monkeypatch):
    k, v, table = make(False, 2, 32, 2, 64, torch.bfloat16)
    seqlens = torch.tensor([0, 9], dtype=torch.int32, device="cuda")
    k_new, v_new = new_tokens(2, 3, 2, 64, torch.bfloat16)
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table)

    def refuse(*args, **kwargs):
        raise AssertionError("read or built again")

    for name in ("source", "cubin", "compile_cubin", "request", "_module"):
        monkeypatch.setattr(append, name, refuse)
    monkeypatch.setattr(append.cache, "get_or_build", refuse)
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens + 3, table)
    torch.cuda.synchronize()


# --- bad inputs, each in a fresh process --------------------------------------------------


def bad_case(case: str, paged: bool) -> None:
    """One bad input, run by a fresh process (tests below): batch 1 is the bad one; batches
    0 and 2 are appended as usual; then the CUDA context must still work."""
    capacity, new = 64, 5
    k, v, table = make(paged, 3, capacity, 2, 64, torch.bfloat16, seed=3)
    lengths = [4, 10, 50]
    if case == "past":
        lengths[1] = capacity + 1
    elif case == "partly_past":
        lengths[1] = capacity - new + 1  # the first new - 1 tokens fit, the last does not
    elif case == "at_capacity":
        lengths[1] = capacity  # full: nothing fits
    elif case == "negative":
        lengths[1] = -3
    elif case == "int_max":
        lengths[1] = INT_MAX  # s + t overflows 32 bits
    elif case in ("page_minus_one", "page_past_the_cache"):
        table[1, 0] = -1 if case == "page_minus_one" else k.shape[0]
        table[1, 3] = k.shape[0] + 1000  # past the pages batch 1 reaches: never read
        lengths[1] = 12  # tokens 12..16: the first four in the bad page, the last in page 1
    else:
        raise AssertionError(case)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    k_new, v_new = new_tokens(3, new, 2, 64, torch.bfloat16)
    out = torch.zeros_like(seqlens)
    append.append_kv(k.cache, v.cache, k_new, v_new, seqlens, table, seqlens_out=out)
    torch.cuda.synchronize()
    k.check(k_new, seqlens, table, f"k, {case}")
    v.check(v_new, seqlens, table, f"v, {case}")
    want = [s + new if s >= 0 else s for s in lengths]
    assert out.tolist() == [min(w, INT_MAX) for w in want]
    # the context is alive: a torch op and a sync succeed
    assert torch.ones(1000, device="cuda").sum().item() == 1000
    torch.cuda.synchronize()


def in_fresh_process(call: str) -> None:
    """Run ``call`` (an expression on this module, ``t``) in a new Python process importing
    the fadsl this one imported; it must print 'alive' and exit 0."""
    paths = [str(Path(fadsl.__file__).resolve().parent.parent), str(ROOT / "tests")]
    code = (
        f"import sys; sys.path[:0] = {paths!r}\n"
        "import test_gpu_append_kv as t\n"
        f"{call}\n"
        "print('alive')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("alive"), (
        proc.stdout[-3000:] + proc.stderr[-3000:]
    )


BAD = ["past", "partly_past", "at_capacity", "negative", "int_max"]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", BAD)
def test_bad_lengths_write_nothing_out_of_bounds(case, paged):
    in_fresh_process(f"t.bad_case({case!r}, {paged!r})")


@pytest.mark.parametrize("case", ["page_minus_one", "page_past_the_cache"])
def test_bad_pages_write_nothing(case):
    in_fresh_process(f"t.bad_case({case!r}, True)")


def overflowing_attention() -> None:
    """fadsl.attention_with_kvcache with new tokens that overflow batch 1's cache (run by a
    fresh process): batch 1's rows NaN, the others finite; the tokens that fit written,
    nothing else; the context alive."""
    page, max_pages, hkv, d = 64, 4, 8, 128
    capacity = page * max_pages
    k, v, table = make(True, 3, capacity, hkv, d, torch.bfloat16, page_size=page, seed=11)
    seqlens = torch.tensor([10, capacity - 2, 100], dtype=torch.int32, device="cuda")
    k_new, v_new = new_tokens(3, 4, hkv, d, torch.bfloat16)
    q = torch.randn(3, 4, 32, d, device="cuda", dtype=torch.bfloat16)
    out = fadsl.attention_with_kvcache(q, k.cache, v.cache, seqlens, k_new, v_new, page_table=table)
    torch.cuda.synchronize()
    assert out[1].isnan().all(), "the overflowing batch's rows are NaN"
    assert out[0].isfinite().all() and out[2].isfinite().all(), "the other batches"
    k.check(k_new, seqlens, table, "k")
    v.check(v_new, seqlens, table, "v")
    assert torch.ones(1000, device="cuda").sum().item() == 1000
    torch.cuda.synchronize()


@pytest.mark.skipif(not HOPPER, reason="the shipped kv-cache spec needs a Hopper GPU")
def test_an_overflowing_append_through_attention_gives_nan_rows():
    in_fresh_process("t.overflowing_attention()")
