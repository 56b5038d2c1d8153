"""The backward header (emit/sm90/include/fadsl/sm90_bwd.cuh and its sections) and the
template (emit/sm90/backward.cu.j2) make exactly the sync plan's calls in its order
(backward_header.py reads them), and an edit of either is caught."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from backward_header import (
    HEADER,
    LAG_HEADER,
    SPLIT_HEADER,
    TEMPLATE,
    config_constants,
    consumer_function,
    differences,
    expected_calls,
    header_calls,
    kernel_body,
    kernel_template,
    producer_function,
    writer_function,
)
from backward_walk import MBARS, OFFSETS, evaluate
from cpp_reader import function, squash
from fadsl.targets.sm90.backward.program import (
    BAR_DQ,
    BAR_DQ_EMPTY,
    BAR_DQ_FULL,
    BAR_DS,
    Params,
    WarpRole,
    default_layout,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import (
    parameter_space,
)

from backward_cases import (
    BY_KEYS,
    BY_QUERIES,
    OVERLAPPED,
    PANELS,
    SPLITS,
    STMATRIX,
    WRITERS,
)

PARAMS = parameter_space()

# --- the header makes the protocol's calls (backward_header.py reads it) ------------------


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p.describe())
@pytest.mark.parametrize("role", list(WarpRole), ids=lambda r: r.value)
def test_the_header_makes_the_protocols_calls(role, params):
    expected, found = expected_calls(protocol(params), role), header_calls(role, params)
    assert found == expected, differences(expected, found)


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("a dropped wait_read", "if (tid == 0) tma_store_wait_read<0>();", ""),
        ("a flipped parity", "phase ^ 1u);", "phase);"),
        ("one dS^T buffer", "(run_i % 2) * Cfg::kDSBytes", "0 * Cfg::kDSBytes"),
        ("wait<2>", "wgmma_wait<1>();  // S^T", "wgmma_wait<2>();  // S^T"),
        (
            "a fence moved",
            "fence_proxy_async_smem();\n      meet_and_issue_dq",
            "meet_and_issue_dq",
        ),
        ("expect_tx", "2 * Cfg::kQBytes + 2 * Cfg::kRowFloatsBytes", "2 * Cfg::kQBytes"),
        (
            "the leader's barrier",
            "named_bar_sync(Cfg::kBarDQ + wg, 128);\n    stage_dq",
            "stage_dq",
        ),
        ("no acquire fence", "fence_proxy_async_global();  // the acquire", ""),
        ("no staging fence", "fence_proxy_async_smem();\n    named_bar_sync", "named_bar_sync"),
        (
            "red.add: dQ not added",
            "    red_add_dq<Cfg>(dst, dq, tid);\n  } else if",
            "  } else if",
        ),
        (
            "no ticket released at the end",
            "if (tid == 0 && b.m_count > 0) release_dq_ticket<Cfg>(owed);",
            "",
        ),
        (
            "the ticket's release at once",
            "  tma_store_commit();\n}",
            "  tma_store_commit();\n  bulk_wait_all();\n}",
        ),
        ("no completion before the release", "  bulk_wait_all();             // the adds", ""),
    ],
)
def test_an_edited_header_is_caught(what, old, new):
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    for params in (PANELS, BY_KEYS, Params(2, 2, 64, True), replace(BY_QUERIES, dq_red=True)):
        for role in (WarpRole.PRODUCER, WarpRole.CONSUMER):
            if header_calls(role, params, edited) != expected_calls(protocol(params), role):
                return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("st.shared for stmatrix", "store_ds_stmatrix<Cfg>(ds_buf", "store_ds<Cfg>(ds_buf"),
        (
            "stmatrix for st.shared",
            "      store_ds<Cfg>(ds_buf",
            "      store_ds_stmatrix<Cfg>(ds_buf",
        ),
        ("stmatrix .trans", "store_ds_stmatrix<Cfg>(ds_buf", "store_ds_t<Cfg>(ds_buf"),
        (
            "no fence after the store",
            "      fence_proxy_async_smem();\n      // dq was read",
            "      // dq was read",
        ),
    ],
)
def test_an_edited_ds_store_is_caught(what, old, new):
    """The header stores dS^T by the instruction the spec's path names (Cfg::kDsStmatrix),
    each followed by the proxy fence before the meeting, in every order."""
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    for params in STMATRIX + (PANELS, replace(BY_QUERIES, dq_red=True, overlap=True)):
        calls = header_calls(WarpRole.CONSUMER, params, edited)
        if calls != expected_calls(protocol(params), WarpRole.CONSUMER):
            return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("no __syncwarp", "    __syncwarp();  // lane 0's wait", "    // lane 0's wait"),
        (
            "no __syncwarp after the release",
            "      __syncwarp();\n    }\n    m = i + 1",
            "    }\n    m = i + 1",
        ),
        ("no exit wait", "    if (lane == 0) bulk_wait_all();\n", ""),
        ("no empty wait", "if (i > 0) named_bar_sync(Cfg::kBarDqEmpty + wg, 160);", ""),
        (
            "no read wait",
            "    if (lane == 0) tma_store_wait_read<0>();  // WAR: the add",
            "    // WAR",
        ),
        (
            "no release",
            "st_release_gpu(dq_semaphore_share<Cfg>(P, accum_head, m, w, chain), ticket + 1);",
            "",
        ),
        (
            "no acquire",
            "while (ld_acquire_gpu(dq_semaphore_share<Cfg>(P, accum_head, m, w, chain)) != ticket)",
            "",
        ),
        (
            "an arrival after the last",
            "if (i + 1 < b.m_count) named_bar_arrive",
            "named_bar_arrive",
        ),
        (
            "no staging fence",
            "fence_proxy_async_smem();\n    named_bar_arrive(Cfg::kBarDqFull",
            "named_bar_arrive(Cfg::kBarDqFull",
        ),
        (
            "the consumer's own release",
            "Cfg::kDeterministic && !Cfg::kDqWriter) {\n    if (tid == 0 &&",
            "Cfg::kDeterministic) {\n    if (tid == 0 &&",
        ),
    ],
)
def test_an_edited_writer_header_is_caught(what, old, new):
    """`dq_writer on`: each of the writer's and the consumer's hand-over syncs, taken out of
    the header, makes its calls differ from the proven plan's."""
    assert HEADER.count(old) == 1, what
    edited = HEADER.replace(old, new)
    cases = (WRITERS[1], replace(PANELS, dq_writer=True, overlap=True), WRITERS[2], WRITERS[0])
    for params in cases:
        for role in (WarpRole.CONSUMER, WarpRole.WRITER):
            if header_calls(role, params, edited) != expected_calls(protocol(params), role):
                return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


