"""`peel_dead on`: in the lagged consumer, a warpgroup whose keys the tile's first m-block
masks entirely (causal at B_r 64, B_c 128: the diagonal n-block's second warpgroup) peels
that m-block: no product, its dS^T rows stored as zeros and the m-block's hand-over kept
(fadsl/targets/sm90/backward/peel.py; sm90_bwd_lag.cuh). The key through the IR and the
template; its refusals; the peeled items against a listing of the header's hand-over; the
proof with every warpgroup peeled or not, and each peeled item needed (the written-bytes
rule for the zeros' store); the header read against the plan, and edits of its peel caught.
The gradients: tests/test_gpu_backward.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from backward_header import lag_edits_missed
from fadsl.errors import SpecError
from fadsl.ir import Dtype
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward.emit import context
from fadsl.targets.sm90.backward.program import (
    Guard,
    Index,
    Kind,
    LoopPhase,
    Mbar,
    Params,
    Reg,
    StagedTile,
    WaitParity,
    WarpRole,
)
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.verify import check_protocol, peel_cases
from fadsl.targets.sm90.backward.verify_space import parameter_space
from training_specs import training_spec

ROOT = Path(__file__).resolve().parents[1]

FILE = "peel_dead.fa"
# fa3_causal's block, the head_dim 64 one's (dQ by queries), one consumer, dQ for the writers
CAUSAL = Params(
    2, 2, 128, overlap=True, dq_red=True, dq_lag=True, ds_stmatrix=True, dkv_tma=True,
    peel_dead=True,
)  # fmt: skip
SHAPES = (
    CAUSAL,
    replace(CAUSAL, head_dim=64, block_m=128, dkv_tma=False, dq_first=True),
    Params(1, 2, 128, overlap=True, dq_red=True, dq_lag=True, peel_dead=True),
    replace(CAUSAL, dq_red=False, dq_writer=True, deterministic=True, dkv_tma=False),
)
PEELED_SPACE = [p for p in parameter_space() if p.peel_dead]


def _peeled(p: Params) -> list:
    return [x for x in protocol(p).consumer if x.phase is LoopPhase.PEELED]


def test_the_key_reaches_the_ir_and_the_cfg():
    compiled = compile_source(training_spec("fa3_causal+peel_dead"), FILE)
    bwd = compiled.kernel.backward
    assert bwd.peel_dead and " peel_dead=on" in bwd.text()
    assert read_backward(bwd.text(), bwd.loc).peel_dead
    assert Params.of(bwd, 128).peel_dead
    assert context(compiled.kernel, Dtype.BF16)["peel_dead"]
    plain = compile_source(training_spec("fa3_causal-peel_dead"), FILE).kernel
    assert not plain.backward.peel_dead and not context(plain, Dtype.BF16)["peel_dead"]
    assert not Params.of(plain.backward, 128).peel_dead


REFUSALS = {
    "fa3_causal-dq_lag+peel_dead": "dq_lag off",
    "fa3_hopper+peel_dead": "B_r = 80",
    "fa3_causal+persistent+peel_dead": "scheduler persistent",
}


@pytest.mark.parametrize("name", REFUSALS)
def test_it_is_refused_where_it_is_not_built(name):
    text = training_spec(name)
    with pytest.raises(SpecError) as info:
        compile_source(text, FILE)
    (d,) = [d for d in info.value.diagnostics if "peel_dead" in d.message]
    assert d.message.startswith("peel_dead on (a warpgroup whose keys are all masked")
    assert REFUSALS[name] in d.message and d.message.endswith("leave it off")
    line = text.split("\n")[d.loc.line - 1]
    assert line[d.loc.col - 1 :].startswith("peel_dead")


def test_it_is_refused_with_a_window_and_taken_with_modifiers():
    """A window is refused (not yet timed or tested with it); a keep modifier (it only
    narrows the causal mask the peel's test reads) and the modifier examples with their
    learnable inputs take it."""
    text = training_spec("fa3_causal+peel_dead")
    window = text.replace("mask       causal", "mask       causal, window(300)")
    assert window != text
    with pytest.raises(SpecError) as info:
        compile_source(window, FILE)
    assert any(
        "peel_dead on" in d.message and "a sliding window" in d.message
        for d in info.value.diagnostics
    ), [d.message for d in info.value.diagnostics]
    kept = text.replace(
        "mask       causal", "mask       causal\n  keep       kv_idx <= q_idx + 7000"
    )
    assert kept != text and compile_source(kept, FILE).kernel.backward.peel_dead
    document = (ROOT / "examples" / "modifiers" / "document_causal.fa").read_text()
    bwd = compile_source(document, "document_causal.fa").kernel.backward
    assert bwd.peel_dead and Params.of(bwd, 128).peel_dead
    # (ALiBi's example does not ship it, 0.97x at 16k; its learnable slopes take it)
    alibi = (ROOT / "examples" / "modifiers" / "alibi_causal.fa").read_text()
    lagged = alibi.replace("    dq_lag     on\n", "    dq_lag     on\n    peel_dead  on\n")
    assert lagged != alibi and compile_source(lagged, FILE).kernel.backward.peel_dead


@pytest.mark.parametrize("p", PEELED_SPACE, ids=lambda p: p.describe())
def test_the_peeled_m_block_is_the_headers_hand_over(p):
    """The slot's q_full wait, the warpgroup's dS^T rows stored as zeros (by the store the
    loop uses), the proxy fence, the buffer's ds_full arrival, the slot's q_empty arrival: in
    that order, the loop's own syncs (their whys), nothing else; without the key, none."""
    peeled = _peeled(p)
    shapes = [(x.kind, x.mbar, x.slot, x.parity, x.guard) for x in peeled]
    assert shapes == [
        (Kind.MBAR_WAIT, Mbar.Q_FULL, Index.RING, WaitParity.RING, Guard.ALWAYS),
        (Kind.ST_SHARED, None, Index.NONE, None, Guard.ALWAYS),
        (Kind.FENCE_PROXY_ASYNC_SMEM, None, Index.NONE, None, Guard.ALWAYS),
        (Kind.MBAR_ARRIVE, Mbar.DS_FULL, Index.ALTERNATE, None, Guard.ALWAYS),
        (Kind.MBAR_ARRIVE, Mbar.Q_EMPTY, Index.RING, None, Guard.ALWAYS),
    ]
    store = peeled[1]
    assert store.reg_reads == (Reg.ZEROS,) and store.writes[0].buffer is StagedTile.DS
    assert all(x.why for x in peeled if x.is_sync)
    assert not _peeled(replace(p, peel_dead=False))


def test_every_warpgroup_is_proven_peeled_or_not():
    assert peel_cases(CAUSAL) == (frozenset(), {0}, {1}, {0, 1})
    assert peel_cases(replace(CAUSAL, peel_dead=False)) == (frozenset(),)


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.describe())
def test_each_peeled_item_is_needed(p):
    """The plan is proven; each peeled item left out fails the proof: the q_full wait (the
    slot's release before its loads landed), the zeros' store (dQ reads bytes no warpgroup
    stored for the m-block), the fence, either arrival (a hang)."""
    proto = protocol(p)
    assert check_protocol(proto) == ()
    consumer = proto.consumer
    at = [n for n, x in enumerate(consumer) if x.phase is LoopPhase.PEELED]
    assert len(at) == 5
    for n in at:
        mutant = proto.with_role(WarpRole.CONSUMER, consumer[:n] + consumer[n + 1 :])
        assert check_protocol(mutant), f"{consumer[n].kind.value} left out: still proven"


