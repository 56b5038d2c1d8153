"""A `keep` that reads inputs per token (document ids): derive_sparsity marks it
(TileRule.by_pass, per_head where it reads h), `fadsl explain` says so, the spec is refused
where the classes' two input slots do not fit, the forward's source carries the classing
kernel and its slots (the others none), and the target's workspaces have the shapes and
starting values the kernel expects (fadsl/targets/sm90/host/keep_classes.py), launched first
with the attention kernel's params (on tests/fake_cuda.py's stand-in device)."""

from __future__ import annotations

import re

import pytest
import torch

import fadsl

from conftest import ROOT
from fadsl.codegen.render import render
from fadsl.errors import SpecError
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.host import keep_classes
from fadsl.tools.report import explain_text

MODIFIERS = ROOT / "examples" / "modifiers"
DOCUMENT = (MODIFIERS / "document_causal.fa").read_text()
KEEP = "  keep       q_doc[b, q_idx] == kv_doc[b, kv_idx]\n"


def _compiled(text: str, file: str = "t.fa"):
    return compile_source(text, file)


def test_a_keep_of_per_token_inputs_is_classed_by_a_pass():
    rule = _compiled(DOCUMENT).kernel.config.modifiers.rule
    assert rule.by_pass and not rule.per_head and not rule.exact
    for name in ("prefix_lm", "prefix_lm_alibi"):  # inputs per batch: the rule alone
        rule = _compiled((MODIFIERS / f"{name}.fa").read_text()).kernel.config.modifiers.rule
        assert not rule.by_pass and rule.exact


def test_a_keep_that_reads_the_head_is_classed_per_head():
    text = DOCUMENT.replace(KEEP, "  keep       q_doc[b, q_idx] == kv_doc[b, kv_idx] or h == 0\n")
    rule = _compiled(text).kernel.config.modifiers.rule
    assert rule.by_pass and rule.per_head


def test_explain_says_the_tiles_are_classed_each_call():
    text = explain_text(_compiled(DOCUMENT))
    assert "by a pass before the kernel, each call" in text


def _with_extra_inputs(count: int) -> str:
    """The document example with ``count`` more inputs, each read by its keep."""
    extra = "".join(f"  input      extra{i} : i32[batch]\n" for i in range(count))
    reads = "".join(f" and extra{i}[b] >= 0" for i in range(count))
    return DOCUMENT.replace(KEEP, extra + KEEP.rstrip("\n") + reads + "\n")


def test_more_inputs_than_the_classes_leave_room_for_are_refused_at_the_keep():
    text = _with_extra_inputs(5)
    with pytest.raises(SpecError) as err:
        _compiled(text)
    line = next(n for n, s in enumerate(text.splitlines(), 1) if s.startswith("  keep"))
    message = str(err.value)
    assert f"t.fa:{line}:" in message and "at most 6 inputs" in message
    assert _compiled(_with_extra_inputs(4)).kernel.config.modifiers.rule.by_pass


def test_the_forward_source_carries_the_classing_kernel_where_it_needs_one():
    c = _compiled(DOCUMENT)
    (source,) = [s for s in render(c.kernel, c.target, "t.fa") if "bf16" in s.kernel_name]
    assert f"{source.kernel_name}{keep_classes.CLASSES_SUFFIX}(" in source.text
    assert re.search(r"kClassesInput = 2;", source.text)  # after q_doc and kv_doc
    assert re.search(r"kClassesPerHead = false;", source.text)
    prefix = _compiled((MODIFIERS / "prefix_lm.fa").read_text())
    (source,) = [s for s in render(prefix.kernel, prefix.target, "t.fa") if "bf16" in s.kernel_name]
    assert keep_classes.CLASSES_SUFFIX not in source.text
    assert "kClassesInput = -1;" in source.text


@pytest.mark.parametrize("sq, sk, heads", [(1000, 1000, 4), (1, 1, 1), (129, 4000, 3)])
def test_the_workspaces_fit_the_tiles_and_start_with_nothing_kept(sq, sk, heads):
    config = _compiled(DOCUMENT).kernel.config
    q = torch.empty(2, sq, heads, 128)
    k = torch.empty(2, sk, 1, 128)
    (classes, ranges), grid = keep_classes.workspaces(config, q, k)
    q_blocks, kv_blocks = -(-sq // config.block_r), -(-sk // config.block_c)
    assert grid == (kv_blocks, q_blocks, 2)  # (per batch: keep does not read h)
    assert classes.dtype == torch.uint8 and classes.numel() == 2 * q_blocks * kv_blocks
    assert ranges.dtype == torch.int32 and ranges.shape == (2 * q_blocks, 2)
    assert (ranges[:, 0] == keep_classes.INT_MAX).all() and (ranges[:, 1] == -1).all()
    assert keep_classes.plan_keep_classes(_compiled(DOCUMENT).kernel, q, k)[1].grid == grid


def test_more_tiles_than_the_pass_can_launch_are_refused_naming_q():
    config = _compiled(DOCUMENT).kernel.config
    q = torch.empty(1, 65536 * config.block_r, 1, 128, device="meta")
    k = torch.empty(1, 128, 1, 128, device="meta")
    with pytest.raises(ValueError, match=r"^q: .* at most 65535 q blocks"):
        keep_classes.workspaces(config, q, k)
    per_head = _compiled(
        DOCUMENT.replace(KEEP, "  keep       q_doc[b, q_idx] == kv_doc[b, kv_idx] or h == 0\n")
    ).kernel.config
    q = torch.empty(1024, 128, 128, 128, device="meta")
    with pytest.raises(ValueError, match=r"^q: batch 1024 x 128 heads"):
        keep_classes.workspaces(per_head, q, k)


def test_the_classing_kernel_runs_first_with_the_kernels_params(monkeypatch):
    """A document call on a stand-in device (tests/fake_cuda.py): <kernel>_keep_classes is
    launched before the attention kernel, on its grid of tiles, with the same params, whose
    inputs are the spec's two then the classes and ranges."""
    import fake_cuda
    from fadsl.targets.sm90.host.launch import INPUTS, INPUTS_OFFSET

    log, _ = fake_cuda.install(monkeypatch)
    made = []
    real = keep_classes.workspaces

    def recording(config, q, k):
        found = real(config, q, k)
        made.append(found[0])
        return found

    monkeypatch.setattr(keep_classes, "workspaces", recording)
    try:
        kern = fadsl.load(DOCUMENT, verbose=False)
        q, k, v = (torch.randn(2, 300, 4, 128, dtype=torch.bfloat16) for _ in "qkv")
        ids = {"q_doc": torch.zeros(2, 300, dtype=torch.int32)}
        ids["kv_doc"] = torch.zeros(2, 300, dtype=torch.int32)
        kern(q, k, v, **ids)
        classes, main = log
        assert classes.kernel == main.kernel + keep_classes.CLASSES_SUFFIX
        assert classes.grid == (3, 3, 2) and classes.block == (keep_classes.CLASSES_THREADS, 1, 1)
        assert classes.params == main.params
        ((cls, ranges),) = made
        pointers = INPUTS.unpack_from(main.params, INPUTS_OFFSET)
        expected = (ids["q_doc"], ids["kv_doc"], cls, ranges)
        assert pointers == (*(t.data_ptr() for t in expected), 0, 0, 0, 0)
    finally:
        fake_cuda.uninstall()
