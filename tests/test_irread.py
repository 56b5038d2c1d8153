"""The IR reader: printed IR reads back to the same IR, and pass tests start from IR by hand."""

from __future__ import annotations

import pytest

from conftest import ROOT
from ir_reader import IRSyntaxError, read_kernel
from passes_support import insert_barriers
from passes_support import plan_smem
from passes_support import VerifyError, verify
from fadsl.pipeline import compile_file
from fadsl.ir.printer import format_kernel
from fadsl.targets.sm80 import caps as sm80


def test_print_read_print_is_identical_after_every_pass(example):
    compiled = compile_file(example.relative_to(ROOT))
    stages = [stage for variant in compiled.variants for stage in variant.stages]
    for stage, kernel in stages:  # `cluster 2`: its variant's too
        text = format_kernel(kernel)
        assert format_kernel(read_kernel(text)) == text, stage


def test_passes_from_the_read_schedule_give_the_pipelines_result(example):
    compiled = compile_file(example.relative_to(ROOT))
    schedule = read_kernel(format_kernel(compiled.stages[0][1]))
    target = compiled.target
    final = schedule
    for _, run in target.passes:
        final = run(final, target)
    assert format_kernel(final) == format_kernel(compiled.kernel)
    assert final.loop_may_be_empty == compiled.kernel.loop_may_be_empty


@pytest.mark.parametrize(
    "spec", ["tests/specs/sm90/fa3_q_ring.fa", "tests/specs/bench/fa3_hdim64_q2_split.fa"]
)
def test_the_q_ring_and_the_split_tail_read_back(spec):
    """q_slots 2 (its ring-of-tiles barriers), alone and with `tail split_kv`, prints and
    reads back after every pass."""
    for stage, kernel in compile_file(spec).stages:
        text = format_kernel(kernel)
        read = read_kernel(text)
        assert format_kernel(read) == text, stage
        assert read.config.ext.q_slots == 2
        assert read.config.ext.split_kv is ("split" in spec)


HEAD = (
    "kernel tiny target=sm_80 dtypes=bf16 head_dim=64 B_r=32 B_c=32 warps={warps} mask=none "
    "swizzle=none smem_alias={alias}\n"
)

# Two CTA-shared tiles, each copied by every warp (its slice) and read whole by every warp.
KV_LOOP = """\
buffer K 32x64x2B scope=cta unplanned
buffer V 32x64x2B scope=cta unplanned
prologue:
mainloop:
  step k_g2s async [write K/slice]
  step qk [read K/whole]
  step v_g2s async [write V/slice]
  step pv [read V/whole]
epilogue:
"""


def test_plan_and_barriers_from_hand_written_ir():
    """K and V never live at once share one region; then every RAW needs the cp.async wait
    and a CTA barrier, and every WAR through the shared bytes a CTA barrier (the back edge
    included)."""
    kernel = insert_barriers(plan_smem(read_kernel(HEAD.format(warps=2, alias="scoped") + KV_LOOP)))
    assert format_kernel(kernel) == HEAD.format(warps=2, alias="scoped") + """\
buffer K 32x64x2B scope=cta offset=0 region=0
buffer V 32x64x2B scope=cta offset=0 region=0
region 0 offset=0 bytes=4096 members=K,V
  why: K (live k_g2s..qk) and V (live v_g2s..pv) are never live at once; both cta-scoped
smem_bytes 4096
prologue:
mainloop:
  sync __syncthreads()
    serves WAR on V/K (aliased): pv -> k_g2s across the loop back edge (warps cross)
  step k_g2s async [write K/slice]
  sync cp.async.wait_group 0
    serves RAW on K: k_g2s -> qk (warps cross)
  sync __syncthreads()
    serves RAW on K: k_g2s -> qk (warps cross)
  step qk [read K/whole]
  sync __syncthreads()
    serves WAR on K/V (aliased): qk -> v_g2s (warps cross)
  step v_g2s async [write V/slice]
  sync cp.async.wait_group 0
    serves RAW on V: v_g2s -> pv (warps cross)
  sync __syncthreads()
    serves RAW on V: v_g2s -> pv (warps cross)
  step pv [read V/whole]
epilogue:
"""  # fmt: skip
    assert verify(kernel) is kernel


def test_one_warp_needs_only_warp_barriers():
    """With one warp no two warps meet: the sync model's cheapest covering barrier is
    __syncwarp(), and verify accepts it."""
    kernel = insert_barriers(plan_smem(read_kernel(HEAD.format(warps=1, alias="off") + KV_LOOP)))
    kinds = {s.kind for s in kernel.syncs()}
    assert kinds == {sm80.SYNCWARP, sm80.CP_ASYNC_WAIT}
    verify(kernel)


def test_verify_rejects_hand_written_ir_without_the_wait():
    """A barrier alone does not complete a cp.async: verify asks for the wait first."""
    text = HEAD.format(warps=2, alias="off") + """\
buffer K 32x64x2B scope=cta offset=0 region=0
region 0 offset=0 bytes=4096 members=K
smem_bytes 4096
prologue:
  step k_g2s async [write K/slice]
  sync __syncthreads()
mainloop:
  step qk [read K/whole]
epilogue:
"""  # fmt: skip
    with pytest.raises(VerifyError) as err:
        verify(read_kernel(text))
    assert {f.missing for f in err.value.failures} == {
        "a cp.async wait before the barrier: cp.async.wait_group 0 (or lower) after the "
        "cp.async, then a CTA barrier (__syncthreads())",
        "a cp.async wait before the barrier: cp.async.wait_group 0 (or lower) after the "
        "cp.async, then a warp barrier (__syncwarp())",
    }
    fixed = text.replace(
        "  sync __syncthreads()", "  sync cp.async.wait_group 0\n  sync __syncthreads()"
    )
    verify(read_kernel(fixed))


@pytest.mark.parametrize(
    "line, why",
    [
        ("  step kq [read K/whole]", "unknown Op"),
        ("  step qk tma [read K/whole]", "no async write kind has this flag"),
        ("  sync bar.sync 1, 256", "not a sync of this target"),
        ("  sync __syncthreads() 2", "not a sync of this target"),
        ("  stop qk", "not a line of fadsl IR"),
    ],
)
def test_bad_ir_names_the_line(line, why):
    text = HEAD.format(warps=2, alias="off") + KV_LOOP.replace("  step qk [read K/whole]", line)
    with pytest.raises(IRSyntaxError, match=f"<ir>:7: {why}"):
        read_kernel(text)
