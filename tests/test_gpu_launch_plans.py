"""Launch plans (fadsl/runtime/plans.py, issue 45) on the GPU: a TMA descriptor pointed at
another address in place (cuTensorMapReplaceAddress in a plan's params buffer) is the
descriptor the driver encodes for that address, for each kind of map the kernels take; and
the public calls through their plans (the third call of a signature, on other tensors)
return what the op's checked body returns on the same inputs, bit for bit. CPU twin:
tests/test_launch_plans.py. `GPU_TESTS=tests/test_gpu_launch_plans.py bash scripts/device.sh
tests`."""

from __future__ import annotations

import pytest
import torch

from fadsl.runtime import planned, public_ops
from fadsl.runtime import public as fadsl
from fadsl.runtime.driver import ParamsBuffer
from fadsl.targets.sm90.host import tma

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]
BF = torch.bfloat16


@pytest.mark.parametrize("kind", ["tiled", "packed heads", "ragged rows"])
def test_a_replaced_address_gives_the_encoded_descriptor(kind):
    tma._encoded.clear()
    if kind == "tiled":
        a, b = (torch.randn(2, 300, 4, 128, device="cuda", dtype=BF) for _ in "ab")
        encode, delta = (lambda t: tma.tensor_map(t, 64, 128)), 0
    elif kind == "packed heads":
        a, b = (torch.randn(2, 3, 32, 128, device="cuda", dtype=BF) for _ in "ab")
        encode, delta = (lambda t: tma.packed_heads_map(t, 4, 64, 64)), 0
    else:
        a, b = (torch.randn(500, 4, 128, device="cuda", dtype=BF) for _ in "ab")
        encode, delta = (lambda t: tma.ragged_rows_map(t, 64, 64)), -64 * 4 * 128 * 2
    buffer = ParamsBuffer(bytes(128) + encode(a) + bytes(64))  # (a map 128 bytes in)
    assert buffer.raw()[128:256] == encode(a)
    buffer.tensor_map_address(128)(b.data_ptr() + delta)
    raw = buffer.raw()
    assert raw[128:256] == encode(b) != encode(a)
    assert raw[:128] == bytes(128) and raw[256:] == bytes(64)  # nothing else written


def _kvcache_inputs(new: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=BF, generator=gen)
    k_cache, v_cache = (
        torch.randn(16, 64, 8, 128, device="cuda", dtype=BF, generator=gen) for _ in "kv"
    )
    table = torch.randperm(16, device="cuda", generator=gen).to(torch.int32).view(2, 8)
    seqlens = torch.tensor([300, 17], device="cuda", dtype=torch.int32)
    k = v = None
    if new:
        k, v = (torch.randn(2, new, 8, 128, device="cuda", dtype=BF, generator=gen) for _ in "kv")
    return q, k_cache, v_cache, seqlens, k, v, table


@pytest.mark.parametrize("new", [0, 1])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_planned_kvcache_calls_match_the_checked_body(new, num_splits):
    planned.clear()
    for seed in range(3):  # the third call is a plan's, on tensors of its own
        q, k_cache, v_cache, seqlens, k, v, table = _kvcache_inputs(new, seed)
        caches = (k_cache.clone(), v_cache.clone())
        out, lse = fadsl.attention_with_kvcache(
            q, k_cache, v_cache, seqlens, k, v, page_table=table, causal=True,
            num_splits=num_splits, return_lse=True,
        )  # fmt: skip
        expected, expected_lse = public_ops.kvcache_call(
            q, *caches, seqlens, k, v, table, True, None, (-1, -1), 0, num_splits, True
        )
        torch.cuda.synchronize()
        assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
        assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])
    assert len(planned._KVCACHE) == 1


