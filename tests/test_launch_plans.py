"""Launch plans (fadsl/runtime/plans.py, planned.py; issue 45) on the CPU, through the public
calls on a stand-in device (tests/fake_cuda.py): a call of a signature met before launches
what the checked, unplanned path launches for the same tensors, byte for byte (params with
their TMA descriptors, grid, block, cluster, programmatic dependence), across paged and
contiguous caches, new tokens, GQA, splits, varlen, padded calls and appends; a changed
shape, stride, dtype or argument is checked again and refused with the checked path's
error; a misaligned address is refused on a plan's call; the plans stay bounded."""

from __future__ import annotations

import pytest
import torch

import fake_cuda
from fadsl.runtime import dispatch, driver, planned, public_ops
from fadsl.runtime import append as append_module
from fadsl.runtime import public as fadsl
from fadsl.runtime.plans import PlanCache

BF = torch.bfloat16


@pytest.fixture
def device(monkeypatch):
    """(launch log, allocator) of a stand-in cuda:0."""
    found = fake_cuda.install(monkeypatch)
    yield found
    fake_cuda.uninstall()


# ---------------------------------------------------------------- the calls under test
def kvcache_inputs(paged=True, new=0, heads=(32, 8), strided_new=False, batch=2, pages=8):
    """q, k_cache, v_cache, cache_seqlens, k, v, page_table of a decode step (fresh memory)."""
    heads_q, heads_kv = heads
    q = torch.randn(batch, 1, heads_q, 128, dtype=BF)
    rows = (batch * pages, 64) if paged else (batch, 512)
    k_cache, v_cache = (torch.randn(*rows, heads_kv, 128, dtype=BF) for _ in range(2))
    table = torch.randperm(batch * pages).to(torch.int32).view(batch, pages) if paged else None
    seqlens = torch.tensor([300, 17, 5, 64][:batch], dtype=torch.int32)
    k = v = None
    if new:
        if strided_new:  # rows not contiguous: the call copies them
            k, v = (torch.randn(batch, heads_kv, new, 128, dtype=BF).transpose(1, 2) for _ in "kv")
        else:
            k, v = (torch.randn(batch, new, heads_kv, 128, dtype=BF) for _ in "kv")
    return q, k_cache, v_cache, seqlens, k, v, table


def kvcache_call(options):
    def call(q, k_cache, v_cache, seqlens, k, v, table, checked=False):
        args = (q, k_cache, v_cache, seqlens, k, v, table, options.get("causal", False))
        args += (options.get("softmax_scale"), (-1, -1), 0, options.get("num_splits"))
        if checked:  # the op's body: every check, no plan
            return public_ops.kvcache_call(*args, options.get("return_lse", False))
        return fadsl.attention_with_kvcache(
            q, k_cache, v_cache, seqlens, k, v, page_table=table, causal=args[7],
            softmax_scale=args[8], num_splits=args[11], return_lse=options.get("return_lse", False),
        )  # fmt: skip

    return call


