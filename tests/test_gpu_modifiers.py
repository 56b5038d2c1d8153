"""Score and mask modifiers (issue 41) on the GPU: the modifier examples and variants of them
(causal and not, every rescale mode, head_dim 64 and 128), both dtypes, odd shapes, GQA, rows
that see no key, against test_gpu_general's float64 reference (the modifier applied in torch
as its bias and keep, not from the IR) with FlashAttention's rule; the LSE within 1e-3 relative. Scores
that jump by hundreds of log2 units from block to block drive the rescale's rare paths,
where guarded recomputes S and applies the score again. The built-in softcap written as a
score runs the built-in's kernel: the same bits."""

from __future__ import annotations

import math
import re

import pytest
import torch

import fadsl
from conftest import ROOT
from document_ids import PATTERNS, document_ids, document_keep, recorded_workspaces
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODIFIERS = ROOT / "examples" / "modifiers"
ALIBI = (MODIFIERS / "alibi_causal.fa").read_text()
ALIBI_LINES = "  input      slopes : f32[heads]\n  score      s + slopes[h] * (kv_idx - q_idx)\n"


def _variant(text: str, name: str, mask: str, rescale: str) -> str:
    text = re.sub(r"^kernel \w+ \{", f"kernel {name} {{", text, flags=re.MULTILINE)
    text = re.sub(r"^(\s*mask\s+)\w+", rf"\g<1>{mask}", text, flags=re.MULTILINE)
    return re.sub(r"^(\s*rescale\s+)\w+", rf"\g<1>{rescale}", text, flags=re.MULTILINE)


def _hdim64_alibi(mask: str) -> str:
    """examples/fa3_hdim64.fa (192 x 128, three consumers) with ALiBi, forward only; its
    split tail (the last round's tiles in pieces, combined in global memory) without a mask."""
    text = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
    text = text[: text.index("  # The backward pass")].rstrip() + "\n}\n"
    if mask != "none":
        text = text.replace("tail       split_kv", "tail       whole")
    return text.replace("  mask       none\n", "  mask       none\n" + ALIBI_LINES)


def alibi_specs() -> dict[str, str]:
    specs = {}
    for mask in ("causal", "none"):
        for rescale in ("guarded", "lazy", "every"):
            name = f"alibi_{mask}_{rescale}"
            specs[name] = _variant(ALIBI, name, mask, rescale)
        name = f"alibi_d64_{mask}"
        # (lazy: at 160 registers guarded's recompute with the score spills, 2026-11-29)
        specs[name] = _variant(_hdim64_alibi(mask), name, mask, "lazy")
    return specs


SPECS = alibi_specs()
_loaded: dict[str, object] = {}


def kernel(name: str, text: str | None = None):
    if name not in _loaded:
        _loaded[name] = fadsl.load(text or SPECS[name], verbose=False)
    return _loaded[name]


def alibi_bias(slopes):
    """ALiBi as the spec writes it: slopes[h] (kv_idx - q_idx), shape (heads, sq, sk)."""
    return lambda i, j: slopes.double()[:, None, None] * (j - i).double()[None]


def check(out, lse, ref, ref_lse, low, what=""):
    assert not out.isnan().any(), f"{what}: outputs never written (or NaN)"
    bound = 2 * (low - ref).abs().max().item() + 1e-3
    err = (out.double() - ref).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"
    empty = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty), f"{what}: rows with no key must have LSE -inf"
    if (~empty).any():
        rel = (lse.double() - ref_lse).abs() / ref_lse.abs().clamp_min(1.0)
        assert rel[~empty].max().item() <= 1e-3, f"{what}: LSE off by {rel[~empty].max():.2e}"
    if empty.any():
        assert (out.double()[empty.transpose(1, 2)] == 0).all(), f"{what}: empty rows must be 0"


SHAPES = [(1, 1), (300, 1100), (1000, 333), (257, 700), (128, 128)]
# per query head: mild, steep (a block's scores 256 natural units above the last one's:
# the rescale's moves and guarded's recompute), zero, negative
SLOPES = [0.0625, -2.0, 0.0, 0.5, -0.0078125, 1.0, -0.25, 0.125]
CASES = [(n, d, sq, sk) for n in SPECS for d in DTYPES for sq, sk in SHAPES]


