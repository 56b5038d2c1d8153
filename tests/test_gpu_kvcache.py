"""KV-cache calls on the GPU (issue 31): `kv_cache` specs (examples/serving/fa3_decode_paged.fa, tests/specs/sm90/fa3_decode*.fa and
variants: pages of 16, 64 and 256 rows, contiguous, pack_gqa on and off, splits auto and
off, causal and not), seqlen_q 1 to 16, GQA 4 and 8, MHA; ragged cache lengths (0, 1, page
and block edges, long ones), forced split counts; each batch against float64 on its first
cache_seqlens[b] keys with FlashAttention's rule, outputs poisoned with NaN first. Also
append_kv (contiguous and paged) and a decode step (append, then attend) under torch.compile
and in a CUDA graph. `GPU_TESTS=tests/test_gpu_kvcache.py bash scripts/device.sh tests`."""

from __future__ import annotations

import math
import re

import pytest
import torch

import fadsl
from conftest import ROOT
from gpu_specs import with_setting
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

SPEC_DIR = ROOT / "tests" / "specs" / "sm90"
SERVING = ROOT / "examples" / "serving"  # the specs fadsl.attention_with_kvcache ships


def _variant(base: str, name: str, **settings: str) -> str:
    text = re.sub(
        r"\bkernel\s+\w+",
        f"kernel {name}",
        (SERVING / base if (SERVING / base).exists() else SPEC_DIR / base).read_text(),
        count=1,
    )
    for key, value in settings.items():
        text = with_setting(text, key, value)
    return text


SPECS = {
    "paged64": (SERVING / "fa3_decode_paged.fa").read_text(),
    "contiguous": (SPEC_DIR / "fa3_decode.fa").read_text(),
    "paged16_nomask": _variant("fa3_decode_paged.fa", "kv_p16", kv_cache="paged(16)", mask="none"),
    "paged256_nopack": _variant(
        "fa3_decode_paged.fa", "kv_p256", kv_cache="paged(256)", pack_gqa="off", splits="off"
    ),
    "paged64_nopack": _variant("fa3_decode_paged.fa", "kv_p64_nopack", pack_gqa="off"),
    "contiguous_nosplit": _variant("fa3_decode.fa", "kv_whole", splits="off"),
    # two CTAs an SM (`ctas_per_sm 2`: half the register file each at launch)
    "paged64_two_ctas": (SPEC_DIR / "fa3_decode_paged_two_ctas.fa").read_text(),
}
LENGTHS = [0, 1, 63, 64, 65, 1000, 3000]
HEADS = [(32, 8), (8, 8), (8, 1)]
CASES = [
    (spec, sq, hq, hkv, splits)
    for spec in SPECS
    for sq in (1, 4, 16)
    for (hq, hkv) in HEADS
    for splits in ((None, 3) if "nosplit" not in spec and "nopack" not in spec else (None,))
]
_loaded: dict[str, object] = {}


def kernel(name: str):
    if name not in _loaded:
        _loaded[name] = fadsl.load(SPECS[name], verbose=False)
    return _loaded[name]


