"""Score and mask modifiers (issue 41) at run time, on the CPU: a call's inputs checked by name,
dtype, shape, device and layout, each error naming the argument; their pointers packed into
FwdParamsSm90 in declared order; a call without them, or with an input that requires grad,
refused. The backward's runtime path: tests/test_modifiers_backward_runtime.py."""

from __future__ import annotations

import pytest
import torch

import fadsl
import fadsl.targets.sm90.host.launch as params
from conftest import ROOT
from fadsl.runtime.arguments import modifier_inputs
from fadsl.targets.launch import Args
from fadsl.targets.sm90.host.launch import INPUTS, INPUTS_OFFSET, pack_fwd_params_sm90
from test_modifiers_front import modifiers

DECLS = modifiers(
    "input slopes : f32[heads]\n  input prefix : i32[batch]\n  input table : f32[heads_kv, 7, seqlen_k]\n"
    "  score s + slopes[h] + table[clamp(h // 2, 0, heads_kv - 1), 3, kv_idx] + prefix[b]"
).inputs
Q = torch.zeros(2, 5, 4, 128)  # batch 2, seqlen_q 5, heads 4
K = torch.zeros(2, 9, 2, 128)  # seqlen_k 9, heads_kv 2


def good() -> dict:
    return {
        "slopes": torch.ones(4),
        "prefix": torch.zeros(2, dtype=torch.int32),
        "table": torch.zeros(2, 7, 9),
    }


def test_the_inputs_come_back_in_declared_order():
    given = good()
    found = modifier_inputs(DECLS, dict(reversed(list(given.items()))), Q, K, "k")
    assert [t is given[n] for t, n in zip(found, ("slopes", "prefix", "table"))] == [True] * 3


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda g: g.pop("prefix"), TypeError, "kernel 'k' needs its input 'prefix' (prefix : i32[batch]): pass prefix=..."),
        (lambda g: g.update(slope=g["slopes"]), TypeError, "kernel 'k' got an unexpected keyword argument 'slope'; its inputs are slopes, prefix, table"),
        (lambda g: g.update(slopes=[1.0] * 4), TypeError, "slopes must be a torch.Tensor (slopes : f32[heads]), got list"),
        (lambda g: g.update(slopes=torch.ones(4, dtype=torch.float64)), TypeError, "slopes must be torch.float32 (slopes : f32[heads]), got torch.float64"),
        (lambda g: g.update(prefix=torch.zeros(2)), TypeError, "prefix must be torch.int32 (prefix : i32[batch]), got torch.float32"),
        (lambda g: g.update(slopes=torch.ones(2)), ValueError, "slopes must have shape (4,) (slopes : f32[heads], with q's and k's sizes), got (2,)"),
        (lambda g: g.update(table=torch.zeros(2, 7, 5)), ValueError, "table must have shape (2, 7, 9)"),
        (lambda g: g.update(slopes=torch.ones(4, device="meta")), ValueError, "slopes is on meta but q is on cpu"),
        (lambda g: g.update(table=torch.zeros(2, 9, 7).transpose(1, 2)), ValueError, "table must be contiguous (the kernel reads it row-major); pass table.contiguous()"),
    ],
)  # fmt: skip
def test_each_bad_input_is_named(change, error, message):
    given = good()
    change(given)
    with pytest.raises(error) as info:
        modifier_inputs(DECLS, given, Q, K, "k")
    assert str(info.value).startswith(message)


def test_a_spec_without_inputs_takes_none():
    with pytest.raises(TypeError, match="its spec declares no inputs"):
        modifier_inputs((), {"slopes": torch.ones(4)}, Q, K, "k")
    assert modifier_inputs((), {}, Q, K, "k") == ()


def test_the_params_hold_as_many_inputs_as_a_spec_may_declare():
    from fadsl.frontend.modifiers import MAX_INPUTS

    assert INPUTS.size == 8 * MAX_INPUTS


def test_the_pointers_land_after_the_kv_cache_fields(monkeypatch):
    import fadsl.targets.sm90.host.tma as tma

    monkeypatch.setattr(tma, "_encode", lambda *a: bytes(tma.MAP_BYTES))
    monkeypatch.setattr(tma, "_encoded", {})
    monkeypatch.setattr(params, "_SM90_PACKED", {})
    kern = fadsl.load(ROOT / "examples" / "modifiers" / "alibi_causal.fa", verbose=False)
    q = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16)
    slopes = torch.ones(4)
    plain = Args(q, k, k, torch.empty_like(q), None, 0.1)
    raw = pack_fwd_params_sm90(kern.compiled.kernel, plain._replace(inputs=(slopes,)))
    assert INPUTS.unpack_from(raw, INPUTS_OFFSET) == (slopes.data_ptr(), *[0] * 7)
    without = pack_fwd_params_sm90(kern.compiled.kernel, plain)
    assert raw[:INPUTS_OFFSET] == without[:INPUTS_OFFSET]
    assert raw[INPUTS_OFFSET + INPUTS.size :] == without[INPUTS_OFFSET + INPUTS.size :]
    assert INPUTS.unpack_from(without, INPUTS_OFFSET) == (0,) * 8


def test_a_call_without_its_inputs_is_refused():
    """(An input that requires grad and cannot have a gradient: tests/test_modifiers_learnable.py.)"""
    kern = fadsl.load(ROOT / "examples" / "modifiers" / "alibi_causal.fa", verbose=False)
    q = torch.zeros(1, 64, 4, 128, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(TypeError, match="kernel 'alibi_causal' reads inputs \\(slopes\\)"):
        kern.launch(None, q, q, q, None, None, 0.1)
    plain = fadsl.load(ROOT / "examples" / "fa3_hdim256.fa", verbose=False)
    with pytest.raises(
        TypeError, match="unexpected keyword argument 'slopes'; its spec declares no inputs"
    ):
        plain(q.detach(), q.detach(), q.detach(), slopes=torch.ones(4))


def test_a_modified_calls_plan_packs_each_calls_own_inputs(monkeypatch):
    """Launch plans (fadsl/runtime/plans.py) of a spec with modifiers list the inputs'
    addresses in their slots (P.inputs): each call, on a stand-in device (tests/fake_cuda.py),
    packs its own inputs' pointers, none reused from an earlier call, planned or not
    (tests/test_plain_call_plans.py has the rest)."""
    import fake_cuda

    log, _ = fake_cuda.install(monkeypatch)
    try:
        kern = fadsl.load(ROOT / "examples" / "modifiers" / "alibi_causal.fa", verbose=False)
        q, k, v = (torch.randn(1, 128, 4, 128, dtype=torch.bfloat16) for _ in "qkv")
        first, second = torch.ones(4), torch.full((4,), 2.0)
        for slopes in (first, first, second, first):
            kern(q, k, v, slopes=slopes)
        found = [INPUTS.unpack_from(launched.params, INPUTS_OFFSET) for launched in log]
        expected = [p.data_ptr() for p in (first, first, second, first)]
        assert found == [(p, *[0] * 7) for p in expected]
        assert len(kern._plans) == 1  # (kept at the second call, used by the last two)
    finally:
        fake_cuda.uninstall()
