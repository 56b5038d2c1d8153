"""`late_v on`: in the lagged consumer's backward, K alone on kv_full and V loaded after the
first m-block's Q, dO, LSE and D on a barrier of its own (v_full), so that S^T's first wgmma
waits for K's bytes and the slot's only. Each warpgroup waits for V before its first dP^T
(``Guard.FIRST``: its first pass of the loop, m-block 1 after a peeled m-block 0) and once
more after the loop (a peeled warpgroup of a one-m-block tile runs no pass; dV may be staged
over V; the CTA must not end with the load in flight). The key through the IR, the Cfg and
the SMEM plan; its refusals; the plan the sync pass places; the proof, and each of V's
syncs needed; the header read against the plan, and edits of it caught. The gradients:
tests/test_gpu_backward.py (fa3_causal ships it)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backward_header import LAG_HEADER, HEADER, TEMPLATE, header_calls, lag_edits_missed
from fadsl.errors import SpecError
from fadsl.ir import Dtype
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward.emit import context
from fadsl.targets.sm90.backward.plan_smem import plan_smem
from fadsl.targets.sm90.backward.program import (
    CodeSite,
    Guard,
    Kind,
    LoopPhase,
    Mbar,
    Params,
    StagedTile,
    WaitParity,
    WarpRole,
    unrolled,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import check_protocol
from fadsl.targets.sm90.backward.verify_space import parameter_space
from fadsl.targets.sm90.variants import variant_lines
from training_specs import training_spec
from test_verify_backward_header import expected_calls

FILE = "late_v.fa"
# fa3_causal's block (peeled, dK and dV by TMA), without the peel, from registers, one consumer
CAUSAL = Params(
    2, 2, 128, overlap=True, dq_red=True, dq_lag=True, ds_stmatrix=True, dkv_tma=True,
    peel_dead=True, late_v=True,
)  # fmt: skip
SHAPES = (
    CAUSAL,
    replace(CAUSAL, peel_dead=False),
    replace(CAUSAL, dkv_tma=False),
    replace(CAUSAL, dv_out_first=True),
    Params(1, 2, 64, overlap=True, dq_red=True, dq_lag=True, late_v=True),
)
LATE_SPACE = [p for p in parameter_space() if p.late_v]


def _v_syncs(plan, role: WarpRole) -> list:
    return [x for x in plan.role(role) if x.mbar is Mbar.V_FULL and x.is_sync]


def test_the_key_reaches_the_ir_the_cfg_and_the_smem_plan():
    compiled = compile_source(training_spec("fa3_causal+late_v"), FILE)
    bwd = compiled.kernel.backward
    assert bwd.late_v and bwd.text().endswith(" late_v=on")
    assert read_backward(bwd.text(), bwd.loc).late_v
    assert Params.of(bwd, 128).late_v and context(compiled.kernel, Dtype.BF16)["late_v"]
    plain = compile_source(training_spec("fa3_causal-late_v"), FILE).kernel
    assert not plain.backward.late_v and not context(plain, Dtype.BF16)["late_v"]
    # one more mbarrier word in the plan (v_full), the rest unchanged
    bars = {b.name: b.nbytes for b in plan_smem(bwd, 128).buffers}
    plain_bars = {b.name: b.nbytes for b in plan_smem(plain.backward, 128).buffers}
    assert bars["mbarriers"] == plain_bars["mbarriers"] + 8
    assert {k: v for k, v in bars.items() if k != "mbarriers"} == {
        k: v for k, v in plain_bars.items() if k != "mbarriers"
    }


def test_a_modifier_examples_block_takes_it_by_name():
    """training_spec finds examples/modifiers/NAME.fa too: prefix_lm's block with late_v (and
    peel_dead) builds, the keep modifier kept."""
    kernel = compile_source(training_spec("prefix_lm+late_v+peel_dead"), FILE).kernel
    assert kernel.backward.late_v and kernel.backward.peel_dead and kernel.config.modifiers
    assert not compile_source(training_spec("prefix_lm-late_v"), FILE).kernel.backward.late_v


REFUSALS = {
    "fa3_causal-dq_lag+late_v": "dq_lag off",
    "fa3_causal+persistent+late_v": "scheduler persistent",
}


@pytest.mark.parametrize("name", REFUSALS)
def test_it_is_refused_where_it_is_not_built(name):
    text = training_spec(name)
    with pytest.raises(SpecError) as info:
        compile_source(text, FILE)
    (d,) = [d for d in info.value.diagnostics if d.message.startswith("late_v on")]
    assert REFUSALS[name] in d.message and d.message.endswith("leave it off")
    line = text.split("\n")[d.loc.line - 1]
    assert line[d.loc.col - 1 :].startswith("late_v")


def test_a_softcap_variant_leaves_it_with_the_lag():
    """fadsl.attention's softcap variant of fa3_causal turns dq_lag off, and late_v with it
    (the variant's block must build); a window's keeps it."""
    kernel = compile_source(training_spec("fa3_causal"), FILE).kernel
    assert kernel.backward.late_v  # (the example ships it)
    capped = variant_lines(kernel, windowed=False, capped=True, causal=True).backward
    assert capped["dq_lag"] == "off" and capped["late_v"] == "off"
    windowed = variant_lines(kernel, windowed=True, capped=False, causal=True).backward
    assert "late_v" not in windowed


@pytest.mark.parametrize("p", LATE_SPACE, ids=lambda p: p.describe())
def test_the_plan_loads_v_late_and_waits_twice(p):
    """K alone on kv_full; V's panels on v_full in the producer's first pass, after the
    slot's loads, armed with V's bytes; each warpgroup's waits: the first pass's before
    dP^T (after S^T's commit), and one after the loop for a CTA with work, before any of
    the epilogue's steps."""
    plan = protocol(p)
    arm_kv = [x for x in plan.producer if x.kind is Kind.MBAR_ARRIVE_EXPECT_TX]
    assert arm_kv[0].mbar is Mbar.KV_FULL and arm_kv[0].tx == p.kv_bytes
    v_loads = [
        x for x in plan.producer if x.kind is Kind.TMA_LOAD and x.writes[0].buffer is StagedTile.V
    ]
    assert len(v_loads) == p.panels
    assert all(x.mbar is Mbar.V_FULL and x.guard is Guard.FIRST for x in v_loads)
    assert all(x.source is CodeSite.LOAD_V_LATE for x in v_loads)
    loop = [x for x in plan.producer if x.phase is LoopPhase.LOOP]
    assert loop[-p.panels :] == v_loads  # (after the slot's Q, dO, LSE and D)
    (arm,) = _v_syncs(plan, WarpRole.PRODUCER)
    assert arm.kind is Kind.MBAR_ARRIVE_EXPECT_TX and arm.tx == p.kv_bytes
    first, *rest = _v_syncs(plan, WarpRole.CONSUMER)
    assert (first.kind, first.phase, first.guard) == (Kind.MBAR_WAIT, LoopPhase.LOOP, Guard.FIRST)
    # the second wait only where a warpgroup's loop may run no pass (the peel)
    assert len(rest) == int(p.peel_dead)
    assert first.parity is WaitParity.ZERO
    consumer = list(plan.consumer)
    following = consumer[consumer.index(first) + 1]
    assert following.kind is Kind.WGMMA and following.name == "dP^T = V dO^T"
    assert consumer[consumer.index(first) - 1].kind is Kind.WGMMA_COMMIT
    for after in rest:  # (the peel's: the epilogue's first item, for a CTA with work)
        assert (after.kind, after.phase, after.guard, after.parity) == (
            Kind.MBAR_WAIT,
            LoopPhase.AFTER,
            Guard.HAS_WORK,
            WaitParity.ZERO,
        )
        assert [x for x in consumer if x.phase is LoopPhase.AFTER][0] is after
    (init,) = _v_syncs(plan, WarpRole.SETUP)
    assert init.count == 1
    # without the key: K and V on kv_full, no v_full anywhere
    plain = protocol(replace(p, late_v=False))
    assert not any(_v_syncs(plain, role) for role in WarpRole)


def test_the_first_pass_is_the_peeled_warpgroups_m_block_1():
    plan = protocol(CAUSAL)
    first = _v_syncs(plan, WarpRole.CONSUMER)[0]
    for m_count in (1, 2, 3):
        whole = [i for x, i in unrolled(plan.consumer, m_count) if x is first]
        peeled = [i for x, i in unrolled(plan.consumer, m_count, peeled=True) if x is first]
        assert whole == [0] and peeled == ([1] if m_count > 1 else [])
    assert not [i for x, i in unrolled(plan.consumer, 0) if x is first]
    # the peeled m-block's items never read V (its products are dropped)
    peeled_items = [x for x in plan.consumer if x.phase is LoopPhase.PEELED]
    assert not any(op.buffer is StagedTile.V for x in peeled_items for op in x.reads)


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.describe())
def test_each_of_vs_syncs_is_needed(p):
    """The plan is proven; either wait left out, or the first one moved to the loop's
    second pass, fails the proof (dP^T reads V unordered; a peeled one-m-block warpgroup's
    epilogue writes V, or the CTA ends, with the load in flight); without the peel the plan
    has the first one only."""
    plan = protocol(p)
    assert check_protocol(plan) == ()
    consumer = plan.consumer
    for sync in _v_syncs(plan, WarpRole.CONSUMER):
        n = consumer.index(sync)
        mutant = plan.with_role(WarpRole.CONSUMER, consumer[:n] + consumer[n + 1 :])
        assert check_protocol(mutant), f"{sync.phase.value}'s wait left out: still proven"
    first = _v_syncs(plan, WarpRole.CONSUMER)[0]
    late = tuple(replace(x, guard=Guard.AFTER_FIRST) if x is first else x for x in consumer)
    assert check_protocol(plan.with_role(WarpRole.CONSUMER, late))


# edits of the header's late V that the header check must catch
CONSUMER_EDITS = {
    "the loop's wait dropped": (
        "      if (i == i_first) mbar_wait_parity(bwd_bar_v_late<Cfg>(smem), 0u);\n",
        "",
    ),
    "the loop's wait in every m-block but the first": (
        "if (i == i_first) mbar_wait_parity(bwd_bar_v_late",
        "if (i > 0) mbar_wait_parity(bwd_bar_v_late",
    ),
    "the wait after the loop dropped": (
        "    if (b.m_count > 0) mbar_wait_parity(bwd_bar_v_late<Cfg>(smem), 0u);\n",
        "",
    ),
    "the wait after the loop without the peel too": (
        "if constexpr (Cfg::kLateV && Cfg::kPeelDead) {",
        "if constexpr (Cfg::kLateV) {",
    ),
    "the loop's wait on kv_full": (
        "if (i == i_first) mbar_wait_parity(bwd_bar_v_late<Cfg>(smem), 0u);",
        "if (i == i_first) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), 0u);",
    ),
}


@pytest.mark.parametrize("what", CONSUMER_EDITS)
def test_an_edited_consumer_is_caught(what):
    old, new = CONSUMER_EDITS[what]
    assert LAG_HEADER.count(old) == 1, what
    assert lag_edits_missed(old, new, SHAPES) == [], what


PRODUCER_EDITS = {
    "V loaded in every m-block": (
        "      if (i == 0) bwd_load_v_late<Cfg>(P, smem, b);",
        "      bwd_load_v_late<Cfg>(P, smem, b);",
    ),
    "V's bytes on kv_full too": (
        "    mbar_arrive_expect_tx(bar_kv, Cfg::kKVBytes);\n  } else {",
        "    mbar_arrive_expect_tx(bar_kv, 2 * Cfg::kKVBytes);\n  } else {",
    ),
    "V loaded with K as well": (
        "    if constexpr (!Cfg::kLateV) tma_load_4d(smem + Cfg::kOffV",
        "    tma_load_4d(smem + Cfg::kOffV",
    ),
}


@pytest.mark.parametrize("what", PRODUCER_EDITS)
def test_an_edited_producer_or_setup_is_caught(what):
    old, new = PRODUCER_EDITS[what]
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    assert any(
        header_calls(WarpRole.PRODUCER, p, header=edited)
        != expected_calls(protocol(p), WarpRole.PRODUCER)
        for p in SHAPES
    ), what


def test_an_edited_init_is_caught():
    old = "    mbar_init(bwd_bar_v_late<Cfg>(smem), 1);"
    assert TEMPLATE.count(old) == 1
    for new in (old.replace(", 1)", ", 2)"), ""):
        edited = TEMPLATE.replace(old, new)
        assert header_calls(WarpRole.SETUP, CAUSAL, template=edited) != expected_calls(
            protocol(CAUSAL), WarpRole.SETUP
        )
    assert header_calls(WarpRole.SETUP, CAUSAL) == expected_calls(protocol(CAUSAL), WarpRole.SETUP)
