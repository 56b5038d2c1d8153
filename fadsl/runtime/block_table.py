"""FlexAttention's BlockMask as a table a spec reads (issue 41, item 3).

A BlockMask (torch.nn.attention.flex_attention) lists, for each (batch, head, q block), the kv
blocks flex_attention visits: ``kv_indices[..., :kv_num_blocks]`` the partial ones, where the
mask function applies, and ``full_kv_indices[..., :full_kv_num_blocks]`` the full ones, where
it does not; every other block is skipped. ``block_table`` writes that as one int32 entry per
block, (batch, heads, q blocks, kv blocks): 0 skipped, 1 partial, 2 full, which a spec declares
as an input with block dimensions and reads in its `keep`
(examples/modifiers/block_sparse.fa):

    input  blocks : i32[batch, heads, cdiv(seqlen_q, 128), cdiv(seqlen_k, 128)]
    keep   blocks[b, h, q_idx // 128, kv_idx // 128] + where(kv_idx <= q_idx, 1, 0) >= 2

The spec's own tile classes then come from the table (``kern.keep_classes``, or each call's
pass), exact at the kernel's tiles whatever their size: a block is never assumed full or
empty because the BlockMask says so, only because the table, read score by score, does.
"""

from __future__ import annotations

SKIPPED, PARTIAL, FULL = 0, 1, 2


def block_table(block_mask, block_size=(128, 128), batch: int | None = None, heads=None):
    """The int32 table (batch, heads, q blocks, kv blocks) of ``block_mask`` (a FlexAttention
    BlockMask, or anything with its kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices, BLOCK_SIZE and seq_lengths), on its device: 0 where it skips a block, 1
    where the block is partial, 2 where full. ``block_size``: the spec's (q, kv) block, which
    the BlockMask's must be; ``batch``, ``heads``: the call's, where the BlockMask broadcasts
    over them (its batch or heads 1), made contiguous."""
    import torch

    fields = ("kv_num_blocks", "kv_indices", "BLOCK_SIZE", "seq_lengths")
    if any(not hasattr(block_mask, f) for f in fields):
        raise TypeError(
            "block_mask must be a FlexAttention BlockMask (torch.nn.attention.flex_attention), "
            f"got {type(block_mask).__name__}"
        )
    size = block_mask.BLOCK_SIZE
    size = (size, size) if isinstance(size, int) else tuple(size)
    if size != tuple(block_size):
        raise ValueError(
            f"block_mask has blocks of {size[0]} x {size[1]} (BLOCK_SIZE) but the spec's table "
            f"reads blocks of {block_size[0]} x {block_size[1]}: make the BlockMask with "
            f"BLOCK_SIZE={tuple(block_size)}"
        )
    counts, indices = block_mask.kv_num_blocks, block_mask.kv_indices
    if counts.dim() != 3 or indices.dim() != 4:
        raise ValueError(
            "block_mask's kv_num_blocks must be (batch, heads, q blocks) and kv_indices (batch, "
            f"heads, q blocks, kv blocks), got {tuple(counts.shape)} and {tuple(indices.shape)}"
        )
    q_len, kv_len = (int(n) for n in block_mask.seq_lengths)
    q_blocks, kv_blocks = -(-q_len // size[0]), -(-kv_len // size[1])
    b, h, rows = counts.shape
    if rows != q_blocks:
        raise ValueError(
            f"block_mask has {rows} q blocks for {q_len} queries of {size[0]} (seq_lengths)"
        )
    # one more column takes the slots past each row's count (never a block)
    table = torch.zeros((b, h, q_blocks, kv_blocks + 1), dtype=torch.int32, device=counts.device)
    lists = [(counts, indices, PARTIAL)]
    if getattr(block_mask, "full_kv_num_blocks", None) is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, FULL))
    for count, index, value in lists:  # (full last: a block in both lists is full)
        slots = torch.arange(index.shape[-1], device=index.device)
        listed = slots < count[..., None]
        index = index.long()
        listed &= (index >= 0) & (index < kv_blocks)  # (never a block: a malformed list's)
        columns = torch.where(listed, index, kv_blocks)
        table.scatter_(3, columns, value)
    table = table[..., :kv_blocks]
    for name, given, have in (("batch", batch, b), ("heads", heads, h)):
        if given is not None and have not in (1, given):
            raise ValueError(
                f"block_mask has {name} {have}, neither 1 (broadcast) nor the call's {given}"
            )
    table = table.expand(batch or b, heads or h, q_blocks, kv_blocks)
    return table.contiguous()
