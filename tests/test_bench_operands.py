"""fadsl bench's operands (fadsl/tools/bench.py), on the CPU: the inputs every contender of a
row reads, 16-bit or 8-bit (quantized, with descales, and the references given the
dequantized values), and the error bound a kernel must meet before it is timed."""

from __future__ import annotations

import math

import pytest
import torch

from fadsl.tools import bench

SHAPE = (2, 40, 4, 64)


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_16bit_operands_are_what_every_contender_reads(name, dtype):
    ops = bench.operands(name, SHAPE, device="cpu")
    assert ops.keywords == {} and ops.views is ops.args and ops.values() is ops.args
    assert all(t.dtype == dtype and t.shape == SHAPE for t in ops.args)


@pytest.mark.parametrize(
    "name, dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)]
)
def test_8bit_operands_carry_descales_and_the_references_read_their_values(name, dtype):
    torch.manual_seed(0)
    ops = bench.operands(name, SHAPE, device="cpu")
    assert all(t.dtype == dtype and t.shape == SHAPE for t in ops.args)
    assert sorted(ops.keywords) == ["k_descale", "q_descale", "v_descale"]
    for (n, t), values, view in zip(zip("qkv", ops.args), ops.values(), ops.views):
        descale = ops.keywords[f"{n}_descale"]
        assert descale.shape == SHAPE[::2] and descale.dtype == torch.float32
        assert torch.equal(values, t.float() * descale[:, None, :, None])
        # the references' bf16 copy: the dequantized values rounded once (2^-8 relative)
        assert view.dtype == torch.bfloat16
        assert ((view.float() - values).abs() <= values.abs() * 2**-8).all()
        # quantize's per-(batch, head) scale: each group's largest value is the format's
        top = t.float().abs().amax(dim=(1, 3))
        assert torch.equal(top, torch.full_like(top, 448.0 if name == "e4m3" else 57344.0))


def _attention_with_p_in_e4m3(q, k, v, scale: float, rows: int):
    """What the 8-bit kernel computes for batch 0's first ``rows`` queries, every head, in
    float64 but for its roundings: P = 2^(s - m + 8) rounded to e4m3, O = P v / sum(P) in
    bf16 (research/fp8-forward.md §3.5 and §4)."""
    qs, ks, vs = (t[0].transpose(0, 1).double() for t in (q[:, :rows], k, v))
    s = torch.matmul(qs, ks.transpose(1, 2)) * scale
    p = torch.exp(s - s.amax(dim=-1, keepdim=True)) * 256
    p = p.to(torch.float8_e4m3fn).double()
    out = torch.matmul(p, vs) / torch.exp(s - s.amax(dim=-1, keepdim=True)).sum(-1, True) / 256
    return out.to(torch.bfloat16).float().transpose(0, 1)


def test_the_8bit_bound_holds_for_the_kernels_roundings_and_not_for_a_wrong_output():
    """§4's bound (research/fp8-forward.md) from the operands' own v: an output computed with
    the kernel's roundings (P in e4m3, O in bf16) meets it; one that read another head's
    values, or skipped v's descale, does not."""
    torch.manual_seed(1)
    ops = bench.operands("e4m3", SHAPE, device="cpu")
    scale = 1 / math.sqrt(SHAPE[-1])
    values = ops.values()
    ref = bench._reference_rows(*values, scale, 16, torch.float32)
    bound = bench.error_bound("e4m3", ops, values[2], ref, scale, 16, False)
    assert bound == pytest.approx(
        2**-4 * values[2].abs().max().item() * 1.05 + 2**-7 * ref.abs().max().item()
    )
    rounded = _attention_with_p_in_e4m3(*values, scale, 16)
    assert 0 < (rounded - ref).abs().max().item() <= bound
    q, k, v = values
    wrong_head = _attention_with_p_in_e4m3(q, k, v.roll(1, dims=2), scale, 16)
    assert (wrong_head - ref).abs().max().item() > bound
    no_descale = _attention_with_p_in_e4m3(q, k, ops.args[2].float(), scale, 16)
    assert (no_descale - ref).abs().max().item() > bound


def test_the_16bit_bound_is_twice_the_references_own_rounding():
    torch.manual_seed(2)
    ops = bench.operands("bf16", SHAPE, device="cpu")
    scale = 1 / math.sqrt(SHAPE[-1])
    ref = bench._reference_rows(*ops.values(), scale, 16, torch.float32, causal=True)
    low = bench._reference_rows(*ops.args, scale, 16, torch.bfloat16, causal=True).float()
    bound = bench.error_bound("bf16", ops, ops.args[2], ref, scale, 16, True)
    assert bound == pytest.approx(2 * (low - ref).abs().max().item() + 1e-3)