def varlen_inputs(tokens=(256, 300), heads=(4, 2), bounds=(0, 100, 256)):
    q = torch.randn(tokens[0], heads[0], 128, dtype=BF)
    k, v = (torch.randn(tokens[1], heads[1], 128, dtype=BF) for _ in "kv")
    cu_q = torch.tensor(bounds, dtype=torch.int32)
    cu_k = torch.tensor([0, 150, tokens[1]], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def varlen_call(options):
    def call(q, k, v, cu_q, cu_k, checked=False):
        causal, lse = options.get("causal", False), options.get("return_lse", False)
        if checked:
            found = public_ops.varlen_call(q, k, v, cu_q, cu_k, 156, 156, causal, None,
                                           (-1, -1), 0, lse)  # fmt: skip
            return found
        return fadsl.attention_varlen(q, k, v, cu_q, cu_k, 156, 156, causal, return_lse=lse)

    return call


def padded_inputs(q_shape=(1, 128, 1, 128), kv_shape=None):
    q = torch.randn(*q_shape, dtype=BF)
    k, v = (torch.randn(*(kv_shape or q_shape), dtype=BF) for _ in "kv")
    return q, k, v


def padded_call(options):
    def call(q, k, v, checked=False):
        causal, lse = options.get("causal", False), options.get("return_lse", False)
        if checked:
            return public_ops.attention_call(q, k, v, causal, None, lse)
        return fadsl.attention(q, k, v, causal, return_lse=lse)

    return call


def append_inputs(paged=True, new=1, batch=2):
    _, k_cache, v_cache, seqlens, k, v, table = kvcache_inputs(paged, new, batch=batch)
    return k_cache, v_cache, k, v, seqlens, table


def append_call(options):
    def call(k_cache, v_cache, k, v, seqlens, table, checked=False):
        if checked:
            return append_module.append_kv(k_cache, v_cache, k, v, seqlens, table)
        return fadsl.append_kv(k_cache, v_cache, k, v, seqlens, table)

    return call


CASES = {
    "kvcache paged GQA splits": (kvcache_call({"causal": True}), kvcache_inputs, {}),
    "kvcache paged + 1 new": (kvcache_call({"causal": True}), kvcache_inputs, {"new": 1}),
    "kvcache paged + 3 strided new, lse": (
        kvcache_call({"return_lse": True}), kvcache_inputs, {"new": 3, "strided_new": True}
    ),
    "kvcache paged unpacked, 3 splits": (
        kvcache_call({"num_splits": 3}), kvcache_inputs, {"heads": (24, 8)}
    ),
    "kvcache contiguous, one piece, lse": (
        kvcache_call({"num_splits": 1, "return_lse": True}), kvcache_inputs, {"paged": False}
    ),
    "kvcache contiguous + 2 new": (kvcache_call({}), kvcache_inputs, {"paged": False, "new": 2}),
    "varlen GQA lse": (varlen_call({"return_lse": True}), varlen_inputs, {}),
    "varlen causal MHA": (varlen_call({"causal": True}), varlen_inputs, {"heads": (2, 2)}),
    "padded": (padded_call({}), padded_inputs, {}),
    "padded causal GQA lse": (
        padded_call({"causal": True, "return_lse": True}), padded_inputs,
        {"q_shape": (2, 256, 4, 128), "kv_shape": (2, 300, 2, 128)},
    ),
    "padded cluster pairs": (
        padded_call({}), padded_inputs, {"q_shape": (1, 256, 1, 128), "kv_shape": (1, 4096, 1, 128)}
    ),
    "padded hdim64 one piece": (
        padded_call({}), padded_inputs, {"q_shape": (1, 384, 4, 64), "kv_shape": (1, 128, 4, 64)}
    ),
    "append paged": (append_call({}), append_inputs, {}),
    "append contiguous, 4 new": (append_call({}), append_inputs, {"paged": False, "new": 4}),
}  # fmt: skip
CACHES = {"kvcache": planned._KVCACHE, "varlen": planned._VARLEN, "padded": planned._ATTENTION,
          "append": planned._APPEND}  # fmt: skip


def _cache(case: str) -> PlanCache:
    return CACHES[case.split()[0]]


def _plans(cache: PlanCache) -> list:
    return list(cache._plans.values())


@pytest.mark.parametrize("case", list(CASES))
def test_a_plan_launches_what_the_checked_path_launches(device, case):
    """A signature's first call (checked, no plan), its second (checked, planned, launched
    through the plan), then a call of it on other tensors (a hit): each launches
    byte-identical params, grids, blocks, clusters and dependence to the op's body (every
    check, no plan) on the same tensors; the hit made no plan."""
    log, allocator = device
    call, make, options = CASES[case]
    first, second = make(**options), make(**options)
    cache = _cache(case)

    def launches(generation, inputs, checked=False):
        allocator.next_call(generation)
        log.clear()
        result = call(*inputs, checked=checked)
        return list(log), result

    unplanned, _ = launches(0, first)  # a signature's first call keeps no plan
    assert unplanned and not _plans(cache)
    missed, _ = launches(0, first)  # its second does, and launches through it
    assert missed == unplanned == launches(0, first, checked=True)[0]
    plans = _plans(cache)
    assert len(plans) == 1
    hit, result = launches(1, second)
    assert _plans(cache) == plans and all(a is b for a, b in zip(_plans(cache), plans))
    expected, expected_result = launches(1, second, checked=True)
    assert hit == expected
    assert hit != missed  # (the addresses changed: the plan rewrote them)
    if isinstance(result, tuple):  # the same output and LSE memory (the allocator's)
        assert [t.data_ptr() for t in result] == [t.data_ptr() for t in expected_result]


def test_a_split_padded_call_is_not_planned(device):
    """The padded hdim64 kernel's split tail points at the stream's workspace, not at the
    call's tensors: such a call launches as before and keeps no plan."""
    log, allocator = device
    q, k, v = padded_inputs((1, 384, 4, 64), (1, 2048, 4, 64))
    fadsl.attention(q, k, v)
    assert len(log) == 1 and len(planned._ATTENTION) == 0


# ---------------------------------------------------------------- a changed signature
def _error(fn):
    with pytest.raises(Exception) as found:
        fn()
    return type(found.value), str(found.value)


def _refused_as_when_unplanned(device, warm, bad) -> None:
    """``bad`` after ``warm`` (which keeps a plan) raises the error it raises with no plan,
    and launches nothing."""
    log, allocator = device
    warm()
    warm()  # (planned at its second call)
    log.clear()
    with_plans = _error(bad)
    assert not log, "a refused call launched"
    planned.clear()
    assert _error(bad) == with_plans
    assert with_plans[0] in (TypeError, ValueError, RuntimeError), with_plans


KVCACHE_MUTATIONS = {
    "int64 lengths": lambda a: {**a, "seqlens": a["seqlens"].long()},
    "lengths of 3": lambda a: {**a, "seqlens": torch.zeros(3, dtype=torch.int32)},
    "head_dim 64": lambda a: {**a, "q": a["q"][..., :64]},
    "k_cache's last dim strided": lambda a: {**a, "k_cache": a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)},
    "v_cache fp16": lambda a: {**a, "v_cache": a["v_cache"].half()},
    "int64 page table": lambda a: {**a, "table": a["table"].long()},
    "no page table": lambda a: {**a, "table": None},
    "page table of 3 batches": lambda a: {**a, "table": torch.zeros(3, 8, dtype=torch.int32)},
    "softmax_scale -1": lambda a: {**a, "softmax_scale": -1.0},
    "softmax_scale True": lambda a: {**a, "softmax_scale": True},
    "softmax_scale nan": lambda a: {**a, "softmax_scale": float("nan")},
    "causal 1": lambda a: {**a, "causal": 1},
    "return_lse 0": lambda a: {**a, "return_lse": 0},
    "window [True, -1]": lambda a: {**a, "window_size": [True, -1]},
    "window (5.0, 1)": lambda a: {**a, "window_size": (5.0, 1)},
    "window of 3": lambda a: {**a, "window_size": (-1, -1, -1)},
    "window as a string": lambda a: {**a, "window_size": "ab"},
    "softcap True": lambda a: {**a, "softcap": True},
    "softcap 2.5": lambda a: {**a, "softcap": 2.5},
    "num_splits 2.0": lambda a: {**a, "num_splits": 2.0},
    "num_splits -1": lambda a: {**a, "num_splits": -1},
    "k without v": lambda a: {**a, "k": torch.randn(2, 1, 8, 128, dtype=BF)},
    "new tokens of 4 heads": lambda a: {**a, "k": torch.randn(2, 1, 4, 128, dtype=BF), "v": torch.randn(2, 1, 4, 128, dtype=BF)},
    "q requires grad": lambda a: {**a, "q": a["q"].clone().requires_grad_()},
    "q a list": lambda a: {**a, "q": [1]},
}  # fmt: skip


