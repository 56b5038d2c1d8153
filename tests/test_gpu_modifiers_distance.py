"""A score evaluated once a distance (split_distance_term; DistanceTable in
fadsl/sm90_modifiers.cuh) on the GPU: a relative position bias read from a table over the
distances -200 .. 200 (tests/specs/sm90/modifiers_relative_bias.fa, no mask: distances of both
signs, past the table's ends where its index clamps), forward (O and the LSE) and backward
(dQ, dK, dV, the LSE's gradient) against float64 with FlashAttention's rule; and the same with
other tiles (the forward's B_c 64 and the backward's B_r 80: other window counts and
offsets); odd lengths both ways (padding rows and keys, whose distances the table clamps),
GQA, both dtypes, outputs and gradients poisoned first. The T5 example takes the same path
(tests/test_gpu_modifiers_learnable.py, research/probes/modifier_speed.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT
from test_gpu_general import reference
from test_gpu_modifiers_backward import (
    DTYPES,
    SHAPES,
    check_rule,
    kernel,
    poison_allocator,
    reference_grads,
    run,
    tensors,
)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (compute capability 9.0)"),
]

RELATIVE = (ROOT / "tests" / "specs" / "sm90" / "modifiers_relative_bias.fa").read_text()
# other tiles: the forward's B_c 64 (5 windows a block), the backward's B_r 80 (6 windows)
OTHER_TILES = RELATIVE.replace(
    "  tile       B_r = 128, B_c = 128", "  tile       B_r = 128, B_c = 64", 1
).replace("    tile       B_r = 64, B_c = 128", "    tile       B_r = 80, B_c = 128", 1)
SPECS = {"relative": RELATIVE, "relative_other_tiles": OTHER_TILES}


def table(heads: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(heads + 401)
    return torch.randn(heads, 401, device="cuda", generator=g)


def bias_of(rel: torch.Tensor):
    def bias(i, j):
        return rel.double()[:, torch.clamp(i - j + 200, 0, 400)]

    return bias


def test_the_specs_take_the_distance_path():
    """The spec's score is classed as a term by distance, and both tile variants differ."""
    assert OTHER_TILES != RELATIVE
    for name, text in SPECS.items():
        assert kernel(name, text).config.modifiers.distance_term is not None, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", SPECS)
def test_forward_matches_float64(name, dtype, shape):
    kern = kernel(name, SPECS[name])
    b, sq, sk, hq, _ = shape
    q, k, v, _, _ = tensors(shape, DTYPES[dtype], seed=sum(shape) * 13 + len(name))
    rel = table(hq)
    scale = 128**-0.5
    poison_allocator(4 * q.numel() * 8)
    out, lse = kern(q, k, v, return_lse=True, rel=rel)
    truth, truth_lse = reference(q, k, v, scale, False, torch.float64, bias=bias_of(rel))
    own, _ = reference(q, k, v, scale, False, q.dtype, bias=bias_of(rel))
    err = (out.double() - truth.double()).abs().max().item()
    mine = (own.double() - truth.double()).abs().max().item()
    assert err <= 2 * mine + 1e-4, f"O: error {err:.3g} > 2 x PyTorch's {mine:.3g} + 1e-4"
    lse_err = (lse.double() - truth_lse.double()).abs().max().item()
    assert lse_err <= 1e-3, f"LSE: error {lse_err:.3g}"


@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", SPECS)
def test_gradients_match_float64(name, dtype, shape, with_lse):
    kern = kernel(name, SPECS[name])
    b, sq, sk, hq, _ = shape
    q, k, v, dout, dlse = tensors(shape, DTYPES[dtype], seed=sum(shape) * 17 + len(name))
    rel = table(hq)
    scale = 128**-0.5
    dlse = dlse if with_lse else None
    poison_allocator(4 * q.numel() * 8)
    ours = run(kern, q, k, v, dout, dlse, {"rel": rel})
    truth = reference_grads(q, k, v, dout, dlse, scale, False, torch.float64, bias_of(rel))
    own = reference_grads(q, k, v, dout, dlse, scale, False, q.dtype, bias_of(rel))
    for g, t, o, what in zip(ours, truth, own, ("dq", "dk", "dv")):
        assert g.dtype == q.dtype and g.shape == t.shape
        check_rule(g, t, o, what)