def test_the_writers_are_called_from_the_producer_warpgroup():
    """The kernel body calls bwd_dq_writers unconditionally in warpgroup 0's branch (after
    setmaxnreg.dec), and it runs bwd_dq_writer only under `if constexpr (Cfg::kDqWriter)`."""
    assert writer_function(False) == writer_function(True) == "bwd_dq_writer"
    assert header_calls(WarpRole.WRITER, PANELS) == []
    with pytest.raises(AssertionError):
        writer_function(False, TEMPLATE.replace("    bwd_dq_writers<Cfg>(P, smem, shared);", ""))


# the overlapped order's lines, each with a neighbour that makes it the only such text
ARRIVE = "      mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));\n    } else {"
REDUCE = (
    "      reduce_dq<Cfg>(P, b, stage, dq, accum_head, m, wg, tid, owed, i);\n"
    "      FADSL_BWD_MARK(wg, i, 8);\n      wgmma_wait<0>();"
)
ISSUE = (
    "      meet_and_issue_dq<Cfg>(dq, smem, ds_buf, wg);\n"
    "      FADSL_BWD_MARK(wg, i, 6);\n      if constexpr (!Cfg::kEarlyDv &&"
)
GRADS = "      issue_grad_kv<Cfg>(dk, ds16, q_slot);\n      wgmma_commit();\n      wgmma_wait<1>();"
DV_BEFORE_MEETING = (
    "      if constexpr (Cfg::kDvBeforeMeeting) {\n"
    "        wgmma_fence();  // p16 (its A operand) and dv written by ordinary instructions\n"
    "        issue_grad_kv<Cfg>(dv, p16, do_slot);\n"
    "        wgmma_commit();\n"
    "      }\n"
)
DS_PACK = "    pack_pairs<Cfg>(dp, ds16);\n"


