"""A keep's tile classes made once and passed to each call (fadsl/runtime/keep_classes.py), on
the stand-in device (tests/fake_cuda.py): ``kern.keep_classes(q, k, ...)`` launches the
forward's and the backward's classing kernels once; a call with ``keep_classes=`` launches
neither and hands the kernels those classes as the inputs after the spec's, forward and
backward; a call whose shapes, kernel or input tensors do not match, or whose ids were
written in place since, is refused by name. The classes themselves: tests/test_gpu_modifiers*."""

from __future__ import annotations


import pytest
import torch

import fadsl
from conftest import ROOT
from fadsl.runtime.keep_classes import KeepClasses
from fadsl.targets.sm90.backward import host
from fadsl.targets.sm90.host.keep_classes import CLASSES_SUFFIX
from fadsl.targets.sm90.host.launch import INPUTS, INPUTS_OFFSET

DOCUMENT = (ROOT / "examples" / "modifiers" / "document_causal.fa").read_text()


@pytest.fixture
def device(monkeypatch):
    """The stand-in device with the backward's kernels recorded too: the launch log."""
    import fake_cuda

    log, _ = fake_cuda.install(monkeypatch)
    fake_cuda.install_backward(monkeypatch, log)
    yield log
    fake_cuda.uninstall()


def tensors(sq=300, sk=300):
    q = torch.randn(2, sq, 4, 128, dtype=torch.bfloat16)
    k, v = (torch.randn(2, sk, 2, 128, dtype=torch.bfloat16) for _ in "kv")
    ids = {"q_doc": torch.zeros(2, sq, dtype=torch.int32)}
    ids["kv_doc"] = torch.zeros(2, sk, dtype=torch.int32)
    return q, k, v, ids


def test_made_once_then_no_call_classes_its_tiles(device):
    kern = fadsl.load(DOCUMENT, verbose=False)
    q, k, v, ids = tensors()
    classes = kern.keep_classes(q, k, **ids)
    assert isinstance(classes, KeepClasses)
    made = [x.kernel for x in device]
    assert made == ["document_causal" + CLASSES_SUFFIX, "document_causal_bwd_bf16" + CLASSES_SUFFIX]
    bwd = kern.compiled.kernel.backward
    assert classes.backward[:2] == (bwd.block_m, bwd.block_n)
    device.clear()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern(*leaves, **ids, keep_classes=classes).float().sum().backward()
    names = [x.kernel for x in device]
    assert not any(n.endswith(CLASSES_SUFFIX) for n in names), names
    forward = device[0]
    pointers = INPUTS.unpack_from(forward.params, INPUTS_OFFSET)
    expected = (ids["q_doc"], ids["kv_doc"], *classes.forward)
    assert pointers == (*(t.data_ptr() for t in expected), 0, 0, 0, 0)
    (main,) = [x for x in device if x.kernel == "document_causal_bwd_bf16"]
    pointers = host.MODIFIERS.unpack_from(main.params, host.MODIFIERS_OFFSET)[:8]
    expected = (ids["q_doc"], ids["kv_doc"], *classes.backward[2:])
    assert pointers == (*(t.data_ptr() for t in expected), 0, 0, 0, 0)


def test_without_them_each_call_classes_its_tiles(device):
    kern = fadsl.load(DOCUMENT, verbose=False)
    q, k, v, ids = tensors()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kern(*leaves, **ids).float().sum().backward()
    names = [x.kernel for x in device if x.kernel.endswith(CLASSES_SUFFIX)]
    assert names == [
        "document_causal" + CLASSES_SUFFIX,
        "document_causal_bwd_bf16" + CLASSES_SUFFIX,
    ]


def test_a_call_they_were_not_made_for_is_refused_by_name(device):
    kern = fadsl.load(DOCUMENT, verbose=False)
    q, k, v, ids = tensors()
    classes = kern.keep_classes(q, k, **ids)
    with pytest.raises(ValueError, match=r"made from another tensor than this call's q_doc"):
        kern(q, k, v, q_doc=ids["q_doc"].clone(), kv_doc=ids["kv_doc"], keep_classes=classes)
    q2, k2, v2, ids2 = tensors(sq=200)
    with pytest.raises(
        ValueError, match=r"made for \(batch, seqlen_q, heads, seqlen_k, heads_kv\)"
    ):
        kern(q2, k2, v2, **ids2, keep_classes=classes)
    ids["kv_doc"].add_(1)  # written in place after the classes were made
    with pytest.raises(ValueError, match=r"kv_doc was written in place after keep_classes"):
        kern(q, k, v, **ids, keep_classes=classes)
    with pytest.raises(TypeError, match=r"keep_classes must be what kernel"):
        kern(q, k, v, **ids, keep_classes=object())
    other = fadsl.load(DOCUMENT.replace("kernel document_causal", "kernel other"), verbose=False)
    with pytest.raises(ValueError, match=r"made by kernel 'document_causal_"):
        other(q, k, v, **ids, keep_classes=kern.keep_classes(q, k, **ids))


def test_a_spec_whose_keep_needs_no_pass_refuses_to_make_them(device):
    kern = fadsl.load((ROOT / "examples" / "modifiers" / "prefix_lm.fa").read_text(), verbose=False)
    q, k, _, _ = tensors()
    with pytest.raises(TypeError, match=r"classes no tiles per call"):
        kern.keep_classes(q, k, prefix=torch.zeros(2, dtype=torch.int32))


def test_another_count_of_inputs_and_a_spec_without_keep_are_refused(device):
    kern = fadsl.load(DOCUMENT, verbose=False)
    q, k, v, ids = tensors()
    from fadsl.runtime import keep_classes

    with pytest.raises(TypeError, match=r"takes 2 inputs .* got 3"):
        keep_classes.split(kern, (ids["q_doc"], ids["kv_doc"], ids["kv_doc"]))
    plain = fadsl.load((ROOT / "examples" / "fa3_causal.fa").read_text(), verbose=False)
    with pytest.raises(TypeError, match=r"has no keep"):
        plain.keep_classes(q, k)
    q2 = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16)
    k4 = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16)
    classes = kern.keep_classes(q2, k4, **ids)  # made for 4 K/V heads: not for 2
    with pytest.raises(ValueError, match=r"heads_kv\) = \(2, 300, 4, 300, 4\)"):
        kern(q, k, v, **ids, keep_classes=classes)