@pytest.mark.parametrize(
    "name, dtype, sq, sk", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}" for c in CASES]
)
def test_alibi_matches_float64(name, dtype, sq, sk):
    kern = kernel(name)
    causal = kern.config.mask.value == "causal"
    d = kern.config.head_dim
    gen = torch.Generator(device="cuda").manual_seed(sq * 31 + sk)
    q = torch.randn(2, sq, 8, d, device="cuda", generator=gen).to(DTYPES[dtype])
    k = torch.randn(2, sk, 2, d, device="cuda", generator=gen).to(DTYPES[dtype])
    v = torch.randn(2, sk, 2, d, device="cuda", generator=gen).to(DTYPES[dtype])
    slopes = torch.tensor(SLOPES, device="cuda")
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    out, lse = kern(q, k, v, scale, out=out, return_lse=True, slopes=slopes)
    torch.cuda.synchronize()
    bias = alibi_bias(slopes)
    ref, ref_lse = reference(q, k, v, scale, causal, torch.float64, bias=bias)
    low, _ = reference(q, k, v, scale, causal, q.dtype, bias=bias)
    check(out, lse, ref, ref_lse, low, name)
    if sq > 1 and sk > 1:  # the slopes decide: without them the result differs
        plain = reference(q, k, v, scale, causal, torch.float64)[0]
        assert (plain - ref).abs().max().item() > 0.05, "ALiBi did not matter here"


SOFTCAP = ROOT / "tests" / "specs" / "sm90" / "fa3_softcap.fa"
SOFTCAP_AS_SCORE = ROOT / "tests" / "specs" / "sm90" / "modifiers_softcap.fa"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sq, sk", [(300, 1100), (257, 700)])
def test_the_softcap_written_as_a_score_gives_the_built_in_softcaps_bits(dtype, sq, sk):
    builtin = fadsl.load(SOFTCAP, verbose=False)
    written = fadsl.load(SOFTCAP_AS_SCORE, verbose=False)
    gen = torch.Generator(device="cuda").manual_seed(sq + 7 * sk)
    q = 30 * torch.randn(2, sq, 4, 128, device="cuda", generator=gen)  # far past the cap
    k = torch.randn(2, sk, 4, 128, device="cuda", generator=gen)
    v = torch.randn(2, sk, 4, 128, device="cuda", generator=gen)
    q, k, v = (t.to(DTYPES[dtype]) for t in (q, k, v))
    out, lse = builtin(q, k, v, return_lse=True)
    again, again_lse = written(q, k, v, return_lse=True)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


def test_the_inputs_are_checked_on_the_device():
    kern = kernel("alibi_causal_guarded")
    q = torch.randn(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="needs its input 'slopes'"):
        kern(q, q, q)
    with pytest.raises(ValueError, match=r"slopes must have shape \(8,\)"):
        kern(q, q, q, slopes=torch.ones(4, device="cuda"))
    with pytest.raises(ValueError, match="slopes is on cpu but q is on cuda:0"):
        kern(q, q, q, slopes=torch.ones(8))


# --- keep (step 3): tile classes from the predicate, EMPTY blocks skipped, FULL ones unmasked

PREFIX_LM = {
    name: (MODIFIERS / f"{name}.fa").read_text() for name in ("prefix_lm", "prefix_lm_alibi")
}
KEEP_SHAPES = [(1, 1), (300, 1100), (1000, 333), (257, 700), (640, 640)]
KEEP_CASES = [(n, d, sq, sk) for n in PREFIX_LM for d in DTYPES for sq, sk in KEEP_SHAPES]


