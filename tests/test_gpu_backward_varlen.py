"""The varlen backward on the GPU (research/backward-varlen.md §10): dQ, dK, dV of packed
sequences through fadsl.attention_varlen and a loaded spec's .varlen, against float64
autograd of the reference on each sequence's slices, with FlashAttention's rule over the
packed tensors (the error at most twice PyTorch's own in the input dtype, plus 1e-4). Lengths 1 and 0 (no
query, no key), odd lengths about the tiles, a long sequence among short ones, seqlen_q !=
seqlen_k per sequence both ways, 300 short sequences, calls with no query or no key token;
no mask, causal, a causal window, a two-sided window, softcap 30; head_dim 64 and 128; GQA
1, 2 and 8; both dtypes; a gradient through the LSE; torch.compile; equal lengths against
the padded call; sequences isolated from each other; rows outside every sequence get zero
gradients; malformed cu_seqlens give NaN (or a named error). (`deterministic on` is refused
with `varlen on`, so nothing here is bitwise stable by construction but dK and dV.)
`GPU_TESTS=tests/test_gpu_backward_varlen.py bash scripts/device.sh tests`."""

from __future__ import annotations

import math
import random

import pytest
import torch

import fadsl
from conftest import ROOT
from test_gpu_backward import check_rule, poison_allocator
from test_gpu_backward import kernel as training_kernel
from test_gpu_backward import reference_grads as padded_reference_grads
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

SPEC_DIR = ROOT / "examples" / "serving"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NONE = (-1, -1)
ODD = [17, 63, 65, 79, 81, 127, 129]
MIXED = [4096, 1, 7, 2048, 130, 0, 64]
RAGGED_Q, RAGGED_K = [1, 300, 0, 129, 1000, 64], [1, 300, 5, 0, 1000, 700]
UNEQUAL_Q, UNEQUAL_K = [300, 50, 129, 1, 200], [100, 333, 64, 65, 200]  # d < 0 and d > 0
_rng = random.Random(300)
SHORT_Q, SHORT_K = ([_rng.randint(0, 48) for _ in range(300)] for _ in range(2))
# name: (q lengths, k lengths, head_dim, causal, window_size, softcap, heads_q, heads_kv, dtype)
CASES = {
    "one": ([1], [1], 128, True, NONE, 0, 2, 2, "bf16"),
    "one_d64": ([1], [1], 64, False, NONE, 0, 2, 1, "fp16"),
    "no_query_first": ([0, 5], [5, 5], 128, True, NONE, 0, 4, 2, "bf16"),
    "no_key_second": ([5, 5], [5, 0], 64, False, NONE, 0, 4, 4, "bf16"),
    "no_key_second_causal": ([5, 5], [5, 0], 128, True, NONE, 0, 8, 1, "fp16"),
    "empties_first": ([0, 0, 3], [0, 0, 3], 64, True, NONE, 0, 2, 2, "fp16"),
    "odd_causal": (ODD, ODD, 128, True, NONE, 0, 8, 4, "bf16"),
    "odd_causal_d64": (ODD, ODD, 64, True, NONE, 0, 4, 4, "bf16"),
    "odd_d64": (ODD, ODD, 64, False, NONE, 0, 16, 2, "fp16"),
    "mixed_causal": (MIXED, MIXED, 128, True, NONE, 0, 16, 2, "bf16"),
    "mixed_d64": (MIXED, MIXED, 64, False, NONE, 0, 8, 4, "fp16"),
    "unequal_causal": (UNEQUAL_Q, UNEQUAL_K, 128, True, NONE, 0, 8, 2, "fp16"),
    "unequal_causal_d64": (UNEQUAL_K, UNEQUAL_Q, 64, True, NONE, 0, 4, 4, "bf16"),
    "short300_causal_d64": (SHORT_Q, SHORT_K, 64, True, NONE, 0, 4, 2, "bf16"),
    "short300_d128": (SHORT_Q, SHORT_Q, 128, False, NONE, 0, 2, 2, "fp16"),
    "causal_window32": (RAGGED_Q, RAGGED_K, 128, True, (32, 0), 0, 8, 2, "bf16"),
    "window64_16_d64": (RAGGED_Q, RAGGED_K, 64, False, (64, 16), 0, 8, 8, "fp16"),
    "window64_16_gqa4": (ODD, ODD, 64, False, (64, 16), 0, 4, 1, "bf16"),
    "softcap30": (RAGGED_Q, RAGGED_K, 128, False, NONE, 30, 16, 2, "bf16"),
    "causal_softcap30_d64": (UNEQUAL_Q, UNEQUAL_K, 64, True, NONE, 30, 4, 4, "fp16"),
    "causal_softcap30": (UNEQUAL_Q, UNEQUAL_K, 128, True, NONE, 30, 4, 2, "bf16"),
    "window64_16_softcap30": (RAGGED_Q, RAGGED_K, 128, False, (64, 16), 30, 4, 4, "fp16"),
}
_specs: dict[str, object] = {}


