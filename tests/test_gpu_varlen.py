"""Varlen on the GPU (issue 31): packed batches of sequences of any lengths through `varlen on`
specs (examples/serving/fa3_varlen*.fa, and variants: a window with softcap, the grid
scheduler, every rescale mode), both dtypes, GQA and MQA, against float64 per sequence with
FlashAttention's rule. Lengths include 1, 0 (no query row, or no key: O = 0, LSE -inf), tiles
cut short by their sequence's end (a warpgroup with no row left), seqlen_q != seqlen_k per
sequence (causal rows with no key), and a long sequence among short ones. Outputs are
poisoned with NaN first, and rows past each sequence must be left as they were (the ragged
O store never writes into the next sequence). Malformed cu_seqlens give NaN; a padded call on
a varlen spec, torch.compile and a CUDA graph agree with the eager call.
`GPU_TESTS=tests/test_gpu_varlen.py bash scripts/device.sh tests`."""

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

SPEC_DIR = ROOT / "examples" / "serving"  # the specs fadsl.attention_varlen ships


def _variant(base: str, name: str, **settings: str) -> str:
    text = re.sub(r"\bkernel\s+\w+", f"kernel {name}", (SPEC_DIR / base).read_text(), count=1)
    for key, value in settings.items():
        if re.search(rf"^\s*{key}\s", text, re.MULTILINE):
            text = with_setting(text, key, value)
        else:
            text = text.replace("  varlen     on", f"  varlen     on\n  {key} {value}", 1)
    return text


