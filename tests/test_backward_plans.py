"""A padded backward call's launch plan (fadsl/runtime/backward_plans.py,
fadsl/targets/sm90/backward/launch_plan.py) on the CPU, on a stand-in device
(tests/fake_cuda.py): a signature's second call keeps a plan, and its later calls launch byte
for byte what the checked path launches for the same tensors (the preprocess's, the main
kernel's and dQ's conversion's params with their TMA descriptors, grids and blocks) and
return gradients of the same shapes, dtypes and strides, over the training examples and
their variants (GQA's fp32 adds, `deterministic on`'s partials summed on the host,
`fused_convert on` with leading rows the host zeroes, `scheduler persistent`), with and
without the LSE's gradient, a broadcast output gradient, modifiers' inputs and a keep's
classes made ahead. A changed shape, stride, dtype or scale is checked again; a misaligned
address is refused by name on a plan's call; calls that cannot be planned (a keep classed by
the call's own pass, learnable inputs) keep none. And the slots are exactly where the params
differ between two calls of one signature."""

from __future__ import annotations

import pytest
import torch

import fadsl
import fake_cuda
from conftest import ROOT
from training_specs import training_spec

from fadsl.runtime.plans import PlanCache
from fadsl.targets.sm90.backward import host, launch_plan

BF = torch.bfloat16
MODIFIERS = ROOT / "examples" / "modifiers"
# (spec as training_spec names it, heads (q, kv), seqlen_q, seqlen_k)
CASES = {
    "fa3_causal": ("fa3_causal", (4, 4), 300, 317),
    "fa3_causal GQA": ("fa3_causal", (4, 2), 300, 317),
    "fa3_hopper MQA": ("fa3_hopper", (4, 1), 257, 130),
    "fa3_hdim64 persistent": ("fa3_hdim64", (4, 2), 200, 333),
    "fa3_hdim64_causal": ("fa3_hdim64_causal", (2, 2), 333, 200),
    "deterministic GQA": ("fa3_causal+deterministic-dqred", (4, 2), 300, 317),
    "fused_convert, keyless rows": ("fa3_causal+fused_convert", (2, 2), 400, 150),
}
_loaded: dict[str, object] = {}


@pytest.fixture
def device(monkeypatch):
    """(launch log, allocator) of a stand-in cuda:0 with the backward's kernels."""
    log, allocator = fake_cuda.install(monkeypatch)
    fake_cuda.install_backward(monkeypatch, log)
    yield log, allocator
    fake_cuda.uninstall()


def kernel(name: str):
    if name not in _loaded:
        if name.startswith("modifiers/"):
            text = (MODIFIERS / f"{name.split('/')[1]}.fa").read_text()
        else:
            text = training_spec(name)
        _loaded[name] = fadsl.load(text, verbose=False)
    kern = _loaded[name]
    kern._backward_kernels().plans.clear()
    return kern


def operands(kern, heads, seqlen_q, seqlen_k, dlse=False, broadcast=False, batch=2):
    """A backward call's arguments (what the forward saved, dout, dlse, the scale)."""
    d = kern.config.head_dim
    q, out = (torch.randn(batch, seqlen_q, heads[0], d, dtype=BF) for _ in "qo")
    k, v = (torch.randn(batch, seqlen_k, heads[1], d, dtype=BF) for _ in "kv")
    lse = torch.randn(batch, heads[0], seqlen_q)
    dout = torch.ones((), dtype=BF).expand_as(q) if broadcast else torch.randn_like(q)
    lse_grad = torch.randn(batch, heads[0], seqlen_q) if dlse else None
    return [q, k, v, out, lse, dout, lse_grad, d**-0.5]


def run(kern, allocator, log, generation, args, inputs=(), checked=False):
    """The launches and gradients of ``kern.backward(*args)`` with the allocator at
    ``generation``; ``checked``: through the checked path (the call's signature unseen)."""
    allocator.next_call(generation)
    log.clear()
    kernels = kern._backward_kernels()
    kept = kernels.plans
    if checked:
        kernels.plans = PlanCache()
    try:
        grads = kern.backward(*args, inputs)
    finally:
        kernels.plans = kept
    return list(log), grads