def spec(name: str):
    """A shipped serving spec as is (``fa3_varlen_causal``), or a variant of its backward
    block in tests/training_specs.py's ``training_spec`` syntax
    (``fa3_varlen_causal+br64+early_dv-dqred``)."""
    if name not in _specs:
        plain = "+" not in name and "-" not in name
        _specs[name] = (
            fadsl.load(SPEC_DIR / f"{name}.fa", verbose=False)
            if plain
            else training_kernel(f"serving/{name}")
        )
    return _specs[name]


def starts(lengths) -> list[int]:
    return [0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()]


def packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed):
    """q, k, v, dout and cu_seqlens_q/k (int32 on the GPU) for the lengths."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(tq, hq, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(tk, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(tk, hkv, d, device="cuda", dtype=dtype, generator=g)
    dout = torch.randn(tq, hq, d, device="cuda", dtype=dtype, generator=g)
    cu_q, cu_k = (
        torch.tensor(starts(n), dtype=torch.int32, device="cuda") for n in (lengths_q, lengths_k)
    )
    return q, k, v, dout, cu_q, cu_k


def reference_window(causal: bool, window_size):
    """The reference's window for FlashAttention's window_size (-1: unbounded), or None."""
    left, right = window_size
    if left < 0 and (right < 0 or causal):
        return None
    big = 1 << 30
    return (left if left >= 0 else big, 0 if causal else (right if right >= 0 else big))


def sequence_grads(q, k, v, dout, cu_q, cu_k, scale, causal, window, softcap, dtype, dlse=None):
    """dq, dk, dv of the reference in ``dtype`` (float64: the truth) on each sequence's
    slices, packed like q, k and v in float32 (rows outside every sequence, and sequences
    with no query or no key: 0)."""
    grads = [torch.zeros(t.shape, dtype=torch.float32, device="cuda") for t in (q, k, v)]
    sq, sk = cu_q.tolist(), cu_k.tolist()
    work = torch.float64 if dtype == torch.float64 else torch.float32
    for b in range(len(sq) - 1):
        (q0, q1), (k0, k1) = (sq[b], sq[b + 1]), (sk[b], sk[b + 1])
        if q1 == q0 or k1 == k0:
            continue
        slices = ((q, q0, q1), (k, k0, k1), (v, k0, k1))
        leaves = [t[None, a:e].detach().to(dtype).requires_grad_() for t, a, e in slices]
        out, lse = reference(*leaves, scale, causal, dtype, softcap or None, window)
        loss = (out.to(work) * dout[None, q0:q1].to(work)).sum()
        if dlse is not None:
            loss = loss + (torch.where(lse.isinf(), 0.0, lse) * dlse[None, :, q0:q1]).sum()
        loss.backward()
        for grad, leaf, a, e in zip(grads, leaves, (q0, k0, k0), (q1, k1, k1)):
            grad[a:e] = leaf.grad[0].to(torch.float32)
    return grads


def check_sequences(ours, q, k, v, dout, cu_q, cu_k, scale, causal, window, softcap, dlse=None):
    """dq, dk, dv by FlashAttention's rule against float64 per sequence (PyTorch's own
    error measured in q's dtype); the dtypes and shapes are the inputs'."""
    args = (q, k, v, dout, cu_q, cu_k, scale, causal, window, softcap)
    truth = sequence_grads(*args, torch.float64, dlse)
    own = sequence_grads(*args, q.dtype, dlse)
    # the rule over the whole tensor, as the padded tests apply it (per sequence, a 1-row
    # sequence's own error is so small that the bound is rounding noise)
    for grad, leaf, t, o, what in zip(ours, (q, k, v), truth, own, "qkv"):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, f"d{what}"
        check_rule(grad, t, o, f"d{what}")


def varlen_grads(q, k, v, dout, cu_q, cu_k, causal=False, window_size=NONE, softcap=0, dlse=None):
    """fadsl.attention_varlen's output (and LSE with ``dlse``) and dq, dk, dv."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    longest = [
        max((e - a for a, e in zip(c, c[1:])), default=0) for c in (cu_q.tolist(), cu_k.tolist())
    ]
    found = fadsl.attention_varlen(
        *leaves,
        cu_q,
        cu_k,
        *longest,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        return_lse=dlse is not None,
    )
    out, lse = found if dlse is not None else (found, None)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (torch.where(lse.isinf(), 0.0, lse) * dlse).sum()
    loss.backward()
    return out, lse, [t.grad for t in leaves]


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_float64_per_sequence(case):
    lengths_q, lengths_k, d, causal, window_size, softcap, hq, hkv, dtype = CASES[case]
    q, k, v, dout, cu_q, cu_k = packed(
        lengths_q, lengths_k, hq, hkv, d, DTYPES[dtype], seed=len(lengths_q) * 31 + d + hq
    )
    if softcap:
        q = q * 8  # logits far past the cap: tanh saturates, its derivative near 0
    poison_allocator(4 * max(q.numel(), k.numel()) * 8)
    out, _, ours = varlen_grads(q, k, v, dout, cu_q, cu_k, causal, window_size, softcap)
    assert out.isfinite().all(), "the output has rows never written (or NaN)"
    window = reference_window(causal, window_size)
    check_sequences(ours, q, k, v, dout, cu_q, cu_k, d**-0.5, causal, window, softcap)


