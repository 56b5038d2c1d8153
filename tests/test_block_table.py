"""FlexAttention's BlockMask as a spec's table (issue 41, item 3; fadsl/runtime/block_table.py,
examples/modifiers/block_sparse.fa): an input's block dimensions (``cdiv(seqlen_q, 128)``) and
the proof that ``q_idx // 128`` indexes them; block_table against the BlockMask's own lists
and against its mask function block by block; the example's keep evaluated at every score
equal to FlexAttention's rule (full blocks kept, partial ones masked by the mask function,
the rest skipped); the call's shape check naming the table."""

from __future__ import annotations

import itertools

import pytest
import torch

import fadsl
from conftest import ROOT
from modifier_eval import evaluate

from fadsl.errors import SpecError
from fadsl.ir.expr import Blocks, Dim
from fadsl.pipeline import compile_source
from fadsl.runtime.arguments import modifier_inputs

flex = pytest.importorskip("torch.nn.attention.flex_attention")
EXAMPLE = ROOT / "examples" / "modifiers" / "block_sparse.fa"


def with_lines(input_line: str, keep_line: str) -> str:
    text = EXAMPLE.read_text()
    head, rest = text.split("  input      blocks", 1)
    rest = rest.split("\n", 2)[2]  # (the input and keep lines)
    return f"{head}  input      {input_line}\n  keep       {keep_line}\n{rest}"


def test_the_example_declares_block_dimensions_and_reads_them_proven():
    kernel = compile_source(EXAMPLE.read_text(), str(EXAMPLE)).kernel
    (decl,) = kernel.config.modifiers.inputs
    assert decl.dims == (Dim.BATCH, Dim.HEADS, Blocks(Dim.SEQLEN_Q, 128), Blocks(Dim.SEQLEN_K, 128))
    assert decl.text() == "blocks : i32[batch, heads, cdiv(seqlen_q, 128), cdiv(seqlen_k, 128)]"
    assert kernel.config.modifiers.rule.by_pass  # (classed from the table, score by score)


@pytest.mark.parametrize(
    "input_line, keep_line, message",
    [
        (
            "blocks : i32[batch, heads, cdiv(seqlen_q, 128), cdiv(seqlen_k, 128)]",
            "blocks[b, h, q_idx // 64, kv_idx // 128] != 0",
            "index 3 of 'blocks' may fall outside [0, cdiv(seqlen_q, 128)): 'q_idx // 64' "
            "ranges over [0, cdiv(seqlen_q, 64) - 1]; index it by an index over seqlen_q "
            "floor-divided by 128, "
            "e.g. q_idx // 128",
        ),
        (
            "blocks : i32[batch, heads, cdiv(seqlen_q, 128), cdiv(seqlen_k, 128)]",
            "blocks[b, h, (q_idx + 1) // 128, kv_idx // 128] != 0",
            "index 3 of 'blocks' may fall outside [0, cdiv(seqlen_q, 128))",
        ),
        (
            "blocks : i32[batch, heads, cdiv(seqlen_k, 128), cdiv(seqlen_k, 128)]",
            "blocks[b, h, q_idx // 128, kv_idx // 128] != 0",
            "index 3 of 'blocks' may fall outside [0, cdiv(seqlen_k, 128))",
        ),
        (
            "blocks : i32[batch, heads, cdiv(seqlen_q, 0), cdiv(seqlen_k, 128)]",
            "blocks[b, h, q_idx // 128, kv_idx // 128] != 0",
            "a block of 0: a block is 1 to",
        ),
        (
            "blocks : i32[batch, heads, ceil(seqlen_q, 128), cdiv(seqlen_k, 128)]",
            "blocks[b, h, q_idx // 128, kv_idx // 128] != 0",
            "unknown dimension function 'ceil'",
        ),
        (
            "blocks : i32[batch, heads, cdiv(seqlen, 128), cdiv(seqlen_k, 128)]",
            "blocks[b, h, q_idx // 128, kv_idx // 128] != 0",
            "unknown dimension 'seqlen'",
        ),
    ],
    ids=["a finer block", "one past", "the other size", "a zero block", "not cdiv", "not a size"],
)
def test_block_dimensions_are_refused_where_they_may_not_hold(input_line, keep_line, message):
    with pytest.raises(SpecError) as err:
        compile_source(with_lines(input_line, keep_line), "<spec>")
    assert message in str(err.value), str(err.value)