def test_planned_varlen_and_attention_calls_match_the_checked_body():
    planned.clear()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v = (torch.randn(256, 4, 128, device="cuda", dtype=BF, generator=gen) for _ in "qkv")
        cu = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)
        out, lse = fadsl.attention_varlen(q, k, v, cu, cu, 156, 156, True, return_lse=True)
        expected = public_ops.varlen_call(q, k, v, cu, cu, 156, 156, True, None, (-1, -1), 0, True)
        dq, dk, dv = (t.view(2, 128, 4, 128) for t in (q, k, v))
        padded = fadsl.attention(dq, dk, dv, True)
        padded_expected = public_ops.attention_call(dq, dk, dv, True, None, False)
        torch.cuda.synchronize()
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])
        assert torch.equal(padded, padded_expected)
    assert len(planned._VARLEN) == 1 and len(planned._ATTENTION) == 1


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_causal", "fa3_hdim64_causal"])
def test_a_loaded_kernels_planned_calls_give_the_checked_paths_bits(name):
    """kern(q, k, v) through its plan (fadsl/runtime/plain_calls.py; the third call of a
    signature, on other tensors, outputs poisoned first) equals its checked path's
    (``forward``) on the same tensors, bit for bit, the LSE too."""
    import fadsl
    from conftest import ROOT

    kern = fadsl.load((ROOT / "examples" / f"{name}.fa").read_text(), verbose=False)
    kern._plans.clear()
    d = kern.config.head_dim

    def tensors(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(2, 700, 8, d, device="cuda", dtype=BF, generator=g)
        k, v = (torch.randn(2, 900, 2, d, device="cuda", dtype=BF, generator=g) for _ in "kv")
        return q, k, v

    first = tensors(1)
    kern(*first, return_lse=True)
    kern(*first, return_lse=True)
    assert len(kern._plans) == 1
    q, k, v = tensors(2)
    torch.full((8 * q.numel(),), float("nan"), device="cuda")  # (poisons the allocator's blocks)
    out, lse = kern(q, k, v, return_lse=True)
    ref, ref_lse = kern.forward(q, k, v, d**-0.5, None, True)
    torch.cuda.synchronize()
    assert len(kern._plans) == 1
    assert not out.isnan().any()
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.parametrize("name", ["alibi_causal", "document_causal"])
def test_a_modified_calls_plan_gives_the_checked_paths_bits(name):
    """kern(q, k, v, **inputs) of a modifier example through its plan (the third call of a
    signature, on other tensors and inputs; document_causal with classes made ahead) equals
    the checked path on the same tensors, bit for bit, the LSE too."""
    import fadsl
    from conftest import ROOT

    kern = fadsl.load((ROOT / "examples" / "modifiers" / f"{name}.fa").read_text(), verbose=False)
    kern._plans.clear()

    def call(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q = torch.randn(2, 700, 8, 128, device="cuda", dtype=BF, generator=g)
        k, v = (torch.randn(2, 900, 2, 128, device="cuda", dtype=BF, generator=g) for _ in "kv")
        if name == "alibi_causal":
            named = {"slopes": torch.rand(8, device="cuda", generator=g)}
        else:
            q_doc = torch.randint(0, 3, (2, 700), device="cuda", generator=g).sort(1).values
            kv_doc = torch.randint(0, 3, (2, 900), device="cuda", generator=g).sort(1).values
            named = {"q_doc": q_doc.int(), "kv_doc": kv_doc.int()}
            named["keep_classes"] = kern.keep_classes(q, k, **named)
        return q, k, v, named

    q, k, v, named = call(1)
    with torch.no_grad():
        kern(q, k, v, return_lse=True, **named)
        kern(q, k, v, return_lse=True, **named)
        assert len(kern._plans) == 1
        q, k, v, named = call(2)
        torch.full((8 * q.numel(),), float("nan"), device="cuda")  # (poisons freed blocks)
        out, lse = kern(q, k, v, return_lse=True, **named)
        classes = named.pop("keep_classes", None)
        tensors = tuple(named[d.name] for d in kern.config.modifiers.inputs)
        tensors += () if classes is None else tuple(classes.tensors())
        ref, ref_lse = kern.forward(q, k, v, 128**-0.5, None, True, tensors)
    torch.cuda.synchronize()
    assert len(kern._plans) == 1
    assert not out.isnan().any()
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