@pytest.mark.parametrize("d, causal", [(128, True), (64, False)])
def test_gradient_through_the_lse(d, causal):
    """return_lse=True and a loss on the LSE too (dS gains P dLSE); rows with no key have an
    LSE of -inf and get no gradient from it."""
    q, k, v, dout, cu_q, cu_k = packed(RAGGED_Q, RAGGED_K, 8, 2, d, torch.bfloat16, seed=7)
    dlse = torch.randn(8, q.shape[0], device="cuda")
    out, lse, ours = varlen_grads(q, k, v, dout, cu_q, cu_k, causal, dlse=dlse)
    assert lse.dtype == torch.float32 and lse.shape == (8, q.shape[0])
    assert not lse.isnan().any() and out.isfinite().all()
    check_sequences(ours, q, k, v, dout, cu_q, cu_k, d**-0.5, causal, None, 0, dlse)


@pytest.mark.parametrize("side", ["q", "k"])
def test_calls_with_no_query_or_no_key_token(side):
    """tokens_q == 0: dq empty, dk and dv zeros; tokens_k == 0: dq zeros (the output 0), dk
    and dv empty; each of the right shape and dtype."""
    lengths_q, lengths_k = ([0, 0], [5, 3]) if side == "q" else ([5, 3], [0, 0])
    q, k, v, dout, cu_q, cu_k = packed(lengths_q, lengths_k, 4, 2, 128, torch.bfloat16, seed=3)
    poison_allocator(1 << 24)
    out, _, (dq, dk, dv) = varlen_grads(q, k, v, dout, cu_q, cu_k, causal=True)
    torch.cuda.synchronize()
    assert out.shape == q.shape and (out == 0).all()
    for grad, leaf in ((dq, q), (dk, k), (dv, v)):
        assert grad is not None and grad.shape == leaf.shape and grad.dtype == leaf.dtype
        assert (grad == 0).all()