@pytest.mark.parametrize(
    "what,edits",
    [
        ("wait<2> before the staging", [("wgmma_wait<1>();  // dQ", "wgmma_wait<2>();  // dQ")]),
        (
            "the arrive before wait<0>",
            [
                (ARRIVE, "    } else {"),
                (
                    REDUCE,
                    REDUCE.replace(
                        "\n", "\n      mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));\n", 1
                    ),
                ),
            ],
        ),
        (
            "dQ issued after dV and dK",
            [
                (ISSUE, "      if constexpr (!Cfg::kEarlyDv &&"),
                (
                    GRADS,
                    GRADS.replace(
                        "\n", "\n      meet_and_issue_dq<Cfg>(dq, smem, ds_buf, wg);\n", 1
                    ),
                ),
            ],
        ),
        ("one dS^T buffer", [("(run_i % 2) * Cfg::kDSBytes", "0 * Cfg::kDSBytes")]),
        ("a flipped parity", [("Cfg::kStages) & 1u);", "Cfg::kStages) & 1u ^ 1u);")]),
        ("no meeting by keys", [("named_bar_sync(Cfg::kBarDQ + wg, 128);  // RAW", "// ")]),
        ("a meeting too small", [("kBarDS, Cfg::kConsumerThreads);", "kBarDS, 128);")]),
        ("no wgmma fence", [("wgmma_fence();\n      meet_and_issue_dq", "meet_and_issue_dq")]),
        (
            "early dV: wait<2> for dP^T",
            [("wgmma_wait<1>();  // dP^T", "wgmma_wait<2>();  // dP^T")],
        ),
        ("early dV: no fence for P^T", [("wgmma_fence();  // the A registers p16", "")]),
        (
            "early dV: dV in dK's group",
            [("issue_grad_kv<Cfg>(dv, p16, do_slot);\n      wgmma_commit();", "")],
        ),
        ("by queries: dS^T panel 0", [("ds_buf + wg * Cfg::kDSPanelBytes", "ds_buf")]),
        (
            "dV before the meeting: no fence",
            [("wgmma_fence();  // p16 (its A operand) and dv written", "// ")],
        ),
        (
            "dV before the meeting: issued before the dS^T store (its old place)",
            [
                (DV_BEFORE_MEETING, ""),
                (DS_PACK, DV_BEFORE_MEETING.replace("\n  ", "\n") + DS_PACK),
            ],
        ),
        (
            "dV before the meeting: dQ's fence kept",
            [("if constexpr (!Cfg::kDvBeforeMeeting) wgmma_fence();", "wgmma_fence();")],
        ),
        (
            "dV before the meeting: issued after the meeting too",
            [
                (
                    "      if constexpr (!Cfg::kEarlyDv && !Cfg::kDvBeforeMeeting) issue_grad_kv",
                    "      if constexpr (!Cfg::kEarlyDv) issue_grad_kv",
                )
            ],
        ),
    ],
)
def test_an_edited_overlap_header_is_caught(what, edits):
    edited = HEADER
    for old, new in edits:
        assert edited.count(old) == 1, (what, old)
        edited = edited.replace(old, new)
    for params in OVERLAPPED:
        found = header_calls(WarpRole.CONSUMER, params, header=edited)
        if found != expected_calls(protocol(params), WarpRole.CONSUMER):
            return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