def test_a_dropped_ds_store_in_the_loop_is_caught_without_the_peel_too():
    """The written-bytes rule (verify_written.py) holds every plan: the loop's dS^T store
    left out, the next dQ reads the buffer's bytes of two m-blocks before."""
    proto = protocol(replace(CAUSAL, peel_dead=False))
    consumer = proto.consumer
    (n,) = [
        n
        for n, x in enumerate(consumer)
        if x.kind is Kind.ST_SHARED and x.phase is LoopPhase.LOOP and x.writes[0].buffer is StagedTile.DS
    ]  # fmt: skip
    found = check_protocol(proto.with_role(WarpRole.CONSUMER, consumer[:n] + consumer[n + 1 :]))
    assert any("that no warpgroup stored for m-block" in f for f in found), found


# edits of the header's peel (sm90_bwd_lag.cuh) that the header check must catch
EDITS = {
    "the zeros' fence dropped": (
        "fence_proxy_async_smem();\n      mbar_arrive(bwd_bar_ds_full<Cfg>(smem, run_i % 2));",
        "mbar_arrive(bwd_bar_ds_full<Cfg>(smem, run_i % 2));",
    ),
    "the slot's release dropped": (
        "mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));  // WAR: the slot is read no more",
        "// WAR: the slot is read no more",
    ),
    "the q_full wait dropped": (
        "mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(run_i / Cfg::kStages) & 1u);\n      uint32_t zeros",
        "uint32_t zeros",
    ),
    "the other buffer armed": (
        "mbar_arrive(bwd_bar_ds_full<Cfg>(smem, run_i % 2));  // RAW: this thread's part of dS^T(0)",
        "mbar_arrive(bwd_bar_ds_full<Cfg>(smem, 1));  // RAW: this thread's part of dS^T(0)",
    ),
    "dS^T's registers stored": (
        "store_ds<Cfg>(ds_buf, zeros, wg, warp, lane);\n      }\n      // RAW: the zeros'",
        "store_ds<Cfg>(ds_buf, ds16, wg, warp, lane);\n      }\n      // RAW: the zeros'",
    ),
}  # fmt: skip
LOOP_FROM_FIRST = "for (int i = i_first; i < b.m_count; ++i)"


