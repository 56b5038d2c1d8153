"""GPU tests of the sm_90a kernels (TMA, wgmma, warp specialisation) through fadsl.load, on
a Hopper GPU: the matrix the sm_80 kernels get.

Every sm_90a example with and without the causal mask (tests/gpu_specs.py), both dtypes,
FlashAttention's sequence-length pairs (1 x 1 up to 4096 x 4096, tails, seqlen_q != seqlen_k,
causal rows that see no key), GQA ratios 1 and 4 and MQA, the LSE; outputs and LSE poisoned
with NaN first; a float32 reference with FlashAttention's tolerance (twice PyTorch's own
16-bit error, plus 1e-3). Then strided views (TMA descriptors over the tensors' strides),
the TMA alignment refusals, torch.compile(fullgraph=True) and CUDA-graph replay.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

import fadsl
from gpu_specs import mask_flipped, sm90_specs, whole_tail
from test_gpu_general import reference

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

SPECS = sm90_specs()
SEQLENS = [(1, 1), (1, 65), (113, 203), (128, 217), (108, 256), (200, 100), (1023, 1024),
           (1024, 1023), (1, 4096), (4096, 1), (4096, 4096)]  # fmt: skip
HEADS = [(8, 8), (8, 2), (6, 1)]  # GQA ratios 1 and 4, MQA
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CASES = [
    (name, dtype, sq, sk, *HEADS[i % len(HEADS)])
    for i, (name, dtype, (sq, sk)) in enumerate(itertools.product(SPECS, DTYPES, SEQLENS))
]


@pytest.fixture(scope="module")
def kernels():
    return {name: fadsl.load(text, verbose=False) for name, text in SPECS.items()}


def is_causal(kern) -> bool:
    return kern.config.mask.value == "causal"


def assert_matches(kern, q, k, v, scale, out, lse=None):
    """``out`` (and ``lse``) against the float32 reference, FlashAttention's tolerance."""
    causal = is_causal(kern)
    ref, ref_lse = reference(q, k, v, scale, causal, torch.float32)
    low, _ = reference(q, k, v, scale, causal, q.dtype)
    assert not out.isnan().any(), "some outputs were never written (or are NaN)"
    err = (out.float() - ref).abs().max().item()
    bound = 2 * (low - ref).abs().max().item() + 1e-3
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"
    if lse is None:
        return
    empty = ref_lse == float("-inf")
    assert not lse.isnan().any(), "some LSE values were never written"
    assert torch.equal(lse == float("-inf"), empty), "rows with no key must have LSE -inf"
    if (~empty).any():
        rel = (lse[~empty] - ref_lse[~empty]).abs() / ref_lse[~empty].abs().clamp_min(1.0)
        assert rel.max().item() <= 1e-3
    if empty.any():
        rows = empty.transpose(1, 2)  # (batch, seqlen_q, heads)
        assert (out.float()[rows] == 0).all(), "rows with no key must output 0"


