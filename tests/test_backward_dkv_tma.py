"""dK and dV by TMA through the dead K and V tiles (`dK: rf -stmatrix-> smem[warpgroup] -tma->
gmem`, dV's alike): the spec's paths and their refusals, the plan the sync pass places and the
proof that needs each of its syncs, the header's epilogue read against that plan (and each
edit of it caught), and the host's tensor maps."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from backward_header import LAG_HEADER, expected_calls, header_calls, lag_edits_missed
from conftest import ROOT
from fadsl.errors import SpecError
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward import host, launch_plan
from fadsl.targets.sm90.backward.program import (
    Guard,
    Kind,
    LoopPhase,
    Mbar,
    Named,
    Params,
    StagedTile,
    WaitParity,
    WarpRole,
    Who,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import check_protocol
from fadsl.targets.sm90.host.tma import MAP_BYTES

EXAMPLES = ROOT / "examples"
TMA = "rf -stmatrix-> smem[warpgroup] -tma-> gmem"
# the lagged consumer's shapes: dQ transposed (B_r 80), by head_dim panels (B_r 64), by
# queries (head_dim 64, B_r 128), dQ after dV and before it
LAG = Params(2, 2, 128, overlap=True, block_m=80, dq_red=True, dq_lag=True, dkv_tma=True)
SHAPES = (
    LAG,
    replace(LAG, stages=3),
    replace(LAG, block_m=64),
    replace(LAG, head_dim=64, block_m=128, ds_stmatrix=True, dq_first=True),
    Params(1, 1, 64, overlap=True, dq_red=True, dq_lag=True, dkv_tma=True),
    # `dv_out_first on`: dV's staging and store before the last dQ
    replace(LAG, dv_out_first=True),
    replace(LAG, block_m=64, ds_stmatrix=True, dv_out_first=True),
    Params(1, 1, 64, overlap=True, dq_red=True, dq_lag=True, dkv_tma=True, dv_out_first=True),
)


def _block(name: str) -> str:
    return (EXAMPLES / f"{name}.fa").read_text()


def _errors(text: str) -> list[tuple[int, str]]:
    with pytest.raises(SpecError) as info:
        compile_source(text, "t.fa")
    return [(d.loc.line, d.message) for d in info.value.diagnostics]


def _line(text: str, part: str) -> int:
    (found,) = [n for n, line in enumerate(text.split("\n"), 1) if part in line]
    return found


# --- the spec --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fa3_hopper", "fa3_causal", "fa3_hdim64_causal"])
def test_the_lagged_examples_store_dk_and_dv_by_tma(name):
    bwd = compile_source(_block(name), f"{name}.fa").kernel.backward
    assert bwd.dkv_tma and bwd.dq_lag and not bwd.persistent
    assert {t.role.value: t.path_text() for t in bwd.tensors}["dK"] == TMA
    assert read_backward(bwd.text(), bwd.loc).dkv_tma  # (the IR's text form keeps it)


def test_the_persistent_example_keeps_its_register_stores():
    bwd = compile_source(_block("fa3_hdim64"), "fa3_hdim64.fa").kernel.backward
    assert bwd.persistent and not bwd.dkv_tma


def test_dk_and_dv_take_one_path():
    text = _block("fa3_causal").replace(f"dV: {TMA}", "dV: rf -st.global-> gmem")
    ((line, message),) = _errors(text)
    assert line == _line(text, "dV: rf -st.global")
    assert "dV goes the way dK goes" in message and TMA in message


@pytest.mark.parametrize(
    "old,new,refusal",
    [
        ("dq_lag     on", "dq_lag     off", "dq_lag off"),
        ("    overlap    on\n", "    overlap    on\n    scheduler  persistent\n", "persistent"),
    ],
)
def test_the_tma_paths_are_refused_where_not_built(old, new, refusal):
    text = _block("fa3_causal")
    assert text.count(old) == 1
    text = text.replace(old, new)
    found = _errors(text)
    assert any(
        line == _line(text, f"dK: {TMA}") and refusal in m and "from registers" in m
        for line, m in found
    ), found


def test_the_staging_lives_in_its_warpgroup():
    text = _block("fa3_causal").replace(f"dK: {TMA}", "dK: rf -stmatrix-> smem[cta] -tma-> gmem")
    found = _errors(text)
    assert any(
        line == _line(text, "dK: rf -stmatrix-> smem[cta]") and "smem[warpgroup]" in m
        for line, m in found
    ), found


# --- the plan and its proof -------------------------------------------------------------------


def _epilogue_start(items) -> int:
    """Where the epilogue's first step (dV's staging) is in a consumer program."""
    return next(
        n for n, x in enumerate(items) if x.kind is Kind.ST_SHARED and x.phase is LoopPhase.AFTER
    )


def _epilogue(p: Params) -> list:
    items = protocol(p).consumer
    return list(items[_epilogue_start(items) :])


@pytest.mark.parametrize("p", [s for s in SHAPES if not s.dv_out_first], ids=lambda p: p.describe())
def test_the_pass_places_the_epilogue_syncs(p):
    """dV staged and stored, the wait for every warpgroup's last dQ (it reads K), dK staged
    and stored, the read retired before the exit: each store behind its writers' proxy fence
    and the warpgroup's barrier, the commit after it."""
    kinds = [(x.kind, x.who) for x in _epilogue(p)]
    staged = [
        (Kind.ST_SHARED, Who.WARPGROUP),
        (Kind.FENCE_PROXY_ASYNC_SMEM, Who.WARPGROUP),
        (Kind.NAMED_BAR_SYNC, Who.WARPGROUP),
        (Kind.TMA_STORE, Who.LEADER),
        (Kind.BULK_COMMIT, Who.LEADER),
    ]
    wait = (Kind.MBAR_WAIT, Who.WARPGROUP)
    assert kinds == staged + [wait] + staged + [(Kind.BULK_WAIT_READ, Who.LEADER)]
    items = _epilogue(p)
    assert [x.writes[0].buffer for x in items if x.kind is Kind.ST_SHARED] == [
        StagedTile.V,
        StagedTile.K,
    ]
    w = items[5]
    assert (w.mbar, w.parity, w.guard) == (Mbar.DS_EMPTY, WaitParity.ALTERNATE, Guard.LAGGED)
    assert {x.named for x in items if x.kind is Kind.NAMED_BAR_SYNC} == {Named.DQ}
    assert check_protocol(protocol(p)) == ()


