"""A loaded kernel's plain and modified calls through launch plans
(fadsl/runtime/plain_calls.py, modified_calls.py; issue 45) on the CPU, on a stand-in device
(tests/fake_cuda.py): a signature's second call keeps a plan, and its later calls launch byte
for byte what the checked path (``forward``) launches for the same tensors (params with their
TMA descriptors, grid, block, cluster); a changed shape, stride, dtype, scale or flag is
checked again and refused with the checked path's error, launching nothing; a misaligned
address is refused on a plan's call; calls with ``out=`` keep none. Modified calls (issue
41): their inputs' addresses (and classes made ahead) rewritten in the plan, the classes
checked again on every call, a keep classed by the call's own pass not planned, calls with
gradients not planned."""

from __future__ import annotations

import re

import pytest
import torch

import fadsl
import fake_cuda
from conftest import ROOT

BF = torch.bfloat16
SPECS = {
    "fa3_hopper (cluster 2)": ROOT / "examples" / "fa3_hopper.fa",
    "fa3_causal": ROOT / "examples" / "fa3_causal.fa",
    "fa3_hdim64_causal": ROOT / "examples" / "fa3_hdim64_causal.fa",
    "fa3_hdim64 (split tail)": ROOT / "examples" / "fa3_hdim64.fa",
}
PLANNED = [name for name in SPECS if "split" not in name]
_loaded: dict[str, object] = {}


@pytest.fixture
def device(monkeypatch):
    """(launch log, allocator) of a stand-in cuda:0."""
    found = fake_cuda.install(monkeypatch)
    yield found
    fake_cuda.uninstall()


def kernel(name: str):
    if name not in _loaded:
        _loaded[name] = fadsl.load(SPECS[name].read_text(), verbose=False)
    kern = _loaded[name]
    kern._plans.clear()
    return kern


def inputs(kern, batch=2, seqlen=300, heads=(4, 2)):
    d = kern.config.head_dim
    q = torch.randn(batch, seqlen, heads[0], d, dtype=BF)
    k, v = (torch.randn(batch, seqlen + 17, heads[1], d, dtype=BF) for _ in "kv")
    return q, k, v


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("name", PLANNED)
def test_a_plan_launches_what_the_checked_path_launches(device, name, return_lse):
    log, allocator = device
    kern = kernel(name)
    first, second = inputs(kern), inputs(kern)

    def launches(generation, tensors, checked=False):
        allocator.next_call(generation)
        log.clear()
        if checked:
            result = kern.forward(*tensors, tensors[0].shape[-1] ** -0.5, None, return_lse)
        else:
            result = kern(*tensors, return_lse=return_lse)
        return list(log), result

    unplanned, _ = launches(0, first)  # a signature's first call keeps no plan
    assert unplanned and len(kern._plans) == 0
    missed, _ = launches(0, first)  # its second does, and launches through it
    assert missed == unplanned == launches(0, first, checked=True)[0]
    assert len(kern._plans) == 1
    hit, result = launches(1, second)
    expected, expected_result = launches(1, second, checked=True)
    assert hit == expected and hit != missed  # (the plan rewrote the addresses)
    assert len(kern._plans) == 1
    if return_lse:
        assert [t.data_ptr() for t in result] == [t.data_ptr() for t in expected_result]
        assert result[1].shape == (2, 4, 300) and result[1].dtype == torch.float32


def test_a_split_tail_call_is_not_planned(device):
    """A split tail's workspace is the call's own (no slot names it): every call takes the
    checked path, and launches what it launches; the plan is tried once."""
    log, _ = device
    kern = kernel("fa3_hdim64 (split tail)")
    q, k, v = inputs(kern, batch=1, seqlen=1000, heads=(2, 2))
    found, prepared = [], []
    real_prepare = kern.prepare

    def counting(*args, **kwargs):
        prepared.append(real_prepare(*args, **kwargs))
        return prepared[-1]

    kern.prepare = counting
    try:
        for _ in range(3):
            log.clear()
            kern(q, k, v)
            found.append(list(log))
    finally:
        del kern.prepare
    assert found[0] and len(kern._plans) == 0
    assert prepared == [None]  # (tried at the second call, refused, not tried again)
    assert [[(x.grid, x.block) for x in f] for f in found] == [
        [(x.grid, x.block) for x in found[0]]
    ] * 3


MUTATIONS = {
    "k fp16": lambda q, k, v: (q, k.half(), v),
    "v of fewer keys": lambda q, k, v: (q, k, v[:, :64]),
    "q's rows 132 apart": lambda q, k, v: (
        torch.randn(*q.shape[:-1], q.shape[-1] + 4, dtype=BF)[..., : q.shape[-1]],
        k,
        v,
    ),
    "head_dim 64": lambda q, k, v: (q[..., :64], k[..., :64], v[..., :64]),
    "3 query heads": lambda q, k, v: (q[:, :, :3], k, v),
}


