"""The FP8 forward's schedule, SMEM plan, syncs and proof (research/fp8-forward.md §3.2-§3.3,
§6 tests 4-5, §7 step 3): the 8-bit specs (tests/specs/fp8) compile through every pass, the
plan is proven with the producer as 4 warp agents, every sync is needed (each of the
transpose hop's dropped, flipped, or its expect_tx emptied is refused), shrinking a ring is
refused, the brute-force checker agrees on a small kernel, the IR after each pass is golden,
and no CUDA is rendered yet."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from bruteforce_async import explore
from conftest import ROOT
from fadsl import targets
from fadsl.cli import main
from fadsl.codegen.render import render
from fadsl.errors import SpecError
from fadsl.ir import Kernel, Phase, Step, Sync, Threads
from fadsl.ir.ops import Op
from fadsl.ir.printer import format_kernel
from fadsl.passes.asyncmodel.prove import AsyncVerifyError, check
from fadsl.pipeline import compile_file, compile_source, front_end
from fadsl.targets.sm90.caps import SYNCWARP
from fadsl.targets.sm90.transpose_agents import vt_warp_spans
from fadsl.targets.sm90.verify import build_program, problems_of, verify
from fadsl.tools.report import explain_text, summary
from ir_reader import read_kernel
from sync_mutants import mutants, survivors

SPECS = sorted((ROOT / "tests/specs/fp8").glob("*.fa"))
HDIM256 = (ROOT / "tests/specs/fp8/fa3_fp8_hdim256_eager.fa").read_text()


def _variant(text: str, **settings: str) -> str:
    for key, value in settings.items():
        text, n = re.subn(rf"^(  ){key}\s+\S+", rf"\g<1>{key} {value}", text, flags=re.M)
        if n == 0:  # a knob the spec leaves at its default
            text = text.replace("\n}", f"\n  {key} {value}\n}}")
    return text


VARIANTS = {
    "hdim256_both_off": _variant(HDIM256, pingpong="off", overlap="off"),
    "hdim256_stages_1": _variant(HDIM256, stages="1"),
    "hdim256_every": _variant(HDIM256, rescale="every"),
}
KERNELS: dict[str, Kernel] = {p.stem: compile_file(p).kernel for p in SPECS}
KERNELS.update({name: compile_source(text, name).kernel for name, text in VARIANTS.items()})

# the transpose hop's syncs (syncs/transpose.py), as the mutants name them
TRANSPOSE_SYNCS = (
    "mbarrier.try_wait.parity bar=v_empty[it] parity=phase^1 by producer_thread",
    "mbarrier.arrive.expect_tx bar=v_full[it]",
    "mbarrier.try_wait.parity bar=v_full[it-1] parity=phase by producer_warps",
    "mbarrier.try_wait.parity bar=vt_empty[it-1] parity=phase^1 by producer_warps",
    "mbarrier.try_wait.parity bar=o_free parity=tile^1 by producer_warps",
    "__syncwarp() by producer_warps",
    "mbarrier.arrive bar=v_empty[it-1] by producer_warp_lane0",
    "fence.proxy.async by producer_warps",
    "mbarrier.arrive bar=vt_full[it-1] by producer_warps",
    "mbarrier.try_wait.parity bar=vt_full[it-1] parity=phase by consumers",
    "mbarrier.arrive bar=vt_empty[it-1] by consumer_warp_lane0",
)


def test_the_specs_exist():
    assert {p.stem for p in SPECS} == {
        "fa3_fp8_hdim128_fp16",
        "fa3_fp8_hdim256_eager",
        "fa3_fp8_kvcache_hdim64",
        "fa3_fp8_one_wg",
        "fa3_fp8_tail_split",
    }


def test_the_schedule_transposes_v_into_its_own_ring():
    kernel = KERNELS["fa3_fp8_hdim256_eager"]
    assert [b.name for b in kernel.buffers] == ["Q", "K", "V", "Vt", "O"]
    vt, v, o = kernel.buffer("Vt"), kernel.buffer("V"), kernel.buffer("O")
    assert (vt.rows, vt.cols, vt.elem_bytes, vt.slots) == (256, 128, 1, 2)
    assert (v.rows, v.cols, v.elem_bytes, o.elem_bytes) == (128, 256, 1, 2)
    loop = [(i.op, i.lag, i.who) for i in kernel.mainloop if isinstance(i, Step)]
    assert loop[:3] == [
        (Op.K_G2S, 0, Threads.PRODUCER_THREAD),
        (Op.V_G2S, 0, Threads.PRODUCER_THREAD),
        (Op.TRANSPOSE_V, -1, Threads.PRODUCER_WARPS),
    ]
    pv = next(i for i in kernel.mainloop if isinstance(i, Step) and i.op is Op.PV)
    assert [a.buffer for a in pv.accesses] == ["Vt"] and pv.lag == -1
    epilogue = [i.op for i in kernel.epilogue if isinstance(i, Step)]
    assert epilogue[0] is Op.TRANSPOSE_V and Op.V_G2S not in epilogue


def test_one_stage_transposes_before_the_next_load():
    loop = [i.op for i in KERNELS["hdim256_stages_1"].mainloop if isinstance(i, Step)]
    assert loop[:3] == [Op.K_G2S, Op.TRANSPOSE_V, Op.V_G2S]


def test_one_stage_in_the_two_stage_order_hangs():
    """Warp 0 is one instruction stream: loading V(it) into the one raw slot waits for its own
    transpose of V(it-1). The proof sees the hang only because pw0 holds both."""
    kernel = front_end(_variant(HDIM256, stages="1"), "one_stage.fa")
    loop = list(kernel.mainloop)
    transpose = next(i for i, s in enumerate(loop) if s.op is Op.TRANSPOSE_V)
    load_v = next(i for i, s in enumerate(loop) if s.op is Op.V_G2S)
    loop[transpose], loop[load_v] = loop[load_v], loop[transpose]
    kernel = replace(kernel, mainloop=tuple(loop))
    target = targets.target_of(kernel)
    for name, run in target.passes:
        if name == "verify":
            break
        kernel = run(kernel, target)
    with pytest.raises(AsyncVerifyError, match=r"hang: pw0 #\d+ \(wait on v_empty"):
        verify(kernel)


@pytest.mark.parametrize(
    "name, smem, o_over_vt",
    [("fa3_fp8_hdim256_eager", 230_520, True), ("fa3_fp8_hdim128_fp16", 197_744, False)],
)
def test_smem_is_the_designs_table(name, smem, o_over_vt):
    """§3.2: Q | K | V | Vt | O, 1,024-byte aligned; at head_dim 256 O over the dead Vt."""
    kernel = KERNELS[name]
    assert kernel.smem_bytes == smem
    o, vt = kernel.buffer("O"), kernel.buffer("Vt")
    assert (o.offset == vt.offset) is o_over_vt
    assert [r.members for r in kernel.regions][-1] == (("Vt", "O") if o_over_vt else ("O",))


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_plan_is_proven(name):
    assert verify(KERNELS[name]) is KERNELS[name]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_sync_is_needed(name):
    assert survivors(KERNELS[name]) == []


def test_the_mutants_include_every_transpose_sync():
    """The test above is not vacuous for the new syncs: each is dropped (and its parity
    flipped) in the head_dim 256 kernel, whose O lies over Vt."""
    whats = [what for what, _ in mutants(KERNELS["fa3_fp8_hdim256_eager"])]
    for sync in TRANSPOSE_SYNCS:
        assert any(w.startswith("drop mainloop") and sync in w for w in whats), sync
        if "parity" in sync:
            assert any(w.startswith("flip mainloop") and sync in w for w in whats), sync
    assert any(w.startswith("no expect_tx") for w in whats)


@pytest.mark.parametrize("tile", ["V", "Vt"])
def test_shrinking_a_ring_fails(tile):
    kernel = KERNELS["fa3_fp8_hdim128_fp16"]
    buffers = tuple(replace(b, slots=1) if b.name == tile else b for b in kernel.buffers)
    with pytest.raises(AsyncVerifyError):
        verify(replace(kernel, buffers=buffers))


def test_a_lane0_arrival_needs_the_warps_syncwarp():
    """Warps 1-3 hold no TMA load, so the async model alone would take lane 0's arrival for the
    whole warp's; verify's rule names it."""
    kernel = KERNELS["fa3_fp8_hdim128_fp16"]
    loop = tuple(i for i in kernel.mainloop if not (isinstance(i, Sync) and i.kind is SYNCWARP))
    found = problems_of(replace(kernel, mainloop=loop), (2,))
    assert any("pw1" in p and "no __syncwarp of pw1" in p for p in found), found


def test_each_warp_writes_its_own_vt_rows():
    """The agents' spans tile each Vt slot once, every warp a contiguous share per panel."""
    for head_dim, block_c in ((128, 192), (256, 128), (128, 256)):
        covered = []
        for warp in range(4):
            covered += vt_warp_spans(head_dim, block_c, warp)
        covered.sort()
        assert covered[0][0] == 0 and covered[-1][1] == head_dim * block_c
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