def random_qkv(batch, sq, sk, hq, hkv, d, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(batch, sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(batch, sk, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return q, k, v


@pytest.mark.parametrize(
    "name, dtype, sq, sk, hq, hkv", CASES, ids=["-".join(map(str, c)) for c in CASES]
)
def test_matches_float32_reference(kernels, name, dtype, sq, sk, hq, hkv):
    kern = kernels[name]
    d = kern.config.head_dim
    batch = 1 if sq * sk > 2**22 else 2
    q, k, v = random_qkv(batch, sq, sk, hq, hkv, d, DTYPES[dtype], sq * 7919 + sk)
    scale = d**-0.5
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    kern.forward_into(q, k, v, out, lse, scale)  # the poisoned LSE buffer is written in place
    torch.cuda.synchronize()
    assert_matches(kern, q, k, v, scale, out, lse)


# More tiles than an H100 has SMs (132): each CTA of the persistent grid runs several,
# the K/V rings, Q's and O's barriers going on across them; odd and even block counts
# against the ring's 2 stages; causal tiles whose rows see no key (seqlen_q > seqlen_k).
MANY_TILES = [(1000, 333), (777, 1024), (2048, 130)]


def with_setting(text: str, key: str, old: str, new: str) -> str:
    """The spec with `key old` set to `key new`, its kernel named after the new value."""
    text, found = re.subn(rf"^(\s*{key}\s+){old}\b", rf"\g<1>{new}", text, count=1, flags=re.M)
    assert found, f"the spec has no `{key} {old}` line to change"
    return re.sub(r"\bkernel\s+(\w+)", rf"kernel \1_{new}", text, count=1)


def as_whole_tiles(text: str) -> str:
    """The spec with `tail whole` where it splits its last round (the pieces' partial results
    combine in another order than one CTA's blocks do: other bits), named apart."""
    whole = whole_tail(text)
    return (
        text if whole == text else re.sub(r"\bkernel\s+(\w+)", r"kernel \1_whole", whole, count=1)
    )


def as_grid_scheduler(text: str) -> str:
    """The spec with `scheduler grid` (one CTA per tile; whole tiles)."""
    return with_setting(as_whole_tiles(text), "scheduler", "persistent", "grid")


@pytest.mark.parametrize("sq, sk", MANY_TILES)
@pytest.mark.parametrize("name", list(SPECS))
def test_persistent_ctas_run_many_tiles(kernels, name, sq, sk):
    kern = kernels[name]
    if not kern.config.ext.persistent:
        pytest.skip("a CTA per tile (scheduler grid): test_matches_float32_reference covers it")
    d = kern.config.head_dim
    batch, hq, hkv = 3, 24, 8
    tiles = -(-sq // kern.config.block_r) * hq * batch
    assert tiles > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    q, k, v = random_qkv(batch, sq, sk, hq, hkv, d, torch.bfloat16, sq + 31 * sk)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((batch, hq, sq), float("nan"), device="cuda", dtype=torch.float32)
    kern.forward_into(q, k, v, out, lse, d**-0.5)
    torch.cuda.synchronize()
    assert_matches(kern, q, k, v, d**-0.5, out, lse)
    if kern.config.ext.split_kv:
        # Split pieces combine in another order (checked against the reference above); the
        # scheduler's bits are compared on whole tiles.
        kern = fadsl.load(as_whole_tiles(SPECS[name]), verbose=False)
        assert not kern.config.ext.split_kv
        kern.forward_into(q, k, v, out, lse, d**-0.5)
    # One CTA per tile computes each tile the same way: the same bits.
    grid = fadsl.load(as_grid_scheduler(SPECS[name]), verbose=False)
    assert not grid.config.ext.persistent
    out_grid = torch.full_like(q, float("nan"))
    lse_grid = torch.full_like(lse, float("nan"))
    grid.forward_into(q, k, v, out_grid, lse_grid, d**-0.5)
    torch.cuda.synchronize()
    assert torch.equal(out, out_grid) and torch.equal(lse, lse_grid)


def as_rescale_every(text: str) -> str:
    """The spec with `rescale every` (FlashAttention-3's per-block rescale)."""
    return with_setting(text, "rescale", "(?:lazy|guarded)", "every")


@pytest.mark.parametrize("growth", [2.5, 0.7])
@pytest.mark.parametrize("name", list(SPECS))
def test_lazy_rescale_follows_a_growing_row_max(kernels, name, growth):
    """Scores that rise block after block in the order the kernel visits the key blocks (the
    last one first), by up to `growth` x the lazy slack (2^8) per block, each row at its own
    rate (0.3x to 2x), so that rows of one warp, and the two rows of one thread, keep and
    move their max in different blocks. 2.5: most rows move every block; 0.7: the kept max
    lags the true one by up to 2^8 (P up to 256 in 16 bits). Both dtypes, against the
    float64 reference and, more tightly, against the same spec with `rescale every`."""
    kern = kernels[name]
    if not kern.config.ext.lazy_rescale:
        pytest.skip("the example rescales every block")
    every = fadsl.load(as_rescale_every(SPECS[name]), verbose=False)
    assert not every.config.ext.lazy_rescale
    d, block_c = kern.config.head_dim, kern.config.block_c
    sq, sk, heads = 300, 1500, 2
    gen = torch.Generator(device="cuda").manual_seed(int(10 * growth) + d)
    slope = growth * 8 / (block_c * math.log2(math.e))  # score rise per key (scale 1)
    rise = slope * torch.arange(sk - 1, -1, -1, device="cuda", dtype=torch.float32)
    row_rate = torch.linspace(0.3, 2.0, sq, device="cuda")[
        torch.randperm(sq, device="cuda", generator=gen)
    ]

    def noise(*shape):
        return 1 + 0.05 * torch.randn(*shape, device="cuda", generator=gen)

    for dtype in (torch.bfloat16, torch.float16):
        q = (row_rate[None, :, None, None] * noise(1, sq, heads, d)).to(dtype)
        k = (rise[None, :, None, None] / d * noise(1, sk, heads, d)).to(dtype)
        v = torch.randn(1, sk, heads, d, device="cuda", generator=gen).to(dtype)
        outs = {}
        for label, kernel in (("lazy", kern), ("every", every)):
            out = torch.full_like(q, float("nan"))
            lse = torch.full((1, heads, sq), float("nan"), device="cuda", dtype=torch.float32)
            kernel.forward_into(q, k, v, out, lse, 1.0)
            torch.cuda.synchronize()
            assert_matches(kernel, q, k, v, 1.0, out, lse)
            outs[label] = out.float()
        ref, _ = reference(q, k, v, 1.0, is_causal(kern), torch.float64)
        err_lazy = (outs["lazy"] - ref.float()).abs().max().item()
        err_every = (outs["every"] - ref.float()).abs().max().item()
        assert err_lazy <= 2 * err_every + 1e-3, (dtype, err_lazy, err_every)


@pytest.mark.parametrize("jump", [150.0, 3000.0])
@pytest.mark.parametrize("name", list(SPECS))
def test_guarded_softmax_survives_a_jump_in_the_scores(kernels, name, jump):
    """`rescale guarded` skips the row max after a tile's first block. Keys whose scores
    jump by `jump` (unscaled) above the rest, in blocks the kernel visits late (it visits
    the last one first) and in the middle: 150 passes the guard's row-sum bound (the rare
    path moves the reference), 3000 overflows P past 2^128 (the rarest path recomputes S
    from SMEM). Both dtypes, outputs and LSE poisoned, against the float32 reference."""
    kern = kernels[name]
    if not kern.config.ext.guarded:
        pytest.skip("the example computes the row max in every block")
    d = kern.config.head_dim
    sq, sk, heads = 300, 1500, 2
    gen = torch.Generator(device="cuda").manual_seed(int(jump) + d)
    direction = torch.nn.functional.normalize(torch.randn(d, device="cuda", generator=gen), dim=0)
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(1, sq, heads, d, device="cuda", generator=gen) + 3 * direction
        k = torch.randn(1, sk, heads, d, device="cuda", generator=gen)
        k[:, [0, 1, 700, sk - 1]] += jump / 3 * direction  # q . k rises by about `jump`
        v = torch.randn(1, sk, heads, d, device="cuda", generator=gen)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        out = torch.full_like(q, float("nan"))
        lse = torch.full((1, heads, sq), float("nan"), device="cuda", dtype=torch.float32)
        kern.forward_into(q, k, v, out, lse, d**-0.5)
        torch.cuda.synchronize()
        assert_matches(kern, q, k, v, d**-0.5, out, lse)


@pytest.mark.parametrize("name", list(SPECS))
def test_strided_views_and_softmax_scale(kernels, name):
    """q, k, v sliced out of a packed qkv tensor and out a view into a wider buffer: the TMA
    descriptors take the strides, nothing is copied; a softmax_scale of the caller's."""
    kern = kernels[name]
    d = kern.config.head_dim
    qkv = torch.randn(2, 300, 3, 4, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    wide = torch.full((2, 300, 6, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = wide[:, :, 1:5]
    assert not (q.is_contiguous() or out.is_contiguous())
    result, lse = kern(q, k, v, 0.3, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert result is out
    assert_matches(kern, q, k, v, 0.3, out, lse)
    assert wide[:, :, 0].isnan().all() and wide[:, :, 5].isnan().all(), "wrote outside out"


def test_size_one_dims_with_odd_strides(kernels):
    """A size-1 dimension's stride is never stepped along: PyTorch lets it be anything (here
    not a multiple of 16 bytes), and the kernel must accept it."""
    kern = kernels["fa3_hopper"]
    q, k, v = random_qkv(1, 150, 150, 1, 1, 128, torch.bfloat16, 11)
    q, k, v = (t.as_strided(t.shape, (3, 128, 5, 1)) for t in (q, k, v))
    out = kern(q, k, v)
    torch.cuda.synchronize()
    assert_matches(kern, q, k, v, 128**-0.5, out)


def test_broadcast_kv_heads(kernels):
    """k and v expanded over the heads (stride 0), as sm_80 accepts them."""
    kern = kernels["fa3_causal"]
    q, k, v = random_qkv(2, 200, 333, 4, 1, 128, torch.bfloat16, 12)
    k4, v4 = k.expand(2, 333, 4, 128), v.expand(2, 333, 4, 128)
    out = kern(q, k4, v4)
    torch.cuda.synchronize()
    assert torch.equal(out, kern(q, k, v)), "broadcast heads must equal MQA"
    assert_matches(kern, q, k, v, 128**-0.5, out)


@pytest.mark.parametrize(
    "which, make, message",
    [
        ("q", lambda t: _padded(t, 132), r"q must be 16-byte aligned .*TMA descriptors"),
        ("k", lambda t: _offset(t, 1), r"k must be 16-byte aligned .*TMA descriptors"),
        ("out", lambda t: _padded(t, 129), r"out must be 16-byte aligned .*TMA descriptors"),
        ("out", lambda t: _offset(t, 4), r"out must be 16-byte aligned .*TMA.*8 bytes past"),
    ],
)
def test_tma_alignment_is_refused_by_name(kernels, which, make, message):
    kern = kernels["fa3_hopper"]
    q, k, v = random_qkv(1, 64, 64, 2, 2, 128, torch.bfloat16, 13)
    args = {"q": q, "k": k, "v": v, "out": torch.empty_like(q)}
    args[which] = make(args[which])
    with pytest.raises(ValueError, match=message):
        kern(args["q"], args["k"], args["v"], out=args["out"])


def _padded(t, row: int):
    """``t``'s values in a buffer whose rows are ``row`` elements apart (not 16-byte
    multiples unless row % 8 == 0)."""
    b, s, h, d = t.shape
    buf = torch.zeros(b, s, h, row, device=t.device, dtype=t.dtype)
    buf[..., :d] = t
    return buf[..., :d]


def _offset(t, elements: int):
    """``t``'s values at an address ``elements`` past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 16, device=t.device, dtype=t.dtype)
    view = flat[elements : elements + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def test_resources_and_launch_info(kernels):
    kern = kernels["fa3_hopper"]
    found = kern.resources("bf16")
    assert found["threads"] == 384 and found["ctas_per_sm"] == 1
    assert found["smem_bytes"] == kern.compiled.kernel.smem_bytes > 48 * 1024
    assert found["local_bytes"] == found["spill_store_bytes"] == found["stack_bytes"] == 0


def test_a_modules_global_reads_back_as_the_cubin_holds_it(kernels):
    """driver.Module.read_global (the tile timeline's reader) on the launch info every kernel
    exports: the same five ints as the cubin's ELF."""
    from fadsl.build.elf import read_ints
    from fadsl.ir import Dtype

    kern = kernels["fa3_hopper"]
    kern(*random_qkv(1, 128, 128, 2, 2, 128, torch.bfloat16, 3))  # loads the module
    module = kern.module(Dtype.BF16, 0)
    name = f"{module.name}_launch_info"
    raw = module.read_global(name)
    cubin = kern.cubin(Dtype.BF16, "sm_90a").cubin
    assert [int.from_bytes(raw[i : i + 4], "little") for i in range(0, 20, 4)] == list(
        read_ints(cubin, name, 5)
    )


def test_causal_skips_blocks_above_the_diagonal(kernels):
    """Causal at seqlen 4096 runs at least 1.5x faster than the same tile without the mask
    (a kernel that computed the blocks above the diagonal would be no faster; skipping them
    halves the work, less the diagonal blocks and the causal tail)."""
    times = {}
    q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    full = mask_flipped("fa3_causal")  # the same tile without the mask
    for name in (full, "fa3_causal"):
        kern = kernels[name]
        for _ in range(5):
            kern(q, k, v)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(20):
            start.record()
            kern(q, k, v)
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        times[name] = sorted(samples)[len(samples) // 2]
    assert times[full] / times["fa3_causal"] >= 1.5, times


def test_compile_fullgraph_matches_eager(kernels):
    kern = kernels["fa3_causal"]
    q, k, v = random_qkv(2, 300, 317, 8, 2, 128, torch.bfloat16, 14)

    def f(q, k, v):
        o, lse = kern(q, k, v, return_lse=True)
        return o * 2, lse.exp()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    (o, e), (ref_o, ref_e) = compiled(q, k, v), f(q, k, v)
    assert torch.equal(o, ref_o) and torch.equal(e, ref_e)
    assert_matches(kern, q, k, v, 128**-0.5, o / 2)


def test_cuda_graph_replay_matches(kernels):
    """Captured once, replayed on new values in the same buffers (the descriptors hold the
    addresses, which a graph keeps)."""
    kern = kernels["fa3_causal"]
    q, k, v = random_qkv(2, 300, 317, 8, 2, 128, torch.bfloat16, 15)
    out = torch.empty_like(q)
    kern(q, k, v, out=out)  # warm-up: build and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(q, k, v, out=out)
        captured = kern(q, k, v)  # an output allocated in the graph's pool
    for seed in (16, 17):
        for dst, src in zip((q, k, v), random_qkv(2, 300, 317, 8, 2, 128, torch.bfloat16, seed)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(kern, q, k, v, 128**-0.5, out)
        assert torch.equal(captured, out)