def dense_blocks(mask_mod, batch, heads, sq, sk, block=128):
    """FlexAttention's class of each block from the mask function at every score, as
    create_block_mask decides them: 2 where every score of the block is kept, 1 where some
    are, 0 where none, a score past the lengths counted as masked (so a block that passes them
    is never full)."""
    q_blocks, kv_blocks = -(-sq // block), -(-sk // block)
    rows = torch.arange(q_blocks * block).view(1, 1, -1, 1)
    cols = torch.arange(kv_blocks * block).view(1, 1, 1, -1)
    b = torch.arange(batch).view(-1, 1, 1, 1)
    h = torch.arange(heads).view(1, -1, 1, 1)
    kept = mask_mod(b, h, rows, cols) & (rows < sq) & (cols < sk)
    kept = kept.expand(batch, heads, -1, -1).reshape(
        batch, heads, q_blocks, block, kv_blocks, block
    )
    every, some = kept.all(dim=5).all(dim=3), kept.any(dim=5).any(dim=3)
    return torch.where(every, 2, torch.where(some, 1, 0)).int()


MASKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "window 150": lambda b, h, q, kv: (q >= kv) & (q - kv <= 150),
    "per head": lambda b, h, q, kv: (q >= kv) | (h == 1),
}


@pytest.mark.parametrize("name", list(MASKS))
def test_block_table_is_the_blockmasks_classes(name):
    mask_mod = MASKS[name]
    batch, heads, sq, sk = 2, 2, 300, 520
    bm = flex.create_block_mask(mask_mod, batch, heads, sq, sk, device="cpu")
    table = fadsl.block_table(bm)
    assert table.dtype == torch.int32 and table.is_contiguous()
    expected = dense_blocks(mask_mod, batch, heads, sq, sk)
    assert torch.equal(table, expected)


def test_a_broadcast_blockmask_is_expanded_to_the_calls_batch_and_heads():
    bm = flex.create_block_mask(MASKS["causal"], 1, 1, 300, 300, device="cpu")
    table = fadsl.block_table(bm, batch=3, heads=4)
    assert table.shape == (3, 4, 3, 3) and table.is_contiguous()
    assert torch.equal(table, fadsl.block_table(bm).expand(3, 4, 3, 3))


def test_a_blockmask_of_other_blocks_or_not_a_blockmask_is_refused_by_name():
    bm = flex.create_block_mask(MASKS["causal"], 1, 1, 300, 300, device="cpu", BLOCK_SIZE=64)
    with pytest.raises(ValueError, match="block_mask has blocks of 64 x 64"):
        fadsl.block_table(bm)
    assert fadsl.block_table(bm, block_size=(64, 64)).shape == (1, 1, 5, 5)
    causal = flex.create_block_mask(MASKS["causal"], 2, 1, 300, 300, device="cpu")
    with pytest.raises(ValueError, match="block_mask has batch 2, neither 1 .* nor the call's 3"):
        fadsl.block_table(causal, batch=3)
    with pytest.raises(TypeError, match="block_mask must be a FlexAttention BlockMask"):
        fadsl.block_table(torch.ones(1, 1, 3, 3))


def test_the_examples_keep_is_flexattentions_rule_at_every_score():
    """At every score: kept where the block is full, where it is partial and the mask function
    (causal, top-left) keeps it, never where the BlockMask skips the block; a BlockMask built
    from explicit lists (partial, full and skipped blocks in any order)."""
    kernel = compile_source(EXAMPLE.read_text(), str(EXAMPLE)).kernel
    keep = kernel.config.modifiers.keep
    sq = sk = 260
    counts = torch.tensor([[[1, 2, 1]]], dtype=torch.int32)
    indices = torch.tensor([[[[2, 0, 0], [0, 2, 0], [1, 0, 0]]]], dtype=torch.int32)
    full_counts = torch.tensor([[[0, 1, 1]]], dtype=torch.int32)
    full_indices = torch.tensor([[[[0, 0, 0], [1, 0, 0], [2, 0, 0]]]], dtype=torch.int32)
    bm = flex.BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, seq_lengths=(sq, sk)
    )
    table = fadsl.block_table(bm)
    assert table[0, 0].tolist() == [[0, 0, 1], [1, 2, 1], [0, 1, 2]]
    for q_idx, kv_idx in itertools.product(range(0, sq, 7), range(0, sk, 5)):
        cls = table[0, 0, q_idx // 128, kv_idx // 128].item()
        expected = cls == 2 or (cls == 1 and kv_idx <= q_idx)
        env = {"b": 0, "h": 0, "q_idx": q_idx, "kv_idx": kv_idx}
        got = evaluate(keep, env, {"blocks": lambda b, h, i, j: table[b, h, i, j].item()})
        assert got == expected, (q_idx, kv_idx)


def test_the_calls_table_is_checked_by_shape_and_named():
    kern = fadsl.load(EXAMPLE.read_text(), verbose=False)
    decls = kern.config.modifiers.inputs
    q = torch.zeros(2, 300, 4, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 520, 2, 128, dtype=torch.bfloat16)
    good = torch.zeros(2, 4, 3, 5, dtype=torch.int32)
    (found,) = modifier_inputs(decls, {"blocks": good}, q, k, "block_sparse")
    assert found is good
    with pytest.raises(ValueError, match=r"blocks must have shape \(2, 4, 3, 5\)"):
        modifier_inputs(decls, {"blocks": torch.zeros(2, 4, 3, 4, dtype=torch.int32)}, q, k, "x")
