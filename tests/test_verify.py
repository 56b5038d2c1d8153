"""verify: the compiled kernels pass, every mutation of their syncs fails, and verify agrees
with an independent brute-force race detector (tests/bruteforce.py) on random schedules."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bruteforce import races
from fadsl.errors import Loc
from fadsl.ir import (
    Access,
    AliasPolicy,
    Buffer,
    Config,
    Dtype,
    Kernel,
    Mask,
    Mode,
    Partition,
    Phase,
    Scope,
    Step,
    Sync,
)
from fadsl.ir.ops import Op
from fadsl.ir.syncmodel import SyncKind
from fadsl.targets.sm80 import caps as sm80
from passes_support import insert_barriers
from passes_support import plan_smem
from passes_support import VerifyError, verify
from fadsl.pipeline import compile_file, compile_source, front_end
from variants import EAGER_ORDER

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fa2_kernel1.fa"
EAGER = EAGER_ORDER
V_FIRST = EAGER.replace("K -> smem\n    V -> smem", "V -> smem\n    K -> smem")


def spec(*edits: tuple[str, str], extra: str = "") -> str:
    """The example's text with each (old, new) substitution made and ``extra`` lines added."""
    text = EXAMPLE.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    return text.replace("  swizzle none\n", "  swizzle none\n" + extra)


WARPS_2 = (("warps    4", "warps    2"), ("B_r = 64", "B_r = 32"))
# K fragment-wise, V loaded one block ahead and as a whole tile: the mirror of FA2's order.
LOAD_V_AHEAD = """  mainloop {
    K -> smem
    S = Q @ K^T
    softmax
    V -> rf
    V(next) -> smem
    O += P @ V
  }
"""
VARIANTS = {
    "example": spec(),
    "alias_off": spec(extra="  smem_alias off\n"),
    "alias_any": spec(extra="  smem_alias any\n"),
    "eager": spec(extra=EAGER),
    "eager_alias_any": spec(extra="  smem_alias any\n" + EAGER),
    "eager_alias_off": spec(extra="  smem_alias off\n" + EAGER),
    "v_first": spec(extra=V_FIRST),
    "warps_2": spec(*WARPS_2),
    "warps_2_eager": spec(*WARPS_2, extra=EAGER),
    "warps_2_alias_any": spec(*WARPS_2, extra="  smem_alias any\n"),
    "warps_1": spec(("warps    4", "warps    1"), ("B_r = 64", "B_r = 16")),
    "warps_8": spec(("warps    4", "warps    8"), ("B_r = 64", "B_r = 128")),
    "bc_32_hd_64": spec(("head_dim 128", "head_dim 64"), ("B_c = 64", "B_c = 32")),
    "swizzled": (EXAMPLE.parent / "fa2_swizzled.fa").read_text(),
    "br_128_bc_32_eager": spec(
        ("B_r = 64", "B_r = 128"),
        ("B_c = 64", "B_c = 32"),
        ("warps    4", "warps    8"),
        extra=EAGER,
    ),
    "pipelined": (EXAMPLE.parent / "fa2_pipelined.fa").read_text(),
    "pipelined_causal_alias_any": (EXAMPLE.parent / "fa2_pipelined.fa")
    .read_text()
    .replace("mask     none", "mask     causal")
    .replace("  swizzle xor", "  smem_alias any\n  swizzle xor"),
    "hdim256": (EXAMPLE.parent / "fa2_hdim256.fa").read_text(),
    "frag_k_ahead_v": spec(
        ("-ldmatrix->       rf\n  V", "-ldmatrix->       rf[frag]\n  V"),
        extra=LOAD_V_AHEAD,
    ),
}


def compiled(name: str) -> Kernel:
    return compile_source(VARIANTS[name], f"{name}.fa").kernel


PHASES = ("prologue", "mainloop", "epilogue")


def sync_sites(kernel: Kernel):
    """(phase attribute, index, sync) for every Sync in the schedule."""
    for phase in PHASES:
        for i, item in enumerate(getattr(kernel, phase)):
            if isinstance(item, Sync):
                yield phase, i, item


def with_item(kernel: Kernel, phase: str, i: int, new: Sync | None) -> Kernel:
    items = getattr(kernel, phase)
    return replace(kernel, **{phase: items[:i] + ((new,) if new else ()) + items[i + 1 :]})


def rejects(kernel: Kernel) -> VerifyError | None:
    try:
        verify(kernel)
    except VerifyError as err:
        return err
    return None


# --- the compiled kernels ---------------------------------------------------------------------