NEEDED = {
    "the wait for every warpgroup's last dQ": (Kind.MBAR_WAIT, 0),
    "dV's proxy fence": (Kind.FENCE_PROXY_ASYNC_SMEM, 0),
    "dK's proxy fence": (Kind.FENCE_PROXY_ASYNC_SMEM, 1),
    "dV's barrier": (Kind.NAMED_BAR_SYNC, 0),
    "dK's barrier": (Kind.NAMED_BAR_SYNC, 1),
    "dK's commit": (Kind.BULK_COMMIT, 1),
    "the exit's wait_group.read": (Kind.BULK_WAIT_READ, 0),
}


@pytest.mark.parametrize("what", NEEDED)
@pytest.mark.parametrize("p", SHAPES[:1] + SHAPES[3:4], ids=lambda p: p.describe())
def test_each_epilogue_sync_is_needed(p, what):
    """Each sync the pass placed after the loop for the stores, left out, fails the proof (dV's
    commit alone is not: the exit's wait retires both stores' reads either way)."""
    kind, nth = NEEDED[what]
    proto = protocol(p)
    tail = _epilogue_start(proto.consumer)
    at = [n for n, x in enumerate(proto.consumer) if n >= tail and x.kind is kind][nth]
    mutant = proto.with_role(WarpRole.CONSUMER, proto.consumer[:at] + proto.consumer[at + 1 :])
    assert check_protocol(mutant), f"{what} left out: still proven"


def test_the_wait_on_another_parity_is_refused():
    proto = protocol(LAG)
    start = _epilogue_start(proto.consumer)
    at = next(n for n in range(start, len(proto.consumer)) if proto.consumer[n].mbar)
    assert proto.consumer[at].mbar is Mbar.DS_EMPTY
    wrong = replace(proto.consumer[at], parity=WaitParity.ALTERNATE_PREVIOUS)
    items = proto.consumer[:at] + (wrong,) + proto.consumer[at + 1 :]
    assert check_protocol(proto.with_role(WarpRole.CONSUMER, items))


# --- the header ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.describe())
def test_the_header_makes_the_plans_epilogue(p):
    assert header_calls(WarpRole.CONSUMER, p) == expected_calls(protocol(p), WarpRole.CONSUMER)