@pytest.mark.parametrize(
    "name",
    [
        "fa3_varlen_causal",
        "fa3_varlen_hdim64",
        "fa3_varlen_causal+br64+early_dv-dqred",
        "fa3_varlen_hdim64+br128",
    ],
)
def test_a_loaded_spec_varlen_call_has_gradients(name):
    """kern.varlen(...) with autograd, the LSE's gradient too: the shipped specs' backward
    blocks, head_dim 128's B_r 64 with dV early and dQ staged, and head_dim 64's B_r 128 (dQ
    split by queries; without spills since each role finds its block after its setmaxnreg)."""
    kern = spec(name)
    d, causal = kern.config.head_dim, kern.config.mask.value == "causal"
    q, k, v, dout, cu_q, cu_k = packed(UNEQUAL_Q, UNEQUAL_K, 8, 2, d, torch.float16, seed=5)
    dlse = torch.randn(8, q.shape[0], device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = kern.varlen(*leaves, cu_q, cu_k, 300, 333, return_lse=True)
    loss = (out.float() * dout.float()).sum() + (torch.where(lse.isinf(), 0.0, lse) * dlse).sum()
    loss.backward()
    ours = [t.grad for t in leaves]
    check_sequences(ours, q, k, v, dout, cu_q, cu_k, d**-0.5, causal, None, 0, dlse)


@pytest.mark.parametrize("name", ["fa3_varlen_causal", "fa3_varlen_hdim64"])
def test_a_padded_call_on_a_varlen_spec_has_gradients(name):
    """kern(q, k, v) on (batch, seqlen, heads, head_dim): the varlen kernels with equal
    lengths; the gradients are the padded reference's."""
    kern = spec(name)
    d, causal = kern.config.head_dim, kern.config.mask.value == "causal"
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v, dout = (
        torch.randn(3, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        for n, h in ((333, 8), (400, 2), (400, 2), (333, 8))
    )
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern(*leaves).backward(dout)
    truth = padded_reference_grads(q, k, v, dout, d**-0.5, causal, torch.float32)
    own = padded_reference_grads(q, k, v, dout, d**-0.5, causal, torch.bfloat16)
    for leaf, t, o, what in zip(leaves, truth, own, ("dq", "dk", "dv")):
        check_rule(leaf.grad, t, o, what)


def assert_near(ours, other, what):
    """Equal but for the order dQ's fp32 reduce-adds land in (a bf16/fp16 ulp or so)."""
    ours, other = ours.float(), other.float()
    atol = 1e-3 * other.abs().max().item() + 1e-5
    assert torch.allclose(ours, other, rtol=1e-2, atol=atol), f"{what} differs"


def test_compile_fullgraph_forward_and_backward():
    """torch.compile(fullgraph=True, dynamic=True) over two packings: the output bit for bit
    the eager call's; dQ, and under GQA (8:2 here) dK and dV, up to the order of their fp32
    reduce-adds (sm90_bwd.cuh's DkvStore)."""
    torch._dynamo.reset()

    def step(q, k, v, cu, dout, longest):
        out, lse = fadsl.attention_varlen(
            q, k, v, cu, cu, longest, longest, causal=True, return_lse=True
        )
        return (out.float() * dout.float()).sum() + lse.sum(), out

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for lengths in ([0, 1, 130, 77], [300, 5, 64, 1000]):
        q, k, v, dout, cu, _ = packed(lengths, lengths, 8, 2, 128, torch.bfloat16, seed=9)
        eager = [t.clone().requires_grad_() for t in (q, k, v)]
        loss, out = step(*eager, cu, dout, max(lengths))
        loss.backward()
        traced = [t.clone().requires_grad_() for t in (q, k, v)]
        loss_c, out_c = compiled(*traced, cu, dout, max(lengths))
        loss_c.backward()
        assert torch.equal(out_c, out)
        for leaf, other, what in zip(traced, eager, ("dq", "dk", "dv")):
            assert_near(leaf.grad, other.grad, what)


@pytest.mark.parametrize(
    "batch, length, d, causal, hq, hkv, dtype",
    [(3, 333, 128, True, 8, 2, "bf16"), (4, 128, 64, False, 4, 4, "fp16")],
)
def test_equal_lengths_match_the_padded_call(batch, length, d, causal, hq, hkv, dtype):
    """cu = arange(0, (B + 1) L, L): the same gradients as fadsl.attention on (B, L, H, D)."""
    lengths = [length] * batch
    q, k, v, dout, cu, _ = packed(lengths, lengths, hq, hkv, d, DTYPES[dtype], seed=length)
    assert cu.tolist() == list(range(0, (batch + 1) * length, length))
    out, _, ours = varlen_grads(q, k, v, dout, cu, cu, causal)
    four_d = [t.clone().view(batch, length, *t.shape[1:]).requires_grad_() for t in (q, k, v)]
    padded = fadsl.attention(*four_d, causal=causal)
    padded.backward(dout.view(batch, length, hq, d))
    assert_near(out, padded.reshape(out.shape), "out")
    for grad, leaf, what in zip(ours, four_d, ("dq", "dk", "dv")):
        assert_near(grad, leaf.grad.reshape(grad.shape), what)


ISOLATION_Q, ISOLATION_K = [700, 300, 900], [900, 500, 700]


@pytest.mark.parametrize("d, heads_kv", [(128, 2), (64, 2), (128, 8), (64, 8)])
def test_sequences_are_isolated(d, heads_kv):
    """New (and 4x larger) q, k, v and dout for sequence 1 leave sequences 0 and 2's dK and
    dV bit for bit without GQA (each a CTA's own stores), and their dQ, and under GQA 4:1
    their dK and dV, up to the order of the fp32 reduce-adds (`deterministic on` is refused
    with `varlen on`); several n-blocks per m-block."""
    q, k, v, dout, cu_q, cu_k = packed(ISOLATION_Q, ISOLATION_K, 8, heads_kv, d, torch.bfloat16, 13)
    first = varlen_grads(q, k, v, dout, cu_q, cu_k, causal=True)[2]
    sq, sk = starts(ISOLATION_Q), starts(ISOLATION_K)
    changed = [t.clone() for t in (q, k, v, dout)]
    g = torch.Generator(device="cuda").manual_seed(99)
    for t, cu in zip(changed, (sq, sk, sk, sq)):
        t[cu[1] : cu[2]] = 4 * torch.randn(t[cu[1] : cu[2]].shape, generator=g, device="cuda")
    second = varlen_grads(*changed, cu_q, cu_k, causal=True)[2]
    for a, b, cu, what in zip(first, second, (sq, sk, sk), ("dq", "dk", "dv")):
        assert not torch.equal(a[cu[1] : cu[2]], b[cu[1] : cu[2]]), "sequence 1 unchanged?"
        for s in (0, 2):
            rows = slice(cu[s], cu[s + 1])
            if what == "dq" or heads_kv < 8:
                assert_near(b[rows], a[rows], f"sequence {s} {what}")
            else:
                assert torch.equal(a[rows], b[rows]), f"sequence {s} {what} moved"


# (rows of q, rows of k, cu_seqlens_q, cu_seqlens_k): rows before cu[0] (fewer than a block,
# and more: n-block slots and dQ chunks before the first sequence) and from cu[B] on
OUTSIDE = {
    # fewer preprocess CTAs than bwd_zero_outside's 16: each covers its own stride
    "tiny": (40, 50, [5, 20, 30], [3, 21, 44]),
    "short": (400, 450, [10, 130, 130, 300], [20, 200, 260, 390]),
    "long": (800, 900, [300, 430, 430, 600], [260, 400, 460, 700]),
}


@pytest.mark.parametrize("heads_kv", [2, 8], ids=["gqa", "mha"])
@pytest.mark.parametrize("case", OUTSIDE)
def test_rows_outside_the_sequences_get_zero_gradients(case, heads_kv):
    """cu_seqlens need not cover the tensors (a statically padded packed batch): rows before
    cu[0] and from cu[B] on get dq = dk = dv = 0 (the preprocess zeroes them; without GQA dk
    and dv are stored in place, with it cast from zeroed fp32 accumulators), on a poisoned
    allocator; the sequences' are right."""
    rows_q, rows_k, starts_q, starts_k = OUTSIDE[case]
    q, k, v, dout, _, _ = packed([rows_q], [rows_k], 8, heads_kv, 128, torch.bfloat16, seed=17)
    cu_q = torch.tensor(starts_q, dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(starts_k, dtype=torch.int32, device="cuda")
    poison_allocator(4 * q.numel() * 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fadsl.attention_varlen(*leaves, cu_q, cu_k, 170, 180, causal=True)
    out.backward(dout)  # (the output's rows outside the sequences are never written)
    ours = [t.grad for t in leaves]
    spans = ((starts_q[0], starts_q[-1]), (starts_k[0], starts_k[-1]), (starts_k[0], starts_k[-1]))
    for grad, (first, last), what in zip(ours, spans, "qkv"):
        assert (grad[:first] == 0).all() and (grad[last:] == 0).all(), f"d{what} outside"
    check_sequences(ours, q, k, v, dout, cu_q, cu_k, 128**-0.5, True, None, 0)


@pytest.mark.parametrize("path", ["public", "loaded", "fused"])
def test_malformed_cu_seqlens_give_nan_gradients_or_a_named_error(path):
    """Decreasing cu_seqlens, or past the tensor (fadsl.attention_varlen, and a loaded spec's
    .varlen, with `fused_convert on` too): no fault and no hang; either an error naming
    cu_seqlens or NaN gradients, never finite ones. The next call is fine."""
    names = {"loaded": "fa3_varlen_causal", "fused": "fa3_varlen_causal+fused_convert"}
    kern = spec(names[path]) if path in names else None
    q, k, v, dout, cu_q, cu_k = packed([100, 200], [100, 200], 4, 4, 128, torch.bfloat16, 5)

    def call(cu_q, cu_k):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if kern is None:
            out = fadsl.attention_varlen(*leaves, cu_q, cu_k, causal=True)
        else:
            out = kern.varlen(*leaves, cu_q, cu_k)
        out.backward(dout)
        torch.cuda.synchronize()
        return [t.grad for t in leaves]

    for bad_q, bad_k in (([0, 250, 200], [0, 100, 300]), ([0, 100, 300], [0, 100, 400])):
        as_cu = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (bad_q, bad_k))
        try:
            found = call(*as_cu)
        except (ValueError, RuntimeError) as error:
            assert "cu_seqlens" in str(error), f"an error not naming cu_seqlens: {error}"
            continue
        for grad, what in zip(found, ("dq", "dk", "dv")):
            assert grad.isnan().any(), f"{bad_q}, {bad_k}: finite {what} for malformed input"
    good = call(cu_q, cu_k)
    assert all(g.isfinite().all() for g in good), "the call after a malformed one"


def test_malformed_cu_seqlens_give_the_same_gradients_whatever_memory_held():
    """cu_seqlens_q [15, 131, 0, 7] (B_r 64): the slot search sends sequence 2's chunk to
    sequence 0, whose rows do not reach it, so the preprocess skips the chunk as padding while
    the main kernel visits it for sequence 2. Its LSE (+inf) and D (0) are written anyway:
    the gradients do not depend on what the allocator's memory held before."""
    kern = spec("fa3_varlen_causal")
    g = torch.Generator(device="cuda").manual_seed(11)
    q, dout = (torch.randn(182, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    k, v = (torch.randn(30, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(2))
    cu_q = torch.tensor([15, 131, 0, 7], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 10, 20, 30], dtype=torch.int32, device="cuda")
    runs = []
    for poison in (float("nan"), 3.0):
        junk = torch.full((1 << 24,), poison, device="cuda")
        del junk
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        try:
            kern.varlen(*leaves, cu_q, cu_k).backward(dout)
        except (ValueError, RuntimeError) as error:  # refused up front: as good
            assert "cu_seqlens" in str(error), f"an error not naming cu_seqlens: {error}"
            return
        torch.cuda.synchronize()
        runs.append([t.grad for t in leaves])
    for first, second, what in zip(*runs, ("dq", "dk", "dv")):
        assert torch.equal(first.isnan(), second.isnan()), what
        assert torch.equal(first.nan_to_num(), second.nan_to_num()), what


# `fused_convert on` with packed sequences: each sequence's m-blocks counted and converted by
# its last CTA, its keyless chunks (causal, queries before every key) zeroed by the preprocess
FUSED_CASES = {
    "fa3_varlen_causal+fused_convert": ("one", "no_query_first", "no_key_second_causal", "odd_causal", "mixed_causal", "unequal_causal"),
    "fa3_varlen_hdim64+fused_convert": ("one_d64", "no_key_second", "odd_d64", "mixed_d64", "short300_d128"),
}  # fmt: skip


@pytest.mark.parametrize(
    "name, case", [(name, case) for name, cases in FUSED_CASES.items() for case in cases]
)
def test_fused_convert_gradients_per_sequence(name, case):
    lengths_q, lengths_k, _, _, _, _, hq, hkv, dtype = CASES[case]
    kern = spec(name)
    d, causal = kern.config.head_dim, kern.config.mask.value == "causal"
    q, k, v, dout, cu_q, cu_k = packed(lengths_q, lengths_k, hq, hkv, d, DTYPES[dtype], seed=17)
    poison_allocator(4 * max(q.numel(), k.numel()) * 8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kern.varlen(*leaves, cu_q, cu_k)
    out.backward(dout)
    assert out.isfinite().all()
    ours = [t.grad for t in leaves]
    check_sequences(ours, q, k, v, dout, cu_q, cu_k, d**-0.5, causal, None, 0)
