"""The brute-force interleaving checker agrees with the proof on the smallest plans, and
`dq_lag on`'s hand-over (dS^T through ds_full / ds_empty) is proven, each broken variant
refused, its header and template read against the plan."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from backward_header import (
    LAG_HEADER,
    TEMPLATE,
    consumer_function,
    expected_calls,
    header_calls,
    lag_edits_missed,
)
from bruteforce_async import explore
from fadsl.passes.asyncmodel.model import Wait
from fadsl.passes.asyncmodel.prove import check
from fadsl.targets.sm90.backward.program import (
    Guard,
    Kind,
    Mbar,
    Named,
    Params,
    WaitParity,
    LoopPhase,
    WarpRole,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import (
    parameter_space,
    build_program,
    check_protocol,
    persistent_space,
)

from backward_cases import (
    single_ds_buffer,
    LAG,
    LAGGED,
    LAG_ORDERS,
    PANELS,
    mutants,
)

PARAMS = parameter_space()

# --- the brute-force interleaving checker -------------------------------------------------

SMALL = [(Params(1, 1, 64), 1), (Params(1, 1, 64), 3), (Params(1, 2, 64), 2)]
SMALL += [(Params(2, 1, 64), 1), (Params(1, 1, 128, True), 2), (Params(2, 1, 128), 2)]
SMALL += [(Params(1, 1, 64, overlap=True), 2), (Params(1, 2, 64, overlap=True), 2)]
SMALL += [(Params(2, 1, 64, overlap=True), 1), (Params(1, 1, 128, True, True), 2)]


@pytest.mark.parametrize("params,m_count", SMALL, ids=str)
def test_bruteforce_agrees_on_the_plan(params, m_count):
    assert explore(build_program(protocol(params), m_count), all_kinds=True) == set()


MODEL_KINDS = frozenset(Kind) - {Kind.MBAR_INIT, Kind.FENCE_MBAR_INIT, Kind.SYNCTHREADS}
MODEL_KINDS -= {Kind.WGMMA_FENCE, Kind.FENCE_PROXY_ASYNC_GLOBAL, Kind.SEM_ACQUIRE}


@pytest.mark.parametrize(
    "params,m_count",
    [(Params(1, 1, 64), 2), (Params(2, 1, 64), 2), (Params(1, 1, 64, overlap=True), 2)],
)
def test_bruteforce_agrees_on_every_dropped_sync(params, m_count):
    refused = 0
    for what, mutant in mutants(
        protocol(params), lambda x: () if x.is_sync and x.kind in MODEL_KINDS else None
    ):
        program = build_program(mutant, m_count)
        found = explore(program)
        assert bool(check(program)) == bool(found), (what, found, check(program))
        refused += bool(found)
    assert refused > 5


def test_bruteforce_finds_the_single_ds_buffer_race():
    """Two stages: the correct plan has too many states for the brute force, the race not."""
    assert explore(build_program(single_ds_buffer(protocol(PANELS)), 2)) == {"race"}
    assert explore(build_program(single_ds_buffer(protocol(Params(2, 1, 128))), 2)) == set()


# --- `dq_lag on`: dS^T handed over by ds_full / ds_empty ---------------------------------


def _lag_edit(params: Params, edit) -> tuple[str, ...]:
    """The problems of the plan with its consumer's items edited by ``edit`` (a list)."""
    items = list(protocol(params).consumer)
    edit(items)
    return check_protocol(protocol(params).with_role(WarpRole.CONSUMER, tuple(items)))


def _at(items: list, kind: Kind, mbar: Mbar | None = None) -> int:
    return next(n for n, x in enumerate(items) if x.kind is kind and x.mbar is mbar)


def _drop(kind: Kind, mbar: Mbar | None = None):
    return lambda items: items.pop(_at(items, kind, mbar))


def _wrong_parity(items: list) -> None:
    n = _at(items, Kind.MBAR_WAIT, Mbar.DS_FULL)
    items[n] = replace(items[n], parity=WaitParity.ALTERNATE_PREVIOUS)


def _empty_before_its_wait(items: list) -> None:
    n = _at(items, Kind.MBAR_ARRIVE, Mbar.DS_EMPTY)
    assert items[n - 1].kind is Kind.WGMMA_WAIT and items[n - 1].pending == 1
    items[n - 1], items[n] = items[n], items[n - 1]