def _kvcache(a):
    return fadsl.attention_with_kvcache(
        a["q"], a["k_cache"], a["v_cache"], a["seqlens"], a.get("k"), a.get("v"),
        page_table=a["table"], causal=a.get("causal", True), softmax_scale=a.get("softmax_scale"),
        window_size=a.get("window_size", (-1, -1)), softcap=a.get("softcap", 0),
        num_splits=a.get("num_splits"), return_lse=a.get("return_lse", False),
    )  # fmt: skip


@pytest.mark.parametrize("mutation", list(KVCACHE_MUTATIONS))
def test_a_changed_kvcache_argument_is_checked_again(device, mutation):
    q, k_cache, v_cache, seqlens, _, _, table = kvcache_inputs()
    good = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "seqlens": seqlens, "table": table}
    bad = KVCACHE_MUTATIONS[mutation](good)
    _refused_as_when_unplanned(device, lambda: _kvcache(good), lambda: _kvcache(bad))


VARLEN_MUTATIONS = {
    "int64 cu_seqlens_q": lambda a: {**a, "cu_q": a["cu_q"].long()},
    "cu_seqlens_k of 4": lambda a: {**a, "cu_k": torch.tensor([0, 1, 2, 3], dtype=torch.int32)},
    "max_seqlen_q -1": lambda a: {**a, "max_q": -1},
    "max_seqlen_q True": lambda a: {**a, "max_q": True},
    "max_seqlen_k 1.5": lambda a: {**a, "max_k": 1.5},
    "k fp16": lambda a: {**a, "k": a["k"].half()},
    "v of other heads": lambda a: {**a, "v": a["v"][:, :1]},
    "q 4-D": lambda a: {**a, "q": a["q"][None]},
    "softcap 10**400": lambda a: {**a, "softcap": 10**400},
}  # fmt: skip