@pytest.mark.parametrize("tiles", [(2,)])  # (1, 1): past the checker's state limit
def test_bruteforce_agrees_on_the_small_kernel(tiles):
    assert explore(build_program(KERNELS["fa3_fp8_one_wg"], tiles), all_kinds=True) == set()


def test_bruteforce_agrees_on_the_dropped_transpose_syncs():
    """The small kernel's transpose syncs of its epilogue (one tile of one block: no
    mainloop, fresh barriers) each dropped: both checkers accept or refuse the program alike,
    and some are refused (the __syncwarp aside: neither model has lanes, verify's own rule
    finds it)."""
    kernel = KERNELS["fa3_fp8_one_wg"]
    refused = 0
    for what, mutant in mutants(kernel):
        if not what.startswith("drop epilogue") or "producer_warp" not in what:
            continue
        program = build_program(mutant, (1,))
        found = explore(program)
        assert bool(check(program)) == bool(found), (what, found)
        refused += bool(found)
    assert refused >= 2


def test_ir_after_each_pass(golden):
    for spec in SPECS:
        for stage, kernel in compile_file(spec.relative_to(ROOT)).stages:
            text = format_kernel(kernel)
            golden.check(ROOT / "tests/golden/ir" / f"{spec.stem}.{stage}.txt", text)
            assert format_kernel(read_kernel(text)) == text, (spec.stem, stage)