def _full_before_the_store(items: list) -> None:
    arrive = items.pop(_at(items, Kind.MBAR_ARRIVE, Mbar.DS_FULL))
    items.insert(next(n for n, x in enumerate(items) if x.kind is Kind.ST_SHARED), arrive)


DS = r"dS\^T\[buffer \d\][^:]*"
LAG_BREAKS = [
    ("no ds_empty wait", _drop(Kind.MBAR_WAIT, Mbar.DS_EMPTY), rf"WAR on {DS}: .*dQ = dS K"),
    ("no ds_full wait", _drop(Kind.MBAR_WAIT, Mbar.DS_FULL), rf"RAW on {DS}.*dS\^T -> smem"),
    ("ds_full's parity flipped", _wrong_parity, r"hang: wg\d .*wait on ds_full\[0\], parity 1"),
    ("ds_empty before dQ's wait_group", _empty_before_its_wait, rf"WAR on {DS}: .*dQ = dS K"),
    ("no proxy fence", _drop(Kind.FENCE_PROXY_ASYNC_SMEM), r"no fence.proxy.async by wg\d"),
    ("ds_full before the store", _full_before_the_store, rf"RAW on {DS}.*dS\^T -> smem"),
]


@pytest.mark.parametrize("what,edit,hazard", LAG_BREAKS, ids=[b[0] for b in LAG_BREAKS])
@pytest.mark.parametrize("params", LAG_ORDERS, ids=lambda p: p.describe())
def test_a_broken_lag_plan_is_refused(params, what, edit, hazard):
    """Each of the hand-over's syncs taken out, moved or given the wrong parity: the proof
    names the hazard (the dS^T bytes, the dQ or store that races) or the hang."""
    problems = _lag_edit(params, edit)
    assert any(re.search(hazard, p) for p in problems), (what, problems)


def test_one_lagged_consumer_needs_no_empty_wait():
    """A finding: with one consumer warpgroup its own wait_group retired dQ(i - 2) before
    it stores dS^T(i) (program order), so ds_empty's wait and arrivals order nothing more
    (the header keeps them: one program for every consumer count)."""
    one = LAGGED[3]
    assert one.consumers == 1
    assert _lag_edit(one, _drop(Kind.MBAR_WAIT, Mbar.DS_EMPTY)) == ()
    assert _lag_edit(one, _empty_before_its_wait) == ()


def test_the_lagged_plan_has_no_meeting():
    """`dq_lag on`: no meeting (the meeting's kBarDS replaced by the hand-over; with dK and
    dV by TMA only the warpgroup's own barrier before each store, after the loop; with the
    writer warps only the staging's hand-over to them, guarded as the lagged staging runs),
    and every hand-over sync of the loop's dQ acts for the previous m-block."""
    for params in (p for p in PARAMS if p.dq_lag):
        items = protocol(params).consumer
        met = [x for x in items if x.kind in (Kind.NAMED_BAR_SYNC, Kind.NAMED_BAR_ARRIVE)]
        writer = (Named.DQ_EMPTY, Named.DQ_FULL)
        assert [(x.phase, x.named, x.threads) for x in met if x.named not in writer] == (
            [(LoopPhase.AFTER, Named.DQ, 128)] * 2 if params.dkv_tma else []
        )
        handed = [(x.phase, x.kind, x.guard) for x in met if x.named in writer]
        staged = [
            (phase, kind, guard)
            for phase in (LoopPhase.LOOP, LoopPhase.AFTER)
            for kind, guard in (
                (Kind.NAMED_BAR_SYNC, Guard.LAGGED_AFTER_FIRST),
                (Kind.NAMED_BAR_ARRIVE, Guard.LAGGED),
            )
        ]
        assert handed == (staged if params.dq_writer else [])
        for x in items:
            if x.mbar is Mbar.DS_FULL and x.kind is Kind.MBAR_WAIT or x.mbar is Mbar.DS_EMPTY:
                lagged = x.kind is Kind.MBAR_ARRIVE or x.phase is not LoopPhase.LOOP
                assert x.guard is (
                    Guard.LAGGED if lagged or x.mbar is Mbar.DS_FULL else Guard.REUSED
                )


