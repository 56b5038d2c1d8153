"""insert_barriers: the syncs placed for the examples and their variants, and why."""

from dataclasses import replace

from conftest import ROOT

from fadsl.ir import Step, Sync
from fadsl.ir.ops import Op
from fadsl.targets.sm80 import caps as sm80
from passes_support import insert_barriers
from passes_support import plan_smem
from fadsl.pipeline import compile_source, front_end
from variants import EAGER_ORDER, KERNEL1, variant


def plan(text):
    return compile_source(text, "k.fa").kernel


def shape(items):
    """A phase as a compact list: op names, and 'wait N' / 'warp' / 'cta' for syncs."""
    out = []
    for item in items:
        match item:
            case Step():
                out.append(item.op.spelling)
            case Sync(kind=sm80.CP_ASYNC_WAIT):
                out.append(f"wait {item.groups}")
            case Sync(kind=sm80.SYNCWARP):
                out.append("warp")
            case Sync(kind=sm80.SYNCTHREADS):
                out.append("cta")
            case _:
                raise AssertionError(item)
    return out


def test_kernel1_barriers():
    k = plan(KERNEL1)
    assert shape(k.prologue) == ["q_g2s", "init", "wait 0", "warp", "q_s2r"]
    # The seeds' two RAW barriers, plus the two WAR barriers that K/V aliasing adds:
    # all K reads done before V overwrites the region, all V reads done before the next K.
    assert shape(k.mainloop) == [
        "cta", "k_g2s", "wait 0", "cta", "k_s2r", "qk", "softmax",
        "cta", "v_g2s", "wait 0", "cta", "v_s2r", "pv",
    ]  # fmt: skip
    assert shape(k.epilogue) == ["normalize", "o_r2s", "warp", "o_s2g"]


def describe(sync):
    return [h.describe() for h in sync.serves]


def test_each_sync_records_the_hazards_it_serves():
    k = plan(KERNEL1)
    top, _, raw_k, war_kv, _, raw_v = [s for s in k.mainloop if isinstance(s, Sync)]
    assert describe(top) == [
        "WAR on Q/O (aliased): q_s2r -> o_r2s (within each warp)",
        "WAR on V/K (aliased): v_s2r -> k_g2s across the loop back edge (warps cross)",
    ]
    assert describe(raw_k) == ["RAW on K: k_g2s -> k_s2r (warps cross)"]
    assert describe(war_kv) == ["WAR on K/V (aliased): k_s2r -> v_g2s (warps cross)"]
    assert describe(raw_v) == ["RAW on V: v_g2s -> v_s2r (warps cross)"]
    assert all(s.serves for s in k.syncs())


def test_without_aliasing_the_two_seed_barriers_do_double_duty():
    k = plan(variant(alias="off"))
    assert shape(k.mainloop) == [
        "k_g2s", "wait 0", "cta", "k_s2r", "qk", "softmax", "v_g2s", "wait 0", "cta", "v_s2r", "pv",
    ]  # fmt: skip
    first, second = [s for s in k.syncs() if s.kind is sm80.SYNCTHREADS]
    assert "WAR on V: v_s2r -> v_g2s across the loop back edge (warps cross)" in describe(first)
    assert "WAR on K: k_s2r -> k_g2s across the loop back edge (warps cross)" in describe(second)


def test_eager_load_waits_only_for_the_group_it_needs():
    """K -> smem, V -> smem, then K -> rf: wait_group 1 lets V's copy stay in flight."""
    k = plan(variant(order=EAGER_ORDER))
    body = shape(k.mainloop)
    assert body[body.index("k_s2r") - 2 : body.index("k_s2r")] == ["wait 1", "cta"]
    assert body[body.index("v_s2r") - 2 : body.index("v_s2r")] == ["wait 0", "cta"]


def test_one_warp_needs_only_warp_barriers():
    k = plan(variant(warps=1, block_r=16))
    assert {s.kind for s in k.syncs()} <= {sm80.SYNCWARP, sm80.CP_ASYNC_WAIT}


def test_an_empty_loop_is_ordered_too():
    """When the mainloop may run zero times, Q's reads meet O's writes with no loop barrier
    between them: a warp barrier must order them in the epilogue."""
    kernel = plan_smem(front_end(KERNEL1, "k.fa"))
    always = insert_barriers(kernel)
    maybe_empty = insert_barriers(replace(kernel, loop_may_be_empty=True))
    assert shape(always.epilogue) == ["normalize", "o_r2s", "warp", "o_s2g"]
    assert shape(maybe_empty.epilogue) == ["normalize", "warp", "o_r2s", "warp", "o_s2g"]
    assert "WAR on Q/O (aliased): q_s2r -> o_r2s (within each warp)" in describe(
        maybe_empty.epilogue[1]
    )


def test_the_pass_owns_the_syncs():
    """Running it again on its own output changes nothing (it starts from the steps alone)."""
    k = plan(KERNEL1)
    assert insert_barriers(k) == k


PIPELINED = (ROOT / "examples" / "fa2_pipelined.fa").read_text()


def test_fa2_schedule_needs_two_barriers_per_iteration():
    """FA2's order: the CTA barrier that lets V's load overwrite the V that the previous
    P @ V read also publishes K, whose wait moves ahead of V's issue; the barrier that lets
    the next K overwrite K also publishes V, whose wait moves ahead of K's issue."""
    k = plan(PIPELINED)
    assert shape(k.prologue) == ["q_g2s", "k_g2s", "init"]
    assert shape(k.mainloop) == [
        "wait 0", "cta", "v_g2s", "qk", "softmax", "wait 0", "cta", "k_g2s_next", "pv",
    ]  # fmt: skip
    top, middle = (s for s in k.mainloop if isinstance(s, Sync) and s.kind is sm80.SYNCTHREADS)
    assert {"RAW on K: k_g2s_next -> qk across the loop back edge (warps cross)",
            "WAR on V: pv -> v_g2s across the loop back edge (warps cross)"} <= set(describe(top))  # fmt: skip
    assert {"WAR on K: qk -> k_g2s_next (warps cross)",
            "RAW on V: v_g2s -> pv (warps cross)"} <= set(describe(middle))  # fmt: skip


def test_a_sync_joins_an_earlier_one_only_across_cp_async_issues():
    """Between the two barriers a compute step (softmax) stands: no join, the V wait stays
    after it, and the cp.async of K's next block may stay in flight through P @ V."""
    late_k = PIPELINED.replace(
        "    softmax\n    K(next) -> smem         # the next block's K, in flight during O += P @ V\n",
        "    K(next) -> smem\n    softmax\n",
    )
    k = plan(late_k)
    assert shape(k.mainloop) == [
        "wait 0", "cta", "v_g2s", "qk", "cta", "k_g2s_next", "softmax", "wait 1", "cta", "pv",
    ]  # fmt: skip


def test_no_join_past_the_write_a_sync_waits_for():
    """Kernel 1's K barrier follows K's own cp.async: it cannot move before it."""
    k = plan(KERNEL1)
    assert shape(k.mainloop)[:4] == ["cta", "k_g2s", "wait 0", "cta"]


def test_fragment_wise_loads_drop_their_steps():
    k = plan(PIPELINED)
    ops = [s.op for s in k.steps()]
    assert Op.Q_S2R not in ops and Op.K_S2R not in ops and Op.V_S2R not in ops
    qk = next(s for s in k.mainloop if isinstance(s, Step) and s.op is Op.QK)
    assert {(a.buffer, a.mode.value, a.partition.value) for a in qk.accesses} == {
        ("Q", "read", "slice"),
        ("K", "read", "whole"),
    }