def _varlen(a):
    return fadsl.attention_varlen(
        a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"], a.get("max_q", 156), a.get("max_k", 156),
        softcap=a.get("softcap", 0),
    )  # fmt: skip


@pytest.mark.parametrize("mutation", list(VARLEN_MUTATIONS))
def test_a_changed_varlen_argument_is_checked_again(device, mutation):
    q, k, v, cu_q, cu_k = varlen_inputs()
    good = {"q": q, "k": k, "v": v, "cu_q": cu_q, "cu_k": cu_k}
    bad = VARLEN_MUTATIONS[mutation](good)
    _refused_as_when_unplanned(device, lambda: _varlen(good), lambda: _varlen(bad))


PADDED_MUTATIONS = {
    "k fp16": lambda a: {**a, "k": a["k"].half()},
    "v of 64 keys": lambda a: {**a, "v": a["v"][:, :64]},
    "q's rows 132 apart": lambda a: {**a, "q": torch.randn(1, 128, 1, 132, dtype=BF)[..., :128]},
    "window (5.0, 1)": lambda a: {**a, "window_size": (5.0, 1)},
    "causal None": lambda a: {**a, "causal": None},
    "softmax_scale inf": lambda a: {**a, "softmax_scale": float("inf")},
}  # fmt: skip


def _padded(a):
    return fadsl.attention(
        a["q"], a["k"], a["v"], a.get("causal", False), a.get("softmax_scale"),
        window_size=a.get("window_size", (-1, -1)),
    )  # fmt: skip


@pytest.mark.parametrize("mutation", list(PADDED_MUTATIONS))
def test_a_changed_attention_argument_is_checked_again(device, mutation):
    q, k, v = padded_inputs()
    good = {"q": q, "k": k, "v": v}
    bad = PADDED_MUTATIONS[mutation](good)
    _refused_as_when_unplanned(device, lambda: _padded(good), lambda: _padded(bad))


APPEND_MUTATIONS = {
    "new tokens of 4 heads": lambda a: {**a, "k": a["k"][:, :, :4], "v": a["v"][:, :, :4]},
    "int64 lengths": lambda a: {**a, "seqlens": a["seqlens"].long()},
    "page table of 3 batches": lambda a: {**a, "table": torch.zeros(3, 8, dtype=torch.int32)},
    "k_new fp16": lambda a: {**a, "k": a["k"].half()},
}  # fmt: skip


@pytest.mark.parametrize("mutation", list(APPEND_MUTATIONS))
def test_a_changed_append_argument_is_checked_again(device, mutation):
    k_cache, v_cache, k, v, seqlens, table = append_inputs()
    good = {"k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "seqlens": seqlens,
            "table": table}  # fmt: skip
    bad = APPEND_MUTATIONS[mutation](good)

    def call(a):
        names = ("k_cache", "v_cache", "k", "v", "seqlens", "table")
        return fadsl.append_kv(*(a[n] for n in names))

    _refused_as_when_unplanned(device, lambda: call(good), lambda: call(bad))


# ---------------------------------------------------------------- addresses and bounds
def _misaligned(t):
    """``t``'s values at an address 2 bytes past a 16-byte boundary, same shape and strides."""
    flat = torch.randn(t.numel() + 8, dtype=t.dtype)[1 : 1 + t.numel()]
    return flat.view(t.shape).copy_(t)