def _error(call):
    try:
        call()
    except Exception as err:  # noqa: BLE001 (the type and message are compared)
        return type(err), str(err)
    return None


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_changed_argument_is_checked_again(device, mutation):
    """After a planned signature, a changed call raises what it raises with no plan, and
    launches nothing."""
    log, _ = device
    kern = kernel("fa3_causal")
    good = inputs(kern)
    bad = MUTATIONS[mutation](*good)
    kern(*good)
    kern(*good)
    assert len(kern._plans) == 1
    log.clear()
    with_plans = _error(lambda: kern(*bad))
    assert with_plans is not None and with_plans[0] in (TypeError, ValueError), with_plans
    assert not log, "a refused call launched"
    kern._plans.clear()
    assert _error(lambda: kern(*bad)) == with_plans


def test_other_scales_and_flags_are_other_signatures(device):
    log, _ = device
    kern = kernel("fa3_causal")
    q, k, v = inputs(kern)
    for scale in (None, 0.1, 0.1, None):
        for lse in (False, True):
            kern(q, k, v, scale, return_lse=lse)
    assert len(kern._plans) == 4  # (None, 0.1) x (False, True), each called twice
    with pytest.raises(ValueError, match="softmax_scale"):
        kern(q, k, v, float("nan"))
    with pytest.raises(TypeError, match="return_lse"):
        kern(q, k, v, return_lse=1)


def _misaligned(t):
    flat = torch.randn(t.numel() + 8, dtype=t.dtype)[1 : 1 + t.numel()]
    return flat.view(t.shape).copy_(t)


def test_a_misaligned_address_is_refused_on_a_plans_call(device):
    log, _ = device
    kern = kernel("fa3_causal")
    q, k, v = inputs(kern)
    kern(q, k, v)
    kern(q, k, v)
    log.clear()
    with pytest.raises(ValueError, match=r"^v must be 16-byte aligned"):
        kern(q, k, _misaligned(v))
    assert not log and len(kern._plans) == 1


def test_calls_with_out_keep_no_plan(device):
    kern = kernel("fa3_causal")
    q, k, v = inputs(kern)
    out = torch.empty_like(q)
    for _ in range(3):
        kern(q, k, v, out=out)
    assert len(kern._plans) == 0


# ---------------------------------------------------------------- modified calls (issue 41)
MODIFIERS = ROOT / "examples" / "modifiers"


@pytest.fixture
def device_bwd(monkeypatch):
    """The stand-in device with the backward's kernels too (keep_classes makes both)."""
    log, allocator = fake_cuda.install(monkeypatch)
    fake_cuda.install_backward(monkeypatch, log)
    yield log, allocator
    fake_cuda.uninstall()


def modified(name: str):
    key = f"modifiers/{name}"
    if key not in _loaded:
        _loaded[key] = fadsl.load((MODIFIERS / f"{name}.fa").read_text(), verbose=False)
    kern = _loaded[key]
    kern._plans.clear()
    return kern


def modifier_inputs(name, q, k):
    batch, seqlen_q, heads = q.shape[:3]
    if name == "alibi_causal":
        return {"slopes": torch.rand(heads)}
    if name == "t5_bias_causal":
        return {"bias": torch.randn(heads, 32)}
    if name == "prefix_lm":
        return {"prefix": torch.tensor([5, 100][:batch], dtype=torch.int32)}
    return {
        "q_doc": torch.zeros(batch, seqlen_q, dtype=torch.int32),
        "kv_doc": torch.zeros(batch, k.shape[1], dtype=torch.int32),
    }


MODIFIED_CASES = [(n, False) for n in ("alibi_causal", "t5_bias_causal", "prefix_lm")]
MODIFIED_CASES += [("document_causal", False), ("document_causal", True)]


@pytest.mark.parametrize(
    "name, made_ahead",
    MODIFIED_CASES,
    ids=[n + (" classes made ahead" if m else "") for n, m in MODIFIED_CASES],
)
def test_a_modified_plan_launches_what_the_checked_path_launches(device_bwd, name, made_ahead):
    """With its inputs' addresses in the plan's slots (P.inputs); a keep whose classes the
    call makes itself is not planned (its workspaces are the call's own), one whose classes
    were made ahead is."""
    log, allocator = device_bwd
    kern = modified(name)
    calls = []
    for _ in range(2):
        q, k, v = inputs(kern)
        named = modifier_inputs(name, q, k)
        if made_ahead:
            named["keep_classes"] = kern.keep_classes(q, k, **named)
        calls.append((q, k, v, named))

    def launches(generation, call, checked=False):
        q, k, v, named = call
        allocator.next_call(generation)
        log.clear()
        if checked:  # the checked path of the same call: its inputs and classes as it passes them
            named = dict(named)
            classes = named.pop("keep_classes", None)
            tensors = tuple(named[d.name] for d in kern.config.modifiers.inputs)
            tensors += () if classes is None else tuple(classes.tensors())
            result = kern.forward(q, k, v, 128**-0.5, None, True, tensors)
        else:
            result = kern(q, k, v, return_lse=True, **named)
        return list(log), result

    launches(0, calls[0], checked=True)  # (a kernel's first launch allocates what it keeps)
    first, _ = launches(0, calls[0])
    second, _ = launches(0, calls[0])
    checked, _ = launches(0, calls[0], checked=True)
    if name == "document_causal" and not made_ahead:  # (ranges from torch.full: fresh memory)
        shapes = [[(x.kernel, x.grid, x.block) for x in found] for found in (first, second)]
        assert shapes == [[(x.kernel, x.grid, x.block) for x in checked]] * 2
        assert len(kern._plans) == 0
        return
    assert first == second == checked
    assert len(kern._plans) == 1
    hit, result = launches(1, calls[1])
    expected, expected_result = launches(1, calls[1], checked=True)
    assert hit == expected and hit != second
    assert len(kern._plans) == 1
    assert [t.data_ptr() for t in result] == [t.data_ptr() for t in expected_result]