def test_the_cuda_is_rendered_since_step_4():
    """Step 3 refused the CUDA at the dtype line; since step 4 (2026-11-30) the plain 8-bit
    forward renders (tests/test_fp8_codegen.py checks the kernels)."""
    compiled = compile_file(SPECS[0])
    sources = render(
        compiled.kernel, targets.target_of(compiled.kernel), compiled.kernel.config.name
    )
    assert [s.dtype for s in sources] == list(compiled.kernel.config.dtypes)


def test_the_phases_hold_the_producer_warps():
    kernel = KERNELS["fa3_fp8_hdim256_eager"]
    assert all(
        i.who is not Threads.PRODUCER_WARPS for i in kernel.prologue
    ), "the prologue transposes nothing: V(0) is transposed in the first mainloop iteration"
    assert any(i.who is Threads.PRODUCER_WARPS for i in kernel.epilogue)
    assert {
        p
        for p, items in kernel.phases()
        if any(i.op is Op.TRANSPOSE_V for i in items if isinstance(i, Step))
    } == {Phase.MAINLOOP, Phase.EPILOGUE}


def test_check_and_explain_without_a_compiler(golden):
    """`fadsl check` and `fadsl explain --no-compile` of the 8-bit specs: the Vt ring, the
    producer warps' barriers and the transpose's syncs with the hazards they order."""
    for spec in SPECS:
        compiled = compile_file(spec.relative_to(ROOT))
        text = summary(compiled) + explain_text(compiled)
        golden.check(ROOT / "tests/golden/report" / f"{spec.stem}.no_compile.txt", text)
        assert "K, V and Vt each in a ring" in text and "vt_full  128 arrivals" in text


def test_fadsl_compile_writes_the_8bit_kernels(tmp_path, capsys):
    assert main(["compile", str(SPECS[0]), "-o", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.cu")) == [f"{SPECS[0].stem}_e4m3.cu"]
    assert (tmp_path / "fadsl" / "sm90_fp8.cuh").is_file()
    assert (tmp_path / "fadsl" / "sm90_wgmma8.cuh").is_file()
