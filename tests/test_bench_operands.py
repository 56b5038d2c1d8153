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


def test_the_8bit_bound_is_the_fp8_arguments_and_a_correct_output_meets_it():
    """§4's bound (research/fp8-forward.md) from the operands' own v; the float32 attention
    of the dequantized values, rounded to bf16 as a kernel's O is, meets it."""
    torch.manual_seed(1)
    ops = bench.operands("e4m3", SHAPE, device="cpu")
    scale = 1 / math.sqrt(SHAPE[-1])
    ref = bench._reference_rows(*ops.values(), scale, 16, torch.float32)
    bound = bench.error_bound("e4m3", ops, ref, scale, 16, False)
    v_max = ops.values()[2].abs().max().item()
    assert bound == pytest.approx(2**-4 * v_max * 1.05 + 2**-7 * ref.abs().max().item())
    bf16_out = ref.to(torch.bfloat16).float()  # what a kernel writing O in bf16 could give
    assert (bf16_out - ref).abs().max().item() <= bound


def test_the_16bit_bound_is_twice_the_references_own_rounding():
    torch.manual_seed(2)
    ops = bench.operands("bf16", SHAPE, device="cpu")
    scale = 1 / math.sqrt(SHAPE[-1])
    ref = bench._reference_rows(*ops.values(), scale, 16, torch.float32, causal=True)
    low = bench._reference_rows(*ops.args, scale, 16, torch.bfloat16, causal=True).float()
    bound = bench.error_bound("bf16", ops, ref, scale, 16, True)
    assert bound == pytest.approx(2 * (low - ref).abs().max().item() + 1e-3)