@pytest.mark.parametrize("what", EDITS)
def test_an_edited_peel_is_caught(what):
    old, new = EDITS[what]
    cases = (SHAPES[2], replace(CAUSAL, ds_stmatrix=False))
    missed = lag_edits_missed(old, new, cases)
    assert missed == [], f"{what}: occurrence(s) {missed} not caught"


def test_a_loop_from_m_block_0_after_the_peel_is_caught():
    with pytest.raises(AssertionError, match="m-block 0 run twice"):
        lag_edits_missed(LOOP_FROM_FIRST, "for (int i = 0; i < b.m_count; ++i)", SHAPES[:1])
    # without the key i_first stays 0: a loop from 0 makes the same calls
    plain = (replace(CAUSAL, peel_dead=False),)
    assert lag_edits_missed(LOOP_FROM_FIRST, "for (int i = 0; i < b.m_count; ++i)", plain) == [0]


# bwd_keys_dead (sm90_bwd_lag.cuh) on the host, against the mask by brute force: for each
# n-block of B_r 64, B_c 128 blocks, causal or not, at lengths with ragged ends and
# seqlen_q != seqlen_k both ways, whether each warpgroup's 64 keys are masked for every query
# row of the n-block's first m-block (bwd_block_at's m_begin)
DEAD_LENGTHS = [(1, 1), (128, 128), (1024, 1024), (1000, 333), (300, 1100), (64, 1000)]
DEAD_LENGTHS += [(257, 700), (130, 2000), (2000, 130), (192, 190)]
# (seqlen_k - seqlen_q = 1 or -63 mod 64: a first key at the edge or one past it; keys that
# end where a warpgroup's start)
DEAD_LENGTHS += [(100, 101), (300, 365), (200, 137), (129, 130), (64, 65), (100, 192), (50, 64)]
DEAD_PROGRAM = r"""
#include "fadsl/sm90_bwd.cuh"
#include <cstdio>
using namespace fadsl::sm90;
struct causal : BwdConfig<__nv_bfloat16, 128, 64, 128, 2, 2, true, false> {};
struct plain : BwdConfig<__nv_bfloat16, 128, 64, 128, 2, 2, false, false> {};
template <class Cfg>
void run(int causal_flag) {
  const int lengths[][2] = {%s};
  for (const auto& l : lengths) {
    BwdParamsSm90 P{};
    P.seqlen_q = l[0];
    P.seqlen_k = l[1];
    P.m_blocks = (l[0] + Cfg::kBlockM - 1) / Cfg::kBlockM;
    P.group = 1;
    const int n_blocks = (l[1] + Cfg::kBlockN - 1) / Cfg::kBlockN;
    for (int x = 0; x < n_blocks; ++x) {
      const BwdBlock b = bwd_block_at<Cfg>(P, x, 0, 0, n_blocks, 1, 1);
      if (b.m_count == 0) continue;
      printf("%%d %%d %%d %%d %%d", causal_flag, l[0], l[1], b.n0, b.m_begin);
      for (int wg = 0; wg < 2; ++wg) printf(" %%d", bwd_keys_dead<Cfg>(b.n0 + 64 * wg, l[1], b.m_begin, l[1] - l[0]) ? 1 : 0);
      printf("\n");
    }
  }
}
int main() {
  run<causal>(1);
  run<plain>(0);
}
"""


def _all_masked(causal: bool, sq: int, sk: int, key0: int, first_m: int) -> bool:
    rows = range(first_m * 64, first_m * 64 + 64)
    return all(
        k >= sk or (causal and k > q + sk - sq) for q in rows for k in range(key0, key0 + 64)
    )


def test_the_headers_dead_test_is_the_masks(tmp_path):
    from host_program import run_host_program

    lengths = ", ".join(f"{{{sq}, {sk}}}" for sq, sk in DEAD_LENGTHS)
    found = run_host_program(tmp_path, "dead", DEAD_PROGRAM % lengths).split("\n")
    rows = [list(map(int, line.split())) for line in found if line.strip()]
    assert {(c, sq, sk) for c, sq, sk, *_ in rows} == {
        (c, sq, sk) for c in (0, 1) for sq, sk in DEAD_LENGTHS
    }
    for causal, sq, sk, n0, first_m, *dead in rows:
        for wg in (0, 1):
            expected = _all_masked(bool(causal), sq, sk, n0 + 64 * wg, first_m)
            assert dead[wg] == expected, (causal, sq, sk, n0, first_m, wg)
    # fa3_causal at 1k: the diagonal's second warpgroup in each of the 8 n-blocks, no other
    square = [r for r in rows if r[:3] == [1, 1024, 1024]]
    assert [r[5:] for r in square] == [[0, 1]] * 8
    # the keys' end: 700 keys leave the last n-block's second warpgroup none, causal or not
    assert all(r[5:] == [0, 1] for r in rows if r[1:4] == [257, 700, 640])
