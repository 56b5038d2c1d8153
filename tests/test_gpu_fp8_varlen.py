"""The 8-bit varlen forward on the GPU (issue 42, research/fp8-forward.md §12): packed batches
of 8-bit sequences through the FP8 examples with `varlen on` (kern.varlen) and through
fadsl.attention_varlen, every sequence's rows against float64 attention of its dequantized
inputs (t8 * descale, sequence b's row of each (sequences, heads_kv) descale) with
tests/test_gpu_fp8.py's bounds (check_close). Lengths as tests/test_gpu_varlen.py's: 0 query
rows, 0 keys (O = 0, LSE -inf), tails off the 128 and 192 tile grids, more keys than queries
and fewer (causal rows with no key); GQA and MQA; both 8-bit dtypes; O poisoned with NaN
first. Descales that differ per sequence and per K/V head (a kernel reading sequence 0's row
for every sequence fails), the padded call's bits on an equal-length batch, a planned call's
own descales, torch.compile's bits, and a bad descale's shape named."""

from __future__ import annotations

import math

import pytest
import torch

import fadsl
from conftest import ROOT
from fadsl.frontend.rewrite import rewrite
from fadsl.runtime import dispatch, fp8_planned
from test_gpu_backward import poison_allocator
from test_gpu_fp8 import DTYPES, E4M3, _v_stats, check_close, fp8_reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

# (q lengths, k lengths) per sequence
LENGTHS = {
    # 1 x 1; 300 queries over 170 keys (causal rows with none); no query row; no key; more
    # keys than queries; none a multiple of 128 or 192
    "ragged": ([1, 300, 0, 129, 500, 250], [1, 170, 5, 0, 700, 400]),
    # rows of many key blocks beside a short one
    "long": ([1100, 77], [1300, 1100]),
}
HEADS = {"ragged": (8, 2), "long": (4, 1)}  # GQA 4, MQA
_loaded: dict[str, object] = {}


def varlen_spec(name: str, settings=None, variant: str | None = None):
    """examples/NAME.fa with `varlen on` and `tail whole`, named as fadsl.attention_varlen's
    own variant (dispatch.fp8_varlen_kernel: the same text, so the same cached build); or
    with ``settings`` as ``variant``."""
    settings = settings or {"varlen": "on", "tail": "whole"}
    variant = variant or f"{name}_varlen"
    if variant not in _loaded:
        base = (ROOT / "examples" / f"{name}.fa").read_text()
        _loaded[variant] = fadsl.load(rewrite(base, settings, {}, variant), verbose=False)
    return _loaded[variant]


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).cuda()