@pytest.mark.parametrize(
    "what,old,new",
    [
        ("a dropped dO release", "    mbar_arrive(bwd_bar_do_empty<Cfg>(smem, i % Cfg::kDoStages));\n", ""),
        ("a dropped dO wait", "mbar_wait_parity(bwd_bar_do_empty<Cfg>(smem, do_slot), ((i / Cfg::kDoStages) & 1u) ^ 1u);", ""),
        ("a flipped dO parity", "static_cast<uint32_t>(i / Cfg::kDoStages) & 1u);", "(static_cast<uint32_t>(i / Cfg::kDoStages) & 1u) ^ 1u);"),
        ("dO's bytes on q_full", "bulk_load(smem + Cfg::kOffD + do_slot * Cfg::kRowFloatsBytes, P.dpsum + row0, Cfg::kRowFloatsBytes, do_full);", "bulk_load(smem + Cfg::kOffD + do_slot * Cfg::kRowFloatsBytes, P.dpsum + row0, Cfg::kRowFloatsBytes, q_full);"),
        ("no fence before dQ^T's second slice", "    wgmma_fence();  // dq was read by the adds above\n", ""),
        ("the first slice added late", "    red_add_dq<Cfg>(dq_accum_share<Cfg>(P, accum_head, m, 2 * wg), dq, tid);\n    wgmma_fence();", "    wgmma_fence();"),
        ("one P buffer", "(i % 2) * Cfg::kPBytes", "0 * Cfg::kPBytes"),
        ("the meeting of one warpgroup", "named_bar_sync(Cfg::kBarDS, Cfg::kConsumerThreads);", "named_bar_sync(Cfg::kBarDS, 128);"),
        ("dK^T's second panel on the first's", "q_panels + Cfg::kBlockM * Cfg::kRowBytes, ds_buf", "q_panels, ds_buf"),
        ("dQ^T's second slice on K's first panel", "k_panels + Cfg::kBlockN * Cfg::kRowBytes, ds_buf", "k_panels, ds_buf"),
        ("the Q slot released before dK^T retires", "    wgmma_wait<0>();  // dK^T retired: Q read\n", ""),
    ],
)  # fmt: skip
def test_an_edited_split_header_is_caught(what, old, new):
    assert SPLIT_HEADER.count(old) == 1, what
    edited = SPLIT_HEADER.replace(old, new)
    for params in SPLITS:
        for role in (WarpRole.PRODUCER, WarpRole.CONSUMER):
            found = header_calls(role, params, split_header=edited)
            if found != expected_calls(protocol(params), role):
                return
    raise AssertionError(f"{what}: the edited header still matches the protocol")


def _cfg_argument(template: str, index: int) -> str:
    """The template's ``index``-th argument of ``struct Cfg : BwdConfig<...>``."""
    (cfg,) = re.findall(r"struct Cfg : BwdConfig<(.*?)> \{", template)
    return re.split(r",\s*(?={{)", cfg)[index]


def test_an_edited_template_is_caught():
    """The kernel's Cfg must pass the block's `overlap` on (BwdConfig's kOverlap_, which
    picks bwd_consumer's order), and call bwd_consumer once, after the producer's branch."""
    overlap = '{{ "true" if overlap else "false" }}'
    assert _cfg_argument(TEMPLATE, 8) == overlap
    assert _cfg_argument(TEMPLATE.replace(overlap, '"false"'), 8) != overlap
    call = "{{ consumer }}<Cfg>(P, smem, block, warpgroup - 1);"
    with pytest.raises(ValueError):
        consumer_function(False, TEMPLATE.replace(call, call + call))