@pytest.mark.parametrize(
    "params", [p for p in persistent_space() if p.dq_lag], ids=lambda p: p.describe()
)
def test_the_persistent_lag_needs_the_last_empty_arrival(params):
    """`scheduler persistent`: the last dQ's ds_empty arrival after the loop is needed, as
    the next tile's stores wait on it (in a CTA of one tile it is not: LAG_LAST_EMPTY)."""
    items = list(protocol(params).consumer)
    n = max(n for n, x in enumerate(items) if x.mbar is Mbar.DS_EMPTY)
    assert items[n].phase is LoopPhase.AFTER
    problems = _lag_edit(params, lambda its: its.pop(n))
    assert any("ds_empty" in p for p in problems), problems


LAG_EDITS = [
    ("no ds_empty wait", "    if (run_i >= 2) mbar_wait_parity(bwd_bar_ds_empty<Cfg>(smem, buf), static_cast<uint32_t>(run_i / 2 - 1) & 1u);\n", ""),
    ("ds_empty from the first use", "if (run_i >= 2) mbar_wait_parity", "mbar_wait_parity"),
    ("ds_empty's parity", "static_cast<uint32_t>(run_i / 2 - 1) & 1u", "static_cast<uint32_t>(run_i / 2) & 1u"),
    ("ds_full's parity", "static_cast<uint32_t>(prev / 2) & 1u", "static_cast<uint32_t>(prev / 2 - 1) & 1u"),
    ("no fence", "    fence_proxy_async_smem();\n    mbar_arrive(bwd_bar_ds_full", "    mbar_arrive(bwd_bar_ds_full"),
    ("no ds_full wait", "      mbar_wait_parity(bwd_bar_ds_full<Cfg>(smem, prev % 2), static_cast<uint32_t>(prev / 2) & 1u);\n", ""),
    ("this buffer, not the previous", "(smem, prev % 2), static_cast", "(smem, buf), static_cast"),
    ("ds_empty before the wait_group", "      wgmma_wait<1>();  // dQ(i - 1) in registers, and dV(i) issued before it (the newest group still runs)\n      fence_regs(dq);\n      mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, prev % 2));", "      mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, prev % 2));\n      wgmma_wait<1>();\n      fence_regs(dq);"),
    ("dQ's wait_group 2", "wgmma_wait<1>();  // dQ(i - 1) in registers", "wgmma_wait<2>();  // dQ(i - 1) in registers"),
    ("no last dQ", "    issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (last % 2) * Cfg::kDSBytes, wg);\n", ""),
    ("the last dQ's wait_group 1", "    wgmma_wait<0>();  // the last dQ", "    wgmma_wait<1>();  // the last dQ"),
    ("no last ds_empty", "    mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, last % 2));", ""),
    ("dQ of this m-block's buffer", "(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes", "(dq, smem, ds_buf"),
    ("LSE before its slot's q_full wait", "    mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(run_i / Cfg::kStages) & 1u);\n    FADSL_BWD_MARK(wg, i, 1);\n\n    // LSE into registers before S^T's operands fill the SMEM pipe (q_full covered it above)\n    const uint32_t lse_slot = smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes;\n    const uint32_t d_slot = smem + Cfg::kOffD + slot * Cfg::kRowFloatsBytes;\n    const RowPairs<Cfg> lse = load_row_pairs<Cfg>(slot_rows(lse_slot, lane));\n", "    const uint32_t lse_slot = smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes;\n    const uint32_t d_slot = smem + Cfg::kOffD + slot * Cfg::kRowFloatsBytes;\n    const RowPairs<Cfg> lse = load_row_pairs<Cfg>(slot_rows(lse_slot, lane));\n    mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(run_i / Cfg::kStages) & 1u);\n"),
    ("D's registers as P's LSE", "P, lse, key0, m * Cfg::kBlockM, lane, b, prefetch_pairs<Cfg>(d_sums, slot_rows(d_slot, lane)));\n    } else {\n      bwd_probs<Cfg, false>(s, dtanh, P, lse, key0", "P, d_sums, key0, m * Cfg::kBlockM, lane, b, prefetch_pairs<Cfg>(d_sums, slot_rows(d_slot, lane)));\n    } else {\n      bwd_probs<Cfg, false>(s, dtanh, P, d_sums, key0"),
    ("LSE's registers as dS's D", "bwd_grad_scores<Cfg>(s, dp, dtanh, d_sums);", "bwd_grad_scores<Cfg>(s, dp, dtanh, lse);"),
    ("D from the slot after dP^T's wait", "bwd_grad_scores<Cfg>(s, dp, dtanh, d_sums);", "bwd_grad_scores<Cfg>(s, dp, dtanh, slot_rows(d_slot, lane));"),
    ("dV after the hand-over's fence", "    if constexpr (!Cfg::kDqFirst) {  // dV(i) first, in a group of its own, under the fence below\n      wgmma_fence();  // dv and its A registers p16, dk and ds16 written by ordinary instructions\n      issue_grad_kv<Cfg>(dv, p16, do_slot);\n      wgmma_commit();\n    }\n    // RAW: dS^T's st.shared (generic proxy) before either warpgroup's dQ wgmma reads it (async proxy)\n    fence_proxy_async_smem();\n    mbar_arrive(bwd_bar_ds_full<Cfg>(smem, buf));", "    fence_proxy_async_smem();\n    mbar_arrive(bwd_bar_ds_full<Cfg>(smem, buf));\n    if constexpr (!Cfg::kDqFirst) {\n      wgmma_fence();\n      issue_grad_kv<Cfg>(dv, p16, do_slot);\n      wgmma_commit();\n    }"),
    # `dq_first on`'s lines
    ("dq_first: dV and dK apart", "        issue_grad_kv<Cfg>(dv, p16, do_slot);\n      }\n      issue_grad_kv<Cfg>(dk, ds16, q_slot);\n      wgmma_commit();\n      wgmma_wait<1>();", "        issue_grad_kv<Cfg>(dv, p16, do_slot);\n        wgmma_commit();\n      }\n      issue_grad_kv<Cfg>(dk, ds16, q_slot);\n      wgmma_commit();\n      wgmma_wait<1>();"),
    ("dq_first: no fence in m-block 0", "    } else {\n      if constexpr (Cfg::kDqFirst) {\n        wgmma_fence();", "    } else {\n      if constexpr (Cfg::kDqFirst) {"),
    ("dq_first: the fence after dQ", "      if constexpr (Cfg::kDqFirst) {\n        wgmma_fence();  // dv and its A registers p16, dk and ds16, dq written by ordinary instructions\n      }\n      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);", "      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);\n      if constexpr (Cfg::kDqFirst) {\n        wgmma_fence();\n      }"),
    ("dq_first: dV before dQ", "      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);\n      FADSL_BWD_MARK(wg, i, 6);\n      if constexpr (Cfg::kDqFirst) {  // dV(i) after dQ(i - 1), in dK(i)'s group\n        issue_grad_kv<Cfg>(dv, p16, do_slot);\n      }", "      if constexpr (Cfg::kDqFirst) {\n        issue_grad_kv<Cfg>(dv, p16, do_slot);\n      }\n      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);\n      FADSL_BWD_MARK(wg, i, 6);"),
]  # fmt: skip