STAGE_V = "      stage_grad_kv<Cfg>(v_wg, dv, warp, lane, 1.f);\n"
STAGE_K = "      stage_grad_kv<Cfg>(k_wg, dk, warp, lane, P.softmax_scale);\n"
EMPTY_WAIT = (
    "        mbar_wait_parity(bwd_bar_ds_empty<Cfg>(smem, last % 2), "
    "static_cast<uint32_t>(last / 2) & 1u);\n"
)
WAIT_BLOCK = (
    "      if (b.m_count > 0) {\n        const int last = run.m0 + b.m_count - 1;\n"
    "        // WAR: every warpgroup's last dQ, which read K, retired (the last dS^T buffer's "
    "empty phase)\n" + EMPTY_WAIT + "      }\n"
)
FENCE = (
    "      fence_proxy_async_smem();  // RAW: the stmatrix (generic proxy) before the TMA store "
    "reads it (async proxy)\n"
)
BARRIER = (
    "      named_bar_sync(Cfg::kBarDQ + wg, 128);  // RAW: every thread's part of the rows staged "
    "and fenced\n"
)
EDITS = [
    ("no wait for the last dQ", EMPTY_WAIT, ""),
    ("the wait on the previous phase", "(last / 2) & 1u", "(last / 2 - 1) & 1u"),
    ("the wait on the other buffer", "(smem, last % 2), static_cast<uint32_t>(last / 2)", "(smem, (last + 1) % 2), static_cast<uint32_t>(last / 2)"),
    ("no proxy fence", FENCE, ""),
    ("no barrier", BARRIER, ""),
    ("no exit wait", "        tma_store_wait_read<0>();  // both stores read their tiles before the CTA exits\n", ""),
    ("dK staged before the wait", WAIT_BLOCK + STAGE_K, STAGE_K + WAIT_BLOCK),
    ("dV staged in K's rows", STAGE_V, "      stage_grad_kv<Cfg>(k_wg, dv, warp, lane, 1.f);\n"),
    ("dK's store by every thread", "      if (tid == 0) {\n        store_grad_kv_tma<Cfg>(k_wg", "      {\n        store_grad_kv_tma<Cfg>(k_wg"),
]  # fmt: skip


@pytest.mark.parametrize("what,old,new", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_epilogue_is_caught(what, old, new):
    assert LAG_HEADER.count(old) in (1, 2, 3), what  # (dV's block twice: dv_out_first's first)
    missed = lag_edits_missed(old, new, SHAPES)
    assert not missed, f"{what} (occurrences {missed}): the edited header still matches"


# --- the host ------------------------------------------------------------------------------


def test_the_maps_sit_where_the_header_reads_them():
    """BwdParamsSm90 is 1152 bytes with tma_dk and tma_dv at 896 and 1024 (sm90_bwd.cuh's
    static_assert and the host's offsets agree), and a plan's slots name both maps."""
    header = (ROOT / "emit/sm90/include/fadsl/sm90_bwd.cuh").read_text()
    assert "static_assert(sizeof(BwdParamsSm90) == 1152," in header
    fields = header.split("struct BwdParamsSm90 {", 1)[1].split("};", 1)[0]
    assert re.findall(r"CUtensorMap (tma_\w+);", fields)[-2:] == ["tma_dk", "tma_dv"]
    assert (host.DKV_MAPS_OFFSET, host.MAIN_BYTES) == (896, 896 + 2 * MAP_BYTES)
    assert host.FUSED_OFFSET + host.FUSED.size <= host.DKV_MAPS_OFFSET


def test_a_plan_patches_both_maps():
    addresses = dict.fromkeys(host.ADDRESS_NAMES, 0) | {"dk": 1, "dv": 2}
    call = host.PackedCall(None, (), (), addresses, True, dkv_maps=True)
    sizes = type("S", (), {"parts": (), "fused": False})()
    call = call._replace(sizes=sizes)
    found = [s for s in launch_plan.slots("", call) if s.offset >= host.DKV_MAPS_OFFSET]
    assert [(s.offset, s.source, s.tensor_map) for s in found] == [
        (host.DKV_MAPS_OFFSET, "dk", True),
        (host.DKV_MAPS_OFFSET + MAP_BYTES, "dv", True),
    ]
    without = call._replace(dkv_maps=False)
    assert not [s for s in launch_plan.slots("", without) if s.offset >= host.DKV_MAPS_OFFSET]


def test_gqa_keeps_the_register_stores():
    """Under GQA the group's dK and dV are fp32 sums per K/V head: no maps, and the header's
    runtime branch stores them from registers."""
    kernel = compile_source(_block("fa3_causal"), "fa3_causal.fa").kernel
    sizes = lambda store: type("S", (), {"dkv_store": store})()  # noqa: E731
    assert host.stores_dkv_by_tma(kernel, sizes(host.DKV_STORE_T))
    assert not host.stores_dkv_by_tma(kernel, sizes(host.DKV_ADD_FP32))
    assert not host.stores_dkv_by_tma(kernel, sizes(host.DKV_STORE_PARTIAL))
    assert "if (P.dkv_store == kDkvStoreT) {" in LAG_HEADER
