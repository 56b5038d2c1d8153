"""plan_smem: liveness across the loop's back edge, regions, policies, limits."""

from dataclasses import replace

import pytest

from fadsl.errors import SpecError
from ir_reader import read_kernel
from passes_support import occupancy, plan_smem
from fadsl.pipeline import compile_source, front_end
from variants import EAGER_ORDER, KERNEL1, variant


def plan(text):
    return compile_source(text, "k.fa").kernel


def regions(kernel):
    return sorted(tuple(sorted(r.members)) for r in kernel.regions)


def test_kernel1_shares_q_with_o_and_k_with_v():
    k = plan(KERNEL1)
    assert k.smem_bytes == 32768
    assert regions(k) == [("K", "V"), ("O", "Q")]
    offsets = {b.name: b.offset for b in k.buffers}
    assert offsets["Q"] == offsets["O"] and offsets["K"] == offsets["V"] != offsets["Q"]
    why = " ".join(w for r in k.regions for w in r.reasons)
    assert "Q (live q_g2s..q_s2r) and O (live o_r2s..o_s2g) are never live at once" in why
    assert "both cta-scoped" in why


def test_aliasing_off_gives_every_tile_its_bytes():
    k = plan(variant(alias="off"))
    assert k.smem_bytes == 65536
    assert len(k.regions) == 4 and all(not r.reasons for r in k.regions)


def test_alias_any_shares_across_scopes():
    k = plan(variant(alias="any"))
    assert k.smem_bytes == 16384
    assert regions(k) == [("K", "O", "Q", "V")]


def test_eager_v_load_keeps_k_and_v_apart():
    """V is written while K is still live (before K -> rf): they cannot share."""
    k = plan(variant(order=EAGER_ORDER))
    assert k.smem_bytes == 49152
    assert ("K", "V") not in regions(k)


def test_liveness_wraps_the_back_edge():
    """Rotate the body so K is read first and written last: the value crosses the back edge,
    so K stays live from its write through the edge to its read, and into the loop from the
    prologue (the first read sees a value from before the loop), but not into the epilogue."""
    kernel = front_end(KERNEL1, "k.fa")
    body = kernel.mainloop
    rotated = replace(kernel, mainloop=(*body[1:], body[0]))
    steps = rotated.steps()
    live = {steps[i].op.spelling for i in occupancy(rotated)["K"]}
    assert live == {"q_g2s", "init", "q_s2r", "k_s2r", "k_g2s"}
    original = kernel.steps()
    assert {original[i].op.spelling for i in occupancy(kernel)["K"]} == {"k_g2s", "k_s2r"}


def test_smem_over_the_limit_is_a_located_error():
    """The register budget keeps specs under the SMEM limit today; the pass still checks."""
    kernel = front_end(variant(alias="off"), "k.fa")
    huge = replace(kernel, buffers=tuple(replace(b, rows=512) for b in kernel.buffers))
    with pytest.raises(SpecError) as err:
        plan_smem(huge)
    assert err.value.diagnostics[0].loc.line == 6  # the tile line
    assert "the SMEM plan needs 524288 bytes per CTA, over sm_80's limit of 166912" in str(
        err.value
    )


def test_loop_that_may_be_empty_keeps_prologue_values_live_into_the_epilogue():
    """Hand-written IR (a causal kernel's loop may run zero times): O, written in the
    prologue and read in the epilogue, is live while the prologue writes K, so the two
    never share bytes, even under smem_alias any. (plan_smem used to miss the
    prologue -> epilogue edge and put both at offset 0.)"""
    kernel = read_kernel(
        "kernel t target=sm_80 dtypes=bf16 head_dim=64 B_r=16 B_c=16 warps=1 mask=causal "
        "swizzle=none smem_alias=any\n"
        "buffer O 16x64x2B scope=warp unplanned\n"
        "buffer K 16x64x2B scope=warp unplanned\n"
        "prologue:\n"
        "  step init [write O/slice]\n"
        "  step k_g2s [write K/slice]\n"
        "mainloop:\n"
        "  step pv [write O/slice]\n"
        "epilogue:\n"
        "  step o_s2g [read O/slice]\n"
    )
    assert kernel.loop_may_be_empty
    planned = plan_smem(kernel)
    assert planned.buffer("O").offset != planned.buffer("K").offset
    assert plan_smem(replace(kernel, loop_may_be_empty=False)).buffer("K").offset == 0
