"""A score evaluated once a distance (split_distance_term; DistanceTable in
fadsl/sm90_modifiers.cuh) on the GPU: a relative position bias read from a table over the
distances -1200 .. 1200 (tests/specs/sm90/modifiers_relative_bias.fa, no mask: distances of
both signs, each of the shapes' its own entry, so that a score handed another distance's value
shows), forward (O and the LSE) and backward (dQ, dK, dV, the LSE's gradient) against float64
with FlashAttention's rule; the same with other tiles (the forward's B_c 64 and the backward's
B_r 80: other window counts and offsets); and a table indexed by the distance itself,
`rel[h, max(q_idx - kv_idx, 0)]` of seqlen_q entries a head, in bounds only because the kernel
evaluates f at distances clamped into the real scores' range (a padding row's distance would
read past the table: compute-sanitizer's memcheck sees it). Odd lengths both ways (padding
rows and keys), GQA, both dtypes, outputs and gradients poisoned first. The T5 example takes
the same path (tests/test_gpu_modifiers_learnable.py, research/probes/modifier_speed.py)."""

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
# the table by the distance alone, seqlen_q entries a head
BY_ROWS = RELATIVE.replace(
    "  input      rel : f32[heads, 2401]", "  input      rel : f32[heads, seqlen_q]", 1
).replace("rel[h, clamp(q_idx - kv_idx + 1200, 0, 2400)]", "rel[h, max(q_idx - kv_idx, 0)]", 1)
SPECS = {"relative": RELATIVE, "relative_other_tiles": OTHER_TILES, "by_rows": BY_ROWS}


def table(name: str, heads: int, seqlen_q: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(heads + 401)
    size = seqlen_q if name == "by_rows" else 2401
    return torch.randn(heads, size, device="cuda", generator=g)


def bias_of(name: str, rel: torch.Tensor):
    def bias(i, j):
        if name == "by_rows":
            return rel.double()[:, torch.clamp(i - j, min=0)]
        return rel.double()[:, torch.clamp(i - j + 1200, 0, 2400)]

    return bias


def test_the_specs_take_the_distance_path():
    """The spec's score is classed as a term by distance, and the variants differ."""
    assert len({RELATIVE, OTHER_TILES, BY_ROWS}) == 3
    for name, text in SPECS.items():
        assert kernel(name, text).config.modifiers.distance_term is not None, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", SPECS)
def test_forward_matches_float64(name, dtype, shape):
    kern = kernel(name, SPECS[name])
    b, sq, sk, hq, _ = shape
    q, k, v, _, _ = tensors(shape, DTYPES[dtype], seed=sum(shape) * 13 + len(name))
    rel = table(name, hq, sq)
    scale = 128**-0.5
    poison_allocator(4 * q.numel() * 8)
    out, lse = kern(q, k, v, return_lse=True, rel=rel)
    bias = bias_of(name, rel)
    truth, truth_lse = reference(q, k, v, scale, False, torch.float64, bias=bias)
    own, _ = reference(q, k, v, scale, False, q.dtype, bias=bias)
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
    rel = table(name, hq, sq)
    scale = 128**-0.5
    dlse = dlse if with_lse else None
    poison_allocator(4 * q.numel() * 8)
    ours = run(kern, q, k, v, dout, dlse, {"rel": rel})
    bias = bias_of(name, rel)
    truth = reference_grads(q, k, v, dout, dlse, scale, False, torch.float64, bias)
    own = reference_grads(q, k, v, dout, dlse, scale, False, q.dtype, bias)
    for g, t, o, what in zip(ours, truth, own, ("dq", "dk", "dv")):
        assert g.dtype == q.dtype and g.shape == t.shape
        check_rule(g, t, o, what)
