"""fadsl.attention's choice of spec (Target.shipped), without a GPU: which example each GPU,
head_dim and mask get, that each shipped example is what the table says, and the errors that
name the argument."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fadsl
from fadsl import targets
from fadsl.pipeline import compile_file
from fadsl.runtime.dispatch import shipped_spec

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [
    (name, key, spec) for name in targets.names() for key, spec in targets.get(name).shipped.items()
] + [
    (name, key, spec)
    for name in targets.names()
    for key, (_, spec) in targets.get(name).shipped_short.items()
]


@pytest.mark.parametrize("target, key, spec", SHIPPED, ids=[f"{s}" for _, _, s in SHIPPED])
def test_each_shipped_spec_is_an_example_of_its_target_head_dim_and_mask(target, key, spec):
    config = compile_file(str((ROOT / "examples" / f"{spec}.fa").relative_to(ROOT))).kernel.config
    head_dim, causal = key
    assert (config.target, config.head_dim, config.mask.value) == (
        target,
        head_dim,
        "causal" if causal else "none",
    )


SM90_SHIPPED = sorted(targets.get("sm_90a").shipped.items()) + sorted(
    (key, spec) for key, (_, spec) in targets.get("sm_90a").shipped_short.items()
)


@pytest.mark.parametrize("key, spec", SM90_SHIPPED, ids=[s for _, s in SM90_SHIPPED])
def test_every_shipped_sm90_spec_trains(key, spec):
    """fadsl.attention on Hopper has gradients at every head_dim it ships (head_dim 256's
    examples run the split backward, sm90_bwd_split.cuh): each shipped spec has a backward
    block for its head_dim."""
    kernel = compile_file(str((ROOT / "examples" / f"{spec}.fa").relative_to(ROOT))).kernel
    assert kernel.backward is not None, spec
    assert key[0] == kernel.config.head_dim
    assert (kernel.backward.block_n == 80) == (kernel.config.head_dim == 256)


@pytest.mark.parametrize(
    "capability, head_dim, causal, spec",
    [
        ((9, 0), 64, False, "fa3_hdim64"),
        ((9, 0), 64, True, "fa3_hdim64_causal"),
        ((9, 0), 128, False, "fa3_hopper"),
        ((9, 0), 128, True, "fa3_causal"),
        ((9, 0), 256, False, "fa3_hdim256"),
        ((9, 0), 256, True, "fa3_hdim256_causal"),
        ((8, 0), 128, False, "fa2_pipelined"),  # A100: the sm_80 kernels
        ((8, 9), 128, True, "fa2_causal"),
        ((10, 0), 256, False, "fa2_hdim256"),  # newer GPUs run sm_80's code, not sm_90a's
    ],
)
def test_the_gpu_head_dim_and_mask_pick_the_spec(capability, head_dim, causal, spec):
    assert shipped_spec(capability, head_dim, causal) == spec


@pytest.mark.parametrize(
    "capability, head_dim, causal, seqlen_q, spec",
    [
        ((9, 0), 64, True, 1, "fa3_hdim64_causal_short"),
        ((9, 0), 64, True, 2048, "fa3_hdim64_causal_short"),
        ((9, 0), 64, True, 2049, "fa3_hdim64_causal"),
        ((9, 0), 64, True, None, "fa3_hdim64_causal"),  # no length: the long queries' spec
        ((9, 0), 64, False, 1024, "fa3_hdim64"),  # no short spec for it
        ((9, 0), 128, True, 1024, "fa3_causal"),
        ((8, 0), 128, True, 1024, "fa2_causal"),
    ],
)
def test_short_queries_pick_the_short_spec_where_one_ships(
    capability, head_dim, causal, seqlen_q, spec
):
    assert shipped_spec(capability, head_dim, causal, seqlen_q) == spec


def test_the_short_spec_is_the_long_ones_kernel_but_its_tile_and_schedule():
    """fa3_hdim64_causal_short differs from fa3_hdim64_causal only in the lines that fit short
    queries (tile, warpgroups, registers, scheduler): the same dtypes, mask, paths and
    backward block, so a call's gradients do not depend on which one ran."""
    long_, short = (
        compile_file(f"examples/{name}.fa").kernel
        for name in ("fa3_hdim64_causal", "fa3_hdim64_causal_short")
    )
    assert short.config.block_r < long_.config.block_r
    for field in ("dtypes", "head_dim", "mask", "window", "modifiers", "out_dtype"):
        assert getattr(short.config, field) == getattr(long_.config, field), field
    blocks = [
        (ROOT / "examples" / f"{name}.fa").read_text().split("backward {", 1)[1]
        for name in ("fa3_hdim64_causal", "fa3_hdim64_causal_short")
    ]
    assert blocks[0] == blocks[1]
    assert short.backward is not None


def test_what_no_spec_covers_is_named():
    with pytest.raises(ValueError, match=r"q.shape\[-1\] \(head_dim\) = 96 with causal=False"):
        shipped_spec((9, 0), 96, False)
    with pytest.raises(ValueError, match=r"\(head_dim 128 with causal=True\)"):
        shipped_spec((8, 0), 64, True)  # sm_80 ships no causal head_dim 64 kernel
    with pytest.raises(ValueError, match=r"compute capability 7.5; fadsl's kernels need 8.0"):
        shipped_spec((7, 5), 128, False)


def test_arguments_are_checked_by_name_before_any_gpu_is_asked():
    q = torch.zeros(1, 8, 2, 64)
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor, got list"):
        fadsl.attention([1, 2], q, q)
    with pytest.raises(TypeError, match=r"causal must be True or False, got 1"):
        fadsl.attention(q, q, q, causal=1)
    with pytest.raises(ValueError, match=r"q must be 4-d .* got shape \(8, 2, 64\)"):
        fadsl.attention(q[0], q, q)
    with pytest.raises(ValueError, match=r"q must be on a CUDA device, got cpu"):
        fadsl.attention(q, q, q)