def test_a_modified_plans_call_checks_its_classes_and_inputs_again(device_bwd):
    """On a plan's call: classes made from other ids, or ids written in place since, are
    refused by name; an input of another dtype or shape is another signature, refused as
    the checked path refuses it; none of them launches."""
    log, _ = device_bwd
    kern = modified("document_causal")
    q, k, v = inputs(kern)
    ids = modifier_inputs("document_causal", q, k)
    classes = kern.keep_classes(q, k, **ids)
    for _ in range(2):
        kern(q, k, v, **ids, keep_classes=classes)
    assert len(kern._plans) == 1
    log.clear()
    other = {n: t.clone() for n, t in ids.items()}
    with pytest.raises(ValueError, match="made from another tensor than this call's q_doc"):
        kern(q, k, v, **other, keep_classes=classes)
    with pytest.raises(ValueError, match=r"^q must be 16-byte aligned"):
        kern(_misaligned(q), k, v, **ids, keep_classes=classes)
    ids["kv_doc"].add_(1)
    with pytest.raises(ValueError, match="kv_doc was written in place"):
        kern(q, k, v, **ids, keep_classes=classes)
    with pytest.raises(TypeError, match="q_doc must be torch.int32"):
        kern(q, k, v, q_doc=ids["q_doc"].long(), kv_doc=ids["kv_doc"], keep_classes=classes)
    with pytest.raises(ValueError, match="kv_doc must have shape"):
        kern(q, k, v, q_doc=ids["q_doc"], kv_doc=ids["kv_doc"][:, :7], keep_classes=classes)
    assert not log and len(kern._plans) == 1


def test_a_modified_call_with_gradients_keeps_no_plan(device_bwd):
    kern = modified("alibi_causal")
    q, k, v = inputs(kern)
    slopes = torch.rand(q.shape[2], requires_grad=True)
    for _ in range(3):
        kern(q, k, v, slopes=slopes)
    assert len(kern._plans) == 0
    with torch.no_grad():
        for _ in range(2):
            kern(q, k, v, slopes=slopes)
    assert len(kern._plans) == 1
    (plan,) = kern._plans._plans.values()
    planned = []
    monkeypatch_call = type(plan).__call__

    def recording(self, *args, **kwargs):
        planned.append(args)
        return monkeypatch_call(self, *args, **kwargs)

    type(plan).__call__ = recording
    try:
        grad = kern(q, k, v, slopes=slopes)  # (grad enabled again: the autograd Function)
        with torch.no_grad():
            kern(q, k, v, slopes=slopes)
    finally:
        type(plan).__call__ = monkeypatch_call
    assert grad.requires_grad and len(planned) == 1


def test_a_spec_with_modifiers_and_no_inputs_plans_its_calls(device, tmp_path):
    """A score that reads no input (a bias computed from the distance alone) keeps a plan,
    and launches what the checked path launches."""
    log, allocator = device
    text = (MODIFIERS / "alibi_causal.fa").read_text()
    text = re.sub(r"^  input      slopes : f32\[heads\].*\n", "", text, flags=re.M)
    text = text.replace(
        "s + slopes[h] * (kv_idx - q_idx)", "s + log(1.0 + abs(q_idx - kv_idx)) * -0.25"
    )
    kern = fadsl.load(text, verbose=False)
    assert not kern.config.modifiers.inputs and kern.config.modifiers.distance_term is not None
    q, k, v = inputs(kern)
    kern.forward(q, k, v, 128**-0.5)  # (a kernel's first launch allocates what it keeps)
    found = []
    for _ in range(3):
        allocator.next_call(0)
        log.clear()
        kern(q, k, v)
        found.append(list(log))
    allocator.next_call(0)
    log.clear()
    kern.forward(q, k, v, 128**-0.5)
    assert found == [list(log)] * 3 and len(kern._plans) == 1