def random_descales(sequences: int, heads_kv: int, seed: int):
    """(q_descale, k_descale, v_descale), each (sequences, heads_kv) in [0.25, 1.75)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(
        torch.rand(sequences, heads_kv, device="cuda", generator=g) * 1.5 + 0.25 for _ in range(3)
    )


def packed_fp8(lengths_q, lengths_k, hq, hkv, d, dtype, descales, seed: int, tail: int = 0):
    """q8 (tokens_q + tail, hq, d), k8 and v8 (tokens_k, hkv, d), cu_seqlens_q, cu_seqlens_k:
    N(0, 1) stored as t / descale in the 8-bit type (sequence b's row, each head's K/V head;
    None: 1), so that the dequantized inputs are N(0, 1) to within the type's rounding
    whatever the descales (tests/test_gpu_fp8.py's encoded_inputs, per sequence). ``tail``:
    query rows past the last sequence."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lengths_q) + tail, hq, d, device="cuda", generator=g)
    k = torch.randn(sum(lengths_k), hkv, d, device="cuda", generator=g)
    v = torch.randn(sum(lengths_k), hkv, d, device="cuda", generator=g)
    owners = [torch.arange(len(n)).repeat_interleave(torch.tensor(n)).cuda() for n in
              (lengths_q, lengths_k, lengths_k)]  # fmt: skip
    encoded = []
    for t, owner, descale in zip((q, k, v), owners, descales):
        if descale is not None:
            per_head = descale.repeat_interleave(t.shape[1] // hkv, dim=1)  # (sequences, heads)
            t[: len(owner)] /= per_head[owner][:, :, None]
        encoded.append(t.to(dtype))
    return (*encoded, cu_seqlens(lengths_q), cu_seqlens(lengths_k))


def check_sequence(got, got_lse, qb, kb, vb, rows, scale, causal, what) -> None:
    """One sequence's O rows (rows, heads, head_dim) and LSE (heads, rows) against
    fp8_reference of it alone (qb, kb, vb: (1, length, heads, head_dim); rows: its descales,
    each (1, heads_kv) or None): rows that see no key (no key at all, or causal rows above the
    bottom-right diagonal) O exactly 0 and LSE -inf, the others within check_close's bounds
    (and so written: finite)."""
    ref_out, ref_lse = fp8_reference(qb, kb, vb, rows, scale, causal)
    got, ref, ref_lse = got.transpose(0, 1), ref_out[0].transpose(0, 1), ref_lse[0]
    empty = ref_lse == -math.inf  # (heads, rows)
    assert (got[empty] == 0).all(), f"{what}: a row with no key outputs 0"
    assert (got_lse[empty] == -math.inf).all(), f"{what}: a row with no key has LSE -inf"
    if (~empty).any():
        stats = _v_stats(vb, rows[2], kb.shape[2])
        check_close(got[~empty], got_lse[~empty], ref[~empty], ref_lse[~empty], *stats, what)


def sequences(q8, k8, v8, cu_q, cu_k, descales):
    """(b, its rows of q and O (a slice), (qb, kb, vb), its descales' rows) of each sequence
    with a query row."""
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 > q0:
            rows = tuple(None if t is None else t[b : b + 1] for t in descales)
            yield b, slice(q0, q1), (q8[None, q0:q1], k8[None, k0:k1], v8[None, k0:k1]), rows


def check_sequences(out, lse, q8, k8, v8, cu_q, cu_k, descales, scale, causal, what) -> None:
    """Every sequence's rows of O and the LSE (check_sequence), descales' row b for
    sequence b."""
    for b, rows_q, inputs, rows in sequences(q8, k8, v8, cu_q, cu_k, descales):
        name = f"{what}: sequence {b}"
        check_sequence(out[rows_q], lse[:, rows_q], *inputs, rows, scale, causal, name)


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_loaded_8bit_varlen_spec_matches_each_sequence(name, causal, lengths):
    """examples/fa3_fp8_hdim128{,_causal}.fa with `varlen on`, out= a NaN-filled bf16 tensor,
    descales random per (sequence, K/V head)."""
    kern = varlen_spec("fa3_fp8_hdim128_causal" if causal else "fa3_fp8_hdim128")
    (lq, lk), (hq, hkv) = LENGTHS[lengths], HEADS[lengths]
    descales = random_descales(len(lq), hkv, seed=len(lq) + causal)
    q8, k8, v8, cu_q, cu_k = packed_fp8(lq, lk, hq, hkv, 128, DTYPES[name], descales, seed=hq)
    out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    poison_allocator(8 * q8.numel() * 4)
    got, lse = kern.varlen(q8, k8, v8, cu_q, cu_k, softmax_scale=128**-0.5, out=out,
                           return_lse=True, q_descale=descales[0], k_descale=descales[1],
                           v_descale=descales[2])  # fmt: skip
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    assert lse.shape == (hq, q8.shape[0]) and lse.dtype == torch.float32
    check_sequences(out, lse, q8, k8, v8, cu_q, cu_k, descales, 128**-0.5, causal, lengths)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_each_sequence_reads_its_own_descales(name, causal):
    """Descales far apart per sequence (q's rows 0.5, 2, 1, 4) and per K/V head: sequence b
    must read row b. With sequence 0's descales every sequence's reference moves far past
    the bound (checked below, so the test can tell the two kernels apart)."""
    lq, lk, hq, hkv = [200, 333, 150, 400], [300, 333, 500, 129], 8, 2
    qd = torch.tensor([[0.5, 0.75], [2.0, 3.0], [1.0, 0.25], [4.0, 1.5]], device="cuda")
    kd = torch.tensor([[1.0, 0.25], [3.0, 0.5], [0.125, 2.0], [1.5, 6.0]], device="cuda")
    vd = torch.tensor([[0.5, 2.0], [4.0, 0.25], [1.0, 8.0], [0.125, 3.0]], device="cuda")
    descales = (qd, kd, vd)
    q8, k8, v8, cu_q, cu_k = packed_fp8(lq, lk, hq, hkv, 128, DTYPES[name], descales, seed=17)
    kern = varlen_spec("fa3_fp8_hdim128_causal" if causal else "fa3_fp8_hdim128")
    out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    poison_allocator(8 * q8.numel() * 4)
    _, lse = kern.varlen(q8, k8, v8, cu_q, cu_k, out=out, return_lse=True, q_descale=qd,
                         k_descale=kd, v_descale=vd)  # fmt: skip
    check_sequences(out, lse, q8, k8, v8, cu_q, cu_k, descales, 128**-0.5, causal, name)
    first = tuple(t[:1] for t in descales)  # sequence 0's descales for every sequence
    for b, rows_q, inputs, _ in sequences(q8, k8, v8, cu_q, cu_k, descales):
        if b > 0:  # (what a kernel reading row 0 would be checked against)
            with pytest.raises(AssertionError):
                check_sequence(out[rows_q], lse[:, rows_q], *inputs, first, 128**-0.5, causal, "")


PUBLIC = [(d, c) for d in (64, 128, 256) for c in (False, True)]


@pytest.mark.parametrize("head_dim, causal", PUBLIC, ids=[f"d{d}-{c}" for d, c in PUBLIC])
def test_attention_varlen_on_8bit_inputs(head_dim, causal):
    """fadsl.attention_varlen runs the shipped 8-bit spec with `varlen on`: each head_dim and
    mask on a small ragged batch (e5m2 and no descales (1) at head_dim 64 without a mask);
    out_dtype=torch.float16 at head_dim 128 causal."""
    lq, lk, hq, hkv = [77, 0, 300, 129, 1], [200, 3, 250, 0, 64], 4, 2
    plain = (head_dim, causal) == (64, False)
    dtype = DTYPES["e5m2"] if plain else E4M3
    descales = (None,) * 3 if plain else random_descales(len(lq), hkv, seed=head_dim + causal)
    q8, k8, v8, cu_q, cu_k = packed_fp8(lq, lk, hq, hkv, head_dim, dtype, descales, seed=3)
    out_dtype = torch.float16 if (head_dim, causal) == (128, True) else None
    poison_allocator(8 * q8.numel() * 4)
    out, lse = fadsl.attention_varlen(q8, k8, v8, cu_q, cu_k, max(lq), max(lk), causal,
                                      return_lse=True, q_descale=descales[0],
                                      k_descale=descales[1], v_descale=descales[2],
                                      out_dtype=out_dtype)  # fmt: skip
    assert out.dtype == (out_dtype or torch.bfloat16) and out.shape == q8.shape
    check_sequences(out, lse, q8, k8, v8, cu_q, cu_k, descales, head_dim**-0.5, causal, "public")


# (head_dim, causal, batch, seqlen_q, seqlen_k): past Target.shipped_fp8_short's limits (head_dim
# 128: 1024), so that fadsl.attention runs the spec the varlen call rewrites, not its twin
# (1000 queries at head_dim 128: both calls run the 128 x 128 short-query spec)
# (2100 queries at head_dim 64 causal: past the short spec's 2048, the three-consumer tile)
PADDED = [(128, True, 2, 1100, 1100), (128, False, 2, 1000, 900), (256, True, 2, 200, 333),
          (64, False, 3, 333, 200), (64, True, 1, 2100, 2100)]  # fmt: skip


@pytest.mark.parametrize("head_dim, causal, batch, sq, sk", PADDED,
                         ids=["-".join(map(str, c)) for c in PADDED])  # fmt: skip
def test_an_equal_length_packed_batch_gives_the_padded_calls_bits(head_dim, causal, batch, sq, sk):
    """The padded 8-bit call and the varlen one on the same sequences packed end to end
    (reshape) must agree bit for bit: the varlen variant is the same spec (tile, rescale,
    roundings) with the same descales (batch b's row = sequence b's), so each (sequence, head,
    q block) tile does the same arithmetic on the same bytes; the schedules differ only in
    the order tiles run, and no tile reads another's results. Keys past a sequence's end
    (another sequence's in the packed tensors, TMA's zeros in the padded ones) are masked to
    P = 0 in both, adding exact zeros; query rows past it are rows of their own, not stored."""
    capability = torch.cuda.get_device_capability(0)
    spec = dispatch.shipped_fp8_spec(capability, head_dim, causal, E4M3, sq)
    hq, hkv = 4, 2
    descales = random_descales(batch, hkv, seed=head_dim)
    lengths_q, lengths_k = [sq] * batch, [sk] * batch
    q8, k8, v8, cu_q, cu_k = packed_fp8(lengths_q, lengths_k, hq, hkv, head_dim, E4M3, descales,
                                        seed=head_dim + 1)  # fmt: skip
    padded = (
        q8.view(batch, sq, hq, head_dim),
        *(t.view(batch, sk, hkv, head_dim) for t in (k8, v8)),
    )
    ours = dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    out_p, lse_p = fadsl.attention(*padded, causal=causal, softmax_scale=0.1, return_lse=True,
                                   **ours)  # fmt: skip
    if dispatch._shipped(spec).config.ext.split_kv:
        # the padded call merges its last round's tiles from pieces (`tail split_kv`, other
        # roundings: tests/test_gpu_fp8.py's tail split tests); the same spec with `tail
        # whole` runs every tile whole, as the varlen variant does
        whole = varlen_spec(spec, {"tail": "whole"}, f"{spec}_whole")
        assert not torch.equal(out_p, whole(*padded, 0.1, **ours))  # (the shape splits)
        out_p, lse_p = whole(*padded, 0.1, return_lse=True, **ours)
    out_v, lse_v = fadsl.attention_varlen(q8, k8, v8, cu_q, cu_k, sq, sk, causal, 0.1,
                                          return_lse=True, **ours)  # fmt: skip
    chosen = dispatch.fp8_varlen_kernel(q8, causal, None, sq)  # (max_seqlen_q = sq: the same tile)
    assert chosen.config.name == f"{spec}_varlen"
    assert torch.equal(out_v, out_p.reshape(batch * sq, hq, head_dim))
    assert torch.equal(lse_v, lse_p.permute(1, 0, 2).reshape(hq, batch * sq))


def test_a_planned_call_reads_each_calls_descales():
    """One signature called four times (the later calls run its plan) with new descale
    tensors of other values: each call's output is its own descales' reference."""
    lq, lk, hq, hkv = [130, 257, 64], [200, 257, 400], 4, 2
    base = random_descales(len(lq), hkv, seed=8)
    q8, k8, v8, cu_q, cu_k = packed_fp8(lq, lk, hq, hkv, 128, E4M3, base, seed=8)
    fp8_planned.clear()
    outputs = []
    for factor in (1.0, 0.5, 2.0, 0.25):
        scaled = (base[0] * factor, base[1].clone(), base[2] * factor)
        out, lse = fadsl.attention_varlen(q8, k8, v8, cu_q, cu_k, 257, 400, causal=True,
                                          return_lse=True, q_descale=scaled[0],
                                          k_descale=scaled[1], v_descale=scaled[2])  # fmt: skip
        check_sequences(out, lse, q8, k8, v8, cu_q, cu_k, scaled, 128**-0.5, True, str(factor))
        outputs.append(out)
    assert not torch.equal(outputs[2], outputs[3]), "a plan that kept one call's descales"


def test_rows_past_the_last_sequence_stay_as_they_were():
    """cu_seqlens_q need not cover q: the 8-bit O store writes the sequences' rows only."""
    lq, lk, hq, hkv = [130, 260], [300, 100], 4, 4
    descales = random_descales(len(lq), hkv, seed=2)
    q8, k8, v8, cu_q, cu_k = packed_fp8(lq, lk, hq, hkv, 128, E4M3, descales, seed=2, tail=70)
    out = torch.full(q8.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    qd, kd, vd = descales
    _, lse = varlen_spec("fa3_fp8_hdim128").varlen(q8, k8, v8, cu_q, cu_k, out=out,
                                                   return_lse=True, q_descale=qd, k_descale=kd,
                                                   v_descale=vd)  # fmt: skip
    check_sequences(out, lse, q8, k8, v8, cu_q, cu_k, descales, 128**-0.5, False, "tail")
    assert out[sum(lq) :].isnan().all(), "rows past the last sequence were written"


def test_torch_compile_fullgraph_gives_the_eager_bits():
    lq, lk, hq, hkv = [513, 1, 77, 700], [600, 9, 0, 700], 8, 2
    descales = random_descales(len(lq), hkv, seed=21)
    q8, k8, v8, cu_q, cu_k = packed_fp8(lq, lk, hq, hkv, 128, E4M3, descales, seed=21)

    def call(q, k, v, cu_q, cu_k, qd, kd, vd):
        return fadsl.attention_varlen(q, k, v, cu_q, cu_k, 700, 700, causal=True, q_descale=qd,
                                      k_descale=kd, v_descale=vd, return_lse=True)  # fmt: skip

    eager = call(q8, k8, v8, cu_q, cu_k, *descales)
    compiled = torch.compile(call, fullgraph=True)(q8, k8, v8, cu_q, cu_k, *descales)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_bad_arguments_are_named():
    """A descale not (sequences, heads_kv), through the loaded spec and the public call;
    gradients, a window and a softcap refused on 8-bit inputs."""
    lq, lk, hq, hkv = [10, 20, 30], [10, 20, 30], 4, 2
    q8, k8, v8, cu_q, cu_k = packed_fp8(lq, lk, hq, hkv, 128, E4M3, (None,) * 3, seed=1)
    kern = varlen_spec("fa3_fp8_hdim128")
    for bad in (torch.ones(4, hkv, device="cuda"), torch.ones(3, hq, device="cuda")):
        with pytest.raises(ValueError, match="q_descale"):
            kern.varlen(q8, k8, v8, cu_q, cu_k, q_descale=bad)
        with pytest.raises(ValueError, match="q_descale"):
            fadsl.attention_varlen(q8, k8, v8, cu_q, cu_k, q_descale=bad)
    with pytest.raises(ValueError, match="window"):
        fadsl.attention_varlen(q8, k8, v8, cu_q, cu_k, window_size=(64, 0))
    with pytest.raises(ValueError, match="softcap"):
        fadsl.attention_varlen(q8, k8, v8, cu_q, cu_k, softcap=30.0)
    kd = torch.ones(3, hkv, device="cuda", requires_grad=True)
    with pytest.raises(RuntimeError, match="k_descale requires grad"):
        fadsl.attention_varlen(q8, k8, v8, cu_q, cu_k, k_descale=kd)
    with pytest.raises(RuntimeError, match="q requires grad"):
        fadsl.attention_varlen(q8.detach().requires_grad_(), k8, v8, cu_q, cu_k)


def test_fadsl_bench_times_an_8bit_varlen_spec():
    """bench_varlen (fadsl bench on a `varlen on` spec) on an 8-bit spec: its output checked
    within the 8-bit bound, then timed (TF/s for fadsl)."""
    from fadsl.tools import bench_varlen

    kern = varlen_spec("fa3_fp8_hdim128")
    found = bench_varlen.run(kern, (512,), tokens=2048, heads=4, warmup=1, runs=2,
                             dtype_name="e4m3", log=lambda s: None)  # fmt: skip
    (row,) = found["rows"]
    assert found["dtype"] == "e4m3" and row["tflops"]["fadsl"] > 0


def test_a_padded_call_of_a_varlen_8bit_spec_gives_the_padded_specs_bits():
    """kern(q8, k8, v8, ...) on a `varlen on` 8-bit spec packs the batch end to end and runs
    its varlen kernels with the (batch, heads_kv) descales as per-sequence rows: the padded
    example's bits (the same tile, 1100 queries being past the short spec's 1024)."""
    kern = varlen_spec("fa3_fp8_hdim128")
    batch, sq, sk, hq, hkv = 2, 1100, 700, 4, 2
    descales = random_descales(batch, hkv, seed=21)
    q8, k8, v8, _, _ = packed_fp8([sq] * batch, [sk] * batch, hq, hkv, 128, E4M3, descales, seed=22)
    padded = (q8.view(batch, sq, hq, 128), *(t.view(batch, sk, hkv, 128) for t in (k8, v8)))
    ours = dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])
    out_v, lse_v = kern(*padded, 0.1, return_lse=True, **ours)
    out_p, lse_p = fadsl.attention(*padded, softmax_scale=0.1, return_lse=True, **ours)
    assert torch.equal(out_v, out_p) and torch.equal(lse_v, lse_p)