@pytest.mark.parametrize("what,old,new", LAG_EDITS, ids=[e[0] for e in LAG_EDITS])
def test_an_edited_lag_header_is_caught(what, old, new):
    """`dq_lag on`: each of bwd_consumer_lagged's hand-over calls taken out, moved or changed
    (in each order's branch, `dq_first` on or off, where both spell it) makes its calls
    differ from the proven plan's."""
    assert LAG_HEADER.count(old) in (1, 2), what
    missed = lag_edits_missed(old, new, LAGGED)
    assert (
        not missed
    ), f"{what} (occurrences {missed}): the edited header still matches the protocol"


def test_an_edited_lag_template_is_caught():
    """The template's dS^T barrier inits: both per buffer, every consumer thread, and the
    lagged consumer called with `dq_lag on`."""
    for old, new in (
        ("      mbar_init(bwd_bar_ds_empty<Cfg>(smem, buf), Cfg::kConsumerThreads);", ""),
        ("mbar_init(bwd_bar_ds_full<Cfg>(smem, buf), Cfg::kConsumerThreads)", "mbar_init(bwd_bar_ds_full<Cfg>(smem, buf), 128)"),
    ):  # fmt: skip
        assert TEMPLATE.count(old) == 1
        edited = TEMPLATE.replace(old, new)
        assert header_calls(WarpRole.SETUP, LAG, template=edited) != expected_calls(
            protocol(LAG), WarpRole.SETUP
        )
    assert consumer_function(True, dq_lag=True) == "bwd_consumer_lagged"