def make_cache(kern, lengths, hkv, d, dtype, capacity, seed):
    """The caches, their lengths and (paged) a shuffled page table; and each batch's keys and
    values as a contiguous tensor (the reference's)."""
    torch.manual_seed(seed)
    batch = len(lengths)
    page = kern.config.ext.kv_cache
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    if page == 0:
        k = torch.randn(batch, capacity, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        return k, v, seqlens, None, [(k[b, :n], v[b, :n]) for b, n in enumerate(lengths)]
    per_batch = -(-capacity // page)
    pages = batch * per_batch + 3  # a few never used
    k = torch.randn(pages, page, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    table = torch.randperm(pages, device="cuda")[: batch * per_batch].view(batch, per_batch)
    table = table.to(torch.int32).contiguous()
    keys = []
    for b, n in enumerate(lengths):
        rows = table[b].long()
        kb = k[rows].reshape(-1, hkv, d)[:n]
        vb = v[rows].reshape(-1, hkv, d)[:n]
        keys.append((kb, vb))
    return k, v, seqlens, table, keys


def check(kern, q, keys, scale, out, lse):
    causal = kern.config.mask.value == "causal"
    assert not out.isnan().any() and not lse.isnan().any(), "outputs never written (or NaN)"
    for b, (kb, vb) in enumerate(keys):
        qb = q[b : b + 1]
        ref, ref_lse = reference(qb, kb[None], vb[None], scale, causal, torch.float64)
        low, _ = reference(qb, kb[None], vb[None], scale, causal, q.dtype)
        bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
        err = (out[b : b + 1].double() - ref).abs().max().item()
        assert err <= bound, f"batch {b} (length {kb.shape[0]}): max error {err:.3e} > {bound:.3e}"
        empty = ref_lse[0] == -math.inf
        got = lse[b].double()
        assert torch.equal(got == -math.inf, empty), f"batch {b}: LSE -inf rows"
        if (~empty).any():
            rel = (got - ref_lse[0]).abs() / ref_lse[0].abs().clamp_min(1.0)
            assert rel[~empty].max().item() <= 1e-3, f"batch {b}: LSE"
        if empty.any():
            assert (
                out[b].double().transpose(0, 1)[empty] == 0
            ).all(), "a row with no key outputs 0"


@pytest.mark.parametrize(
    "spec, sq, hq, hkv, splits", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_kvcache_matches_each_batch(spec, sq, hq, hkv, splits):
    kern = kernel(spec)
    d = kern.config.head_dim
    dtype = torch.float16 if hq == 8 and hkv == 1 else torch.bfloat16
    k, v, seqlens, table, keys = make_cache(kern, LENGTHS, hkv, d, dtype, 3200, seed=sq * 13 + hq)
    q = torch.randn(len(LENGTHS), sq, hq, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((len(LENGTHS), hq, sq), float("nan"), device="cuda")
    scale = d**-0.5
    kern.kvcache_forward(q, k, v, seqlens, table, scale, splits, out, True, lse)
    torch.cuda.synchronize()
    check(kern, q, keys, scale, out, lse)


@pytest.mark.parametrize("spec", ["paged64", "paged64_nopack", "contiguous"])
@pytest.mark.parametrize("sq", [1, 3, 16])
def test_the_combine_reads_only_partials_the_pieces_wrote(monkeypatch, spec, sq):
    """Only the threads holding a tile's rows write a piece's partial (holds_rows), and
    the combine reads only theirs: with the workspace NaN before each call, every row still
    matches (3 pieces and the automatic count; packed tiles of 4, 12 and 64 rows of 64,
    unpacked of 1, 3 and 16)."""
    from fadsl.targets.sm90.host import kvcache as host

    monkeypatch.setattr(host, "POISON_PARTIALS", True)
    kern = kernel(spec)
    k, v, seqlens, table, keys = make_cache(kern, LENGTHS, 8, 128, torch.bfloat16, 3200, sq)
    scale = 128**-0.5
    for splits in (3, None):
        q = torch.randn(len(LENGTHS), sq, 32, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((len(LENGTHS), 32, sq), float("nan"), device="cuda")
        kern.kvcache_forward(q, k, v, seqlens, table, scale, splits, out, True, lse)
        torch.cuda.synchronize()
        check(kern, q, keys, scale, out, lse)


def test_long_cache_batch_one_splits_over_the_sms():
    """Batch 1 x 32k keys (the case split-KV is for): auto splits, against float64."""
    kern = kernel("paged64")
    k, v, seqlens, table, keys = make_cache(kern, [32768 - 5], 8, 128, torch.bfloat16, 32768, 1)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = kern.kvcache(q, k, v, seqlens, table, return_lse=True)
    torch.cuda.synchronize()
    check(kern, q, keys, 128**-0.5, out, lse)


def test_two_ctas_an_sm_give_the_one_cta_kernels_bits():
    """More tiles than two CTAs an SM hold (48 x 8 K/V heads, persistent CTAs looping): the
    `ctas_per_sm 2` kernel, whose persistent grid is twice the SMs, writes exactly the bits
    of the example's one-CTA kernel (each tile's blocks in the same order), in whole tiles
    and in pieces."""
    one, two = kernel("paged64"), kernel("paged64_two_ctas")
    assert two.config.ext.ctas_per_sm == 2
    lengths = [(97 * b) % 2900 + (b % 3) for b in range(48)]
    k, v, seqlens, table, keys = make_cache(one, lengths, 8, 128, torch.bfloat16, 3000, seed=5)
    q = torch.randn(len(lengths), 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    for splits in (None, 2):
        outs = []
        for kern in (one, two):
            out = torch.full_like(q, float("nan"))
            lse = torch.full((len(lengths), 32, 1), float("nan"), device="cuda")
            kern.kvcache_forward(q, k, v, seqlens, table, 128**-0.5, splits, out, True, lse)
            outs.append((out, lse))
        torch.cuda.synchronize()
        check(two, q, keys, 128**-0.5, *outs[1])
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("paged", [False, True])
def test_append_kv_writes_after_each_length(paged):
    kern = kernel("paged64" if paged else "contiguous")
    k, v, seqlens, table, _ = make_cache(kern, [5, 0, 130], 2, 128, torch.bfloat16, 256, 4)
    k0, v0 = k.clone(), v.clone()
    k_new = torch.randn(3, 7, 2, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    fadsl.append_kv(k, v, k_new, v_new, seqlens, table)
    for b, n in enumerate(seqlens.tolist()):
        for i in range(7):
            pos = n + i
            if table is None:
                at_k, at_v = k[b, pos], v[b, pos]
            else:
                page = table[b, pos // 64].item()
                at_k, at_v = k[page, pos % 64], v[page, pos % 64]
            assert torch.equal(at_k, k_new[b, i]) and torch.equal(at_v, v_new[b, i])
    changed = (k != k0).any(dim=(-1, -2)).sum().item()
    assert changed == 3 * 7, "only the new rows change"


def test_decode_step_in_a_cuda_graph_and_compiled():
    """append_kv then the kv-cache call, captured in a CUDA graph and replayed; and the call
    through torch.compile(fullgraph=True): both equal to eager."""
    kern = kernel("paged64")
    k, v, seqlens, table, _ = make_cache(kern, [100, 2000, 7], 8, 128, torch.bfloat16, 4096, 9)
    q = torch.randn(3, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(3, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    longer = seqlens + 1
    fadsl.append_kv(k, v, k_new, v_new, seqlens, table)
    eager = kern.kvcache(q, k, v, longer, table)
    compiled = torch.compile(lambda q, k, v, s, t: kern.kvcache(q, k, v, s, t), fullgraph=True)
    assert torch.equal(compiled(q, k, v, longer, table), eager)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kern.kvcache(q, k, v, longer, table, out=out)  # built and loaded before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fadsl.append_kv(k, v, k_new, v_new, seqlens, table)
        kern.kvcache(q, k, v, longer, table, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_kvcache_arguments_are_named():
    kern = kernel("paged64")
    k, v, seqlens, table, _ = make_cache(kern, [10, 20], 8, 128, torch.bfloat16, 256, 2)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="pass page_table"):
        kern.kvcache(q, k, v, seqlens)
    with pytest.raises(ValueError, match="cache_seqlens must be a 1-D int32"):
        kern.kvcache(q, k, v, seqlens.long(), table)
    with pytest.raises(ValueError, match="page_table has 1 rows"):
        kern.kvcache(q, k, v, seqlens, table[:1])
    with pytest.raises(ValueError, match="must divide 64"):
        kern.kvcache(q[:, :, :24], k[:, :, :8], v[:, :, :8], seqlens, table)
    with pytest.raises(RuntimeError, match="reads K/V from a cache"):
        kern(q, q, q)


@pytest.mark.parametrize(
    "spec, splits",
    [("paged64", None), ("paged64", 3), ("paged64", 1), ("contiguous", 2), ("contiguous", 1)],
)
def test_bad_lengths_and_pages_give_nan_rows(spec, splits):
    """A cache length outside 0 .. capacity, or a page-table entry outside the cache among a
    batch's pages, makes that batch's rows NaN; the other batches (one with a bad entry past
    its pages, never read) are right."""
    kern = kernel(spec)
    lengths = [300, 3000, 5, 200, 100]
    k, v, seqlens, table, keys = make_cache(kern, lengths, 8, 128, torch.bfloat16, 3200, seed=7)
    capacity = 3200 if table is None else table.shape[1] * kern.config.ext.kv_cache
    bad = torch.tensor([300, capacity + 1, -3, 200, 100], dtype=torch.int32, device="cuda")
    poisoned = {1, 2}
    if table is not None:
        table[3, 1] = k.shape[0]  # a page past the cache, among batch 3's
        table[4, 10] = -1  # past batch 4's two pages: never read
        poisoned.add(3)
    q = torch.randn(len(lengths), 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = kern.kvcache(q, k, v, bad, table, num_splits=splits, return_lse=True)
    torch.cuda.synchronize()
    for b in range(len(lengths)):
        if b in poisoned:
            assert out[b].isnan().all() and lse[b].isnan().all(), f"batch {b} not poisoned"
        else:
            assert not out[b].isnan().any() and not lse[b].isnan().any(), f"batch {b}"
    good = [b for b in range(len(lengths)) if b not in poisoned]
    check(
        kern,
        q[good],
        [keys[b] for b in good],
        128**-0.5,
        out[good],
        lse[good],
    )


def test_a_bad_page_makes_nan_exactly_the_tiles_that_read_it():
    """Whole tiles without PackGQA (64 query rows each, causal, 256 rows over 1100 keys in
    pages of 64): a bad entry for the last page (keys 1088-1099) poisons the q blocks whose
    K/V blocks reach the one holding it (row r sees keys up to r + 844: with blocks of 64,
    q block 3; of 128, q blocks 2 and 3), and leaves the others right."""
    kern = kernel("paged64_nopack")
    sq, hq, hkv, d = 256, 8, 2, 128
    k, v, seqlens, table, keys = make_cache(kern, [1100], hkv, d, torch.bfloat16, 1152, seed=3)
    table[0, 17] = k.shape[0] + 5
    q = torch.randn(1, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    out, lse = kern.kvcache(q, k, v, seqlens, table, num_splits=1, return_lse=True)
    torch.cuda.synchronize()
    b_c, bad_block = kern.config.block_c, 1088 // kern.config.block_c
    # the first q block whose last row's last key lies in the bad page's block
    first = next(m for m in range(4) if min(64 * m + 63 + 1100 - sq, 1099) // b_c >= bad_block)
    assert first == {64: 3, 128: 2}[b_c]
    cut = 64 * first
    assert out[0, cut:].isnan().all() and lse[0, :, cut:].isnan().all(), f"rows {cut}-255"
    assert not out[0, :cut].isnan().any() and not lse[0, :, :cut].isnan().any(), f"rows 0-{cut - 1}"
    kb, vb = keys[0]
    full, _ = reference(q, kb[None], vb[None], d**-0.5, True, torch.float64)
    low, _ = reference(q, kb[None], vb[None], d**-0.5, True, q.dtype)
    bound = 2 * (low[:, :cut].double() - full[:, :cut]).abs().max().item() + 1e-3
    assert (out[:, :cut].double() - full[:, :cut]).abs().max().item() <= bound
