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
from document_ids import recorded_workspaces
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
    (classes, lists), grid = keep_classes.workspaces(
        config, q, k, config.block_r, config.block_c, False
    )
    q_blocks, kv_blocks = -(-sq // config.block_r), -(-sk // config.block_c)
    assert grid == (kv_blocks, q_blocks, 2)  # (per batch: keep does not read h)
    assert classes.dtype == torch.uint8 and classes.numel() == 2 * q_blocks * kv_blocks
    # the forward: each q block's list (CTAs done, count, the kept blocks), zeroed
    assert lists.dtype == torch.int32 and lists.shape == (2 * q_blocks, 2 + kv_blocks)
    assert not lists.any()
    assert keep_classes.plan_keep_classes(_compiled(DOCUMENT).kernel, q, k)[1].grid == grid
    # the backward: each n-block's list of kept m-blocks, zeroed
    (_, lists), grid = keep_classes.workspaces(config, q, k, 64, 128, True)
    assert grid == (-(-sq // 64), kv_blocks, 2)
    assert lists.dtype == torch.int32 and lists.shape == (2 * kv_blocks, 2 + -(-sq // 64))
    assert not lists.any()


def test_more_tiles_than_the_pass_can_launch_are_refused_naming_q():
    config = _compiled(DOCUMENT).kernel.config
    q = torch.empty(1, 65536 * config.block_r, 1, 128, device="meta")
    k = torch.empty(1, 128, 1, 128, device="meta")
    with pytest.raises(ValueError, match=r"^q: .* at most 65535 q blocks"):
        keep_classes.workspaces(config, q, k, config.block_r, config.block_c, False)
    per_head = _compiled(
        DOCUMENT.replace(KEEP, "  keep       q_doc[b, q_idx] == kv_doc[b, kv_idx] or h == 0\n")
    ).kernel.config
    q = torch.empty(1024, 128, 128, 128, device="meta")
    with pytest.raises(ValueError, match=r"^q: batch 1024 x 128 heads"):
        keep_classes.workspaces(per_head, q, k, per_head.block_r, per_head.block_c, False)


def test_the_classing_kernel_runs_first_with_the_kernels_params(monkeypatch):
    """A document call on a stand-in device (tests/fake_cuda.py): <kernel>_keep_classes is
    launched before the attention kernel, on its grid of tiles, with the same params, whose
    inputs are the spec's two then the classes and the lists of kept blocks."""
    import fake_cuda
    from fadsl.targets.sm90.host.launch import INPUTS, INPUTS_OFFSET

    log, _ = fake_cuda.install(monkeypatch)
    made = recorded_workspaces(monkeypatch)
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
        ((_, (cls, lists)),) = made
        pointers = INPUTS.unpack_from(main.params, INPUTS_OFFSET)
        expected = (ids["q_doc"], ids["kv_doc"], cls, lists)
        assert pointers == (*(t.data_ptr() for t in expected), 0, 0, 0, 0)
    finally:
        fake_cuda.uninstall()


def _backward_source(text: str):
    from fadsl.codegen.render import render_backward

    c = _compiled(text)
    (source,) = [s for s in render_backward(c.kernel, c.target, "t.fa") if "bf16" in s.kernel_name]
    return c, source


def test_the_backward_source_carries_its_own_classing_kernel():
    c, source = _backward_source(DOCUMENT)
    assert f"{source.kernel_name}{keep_classes.CLASSES_SUFFIX}(" in source.text
    assert "bwd_keep_classes<Cfg>(P);" in source.text
    assert re.search(r"kClassesInput = 2;", source.text)
    from fadsl.targets.sm90.backward import host as bwd_host

    assert keep_classes.CLASSES_SUFFIX in bwd_host.suffixes(c.kernel)
    prefix, source = _backward_source((MODIFIERS / "prefix_lm.fa").read_text())
    assert keep_classes.CLASSES_SUFFIX not in source.text
    assert "kClassesInput = -1;" in source.text
    assert keep_classes.CLASSES_SUFFIX not in bwd_host.suffixes(prefix.kernel)


@pytest.mark.parametrize("sq, sk", [(1000, 1000), (100, 700), (700, 1)])
def test_the_backward_workspaces_are_per_n_block_at_its_tile(sq, sk):
    kernel = _compiled(DOCUMENT).kernel
    bwd = kernel.backward
    q = torch.empty(3, sq, 4, 128)
    k = torch.empty(3, sk, 2, 128)
    (classes, lists), grid = keep_classes.plan_backward_classes(kernel, q, k)
    m_blocks, n_blocks = -(-sq // bwd.block_m), -(-sk // bwd.block_n)
    assert bwd.block_m != kernel.config.block_r  # (its own geometry: B_r 80)
    assert grid == (m_blocks, n_blocks, 3)
    assert classes.numel() == 3 * m_blocks * n_blocks
    assert lists.shape == (3 * n_blocks, 2 + m_blocks) and not lists.any()


def test_more_key_blocks_than_the_backward_pass_can_launch_are_refused_naming_k():
    kernel = _compiled(DOCUMENT).kernel
    q = torch.empty(1, 128, 1, 128, device="meta")
    k = torch.empty(1, 65536 * kernel.backward.block_n, 1, 128, device="meta")
    with pytest.raises(ValueError, match=r"^k: .* at most 65535 kv blocks"):
        keep_classes.plan_backward_classes(kernel, q, k)


def test_the_backward_classes_its_tiles_before_its_main_kernel():
    """The backward of a document call (tests/fake_cuda.py's TMA stand-in): the classing
    kernel of the backward's source runs before the main kernel, on the backward's tiles,
    with the main kernel's params, whose inputs are the ids then the classes and the lists."""
    import fadsl.targets.sm90.host.tma as tma
    from fadsl.targets.sm90.backward import host as bwd_host

    kernel = _compiled(DOCUMENT).kernel
    original = tma._encode
    tma._encode = lambda *a: bytes(tma.MAP_BYTES)
    try:
        q, k, v = (torch.randn(2, 300, 4, 128, dtype=torch.bfloat16) for _ in "qkv")
        ids = (torch.zeros(2, 300, dtype=torch.int32), torch.zeros(2, 300, dtype=torch.int32))
        launches = []
        bwd_host.run(kernel, launches.append, q, k, v, q, torch.randn(2, 4, 300), q, None, 0.1, ids)
    finally:
        tma._encode = original
    names = [x.suffix for x in launches]
    assert names == ["_preprocess", keep_classes.CLASSES_SUFFIX, "", "_convert_dq"]
    classes, main = launches[1], launches[2]
    assert classes.params == main.params
    assert classes.grid == (-(-300 // kernel.backward.block_m), 3, 2)
    assert classes.block == (keep_classes.CLASSES_THREADS, 1, 1)
    pointers = bwd_host.MODIFIERS.unpack_from(main.params, bwd_host.MODIFIERS_OFFSET)[:8]
    assert pointers[:2] == tuple(t.data_ptr() for t in ids)
    assert all(pointers[2:4]) and pointers[4:] == (0, 0, 0, 0)


def test_classes_made_for_other_tiles_are_not_used_by_the_backward():
    """run's classes are used only at the tiles they were made for (a learnable variant's
    backward may take B_r 64 where a spec's takes 80): otherwise its own pass runs."""
    import fadsl.targets.sm90.host.tma as tma
    from fadsl.targets.sm90.backward import host as bwd_host

    kernel = _compiled(DOCUMENT).kernel
    bwd = kernel.backward
    original = tma._encode
    tma._encode = lambda *a: bytes(tma.MAP_BYTES)
    try:
        q, k, v = (torch.randn(1, 200, 2, 128, dtype=torch.bfloat16) for _ in "qkv")
        ids = (torch.zeros(1, 200, dtype=torch.int32), torch.zeros(1, 200, dtype=torch.int32))
        made = (torch.zeros(8, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.int32))
        other = 80 if bwd.block_m != 80 else 64  # (B_r 64 and 80: the target's two at 128)
        for tiles, classed in (((bwd.block_m, bwd.block_n), False), ((other, bwd.block_n), True)):
            launches = []
            lse = torch.randn(1, 2, 200)
            bwd_host.run(
                kernel, launches.append, q, k, v, q, lse, q, None, 0.1, ids, classes=(*tiles, *made)
            )
            names = [x.suffix for x in launches]
            assert (keep_classes.CLASSES_SUFFIX in names) == classed
            main = next(x for x in launches if x.suffix == "")
            pointers = bwd_host.MODIFIERS.unpack_from(main.params, bwd_host.MODIFIERS_OFFSET)[2:4]
            assert (pointers == tuple(t.data_ptr() for t in made)) == (not classed)
    finally:
        tma._encode = original


@pytest.mark.parametrize("heads_q, heads_kv", [(4, 4), (4, 2), (8, 1)])
def test_the_backward_pass_made_ahead_reads_the_sizes_each_call_gives_it(heads_q, heads_kv):
    """classes_only's params hold what the per-call pass's hold for the fields a keep may
    read (seqlen_q, seqlen_k, rows, m_blocks, heads_q, group: an expression's heads_kv is
    heads_q / group) and the same batch."""
    import fadsl.targets.sm90.host.tma as tma
    from fadsl.targets.sm90.backward import host as bwd_host

    kernel = _compiled(DOCUMENT).kernel
    original = tma._encode
    tma._encode = lambda *a: bytes(tma.MAP_BYTES)
    try:
        q = torch.randn(3, 200, heads_q, 128, dtype=torch.bfloat16)
        k, v = (torch.randn(3, 300, heads_kv, 128, dtype=torch.bfloat16) for _ in "kv")
        ids = (torch.zeros(3, 200, dtype=torch.int32), torch.zeros(3, 300, dtype=torch.int32))
        per_call, ahead = [], []
        lse = torch.randn(3, heads_q, 200)
        bwd_host.run(kernel, per_call.append, q, k, v, q, lse, q, None, 0.1, ids)
        bwd_host.classes_only(kernel, ahead.append, q, k, ids)
    finally:
        tma._encode = original
    ((made,),) = [[x for x in per_call if x.suffix == keep_classes.CLASSES_SUFFIX]]
    (alone,) = ahead
    ints = slice(4 * 128 + 6 * 8 + 6 * 8, 4 * 128 + 6 * 8 + 6 * 8 + 6 * 4)  # (up to group)
    assert alone.params[ints] == made.params[ints]
    assert alone.grid == made.grid
    batch = bwd_host.MODIFIERS.unpack_from(alone.params, bwd_host.MODIFIERS_OFFSET)[8]
    assert batch == bwd_host.MODIFIERS.unpack_from(made.params, bwd_host.MODIFIERS_OFFSET)[8] == 3
