"""FlexAttention's BlockMask through examples/modifiers/block_sparse.fa on the GPU (issue 41,
item 3): ``fadsl.block_table(block_mask)`` passed as the spec's ``blocks`` gives, forward and
backward, FlashAttention's rule against float64 attention under FlexAttention's semantics
(a full block kept whole, a partial one masked by the causal mask function, every other block
skipped), for BlockMasks from create_block_mask (causal, a window of blocks, per head) and
from explicit lists (skipped blocks between kept ones, rows that keep no block), GQA, odd
lengths; with the tiles classed per call and made ahead (``keep_classes``); and beside
flex_attention's own output on the same BlockMask. CPU twin: tests/test_block_table.py."""

from __future__ import annotations

import pytest
import torch

import fadsl
from conftest import ROOT
from test_gpu_general import reference
from test_gpu_modifiers import check
from test_gpu_modifiers_backward import check_rule, reference_grads

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]
flex = pytest.importorskip("torch.nn.attention.flex_attention")
SPEC = (ROOT / "examples" / "modifiers" / "block_sparse.fa").read_text()
_loaded: list = []


def kernel():
    if not _loaded:
        _loaded.append(fadsl.load(SPEC, verbose=False))
    return _loaded[0]


def causal(b, h, q, kv):
    return q >= kv


def block_window(b, h, q, kv):  # the two latest 128-key blocks, causal
    return (q >= kv) & (q // 128 - kv // 128 <= 1)


def per_head(b, h, q, kv):  # head 1 sees everything, the others causally
    return (q >= kv) | (h == 1)


def listed(batch, heads, sq, sk, seed):
    """A BlockMask from explicit lists: random blocks partial, full or skipped, one q block
    keeping none."""
    gen = torch.Generator().manual_seed(seed)
    q_blocks, kv_blocks = -(-sq // 128), -(-sk // 128)
    classes = torch.randint(0, 3, (batch, heads, q_blocks, kv_blocks), generator=gen)
    classes[:, :, 0] = 0  # (the first q block keeps no key: its rows give 0, LSE -inf)

    def lists(value):
        hit = classes == value
        counts = hit.sum(-1).int()
        order = torch.argsort((~hit).int(), dim=-1, stable=True).int()
        return counts.cuda(), order.cuda()

    (pc, pi), (fc, fi) = lists(1), lists(2)
    return flex.BlockMask.from_kv_blocks(pc, pi, fc, fi, seq_lengths=(sq, sk))


def keep_of(table, sq, sk):
    """FlexAttention's rule at every score, (batch, heads, sq, sk): full, or partial and
    causal (top-left)."""
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    cls = table[:, :, i // 128, j // 128]
    return (cls == 2) | ((cls == 1) & (j <= i))


CASES = [
    ("causal", 2, 4, 2, 300, 300),
    ("block window", 1, 4, 4, 700, 700),
    ("per head", 2, 4, 2, 257, 520),
    ("listed", 2, 4, 2, 500, 391),
]


def block_mask(name, batch, heads, sq, sk):
    if name == "listed":
        return listed(batch, heads, sq, sk, seed=sq + sk)
    fn = {"causal": causal, "block window": block_window, "per head": per_head}[name]
    return flex.create_block_mask(fn, 1 if name != "per head" else batch, heads, sq, sk)


def inputs(batch, heads, heads_kv, sq, sk, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, heads, 128, device="cuda", generator=gen).to(dtype)
    k = torch.randn(batch, sk, heads_kv, 128, device="cuda", generator=gen).to(dtype)
    v = torch.randn(batch, sk, heads_kv, 128, device="cuda", generator=gen).to(dtype)
    dout = torch.randn(batch, sq, heads, 128, device="cuda", generator=gen).to(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("made_ahead", [False, True], ids=["classed per call", "made ahead"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_blockmasks_attention_and_gradients_hold_the_rule(case, made_ahead):
    name, batch, heads, heads_kv, sq, sk = case
    kern = kernel()
    bm = block_mask(name, batch, heads, sq, sk)
    table = fadsl.block_table(bm, batch=batch, heads=heads)
    q, k, v, dout = inputs(batch, heads, heads_kv, sq, sk, seed=sq * 3 + sk)
    named = {"blocks": table}
    if made_ahead:
        named["keep_classes"] = kern.keep_classes(q, k, blocks=table)
    keep = keep_of(table, sq, sk)
    scale = 128**-0.5
    with torch.no_grad():
        out = torch.full_like(q, float("nan"))
        out, lse = kern(q, k, v, scale, out=out, return_lse=True, **named)
    ref, ref_lse = reference(q, k, v, scale, False, torch.float64, keep=keep)
    low, _ = reference(q, k, v, scale, False, q.dtype, keep=keep)
    check(out, lse, ref, ref_lse, low, name)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(kern(*leaves, scale, **named), leaves, dout)
    truth = reference_grads(q, k, v, dout, None, scale, False, torch.float64, keep=keep)
    own = reference_grads(q, k, v, dout, None, scale, False, q.dtype, keep=keep)
    for g, t, o, what in zip(got, truth, own, ("dq", "dk", "dv")):
        check_rule(g, t, o, f"{name} {what}")


def test_beside_flex_attention_on_the_same_blockmask():
    batch, heads, sq = 2, 4, 1000
    kern = kernel()
    bm = flex.create_block_mask(block_window, 1, 1, sq, sq)
    q, k, v, _ = inputs(batch, heads, heads, sq, sq, seed=7)
    ours = kern(q, k, v, blocks=fadsl.block_table(bm, batch=batch, heads=heads))
    theirs = flex.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=bm).transpose(
        1, 2
    )
    assert (ours.float() - theirs.float()).abs().max().item() < 2e-2
