"""8-bit (FP8) attention over a KV cache on the GPU (issue 42, research/fp8-forward.md §14):
examples/serving/fa3_fp8_decode_paged.fa (paged(64), pack_gqa on, splits auto, causal, head_dim
128, O bf16) and tests/specs/fp8/fa3_fp8_kvcache_hdim64.fa (contiguous, pack_gqa off, splits
auto, no mask, head_dim 64, O fp16) through kern.kvcache, both 8-bit dtypes. Inputs are N(0, 1)
stored as t / descale per (batch, K/V head) (tests/test_gpu_fp8.py's encoded_inputs, here on
the cache's shuffled pages), each batch's rows against float64 attention of its first
cache_seqlens[b] dequantized keys with tests/test_gpu_fp8.py's bounds (test_gpu_fp8_varlen's
check_sequence: rows with no key O = 0 and LSE -inf); O poisoned with NaN first. Also: descales
far apart (a reading of batch 0's row, or of the query head's column, fails the bound),
split pieces combined from a NaN-poisoned workspace, append_kv then attend, bad lengths and
pages as NaN rows of their batch only, bad arguments named, and fadsl.attention_with_kvcache
on 8-bit inputs (new tokens and descales; torch.compile giving the eager bits).
`GPU_TESTS=tests/test_gpu_fp8_kvcache.py bash scripts/device.sh tests`."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from fadsl.frontend.rewrite import rewrite
from conftest import ROOT
from test_gpu_fp8 import DTYPES, E4M3, E5M2
from test_gpu_fp8_varlen import check_sequence, random_descales
from test_gpu_kvcache import kernel as kernel_16bit, make_cache

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

DECODE = ROOT / "examples/serving/fa3_fp8_decode_paged.fa"


def _decode_variant(settings: dict, name: str) -> str:
    """The decode example with ``settings`` written in (dispatch.fp8_kvcache_kernel's B_c
    where the example's 256 does not build: head_dim 256, pages of 16 keys)."""
    return rewrite(DECODE.read_text(), settings, {}, name)


# name -> (spec, O's dtype, (heads_q, heads_kv)): GQA 4 packed, GQA 3 unpacked
SPECS = {
    "paged": (DECODE, torch.bfloat16, (8, 2)),
    "contiguous64": (ROOT / "tests/specs/fp8/fa3_fp8_kvcache_hdim64.fa", torch.float16, (6, 2)),
    "hdim256": (
        _decode_variant({"head_dim": "256", "tile": "B_r = 64, B_c = 64"}, "fp8_decode_hd256"),
        torch.bfloat16,
        (8, 2),
    ),
    "pages16": (
        _decode_variant({"kv_cache": "paged(16)", "tile": "B_r = 64, B_c = 128"}, "fp8_decode_p16"),
        torch.bfloat16,
        (8, 2),
    ),
}
LENGTHS = [0, 1, 63, 64, 65, 1000]  # no key, one, page and block edges, many blocks
CAPACITY = 1100
_loaded: dict[str, object] = {}


def kernel(spec: str):
    if spec not in _loaded:
        _loaded[spec] = fadsl.load(SPECS[spec][0], verbose=False)
    return _loaded[spec]


def encode(t, descale, owner, hkv: int, dtype):
    """t / descale in the 8-bit type, t[i] scaled by the descale's row owner[i] (each head by
    its K/V head's column; None: 1): t8 * descale is t to within the type's rounding."""
    if descale is not None:
        per_head = descale[owner].repeat_interleave(t.shape[2] // hkv, dim=1)
        t = t / per_head[:, None, :, None]
    return t.to(dtype)


def owners(table, entries: int):
    """The batch of each entry of a cache's first axis: a contiguous cache's own index, a
    page's the batch whose page-table row holds it (0 for the unused pages)."""
    if table is None:
        return torch.arange(entries, device="cuda")
    owner = torch.zeros(entries, dtype=torch.long, device="cuda")
    batches = torch.arange(table.shape[0], device="cuda").repeat_interleave(table.shape[1])
    owner[table.flatten().long()] = batches
    return owner


def gather(cache, table, b: int, n: int):
    """Batch b's first n keys (or values) of a cache, (1, n, heads_kv, head_dim), 8-bit."""
    if table is None:
        return cache[b : b + 1, :n]
    page = cache.shape[1]
    rows = table[b, : -(-n // page)].long()
    flat = cache.view(torch.uint8)[rows].reshape(1, len(rows) * page, *cache.shape[2:])
    return flat[:, :n].view(cache.dtype)


def fp8_cache(kern, heads, lengths, sq: int, dtype, descales, seed: int, capacity=CAPACITY):
    """q8 (batch, sq, heads_q, head_dim) and 8-bit caches (make_cache's, shuffled page table)
    of N(0, 1) stored as t / descale, each (batch, K/V head) its own; the lengths, the table."""
    hq, hkv = heads
    d = kern.config.head_dim
    k, v, seqlens, table, _ = make_cache(kern, lengths, hkv, d, torch.float32, capacity, seed)
    q = torch.randn(len(lengths), sq, hq, d, device="cuda")
    q8 = encode(q, descales[0], torch.arange(len(lengths), device="cuda"), hkv, dtype)
    owner = owners(table, k.shape[0])
    k8, v8 = (encode(t, s, owner, hkv, dtype) for t, s in zip((k, v), descales[1:]))
    return q8, k8, v8, seqlens, table


def named(descales) -> dict:
    return dict(zip(("q_descale", "k_descale", "v_descale"), descales))


def call(spec, q8, k8, v8, seqlens, table, descales, splits=None, fill=math.nan):
    """kern.kvcache into out= filled with ``fill`` (the allocator's free blocks too: the LSE),
    returning (out, lse)."""
    out = torch.full(q8.shape, fill, device="cuda", dtype=SPECS[spec][1])
    junk = torch.full((8 * q8.numel() + 1024,), fill, device="cuda")
    del junk
    got, lse = kernel(spec).kvcache(q8, k8, v8, seqlens, table, num_splits=splits, out=out,
                                    return_lse=True, **named(descales))  # fmt: skip
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr() and got.dtype == SPECS[spec][1]
    assert lse.shape == (q8.shape[0], q8.shape[2], q8.shape[1]) and lse.dtype == torch.float32
    return out, lse


def check_batches(kern, out, lse, q8, k8, v8, table, lengths, descales, what, skip=()):
    """Each batch's rows (but ``skip``'s) against float64 attention of its first lengths[b]
    dequantized keys, its descales' row b (check_sequence)."""
    causal = kern.config.mask.value == "causal"
    scale = kern.config.head_dim**-0.5
    for b, n in enumerate(lengths):
        if b not in skip:
            rows = tuple(None if t is None else t[b : b + 1] for t in descales)
            kb, vb = gather(k8, table, b, n), gather(v8, table, b, n)
            name = f"{what}: batch {b} ({n} keys)"
            check_sequence(out[b], lse[b], q8[b : b + 1], kb, vb, rows, scale, causal, name)


CASES = [
    (spec, name, sq, splits)
    for spec in SPECS
    for name in DTYPES
    for sq in (1, 3)
    for splits in (None, 1, 3)
]


@pytest.mark.parametrize(
    "spec, name, sq, splits", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_fp8_kvcache_matches_each_batch(spec, name, sq, splits):
    """Lengths 0, 1, 63, 64, 65 and 1000, decode (1 query) and 3 queries (causal: rows of the
    short caches that see no key), automatic, whole-tile and 3-piece splits; random descales
    per (batch, K/V head)."""
    kern, heads = kernel(spec), SPECS[spec][2]
    descales = random_descales(len(LENGTHS), heads[1], seed=sq * 7 + (splits or 0))
    q8, k8, v8, seqlens, table = fp8_cache(kern, heads, LENGTHS, sq, DTYPES[name], descales,
                                           seed=sq * 13 + (splits or 0))  # fmt: skip
    out, lse = call(spec, q8, k8, v8, seqlens, table, descales, splits)
    check_batches(kern, out, lse, q8, k8, v8, table, LENGTHS, descales, f"{spec} {name}")


# (batch, K/V head) descales over 2^-3 .. 2^3: every row differs from batch 0's, and every
# batch's two columns differ (v's by 2x or more, so a wrong reading moves O past the bound)
QD = [[0.125, 2.0], [4.0, 0.25], [1.0, 8.0], [0.5, 0.125]]
KD = [[1.0, 0.125], [0.25, 4.0], [8.0, 0.5], [2.0, 0.25]]
VD = [[0.5, 4.0], [8.0, 0.125], [0.25, 2.0], [4.0, 0.5]]


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("spec", list(SPECS))
def test_each_batch_and_kv_head_reads_its_own_descales(spec, name):
    """The kernel matches the reference that reads descale row b, column h // G for query
    head h of batch b; the references reading batch 0's row for every batch, or column
    h % heads_kv (the query head's, not its K/V head's), fail the bound (checked, so that the
    test tells such a kernel apart)."""
    kern, (hq, hkv) = kernel(spec), SPECS[spec][2]
    lengths = [300, 1, 65, 1000]
    descales = tuple(torch.tensor(t, device="cuda") for t in (QD, KD, VD))
    q8, k8, v8, seqlens, table = fp8_cache(kern, (hq, hkv), lengths, 3, DTYPES[name], descales,
                                           seed=23)  # fmt: skip
    out, lse = call(spec, q8, k8, v8, seqlens, table, descales)
    check_batches(kern, out, lse, q8, k8, v8, table, lengths, descales, name)
    causal, scale = kern.config.mask.value == "causal", kern.config.head_dim**-0.5
    own = [h // (hq // hkv) for h in range(hq)]  # each query head's K/V head
    crossed = [h % hkv for h in range(hq)]
    for b, n in enumerate(lengths):
        # K and V per query head, and descales (1, heads_q): any head -> column reading
        kb, vb = (gather(t, table, b, n).double()[:, :, own] for t in (k8, v8))
        readings = {"its own": (b, own), "batch 0's": (0, own), "by query head": (b, crossed)}
        for what, (row, columns) in readings.items():
            if what != "its own" and (row, columns) == (b, own):
                continue  # batch 0's row for batch 0: its own
            rows = tuple(t[row : row + 1, columns] for t in descales)
            args = (out[b], lse[b], q8[b : b + 1], kb, vb, rows, scale, causal, what)
            if what == "its own":
                check_sequence(*args)
            else:
                with pytest.raises(AssertionError):
                    check_sequence(*args)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("spec", list(SPECS))
def test_split_pieces_combine_from_poisoned_partials(monkeypatch, spec, name):
    """The pieces' workspace NaN before each call (POISON_PARTIALS), descales over 2^-3 ..
    2^3 (v's never 1): 3 pieces (65 keys: a piece with no K/V block) and the automatic count,
    each row as the reference (the combine reads only written partials, in O's column
    order, v_descale applied once)."""
    from fadsl.targets.sm90.host import kvcache as host

    monkeypatch.setattr(host, "POISON_PARTIALS", True)
    kern, heads = kernel(spec), SPECS[spec][2]
    lengths = [1000, 65, 1, 777]
    g = torch.Generator(device="cuda").manual_seed(5)
    descales = tuple(
        2.0 ** (torch.rand(len(lengths), heads[1], device="cuda", generator=g) * 6 - 3)
        for _ in range(3)
    )
    q8, k8, v8, seqlens, table = fp8_cache(kern, heads, lengths, 3, DTYPES[name], descales,
                                           seed=31)  # fmt: skip
    for splits in (3, None):
        out, lse = call(spec, q8, k8, v8, seqlens, table, descales, splits)
        check_batches(kern, out, lse, q8, k8, v8, table, lengths, descales, f"splits {splits}")


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("spec", list(SPECS))
def test_append_then_attend(spec, name):
    """fadsl.append_kv writes 3 new 8-bit tokens after each length (one cache filled to its
    capacity): the cache's bytes are the old keys then the new ones, and kern.kvcache over
    the grown lengths (seqlens_out) matches the reference of the whole cache."""
    kern, (hq, hkv) = kernel(spec), SPECS[spec][2]
    dtype, d, new = DTYPES[name], kern.config.head_dim, 3
    lengths = [0, 5, 63, 500, CAPACITY - new]
    descales = random_descales(len(lengths), hkv, seed=41)
    q8, k8, v8, seqlens, table = fp8_cache(kern, (hq, hkv), lengths, new, dtype, descales, 41)
    batches = torch.arange(len(lengths), device="cuda")
    fresh = [
        encode(torch.randn(len(lengths), new, hkv, d, device="cuda"), s, batches, hkv, dtype)
        for s in descales[1:]
    ]
    before = [[gather(t, table, b, n).clone() for t in (k8, v8)] for b, n in enumerate(lengths)]
    fadsl.append_kv(k8, v8, fresh[0], fresh[1], seqlens, table)  # (the caller advances)
    longer = [n + new for n in lengths]
    assert seqlens.tolist() == lengths
    grown = seqlens + new
    for b, n in enumerate(longer):
        for cache, old, t in zip((k8, v8), before[b], fresh):
            want = torch.cat([old.view(torch.uint8), t[b : b + 1].view(torch.uint8)], dim=1)
            got = gather(cache, table, b, n).view(torch.uint8)
            assert torch.equal(got, want), f"batch {b}: the cache after append_kv"
    out, lse = call(spec, q8, k8, v8, grown, table, descales)
    check_batches(kern, out, lse, q8, k8, v8, table, longer, descales, f"appended {name}")


@pytest.mark.parametrize(
    "spec, splits",
    [("paged", None), ("paged", 3), ("paged", 1), ("contiguous64", None), ("contiguous64", 1)],
)
def test_bad_lengths_and_pages_give_nan_rows(spec, splits):
    """A length past the capacity or negative, and (paged) a page-table entry outside the
    cache among a batch's pages, make that batch's O and LSE NaN (out= and the allocator
    zero-filled first: the NaN is written); the other batches (one with a bad entry past its
    pages, never read) match the reference."""
    kern, heads = kernel(spec), SPECS[spec][2]
    lengths = [300, 1000, 5, 200, 100]
    descales = random_descales(len(lengths), heads[1], seed=7)
    q8, k8, v8, seqlens, table = fp8_cache(kern, heads, lengths, 1, E4M3, descales, seed=7)
    capacity = k8.shape[1] if table is None else table.shape[1] * k8.shape[1]
    bad = torch.tensor([300, capacity + 1, -3, 200, 100], dtype=torch.int32, device="cuda")
    poisoned = {1, 2}
    if table is not None:
        table[3, 1] = k8.shape[0]  # a page past the cache, among batch 3's four
        table[4, 10] = -1  # past batch 4's two pages: never read
        poisoned.add(3)
    out, lse = call(spec, q8, k8, v8, bad, table, descales, splits, fill=0.0)
    for b in range(len(lengths)):
        if b in poisoned:
            assert out[b].isnan().all() and lse[b].isnan().all(), f"batch {b} not NaN"
        else:
            assert not out[b].isnan().any() and not lse[b].isnan().any(), f"batch {b} NaN"
    check_batches(kern, out, lse, q8, k8, v8, table, lengths, descales, "good", skip=poisoned)


def test_bad_arguments_are_named():
    """Descales not (batch, heads_kv) or not float32, a descale needing grad, a 16-bit q or
    a cache of the other 8-bit dtype into the 8-bit spec; descales on a 16-bit spec."""
    kern, (hq, hkv) = kernel("paged"), SPECS["paged"][2]
    descales = random_descales(2, hkv, seed=1)
    q8, k8, v8, seqlens, table = fp8_cache(kern, (hq, hkv), [10, 20], 1, E4M3, descales, 1, 256)
    shapes = {"q_descale": (3, hkv), "k_descale": (2, hq), "v_descale": (2, hkv, 1)}
    for arg, shape in shapes.items():
        with pytest.raises(ValueError, match=arg):
            kern.kvcache(q8, k8, v8, seqlens, table, **{arg: torch.ones(shape, device="cuda")})
    with pytest.raises(TypeError, match="v_descale must be float32"):
        kern.kvcache(q8, k8, v8, seqlens, table, v_descale=descales[2].double())
    with pytest.raises(RuntimeError, match="k_descale requires grad"):
        kern.kvcache(q8, k8, v8, seqlens, table, k_descale=descales[1].clone().requires_grad_())
    with pytest.raises(TypeError, match="q has dtype torch.bfloat16"):
        kern.kvcache(q8.to(torch.bfloat16), k8, v8, seqlens, table)
    with pytest.raises(TypeError, match="k_cache has dtype torch.float8_e5m2 but q has"):
        kern.kvcache(q8, k8.float().to(E5M2), v8, seqlens, table)
    kern16 = kernel_16bit("paged64")  # examples/serving/fa3_decode_paged.fa
    k, v, seqlens, table, _ = make_cache(kern16, [10, 20], 8, 128, torch.bfloat16, 256, 2)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    for arg in ("q_descale", "k_descale", "v_descale"):
        with pytest.raises(TypeError, match=arg):
            kern16.kvcache(q, k, v, seqlens, table, **{arg: torch.ones(2, 8, device="cuda")})


def _public_step(spec, name, seed):
    """A decode step of 3 new tokens for fadsl.attention_with_kvcache: the spec's caches
    (tests the public call's kernel against the reference of ``spec``'s mask and head_dim),
    the new tokens in the 8-bit type by each batch's descales, the lengths before them."""
    kern, (hq, hkv) = kernel(spec), SPECS[spec][2]
    dtype, d, new = DTYPES[name], kern.config.head_dim, 3
    lengths = [0, 5, 63, 130, 200 - new]  # (the last: a contiguous cache full)
    descales = random_descales(len(lengths), hkv, seed=seed)
    q8, k8, v8, seqlens, table = fp8_cache(kern, (hq, hkv), lengths, new, dtype, descales, seed,
                                           capacity=200)  # fmt: skip
    batches = torch.arange(len(lengths), device="cuda")
    fresh = [
        encode(torch.randn(len(lengths), new, hkv, d, device="cuda"), s, batches, hkv, dtype)
        for s in descales[1:]
    ]
    return kern, lengths, descales, (q8, k8, v8, seqlens, *fresh, table)


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("spec", list(SPECS))
def test_fadsl_attention_with_kvcache_appends_then_attends(spec, name):
    """fadsl.attention_with_kvcache on 8-bit q, caches and 3 new tokens with descales
    (paged(64) causal head_dim 128 bf16, and contiguous head_dim 64 without a mask in fp16:
    the examples' rewrites dispatch.fp8_kvcache_kernel chooses): the caches hold the old
    keys then the new ones, cache_seqlens is not advanced, and each batch's rows match the
    reference over its grown length."""
    kern, lengths, descales, args = _public_step(spec, name, seed=53)
    q8, k8, v8, seqlens, k_new, v_new, table = args
    before = [[gather(t, table, b, n).clone() for t in (k8, v8)] for b, n in enumerate(lengths)]
    causal, out_dtype = kern.config.mask.value == "causal", SPECS[spec][1]
    out, lse = fadsl.attention_with_kvcache(
        q8, k8, v8, seqlens, k_new, v_new, page_table=table, causal=causal, return_lse=True,
        out_dtype=out_dtype, **named(descales),
    )  # fmt: skip
    torch.cuda.synchronize()
    assert out.dtype == out_dtype and seqlens.tolist() == lengths
    longer = [n + k_new.shape[1] for n in lengths]
    for b, n in enumerate(longer):
        for cache, old, t in zip((k8, v8), before[b], (k_new, v_new)):
            want = torch.cat([old.view(torch.uint8), t[b : b + 1].view(torch.uint8)], dim=1)
            assert torch.equal(gather(cache, table, b, n).view(torch.uint8), want), f"batch {b}"
    check_batches(kern, out, lse, q8, k8, v8, table, longer, descales, f"public {spec} {name}")


@pytest.mark.parametrize("spec", list(SPECS))
def test_torch_compile_gives_the_eager_bits(spec):
    """torch.compile(fullgraph=True) of the call (fadsl::attention_with_kvcache_fp8) on a copy
    of the caches: the eager call's O and LSE bit for bit, and the same caches after."""
    kern, _, descales, args = _public_step(spec, "e4m3", seed=59)
    causal, out_dtype = kern.config.mask.value == "causal", SPECS[spec][1]

    def step(q, k_cache, v_cache, seqlens, k, v, table, qd, kd, vd):
        return fadsl.attention_with_kvcache(
            q, k_cache, v_cache, seqlens, k, v, page_table=table, causal=causal,
            return_lse=True, out_dtype=out_dtype, q_descale=qd, k_descale=kd, v_descale=vd,
        )  # fmt: skip

    copy = tuple(None if t is None else t.clone() for t in args)
    eager = step(*args, *descales)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(*copy, *descales)
    torch.cuda.synchronize()
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype and torch.equal(
            got.view(torch.uint8), want.view(torch.uint8)
        )
    for got, want in zip(copy[1:3], args[1:3]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "the caches differ"


@pytest.mark.parametrize("spec", ["paged", "contiguous64"])
def test_fadsl_bench_times_an_8bit_kvcache_spec(spec):
    """bench_kvcache (fadsl bench on a `kv_cache` spec) on an 8-bit spec: its output checked
    within the 8-bit bound against the dequantized values the others read, then timed."""
    from fadsl.tools import bench_kvcache

    found = bench_kvcache.run(kernel(spec), ((2, 3000),), heads_q=8, heads_kv=2, warmup=1,
                              runs=2, rounds=1, dtype_name="e5m2", log=lambda s: None)  # fmt: skip
    (row,) = found["rows"]
    assert found["dtype"] == "e5m2" and row["tb_per_s"]["fadsl"] > 0
    assert "e5m2" in bench_kvcache.table(found) and "2 bytes an element" in bench_kvcache.table(
        found
    )


def test_torch_compile_takes_a_transposed_q():
    """q (batch, seqlen, heads, head_dim) viewed from (batch, heads, seqlen, head_dim): the
    traced call's O has the eager call's strides (torch.empty_like(q)), so the compiled graph
    reads it where the kernel wrote it."""
    kern, _, descales, args = _public_step("paged", "e4m3", seed=61)
    q8, k8, v8, seqlens, _, _, table = args
    rows = torch.cat([q8, q8], dim=1)  # 2 query rows a batch
    q_t = rows.transpose(1, 2).contiguous().transpose(1, 2)  # (the same values, heads outer)
    assert not q_t.is_contiguous()

    def step(q, qd, kd, vd):
        out = fadsl.attention_with_kvcache(q, k8, v8, seqlens, page_table=table, causal=True,
                                           q_descale=qd, k_descale=kd, v_descale=vd)  # fmt: skip
        return out * 1  # (a consumer of O in the graph)

    eager = step(q_t, *descales)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(q_t, *descales)
    torch.cuda.synchronize()
    assert torch.equal(compiled.view(torch.uint16), eager.view(torch.uint16))