def same_grads(got, expected) -> bool:
    return all(
        (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        for a, b in zip(got, expected, strict=True)
    )


@pytest.mark.parametrize("dlse", [False, True], ids=["dout", "dout+dlse"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_plan_launches_what_the_checked_path_launches(device, case, dlse):
    log, allocator = device
    name, heads, sq, sk = CASES[case]
    kern = kernel(name)
    plans = kern._backward_kernels().plans
    first, second = (operands(kern, heads, sq, sk, dlse) for _ in "12")
    unplanned, _ = run(kern, allocator, log, 0, first)  # a signature's first call: no plan
    assert unplanned and len(plans) == 0
    missed, grads = run(kern, allocator, log, 0, first)  # its second keeps one
    assert len(plans) == 1
    expected, expected_grads = run(kern, allocator, log, 0, first, checked=True)
    assert missed == unplanned == expected and same_grads(grads, expected_grads)
    hit, grads = run(kern, allocator, log, 1, second)
    expected, expected_grads = run(kern, allocator, log, 1, second, checked=True)
    assert hit == expected and hit != missed  # (the plan rewrote the addresses)
    assert same_grads(grads, expected_grads)
    suffixes = [
        x.kernel.removeprefix(kern._backward_kernels()._sources[fadsl.ir.Dtype.BF16].kernel_name)
        for x in hit
    ]
    fused = "fused_convert" in name
    assert suffixes == ["_preprocess", ""] + ([] if fused else ["_convert_dq"])


def test_a_broadcast_output_gradient_is_made_contiguous_on_a_plans_call(device):
    """d(out.sum()) reaches the backward as a broadcast: the plan copies it as the checks do
    (the copy's address in the main kernel's dO map and the preprocess's params)."""
    log, allocator = device
    kern = kernel("fa3_causal")
    first, second = (operands(kern, (4, 2), 200, 200, broadcast=True) for _ in "12")
    for _ in range(2):
        run(kern, allocator, log, 0, first)
    hit, _ = run(kern, allocator, log, 1, second)
    assert hit == run(kern, allocator, log, 1, second, checked=True)[0]


def test_another_shape_stride_dtype_or_scale_is_checked_again(device):
    log, allocator = device
    kern = kernel("fa3_causal")
    plans = kern._backward_kernels().plans
    args = operands(kern, (4, 2), 300, 300)
    for _ in range(2):
        run(kern, allocator, log, 0, args)
    assert len(plans) == 1
    other = operands(kern, (4, 2), 301, 300)
    run(kern, allocator, log, 0, other)
    assert len(plans) == 1  # (a new signature: its first call)
    scaled = [*args[:7], 0.5]
    run(kern, allocator, log, 0, scaled)
    run(kern, allocator, log, 0, scaled)
    assert len(plans) == 2
    wrong = list(args)
    wrong[5] = args[5].float()  # dout's dtype: the checks' error, no launch
    log.clear()
    with pytest.raises(ValueError, match="the output's gradient has shape"):
        kern.backward(*wrong)
    assert not log
    lse = torch.randn(2, 300, 4).transpose(1, 2)  # the LSE's strides: its own signature
    run(kern, allocator, log, 0, [*args[:4], lse, *args[5:]])
    assert len(plans) == 2


def test_a_misaligned_address_is_refused_by_name_on_a_plans_call(device):
    log, allocator = device
    kern = kernel("fa3_causal")
    args = operands(kern, (4, 2), 300, 300)
    for _ in range(2):
        run(kern, allocator, log, 0, args)
    for index, name in ((0, "q"), (5, "dout")):
        wrong = list(args)
        t = args[index]
        flat = torch.empty(t.numel() + 1, dtype=t.dtype)
        wrong[index] = flat[1:].view(t.shape)  # (one element past the 16-byte boundary)
        log.clear()
        with pytest.raises(ValueError, match=f"{name} must be 16-byte aligned"):
            kern.backward(*wrong)
        assert not log


def modifier_inputs(name, q, k):
    batch, seqlen_q, heads = q.shape[:3]
    if name == "alibi_causal":
        return {"slopes": torch.rand(heads)}
    ids = (torch.arange(seqlen_q) // 100).int().expand(batch, seqlen_q).contiguous()
    return {"q_doc": ids, "kv_doc": ids.clone()}


def modified_operands(kern, name, made_ahead):
    args = operands(kern, (4, 2), 300, 300)
    named = modifier_inputs(name, args[0], args[1])
    inputs = tuple(named.values())
    if made_ahead:
        inputs += tuple(kern.keep_classes(args[0], args[1], **named).tensors())
    return args, inputs


@pytest.mark.parametrize(
    "name, made_ahead",
    [("alibi_causal", False), ("document_causal", True)],
    ids=["alibi", "document, classes made ahead"],
)
def test_a_modified_plan_rewrites_the_inputs_and_classes(device, name, made_ahead):
    """The inputs' (and the classes') addresses are the main kernel's MODIFIERS slots."""
    log, allocator = device
    kern = kernel(f"modifiers/{name}")
    plans = kern._backward_kernels().plans
    first, second = (modified_operands(kern, name, made_ahead) for _ in "12")
    for _ in range(2):
        run(kern, allocator, log, 0, *first)
    assert len(plans) == 1
    hit, _ = run(kern, allocator, log, 1, *second)
    expected, _ = run(kern, allocator, log, 1, *second, checked=True)
    assert hit == expected
    (main,) = [
        x
        for x in hit
        if x.kernel == kern._backward_kernels()._sources[fadsl.ir.Dtype.BF16].kernel_name
    ]
    pointers = host.MODIFIERS.unpack_from(main.params, host.MODIFIERS_OFFSET)[:8]
    spec_inputs = second[1][: len(kern.config.modifiers.inputs)]
    read = spec_inputs + (second[1][-2:] if made_ahead else ())
    assert pointers[: len(read)] == tuple(t.data_ptr() for t in read)


def test_a_keep_classed_by_the_call_keeps_no_plan(device):
    log, allocator = device
    kern = kernel("modifiers/document_causal")
    args, inputs = modified_operands(kern, "document_causal", made_ahead=False)
    for _ in range(3):
        run(kern, allocator, log, 0, args, inputs)
        assert any(x.kernel.endswith("_keep_classes") for x in log)
    assert len(kern._backward_kernels().plans) == 0


@pytest.mark.parametrize(
    "case", ["fa3_causal GQA", "deterministic GQA", "fused_convert, keyless rows"]
)
def test_the_slots_are_where_two_calls_params_differ(device, case):
    """Packed for two calls of one signature (different tensors, allocations), the params
    differ at the slots' bytes and nowhere else; a slot's value is its source's address
    plus its delta (the workspace's parts)."""
    _, allocator = device
    name, heads, sq, sk = CASES[case]
    kern = kernel(name)
    kernel_ir = kern.compiled.kernel
    calls = []
    for generation in (0, 1):
        allocator.next_call(generation)
        q, k, v, out, lse, dout, _, scale = operands(kern, heads, sq, sk)
        calls.append(host.padded_call(kernel_ir, q, k, v, out, lse, dout, None, scale))
    for one, two in zip(calls[0].launches, calls[1].launches, strict=True):
        slots = launch_plan.slots(one.suffix, calls[0])
        assert slots == launch_plan.slots(two.suffix, calls[1])
        covered = set()
        for slot in slots:
            width = 128 if slot.tensor_map else 8
            covered |= set(range(slot.offset, slot.offset + width))
            for call, launch in ((calls[0], one), (calls[1], two)):
                value = int.from_bytes(launch.params[slot.offset : slot.offset + 8], "little")
                source = call.made[-1] if slot.source == "workspace" else None
                expected = source.data_ptr() if source is not None else call.addresses[slot.source]
                assert value == expected + slot.delta, (one.suffix, slot)
        differ = {i for i, (a, b) in enumerate(zip(one.params, two.params)) if a != b}
        assert differ and differ <= covered, (one.suffix, sorted(differ - covered)[:8])