SPECS = {
    "causal": (SPEC_DIR / "fa3_varlen_causal.fa").read_text(),
    "hdim64": (SPEC_DIR / "fa3_varlen_hdim64.fa").read_text(),
    "causal_lazy_grid": _variant(
        "fa3_varlen_causal.fa", "vl_causal_lazy_grid", rescale="lazy", scheduler="grid"
    ),
    "causal_every": _variant("fa3_varlen_causal.fa", "vl_causal_every", rescale="every"),
    "window_softcap": _variant(
        "fa3_varlen_hdim64.fa", "vl_window_softcap", mask="window(100, 30)", softcap="30"
    ),
    "causal_window": _variant(
        "fa3_varlen_causal.fa", "vl_causal_window", mask="causal, window(200)"
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (q lengths, k lengths) per sequence
LENGTHS = {
    "ragged": ([1, 300, 0, 129, 1000, 64], [1, 300, 5, 0, 1000, 700]),
    "one_long": ([3000, 17, 1, 1, 250], [3000, 17, 1, 400, 250]),
    "q_longer": ([700, 200], [300, 50]),  # causal rows with no key
    "single": ([2048], [2048]),
}
HEADS = [(8, 2), (8, 8), (8, 1)]  # GQA 4, none, MQA
CASES = [
    (spec, dtype, lengths, *HEADS[i % len(HEADS)])
    for i, (spec, dtype, lengths) in enumerate(
        (s, d, n) for s in SPECS for d in DTYPES for n in LENGTHS
    )
]
_loaded: dict[str, object] = {}


def kernel(name: str):
    if name not in _loaded:
        _loaded[name] = fadsl.load(SPECS[name], verbose=False)
    return _loaded[name]


def packed(lengths_q, lengths_k, hq, hkv, d, dtype, seed):
    torch.manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, device="cuda", dtype=dtype)
    k = torch.randn(sum(lengths_k), hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(sum(lengths_k), hkv, d, device="cuda", dtype=dtype)

    def cu(lengths):
        return torch.tensor(
            [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32
        ).cuda()

    return q, k, v, cu(lengths_q), cu(lengths_k)


def spec_mask(kern, text: str):
    found = re.search(r"window\((\d+)(?:,\s*(\d+))?\)", text)
    window = None if found is None else (int(found.group(1)), int(found.group(2) or 0))
    causal = kern.config.mask.value == "causal"
    return causal, window, kern.config.ext.softcap or None


def check_sequences(kern, text, q, k, v, cu_q, cu_k, scale, out, lse):
    """Each sequence against float64 (FlashAttention's rule), its LSE within 1e-3 and -inf
    exactly where the reference's is; rows with no key output 0."""
    causal, window, cap = spec_mask(kern, text)
    assert not out.isnan().any() and not lse.isnan().any(), "outputs never written (or NaN)"
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(starts_q) - 1):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0:
            continue
        qb, kb, vb = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
        ref, ref_lse = reference(qb, kb, vb, scale, causal, torch.float64, cap, window)
        low, _ = reference(qb, kb, vb, scale, causal, q.dtype, cap, window)
        got, got_lse = out[None, q0:q1].double(), lse[:, q0:q1].double()
        bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
        err = (got - ref).abs().max().item()
        assert err <= bound, f"sequence {b}: max error {err:.3e} > {bound:.3e}"
        empty = ref_lse[0] == -math.inf
        assert torch.equal(got_lse == -math.inf, empty), f"sequence {b}: LSE -inf rows"
        if (~empty).any():
            rel = (got_lse - ref_lse[0]).abs() / ref_lse[0].abs().clamp_min(1.0)
            assert rel[~empty].max().item() <= 1e-3, f"sequence {b}: LSE"
        if empty.any():
            assert (got[empty.transpose(0, 1)[None]] == 0).all(), "a row with no key outputs 0"


@pytest.mark.parametrize(
    "spec, dtype, lengths, hq, hkv", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_varlen_matches_each_sequence(spec, dtype, lengths, hq, hkv):
    kern = kernel(spec)
    d = kern.config.head_dim
    lq, lk = LENGTHS[lengths]
    q, k, v, cu_q, cu_k = packed(lq, lk, hq, hkv, d, DTYPES[dtype], seed=len(lq) * 31 + hq)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
    kern.varlen_forward(q, k, v, cu_q, cu_k, scale, out, True, lse)
    torch.cuda.synchronize()
    check_sequences(kern, SPECS[spec], q, k, v, cu_q, cu_k, scale, out, lse)


def test_rows_past_the_last_sequence_stay_as_they_were():
    """cu_seqlens_q need not cover q: the kernel writes the sequences' rows only (the last
    one's last tile has a warpgroup with 4 rows and one with none); the rest keep their
    poison."""
    kern = kernel("hdim64")
    q, k, v, _, _ = packed([700], [700], 4, 4, 64, torch.bfloat16, seed=3)
    cu_q = torch.tensor([0, 130, 130, 390], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 300, 300, 700], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    kern.varlen_forward(q, k, v, cu_q, cu_k, 0.125, out, False)
    torch.cuda.synchronize()
    assert not out[:390].isnan().any()
    assert out[390:].isnan().all(), "rows past the last sequence were written"


def test_malformed_cu_seqlens_give_nan():
    """Decreasing cu_seqlens, or past the tensor: the tile list fills O and the LSE with NaN."""
    kern = kernel("causal")
    q, k, v, cu_q, cu_k = packed([100, 200], [100, 200], 4, 4, 128, torch.bfloat16, seed=5)
    for bad_q, bad_k in (([0, 250, 200], [0, 100, 300]), ([0, 100, 300], [0, 100, 400])):
        out = torch.zeros_like(q)
        o, lse = kern.varlen(
            q, k, v, torch.tensor(bad_q, dtype=torch.int32).cuda(),
            torch.tensor(bad_k, dtype=torch.int32).cuda(), out=out, return_lse=True,
        )  # fmt: skip
        torch.cuda.synchronize()
        assert o.isnan().all() and lse.isnan().all()
    good = kern.varlen(q, k, v, cu_q, cu_k)  # and the next call is fine
    assert not good.isnan().any()


def test_a_padded_call_on_a_varlen_spec():
    """kern(q, k, v) on (batch, seqlen, heads, head_dim) runs the varlen kernel with equal
    lengths; its output and LSE are the padded reference's."""
    kern = kernel("causal")
    torch.manual_seed(11)
    q = torch.randn(3, 333, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(3, 400, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(3, 400, 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = kern(q, k, v, return_lse=True)
    ref, ref_lse = reference(q, k, v, 128**-0.5, True, torch.float64)
    low, _ = reference(q, k, v, 128**-0.5, True, torch.bfloat16)
    bound = 2 * (low.double() - ref).abs().max().item() + 1e-3
    assert (out.double() - ref).abs().max().item() <= bound
    assert lse.shape == (3, 8, 333)
    assert torch.allclose(lse.double(), ref_lse, rtol=1e-3, atol=1e-3)


def test_torch_compile_and_cuda_graph_match_eager():
    kern = kernel("causal")
    q, k, v, cu_q, cu_k = packed([513, 1, 77, 1500], [600, 9, 77, 1500], 8, 2, 128,
                                 torch.float16, seed=7)  # fmt: skip
    eager = kern.varlen(q, k, v, cu_q, cu_k, 1500, 1500)
    compiled = torch.compile(
        lambda q, k, v, a, b: kern.varlen(q, k, v, a, b, 1500, 1500), fullgraph=True
    )
    assert torch.equal(compiled(q, k, v, cu_q, cu_k), eager)
    static_out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kern.varlen(q, k, v, cu_q, cu_k, out=static_out)  # warm: build and load first
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern.varlen(q, k, v, cu_q, cu_k, out=static_out)
    static_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, eager)


def test_varlen_arguments_are_named():
    kern = kernel("causal")
    q, k, v, cu_q, cu_k = packed([10, 20], [10, 20], 4, 4, 128, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        kern.varlen(q, k, v, cu_q.long(), cu_k)
    with pytest.raises(ValueError, match="cu_seqlens_k has 2 entries"):
        kern.varlen(q, k, v, cu_q, cu_k[:2])
    with pytest.raises(ValueError, match="q must be 3-D"):
        kern.varlen(q[None], k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match=r"k.shape\[2\] is the head_dim"):
        kern.varlen(q, k[..., :64], v[..., :64], cu_q, cu_k)
    with pytest.raises(TypeError, match="max_seqlen_q must be"):
        kern.varlen(q, k, v, cu_q, cu_k, max_seqlen_q=1.5)
    q.requires_grad_(True)
    # a varlen spec without a backward block names that (the shipped one trains:
    # tests/test_gpu_backward_varlen.py)
    forward_only = SPECS["causal"].split("  # The backward pass")[0].rstrip() + "\n}\n"
    forward_only = forward_only.replace("kernel fa3_varlen_causal", "kernel vl_forward_only")
    with pytest.raises(RuntimeError, match="forward-only: its spec has no backward block"):
        fadsl.load(forward_only, verbose=False).varlen(q, k, v, cu_q, cu_k).sum().backward()


def test_the_list_is_every_sequence_longest_first():
    """The tile-list kernel alone: every sequence with a query row once, with its rows, keys,
    q blocks and first tile (the tiles of those before it), sorted by its last q block's K/V
    blocks, longest first; the tile count is every q block of every head."""
    from fadsl.ir import Dtype
    from fadsl.runtime.attention import arch_of
    from fadsl.runtime.driver import Module
    from fadsl.targets.launch import current_stream
    from fadsl.targets.sm90.host.varlen import (
        COUNT_INTS,
        TILES_SUFFIX,
        TILES_THREADS,
        VarlenArgs,
        pack_varlen_params,
        workspace_ints,
    )

    kern = kernel("causal")
    heads = 4
    lq = [1, 300, 0, 129, 1000, 64, 3000, 5]
    lk = [1, 200, 5, 0, 1000, 700, 3000, 5]
    q, k, v, cu_q, cu_k = packed(lq, lk, heads, heads, 128, torch.bfloat16, seed=2)
    kernel_ir = kern.compiled.kernel
    workspace = torch.full((workspace_ints(len(lq)),), -7, dtype=torch.int32, device="cuda")
    args = VarlenArgs(q, k, v, torch.empty_like(q), None, 0.1, cu_q, cu_k, workspace)
    name = kern.module(Dtype.BF16, 0).name
    tiles = Module(kern.cubin(Dtype.BF16, arch_of(0)).cubin, name + TILES_SUFFIX, 0, TILES_THREADS)
    tiles.prepare(0)
    tiles.launch((1, 1, 1), (TILES_THREADS, 1, 1), pack_varlen_params(kernel_ir, args),
                 current_stream(0))  # fmt: skip
    torch.cuda.synchronize()
    tile_count, listed = workspace[0].item(), workspace[1].item()
    entries = workspace[COUNT_INTS : COUNT_INTS + 8 * listed].view(listed, 8).tolist()
    block_m, block_n = kern.config.block_r, kern.config.block_c
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    expected = {}
    for b, (rows, keys) in enumerate(zip(lq, lk)):
        blocks = -(-rows // block_m)
        if blocks == 0:
            continue
        kv_end = min(keys, max(0, blocks * block_m + keys - rows))  # last block, causal
        expected[b] = (starts_q[b], rows, starts_k[b], keys, blocks, -(-kv_end // block_n))
    assert listed == len(expected)
    assert tile_count == heads * sum(e[4] for e in expected.values())
    first = 0
    for entry in entries:
        q0, rows, k0, keys, first_tile, blocks, b, key = entry
        assert expected.pop(b) == (q0, rows, k0, keys, blocks, key)
        assert first_tile == first
        first += blocks * heads
    assert not expected
    sort_keys = [entry[7] for entry in entries]
    assert sort_keys == sorted(sort_keys, reverse=True), "longest K/V loop first"