def prefix_keep(prefix, sq, sk, device):
    """prefix-LM as the examples write it: j <= i + sk - sq or j < prefix[b], (batch, 1, sq, sk)."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    causal = (j <= i + sk - sq)[None, None]
    return causal | (j[None, None] < prefix[:, None, None, None])


@pytest.mark.parametrize(
    "name, dtype, sq, sk", KEEP_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}" for c in KEEP_CASES]
)
def test_prefix_lm_matches_float64(name, dtype, sq, sk):
    kern = kernel(name, PREFIX_LM[name])
    gen = torch.Generator(device="cuda").manual_seed(sq * 13 + sk)
    q = torch.randn(4, sq, 8, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    k = torch.randn(4, sk, 4, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    v = torch.randn(4, sk, 4, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    # none, part of the keys, past the diagonal of every row, all of them and more
    prefix = torch.tensor([0, sk // 3, sk - 1, sk + 5], device="cuda", dtype=torch.int32)
    keep = prefix_keep(prefix, sq, sk, "cuda")
    inputs = {"prefix": prefix}
    bias = None
    if "alibi" in name:
        slopes = torch.tensor(SLOPES, device="cuda")
        inputs["slopes"], bias = slopes, alibi_bias(slopes)
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    out, lse = kern(q, k, v, scale, out=out, return_lse=True, **inputs)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, scale, False, torch.float64, bias=bias, keep=keep)
    low, _ = reference(q, k, v, scale, False, q.dtype, bias=bias, keep=keep)
    check(out, lse, ref, ref_lse, low, name)
    if sq > 1 and sk > 1:  # the prefix decides: plain causal attention differs
        causal = reference(q, k, v, scale, True, torch.float64, bias=bias)[0]
        assert (causal - ref).abs().max().item() > 0.05, "the prefix did not matter here"


DOCUMENT = (MODIFIERS / "document_causal.fa").read_text()
DOC_CASES = [(d, sq, sk) for d in DTYPES for sq, sk in KEEP_SHAPES]


@pytest.mark.parametrize(
    "dtype, sq, sk", DOC_CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in DOC_CASES]
)
def test_document_mask_matches_float64(dtype, sq, sk):
    """examples/modifiers/document_causal.fa: each batch row one pattern of ids (packed
    documents, one document, ids scattered per token, no query's id among the keys), GQA."""
    kern = kernel("document_causal", DOCUMENT)
    gen = torch.Generator(device="cuda").manual_seed(sq * 17 + sk)
    q = torch.randn(4, sq, 8, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    k = torch.randn(4, sk, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    v = torch.randn(4, sk, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    made = document_ids(PATTERNS, sq, sk, seed=sq + sk)
    keep = document_keep(made)
    scale = 128**-0.5
    out = torch.full_like(q, float("nan"))
    out, lse = kern(q, k, v, scale, out=out, return_lse=True, **made)
    torch.cuda.synchronize()
    ref, ref_lse = reference(q, k, v, scale, True, torch.float64, keep=keep)
    low, _ = reference(q, k, v, scale, True, q.dtype, keep=keep)
    check(out, lse, ref, ref_lse, low, "document_causal")
    assert (lse[3] == -math.inf).all(), "no query's document among the keys: no row sees a key"
    # one document: plain causal attention, within the same rule
    plain, plain_lse = reference(q[1:2], k[1:2], v[1:2], scale, True, torch.float64)
    plain_low, _ = reference(q[1:2], k[1:2], v[1:2], scale, True, q.dtype)
    check(out[1:2], lse[1:2], plain, plain_lse, plain_low, "one document")
    if sq > 64 and sk > 64:  # the ids decide: plain causal attention differs
        causal = reference(q, k, v, scale, True, torch.float64)[0]
        assert (causal[0] - ref[0]).abs().max().item() > 0.05, "the documents did not matter"


def _torch_classes(made, sq, sk, block_r, block_c, causal=True):
    """Each tile's class (0 EMPTY, 1 PARTIAL, 2 FULL) and each q block's list of kept blocks
    (the CTAs done: every kv block's; the count; the blocks, the last first; zeros after) by
    the predicate in torch, as <kernel>_keep_classes makes them (tiles wholly above the causal
    diagonal EMPTY)."""
    keep = document_keep(made)[:, 0]  # (batch, sq, sk)
    qb, kb = -(-sq // block_r), -(-sk // block_c)
    classes = torch.zeros(keep.shape[0], qb, kb, dtype=torch.uint8)
    lists = torch.zeros(keep.shape[0], qb, 2 + kb, dtype=torch.int32)
    for b in range(keep.shape[0]):
        for i in range(qb):
            rows = slice(i * block_r, min((i + 1) * block_r, sq))
            for j in range(kb):
                if causal and j * block_c > rows.stop - 1 + sk - sq:
                    continue
                tile = keep[b, rows, j * block_c : (j + 1) * block_c]
                if tile.any():
                    classes[b, i, j] = 2 if tile.all() else 1
            kept = [j for j in reversed(range(kb)) if classes[b, i, j]]
            lists[b, i, : 2 + len(kept)] = torch.tensor([kb, len(kept), *kept], dtype=torch.int32)
    return classes, lists


@pytest.mark.parametrize("sq, sk", [(1000, 1000), (640, 1000), (1000, 333)], ids=str)
def test_document_tiles_are_classed_as_the_predicate_says(monkeypatch, sq, sk):
    """<kernel>_keep_classes's bytes and lists of kept blocks against the predicate evaluated
    in torch."""

    made_here = recorded_workspaces(monkeypatch)
    kern = kernel("document_causal", DOCUMENT)
    gen = torch.Generator(device="cuda").manual_seed(sq + 3 * sk)
    q = torch.randn(4, sq, 4, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(4, sk, 2, 128, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(4, sk, 2, 128, device="cuda", generator=gen).to(torch.bfloat16)
    made = document_ids(PATTERNS, sq, sk, seed=sq * sk)
    kern(q, k, v, **made)
    torch.cuda.synchronize()
    ((_, (classes, lists)),) = made_here
    want_classes, want_lists = _torch_classes(made, sq, sk, 128, 128)
    qb, kb = want_classes.shape[1:]
    got = classes.view(4, qb, kb).cpu()
    below = torch.ones(qb, kb, dtype=torch.bool)  # (tiles above the diagonal: EMPTY, unread)
    for i in range(qb):
        for j in range(kb):
            below[i, j] = j * 128 <= min((i + 1) * 128, sq) - 1 + sk - sq
    assert torch.equal(got[:, below], want_classes[:, below])
    assert torch.equal(lists.view(4, qb, 2 + kb).cpu(), want_lists)


@pytest.mark.parametrize("dtype", DTYPES)
def test_document_blocks_no_query_keeps_are_never_read(dtype):
    """Keys 256-511 of each batch row belong to a document no query is in: their K/V blocks
    (2 and 3 of B_c 128) are EMPTY for every tile, so the kernel must never load them. Their
    V is NaN: a block loaded and masked would still add 0 x NaN into O."""
    kern = kernel("document_causal", DOCUMENT)
    gen = torch.Generator(device="cuda").manual_seed(5)
    n = 1024
    q = torch.randn(2, n, 4, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    k = torch.randn(2, n, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    v = torch.randn(2, n, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    kv_doc = torch.zeros(2, n, dtype=torch.int32, device="cuda")
    kv_doc[:, 256:512], kv_doc[:, 512:] = 9, 1
    q_doc = kv_doc.clone()
    q_doc[:, 256:512] = 0  # (these queries see document 0's keys, before them)
    made = {"q_doc": q_doc, "kv_doc": kv_doc}
    clean = v.clone()
    clean[:, 256:512] = 0
    v[:, 256:512] = float("nan")
    scale = 128**-0.5
    out, lse = kern(q, k, v, scale, return_lse=True, **made)
    torch.cuda.synchronize()
    keep = document_keep(made)
    ref, ref_lse = reference(q, k, clean, scale, True, torch.float64, keep=keep)
    low, _ = reference(q, k, clean, scale, True, q.dtype, keep=keep)
    check(out, lse, ref, ref_lse, low, "document_causal, unread blocks poisoned")


@pytest.mark.parametrize("dtype", DTYPES)
def test_document_blocks_between_kept_ones_are_never_read(dtype):
    """Document 1 owns keys 0-127 and 512-1023, so its queries (512 on) keep kv block 0 and
    blocks 4 on, and blocks 1-3 (document 0's keys 128-255, document 9's 256-511, which no
    query is in) are EMPTY between kept ones: the kernel visits the q block's list of kept
    blocks and never loads them. Keys 256-511's V is NaN: a block loaded and masked would
    still add 0 x NaN into O."""
    kern = kernel("document_causal", DOCUMENT)
    gen = torch.Generator(device="cuda").manual_seed(6)
    n = 1024
    q = torch.randn(2, n, 4, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    k = torch.randn(2, n, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    v = torch.randn(2, n, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    kv_doc = torch.ones(2, n, dtype=torch.int32, device="cuda")
    kv_doc[:, 128:256], kv_doc[:, 256:512] = 0, 9
    q_doc = kv_doc.clone()
    q_doc[:, 256:512] = 0  # (these queries see document 0's keys, before them)
    made = {"q_doc": q_doc, "kv_doc": kv_doc}
    clean = v.clone()
    clean[:, 256:512] = 0
    v[:, 256:512] = float("nan")
    scale = 128**-0.5
    out, lse = kern(q, k, v, scale, return_lse=True, **made)
    torch.cuda.synchronize()
    keep = document_keep(made)
    ref, ref_lse = reference(q, k, clean, scale, True, torch.float64, keep=keep)
    low, _ = reference(q, k, clean, scale, True, q.dtype, keep=keep)
    check(out, lse, ref, ref_lse, low, "document_causal, blocks between kept ones poisoned")


WINDOW = (ROOT / "tests" / "specs" / "sm90" / "fa3_window.fa").read_text()
AS_KEEP = {
    # the built-in mask, and the same kernel with the mask written as keep
    "causal": (
        _variant(
            WINDOW.replace("causal, window(256)", "causal"), "builtin_causal", "causal", "guarded"
        ),
        (ROOT / "tests" / "specs" / "sm90" / "modifiers_causal.fa").read_text(),
    ),
    "window": (WINDOW, (ROOT / "tests" / "specs" / "sm90" / "modifiers_window.fa").read_text()),
}
EQUAL_CASES = [(m, d, sq, sk) for m in AS_KEEP for d in DTYPES for sq, sk in KEEP_SHAPES]
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


@pytest.mark.parametrize(
    "mask, dtype, sq, sk", EQUAL_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}x{c[3]}" for c in EQUAL_CASES]
)
def test_a_mask_written_as_keep_gives_the_built_in_masks_results(mask, dtype, sq, sk):
    """The same scores kept, the same blocks run (keep's last tile may skip a block the
    built-in runs for its padding rows), so the results agree to the 16-bit rounding of P:
    within a few units of the output's last place, and both hold FlashAttention's rule."""
    builtin_text, keep_text = AS_KEEP[mask]
    builtin = kernel(f"builtin_{mask}", builtin_text)
    as_keep = kernel(f"keep_{mask}", keep_text)
    gen = torch.Generator(device="cuda").manual_seed(sq * 5 + sk)
    q = torch.randn(2, sq, 8, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    k = torch.randn(2, sk, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    v = torch.randn(2, sk, 2, 128, device="cuda", generator=gen).to(DTYPES[dtype])
    out, lse = builtin(q, k, v, return_lse=True)
    again, again_lse = as_keep(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    keep = j <= i + sk - sq
    if mask == "window":
        keep &= j >= i + sk - sq - 256
    scale = 128**-0.5
    ref, ref_lse = reference(q, k, v, scale, False, torch.float64, keep=keep)
    low, _ = reference(q, k, v, scale, False, q.dtype, keep=keep)
    check(again, again_lse, ref, ref_lse, low, f"keep {mask}")
    check(out, lse, ref, ref_lse, low, f"mask {mask}")
    assert torch.equal(lse == -math.inf, again_lse == -math.inf)
    finite = lse != -math.inf
    assert (lse[finite] - again_lse[finite]).abs().max().item() <= 1e-4 if finite.any() else True
    diff = (out.double() - again.double()).abs().max().item()
    assert diff <= 4 * UNIT_ROUNDOFF[dtype], f"keep {mask} differs from the built-in by {diff:.3e}"