def test_compile_file_verifies():
    kernel = compile_file(EXAMPLE).kernel
    assert verify(kernel) is kernel
    assert not races(kernel)


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_verifies(name):
    kernel = compiled(name)
    assert verify(kernel) is kernel
    assert not races(kernel)


def test_variants_differ():
    """The variants exercise different plans and schedules, not one kernel many times."""
    shapes = {
        (tuple((b.name, b.offset) for b in k.buffers), tuple(s.text() for s in k.syncs()))
        for k in map(compiled, VARIANTS)
    }
    assert len(shapes) >= 6


# --- mutations: every sync is needed, none may be weakened ------------------------------------


@pytest.mark.parametrize("name", VARIANTS)
def test_removing_any_sync_fails(name):
    kernel = compiled(name)
    for phase, i, sync in sync_sites(kernel):
        mutant = with_item(kernel, phase, i, None)
        assert rejects(mutant), f"{sync.text()} at {phase}[{i}] is redundant (insert_barriers)"
        assert races(mutant), f"brute force: {sync.text()} at {phase}[{i}] is redundant"


@pytest.mark.parametrize("name", VARIANTS)
def test_weakening_any_sync_fails(name):
    kernel = compiled(name)
    waits = 0
    for phase, i, sync in sync_sites(kernel):
        if sync.kind is sm80.SYNCTHREADS:
            mutant = with_item(kernel, phase, i, replace(sync, kind=sm80.SYNCWARP))
        elif sync.kind is sm80.CP_ASYNC_WAIT:
            if not rejects(with_item(kernel, phase, i, None)):
                continue  # orders nothing (already reported as redundant by the removal test)
            mutant = with_item(kernel, phase, i, replace(sync, groups=sync.groups + 1))
            waits += 1
        else:
            continue
        assert rejects(mutant), f"{sync.text()} at {phase}[{i}] could be weaker"
        assert races(mutant), f"brute force: {sync.text()} at {phase}[{i}] could be weaker"
    assert waits >= 1


# --- failure messages -------------------------------------------------------------------------


def find_sync(kernel: Kernel, phase: str, kind: SyncKind, nth: int = 0) -> int:
    hits = [i for p, i, s in sync_sites(kernel) if p == phase and s.kind is kind]
    return hits[nth]


def test_message_cta_barrier():
    kernel = compiled("example")
    i = find_sync(kernel, "mainloop", sm80.SYNCTHREADS, 1)  # after K's wait, before k_s2r
    err = rejects(with_item(kernel, "mainloop", i, None))
    text = str(err)
    assert "k_g2s (mainloop, iteration 0) -> k_s2r (mainloop, iteration 0)" in text
    assert "RAW on K" in text and "__syncthreads()" in text and "CTA barrier" in text
    cross = [f for f in err.failures if f.warps[0] != f.warps[1]]
    assert cross and all("CTA barrier" in f.missing for f in cross)
    k = kernel.buffer("K")
    for f in err.failures:
        assert f.buffers == ("K", "K")
        assert k.offset <= f.lo < f.hi <= k.offset + k.nbytes
        assert str(f) in text


def test_message_warp_barrier():
    kernel = compiled("example")
    i = find_sync(kernel, "epilogue", sm80.SYNCWARP)
    (fail,) = rejects(with_item(kernel, "epilogue", i, None)).failures
    assert (fail.earlier, fail.later) == ("o_r2s (epilogue)", "o_s2g (epilogue)")
    assert fail.buffers == ("O", "O") and fail.warps[0] == fail.warps[1]
    assert "warp barrier (__syncwarp())" in fail.missing and "CTA" not in fail.missing
    assert str(fail).startswith("RAW on O, bytes [")


def test_message_cp_async_wait():
    kernel = compiled("example")
    i = find_sync(kernel, "prologue", sm80.CP_ASYNC_WAIT)
    err = rejects(with_item(kernel, "prologue", i, None))
    assert "q_g2s (prologue) -> q_s2r (prologue)" in str(err)
    assert "cp.async wait before the barrier" in str(err)
    assert "cp.async.wait_group 0" in str(err)


def test_message_barrier_before_wait_does_not_count():
    """Swap K's wait and barrier: the barrier now precedes the wait and orders nothing."""
    kernel = compiled("example")
    i = find_sync(kernel, "mainloop", sm80.CP_ASYNC_WAIT)
    loop = kernel.mainloop
    assert isinstance(loop[i + 1], Sync) and loop[i + 1].kind is sm80.SYNCTHREADS
    swapped = replace(kernel, mainloop=loop[:i] + (loop[i + 1], loop[i]) + loop[i + 2 :])
    err = rejects(swapped)
    assert any(
        f.earlier.startswith("k_g2s") and f.later.startswith("k_s2r") and "after the" in f.missing
        for f in err.failures
    ), str(err)
    assert races(swapped)