def test_a_misaligned_address_is_refused_on_a_plans_call(device):
    log, _ = device
    q, k_cache, v_cache, seqlens, _, _, table = kvcache_inputs()
    for _ in range(2):  # planned at the second call
        fadsl.attention_with_kvcache(q, k_cache, v_cache, seqlens, page_table=table, causal=True)
    log.clear()
    for name, bad in (("q", _misaligned(q)), ("k_cache", _misaligned(k_cache))):
        args = {"q": q, "k_cache": k_cache, **{name: bad}}
        with pytest.raises(ValueError, match=rf"{name} must be 16-byte aligned .* 2 bytes past"):
            fadsl.attention_with_kvcache(args["q"], args["k_cache"], v_cache, seqlens,
                                         page_table=table, causal=True)  # fmt: skip
    assert not log and len(planned._KVCACHE) == 1
    pq, pk, pv, cu_q, cu_k = varlen_inputs()
    for _ in range(2):
        fadsl.attention_varlen(pq, pk, pv, cu_q, cu_k, 156, 156)
    assert len(planned._VARLEN) == 1
    with pytest.raises(ValueError, match=r"^v must be 16-byte aligned"):
        fadsl.attention_varlen(pq, pk, _misaligned(pv), cu_q, cu_k, 156, 156)
    dq, dk, dv = padded_inputs()
    for _ in range(2):
        fadsl.attention(dq, dk, dv)
    assert len(planned._ATTENTION) == 1
    with pytest.raises(ValueError, match=r"^k must be 16-byte aligned"):
        fadsl.attention(dq, _misaligned(dk), dv)


def test_misaligned_new_tokens_are_appended_without_16_byte_vectors(device):
    """The append's 16-byte flag follows each call's addresses on a plan's call too."""
    log, _ = device
    k_cache, v_cache, k, v, seqlens, table = append_inputs()
    for _ in range(2):
        fadsl.append_kv(k_cache, v_cache, k, v, seqlens, table)
    flag = append_module.VECTOR16_OFFSET
    assert log[-1].params[flag] == 1
    fadsl.append_kv(k_cache, v_cache, _misaligned(k), v, seqlens, table)
    assert log[-1].params[flag] == 0 and len(planned._APPEND) == 1
    fadsl.append_kv(k_cache, v_cache, k, v, seqlens, table)
    assert log[-1].params[flag] == 1


def test_the_plans_stay_bounded(device, monkeypatch):
    monkeypatch.setattr(planned._KVCACHE, "limit", 2)
    calls = []
    for batch in (1, 2, 3, 4):
        q, k_cache, v_cache, seqlens, _, _, table = kvcache_inputs(batch=batch)
        calls.append(lambda a=(q, k_cache, v_cache, seqlens), t=table: fadsl.attention_with_kvcache(
            *a, page_table=t, causal=True))  # fmt: skip
        calls[-1]()
        calls[-1]()  # (planned at the second call)
        assert len(planned._KVCACHE) == min(batch, 2)
    kept = _plans(planned._KVCACHE)
    calls[-1]()  # the newest is kept: a hit
    assert _plans(planned._KVCACHE) == kept
    calls[0]()  # the oldest was dropped: planned again, in place of the next oldest
    assert len(planned._KVCACHE) == 2 and _plans(planned._KVCACHE)[0] is kept[1]
    assert len(planned._KVCACHE._seen) <= 4 * 2
    before = _plans(planned._KVCACHE)
    for batch in range(5, 13):  # eight signatures met once: remembered, bounded, not planned
        q, k_cache, v_cache, seqlens, _, _, table = kvcache_inputs(batch=batch % 4 + 1)
        fadsl.attention_with_kvcache(q[:, :, :16], k_cache[..., :4, :], v_cache[..., :4, :],
                                     seqlens, page_table=table, causal=batch < 9)  # fmt: skip
        assert len(planned._KVCACHE._seen) <= 8 and _plans(planned._KVCACHE) == before


def test_a_params_buffer_is_aligned_for_tensor_maps():
    for size in (168, 896):
        raw = bytes(range(256)) * 4
        buffer = driver.ParamsBuffer(raw[:size])
        assert buffer.address % driver.PARAMS_ALIGN == 0 and buffer.raw() == raw[:size]
    with pytest.raises(ValueError, match="a CUtensorMap lies on 64 bytes; offset 32"):
        buffer.tensor_map_address(32)