LAG_SMALL = LAGGED[3]  # one consumer warpgroup, one stage: the brute force's lagged plan


LAG_SMALL_FIRST = replace(LAG_SMALL, dq_first=True)  # (`dq_first on`'s order)


@pytest.mark.parametrize(
    "params,m_count",
    [(LAG_SMALL, 1), (LAG_SMALL, 2), (LAG, 1), (LAG_SMALL_FIRST, 2)],
    ids=str,
)
def test_bruteforce_agrees_on_the_lag(params, m_count):
    """`dq_lag on`: the brute force also takes the warpgroup's ds_full hand-over (every
    thread's arrival after its part of dS^T, then their wait for that phase) as ordering the
    store before dQ's wgmma, as a bar.sync would. LAG's two warpgroups of two m-blocks pass
    the brute force's state limit (400,000 states, about 35 s to give up)."""
    assert explore(build_program(protocol(params), m_count), all_kinds=True) == set()


def _fence_after_the_arrival(items: list) -> None:
    n = _at(items, Kind.FENCE_PROXY_ASYNC_SMEM)
    assert items[n + 1].kind is Kind.MBAR_ARRIVE and items[n + 1].mbar is Mbar.DS_FULL
    items[n], items[n + 1] = items[n + 1], items[n]


BRUTE_LAG_BREAKS = {  # what the brute force finds with one consumer warpgroup, two m-blocks
    "no ds_empty wait": set(),  # test_one_lagged_consumer_needs_no_empty_wait
    "no ds_full wait": {"race"},
    "ds_full's parity flipped": {"hang"},
    "ds_empty before dQ's wait_group": set(),
    "no proxy fence": {"proxy race"},
    "ds_full before the store": {"race"},
    "fence after ds_full's arrival": {"proxy race"},
}


@pytest.mark.parametrize(
    "what,edit",
    [b[:2] for b in LAG_BREAKS] + [("fence after ds_full's arrival", _fence_after_the_arrival)],
    ids=[b[0] for b in LAG_BREAKS] + ["fence after ds_full's arrival"],
)
def test_bruteforce_agrees_on_a_broken_lag_plan(what, edit):
    """The lag's hand-over broken (its wait dropped, its arrival before the store or before
    the fence, ...): the brute force finds the race (or hang) exactly when the proof refuses."""
    items = list(protocol(LAG_SMALL).consumer)
    edit(items)
    program = build_program(protocol(LAG_SMALL).with_role(WarpRole.CONSUMER, tuple(items)), 2)
    found = explore(program, all_kinds=True)
    assert found == BRUTE_LAG_BREAKS[what], (what, found)
    assert bool(found) == bool(check(program)), (what, found, check(program))


def _moved_wait(parity: int | None):
    """The one-m-block lag program with wg0's ds_full wait dropped (``parity`` None) or moved
    just before its arrival, waiting with ``parity``."""
    program = build_program(protocol(LAG_SMALL), 1)
    (agent,) = [a for a in program.agents if a.threads > 1]
    events = list(agent.events)
    (wait,) = [e for e in events if isinstance(e, Wait) and e.barrier == "ds_full[0]"]
    events.remove(wait)
    if parity is not None:
        arrive = next(n for n, e in enumerate(events) if getattr(e, "barrier", "") == "ds_full[0]")
        events.insert(arrive, replace(wait, parity=parity))
    agents = tuple(replace(a, events=tuple(events)) if a is agent else a for a in program.agents)
    return replace(program, agents=agents)


@pytest.mark.parametrize(
    "parity,kind",
    [(None, "race"), (0, "hang"), (1, "race")],
    ids=["no wait", "wait before the arrival", "wait for the phase before"],
)
def test_bruteforce_needs_the_wait_for_the_arrivals_phase(parity, kind):
    """One m-block: without ds_full's wait the store and dQ's wgmma race; the wait moved
    before the arrival hangs (wg0 is its only arriver), or with the other parity returns at
    once, for no phase wg0 arrived on, and orders nothing. The proof agrees."""
    program = _moved_wait(parity)
    assert explore(program, all_kinds=True) == {kind}
    problems = check(program)
    assert problems and (kind == "hang") == any(p.startswith("hang") for p in problems), problems