def test_message_aliased_buffers():
    kernel = compiled("example")  # K and V share a region
    assert kernel.buffer("K").offset == kernel.buffer("V").offset
    i = find_sync(kernel, "mainloop", sm80.SYNCTHREADS, 2)  # before v_g2s
    err = rejects(with_item(kernel, "mainloop", i, None))
    assert "WAR on K/V (aliased)" in str(err)
    assert all(f.earlier.startswith("k_s2r") and f.later.startswith("v_g2s") for f in err.failures)


def test_unplanned_kernel_is_refused():
    with pytest.raises(ValueError, match="plan_smem"):
        verify(front_end(VARIANTS["example"]))


# --- verify against the brute force on random kernels -----------------------------------------

LOC = Loc("<random>", 1, 1)
ROW = 8  # bytes per row: cols 4 x 2-byte elements


@st.composite
def random_kernels(draw) -> Kernel:
    warps = draw(st.sampled_from([2, 3]))
    names = [f"B{i}" for i in range(draw(st.integers(2, 4)))]
    buffers = tuple(
        Buffer(
            name,
            rows=warps * draw(st.integers(1, 2)),
            cols=4,
            elem_bytes=2,
            scope=Scope.CTA,
            swizzle=None,
            loc=LOC,
            offset=ROW * draw(st.integers(0, 5)),
        )
        for name in names
    )
    access = st.builds(
        Access, st.sampled_from(names), st.sampled_from(Mode), st.sampled_from(Partition)
    )

    def items(phase: Phase, lo: int, hi: int) -> tuple:
        out = []
        for k in range(draw(st.integers(lo, hi))):
            if draw(st.integers(0, 9)) < 4:
                kind = draw(st.sampled_from(sm80.SYNC_MODEL.kinds()))
                groups = draw(st.integers(0, 2)) if kind is sm80.CP_ASYNC_WAIT else 0
                out.append(Sync(kind, phase, (), LOC, groups))
            else:
                accesses = tuple(draw(st.lists(access, max_size=2)))
                is_async = draw(st.booleans())
                op = list(Op)[k % len(Op)]
                out.append(Step(op, phase, accesses, sm80.CP_ASYNC if is_async else None, "", LOC))
        return tuple(out)

    config = Config(
        "random", "sm_80", (Dtype.BF16,), 64, 16 * warps, 64, warps, Mask.NONE, None,
        AliasPolicy.SCOPED, LOC,
    )  # fmt: skip
    return Kernel(
        config,
        (),
        buffers,
        items(Phase.PROLOGUE, 0, 4),
        items(Phase.MAINLOOP, 1, 6),
        items(Phase.EPILOGUE, 0, 4),
        loop_may_be_empty=draw(st.integers(0, 3)) == 0,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_kernels())
def test_verify_agrees_with_brute_force(kernel):
    found = races(kernel)
    err = rejects(kernel)
    assert (err is not None) == bool(found), (err, found[:3])


def test_brute_force_agrees_on_mutants():
    """Every single-sync removal or weakening of every variant: same verdict both ways."""
    for name in VARIANTS:
        kernel = compiled(name)
        for phase, i, sync in sync_sites(kernel):
            weaker = {
                sm80.SYNCTHREADS: replace(sync, kind=sm80.SYNCWARP),
                sm80.SYNCWARP: None,
                sm80.CP_ASYNC_WAIT: replace(sync, groups=sync.groups + 1),
            }[sync.kind]
            for new in (None, weaker):
                mutant = with_item(kernel, phase, i, new)
                assert (rejects(mutant) is not None) == bool(races(mutant)), (name, phase, i)


# --- insert_barriers on random well-formed schedules --------------------------------------------
#
# Well-formed like build_schedule's output: a step makes at most one access, writes are
# per-warp slices, and a cp.async step writes at most one slice. Any failure here is an
# insert_barriers bug (or, for the brute force, a verify bug).

SPEC_BASE = front_end(VARIANTS["example"])  # an unplanned schedule, for its config and tensors