def test_the_header_agrees_on_layout_barriers_and_roles():
    for params in PARAMS:
        env = config_constants(params)
        assert (env["kBarDS"], env["kBarDQ"]) == (BAR_DS, BAR_DQ)
        assert (env["kBarDqFull"], env["kBarDqEmpty"]) == (BAR_DQ_FULL, BAR_DQ_EMPTY)
        # the writers' barriers: distinct ids of the 16, past the consumers' own
        ids = {BAR_DS} | {BAR_DQ + wg for wg in range(3)}
        writer_ids = {b + wg for b in (BAR_DQ_FULL, BAR_DQ_EMPTY) for wg in range(3)}
        assert not ids & writer_ids and len(writer_ids) == 6 and max(writer_ids) < 16
        assert env["kThreads"] == 128 * (1 + params.consumers)
        assert env["kDqByKeys"] == params.dq_by_keys and env["kDqFloats"] == params.dq_floats
        assert env["kOverlap"] == params.overlap and env["kEarlyDv"] == params.early_dv
        assert env["kDqByQueries"] == params.dq_by_queries and env["kDqRed"] == params.dq_red
        for buffer, offset, size in default_layout(params).offsets:
            name = next(k for k, v in OFFSETS.items() if v is buffer)
            assert env[name] == offset, (params, buffer)
        # the mbarriers: distinct 8-byte words inside the kNumBars the plan reserves
        words = []
        for name in MBARS:
            if "_do_" in name and not params.split:  # the dO ring's own: head_dim 256
                continue
            if name == "bwd_bar_kv_empty":  # `scheduler persistent`'s: kNumBars one more
                continue
            if "_ds_" in name or name == "bwd_bar_v_late":  # `dq_lag on`'s, `late_v on`'s: below
                continue
            _, body = function(HEADER, rf"uint32_t {name}\(")
            (expr,) = re.findall(r"return ([^;]+);", body)
            ring = params.do_stages if "_do_" in name else params.stages
            slots = range(ring) if "slot" in expr else [0]
            words += [evaluate(expr, env, smem=0, slot=s) - env["kOffBar"] for s in slots]
        assert sorted(words) == [8 * n for n in range(env["kNumBars"])]
        # kv_empty: the word after them (the persistent Cfg's kNumBars counts it)
        _, body = function(HEADER, r"uint32_t bwd_bar_kv_empty\(")
        (expr,) = re.findall(r"return ([^;]+);", body)
        assert evaluate(expr, env, smem=0) - env["kOffBar"] == 8 * env["kNumBars"]
        # dq_lag's ds_full, ds_empty per buffer: the 4 words after those (and kv_empty's), which
        # the template's kNumBars counts (4 more with dq_lag)
        _, full = function(LAG_HEADER, r"uint32_t bwd_bar_ds_full\(")
        (expr,) = re.findall(r"return ([^;]+);", full)
        expr = expr.replace("(Cfg::kPersistent ? 1 : 0)", str(int(params.persistent)))
        at = lambda buf: evaluate(expr, env, smem=0, buf=buf) - env["kOffBar"]  # noqa
        _, empty = function(LAG_HEADER, r"uint32_t bwd_bar_ds_empty\(")
        assert squash(empty) == "returnbwd_bar_ds_full<Cfg>(smem,2+buf);"
        first = env["kNumBars"] + params.persistent
        assert [at(b) for b in range(4)] == [8 * (first + n) for n in range(4)]
        # late_v's v_full: the word after dS^T's four (one tile per CTA: no kv_empty), which
        # the template's kNumBars counts (one more with late_v)
        if not params.persistent:
            _, body = function(HEADER, r"uint32_t bwd_bar_v_late\(")
            (expr,) = re.findall(r"return ([^;]+);", body)
            assert evaluate(expr, env, smem=0) - env["kOffBar"] == 8 * (first + 4)
    for overlap in (False, True):
        split = squash(kernel_body(overlap))
        assert producer_function(overlap) == "bwd_producer"
        assert "if(warpgroup==0){" in split and "threadIdx.x/32==0&&elect_one()" in split
        # the elected thread's block, then the writer warps' call (warpgroup 0's other warps)
        assert "bwd_producer<Cfg>(P,smem,block);}bwd_dq_writers<Cfg>(P,smem,shared);}else{" in split
        assert consumer_function(overlap) == "bwd_consumer"
        assert split.count("warpgroup-1);") == 1
    # head_dim 256: the kernel calls the split header's roles
    assert consumer_function(False, split=True) == "bwd_consumer_split"
    assert producer_function(False, split=True) == "bwd_producer_split"
    assert '#include "fadsl/sm90_bwd_split.cuh"' in kernel_template(False, split=True)
    # the template's Cfg passes `overlap` as BwdConfig's kOverlap_ (its ninth parameter)
    (cfg,) = re.findall(r"struct Cfg : BwdConfig<(.*?)> \{", TEMPLATE)
    head = HEADER[: HEADER.index("struct BwdConfig")]
    names = re.findall(r"(?:class|int|bool) (\w+)", head[head.rindex("template") :])
    assert names[8] == "kOverlap_" and re.split(r",\s*(?={{)", cfg)[8] == (
        '{{ "true" if overlap else "false" }}'
    )
    assert names[9] == "kEarlyDv_" and re.split(r",\s*(?={{)", cfg)[9] == (
        '{{ "true" if early_dv else "false" }}'
    )
    assert names[10] == "kDqRed_" and re.split(r",\s*(?={{)", cfg)[10] == (
        '{{ "true" if dq_red else "false" }}'
    )