@st.composite
def wellformed_schedules(draw, async_phases=(Phase.MAINLOOP,)) -> Kernel:
    warps = draw(st.sampled_from([1, 2, 4]))
    names = [f"B{i}" for i in range(draw(st.integers(1, 4)))]
    buffers = tuple(
        Buffer(name, draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([8, 64])), 2,
               draw(st.sampled_from([Scope.WARP, Scope.CTA])), None, LOC)
        for name in names
    )  # fmt: skip
    write = st.builds(Access, st.sampled_from(names), st.just(Mode.WRITE), st.just(Partition.SLICE))
    read = st.builds(Access, st.sampled_from(names), st.just(Mode.READ), st.sampled_from(Partition))

    def steps(phase: Phase, lo: int, hi: int) -> tuple[Step, ...]:
        out = []
        for k in range(draw(st.integers(lo, hi))):
            is_async = phase in async_phases and draw(st.booleans())
            access = draw(st.lists(write if is_async else write | read, max_size=1))
            kind = sm80.CP_ASYNC if is_async else None
            out.append(Step(list(Op)[k % len(Op)], phase, tuple(access), kind, "", LOC))
        return tuple(out)

    policy = draw(st.sampled_from(list(AliasPolicy)))
    return Kernel(
        replace(SPEC_BASE.config, warps=warps, smem_alias=policy),
        SPEC_BASE.tensors,
        buffers,
        steps(Phase.PROLOGUE, 0, 3),
        steps(Phase.MAINLOOP, 1, 4),
        steps(Phase.EPILOGUE, 0, 3),
        loop_may_be_empty=draw(st.booleans()),
    )


@pytest.mark.parametrize("async_phases", [(Phase.MAINLOOP,), (Phase.PROLOGUE, Phase.EPILOGUE)])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_insert_barriers_random_schedules(async_phases, data):
    """cp.async in the mainloop only, or outside it only: both bugs below need both."""
    kernel = insert_barriers(plan_smem(data.draw(wellformed_schedules(async_phases))))
    assert verify(kernel) is kernel
    assert not races(kernel, 2)
    for phase, i, sync in sync_sites(kernel):
        assert rejects(with_item(kernel, phase, i, None)), f"redundant {sync.text()} {phase}[{i}]"


def bug_kernel(mainloop_tail: tuple, epilogue: tuple) -> Kernel:
    """Two aliased 1-warp buffers; the prologue cp.asyncs B0; the mainloop commits a group."""
    buffers = tuple(Buffer(n, 16, 8, 2, Scope.WARP, None, LOC) for n in ("B0", "B1"))
    config = replace(SPEC_BASE.config, warps=1, smem_alias=AliasPolicy.SCOPED)
    p0 = Step(
        Op.Q_G2S,
        Phase.PROLOGUE,
        (Access("B0", Mode.WRITE, Partition.SLICE),),
        sm80.CP_ASYNC,
        "",
        LOC,
    )
    m0 = Step(Op.K_G2S, Phase.MAINLOOP, (), sm80.CP_ASYNC, "", LOC)
    kernel = Kernel(config, SPEC_BASE.tensors, buffers, (p0,), (m0,) + mainloop_tail, epilogue)
    return plan_smem(kernel)


def test_wait_group_counts_one_iteration():
    """p0 cp.async -> B0; loop: m0 commits a group; epilogue e0 reads B0. After one
    iteration only m0's group follows p0's, so the wait before e0 must be wait_group 1
    (wait_group 2 would leave p0's group in flight)."""
    e0 = Step(Op.O_S2G, Phase.EPILOGUE, (Access("B0", Mode.READ, Partition.SLICE),), None, "", LOC)
    kernel = insert_barriers(bug_kernel((), (e0,)))
    (wait,) = [s for s in kernel.epilogue if isinstance(s, Sync) and s.kind is sm80.CP_ASYNC_WAIT]
    assert wait.groups == 1
    assert not races(kernel)
    verify(kernel)


def test_hoisted_wait_counts_only_prologue_groups():
    """p0 cp.async -> B0; loop: m0 commits a group, m1 reads B0. Ordering p0 -> m1 at the end
    of the prologue must wait for every group (none is committed there after p0's); an
    earlier insert_barriers kept asking for wait_group 1 there and never terminated."""
    m1 = Step(Op.K_S2R, Phase.MAINLOOP, (Access("B0", Mode.READ, Partition.SLICE),), None, "", LOC)
    kernel = insert_barriers(bug_kernel((m1,), ()))
    assert [s.text() for s in kernel.prologue if isinstance(s, Sync)] == [
        "cp.async.wait_group 0",
        "__syncwarp()",
    ]
    assert not races(kernel)
    verify(kernel)
