"""`dv_out_first on`: with dK and dV by TMA, dV staged in its dead V rows and stored before the
last m-block's dQ (its store then reads under that dQ's wgmma and adds), dK's after it
(sm90_bwd_lag.cuh). The key through the IR, the template and the tuner; its refusal without
dK and dV by TMA; the plan the sync pass places (dV's bulk group left in flight until the
exit's wait) and its proof; the header read against it (tests/test_backward_dkv_tma.py's
shapes edit the header with it too); the build's SASS (dV's TMA store before the last
wgmma)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

import fadsl
from backward_header import expected_calls, header_calls
from fadsl.build.resources import can_compile
from fadsl.errors import SpecError
from fadsl.ir import Dtype
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward.emit import context
from fadsl.targets.sm90.backward.program import Guard, Kind, LoopPhase, Params, StagedTile
from fadsl.targets.sm90.backward.program import WarpRole
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.tune_space import candidates
from fadsl.targets.sm90.backward.verify import check_protocol
from fadsl.tools import sass
from training_specs import training_spec

FILE = "dv_out_first.fa"
# the lagged consumer's dQ splits with dK and dV by TMA: transposed (B_r 80), by head_dim
# panels (B_r 64), by queries (head_dim 64, B_r 128), one consumer
LAG = Params(2, 2, 128, overlap=True, block_m=64, dq_red=True, dq_lag=True, dkv_tma=True)
SHAPES = (
    LAG,
    replace(LAG, block_m=80, stages=3),
    replace(LAG, head_dim=64, block_m=128, ds_stmatrix=True, dq_first=True),
    Params(1, 1, 64, overlap=True, dq_red=True, dq_lag=True, dkv_tma=True),
)


def _after(p: Params) -> list:
    return [x for x in protocol(p).consumer if x.phase is LoopPhase.AFTER]


def test_the_key_reaches_the_ir_and_the_cfg():
    text = training_spec("fa3_causal+dv_out_first")
    compiled = compile_source(text, FILE)
    bwd = compiled.kernel.backward
    assert bwd.dv_out_first and bwd.dkv_tma
    assert " dv_out_first=on" in bwd.text()
    assert read_backward(bwd.text(), bwd.loc).dv_out_first
    assert Params.of(bwd, 128).dv_out_first
    assert context(compiled.kernel, Dtype.BF16)["dv_out_first"]
    plain = compile_source(training_spec("fa3_causal"), FILE).kernel
    assert not plain.backward.dv_out_first and not context(plain, Dtype.BF16)["dv_out_first"]


def test_it_is_refused_where_dv_is_stored_from_registers():
    text = training_spec("fa3_causal-dkv_tma+dv_out_first")
    with pytest.raises(SpecError) as info:
        compile_source(text, FILE)
    (d,) = info.value.diagnostics
    assert "dv_out_first on (dV staged and stored by TMA before the last m-block's dQ)" in (
        d.message
    )
    assert "dV stored from registers" in d.message and d.message.endswith("leave it off")
    line = text.split("\n")[d.loc.line - 1]
    assert line[d.loc.col - 1 :].startswith("dv_out_first")


@pytest.mark.parametrize("p", SHAPES, ids=lambda p: p.describe())
def test_dvs_store_goes_before_the_last_dq_and_the_plan_is_proven(p):
    """dV's staging, fence, barrier, TMA store and commit open the epilogue; the last dQ
    (its lagged wgmma and adds) follows with no bulk wait between (dV's store reads on under
    it); dK's staging waits for every warpgroup's last dQ; one wait at the exit names both
    stores. Without the key dV's store follows the last dQ."""
    first = replace(p, dv_out_first=True)
    after = _after(first)
    kinds = [x.kind for x in after]
    store_v = next(n for n, x in enumerate(after) if x.kind is Kind.TMA_STORE)
    last_dq = next(n for n, x in enumerate(after) if x.kind is Kind.WGMMA)
    assert after[0].kind is Kind.ST_SHARED and after[0].writes[0].buffer is StagedTile.V
    assert store_v < last_dq and after[last_dq].guard is Guard.LAGGED
    assert kinds[store_v + 1] is Kind.BULK_COMMIT
    assert kinds.count(Kind.BULK_WAIT_READ) == 1 and kinds[-1] is Kind.BULK_WAIT_READ
    stage_k = next(n for n, x in enumerate(after) if n > last_dq and x.kind is Kind.ST_SHARED)
    assert after[stage_k].writes[0].buffer is StagedTile.K
    assert check_protocol(protocol(first)) == ()
    # the header's epilogue makes the plan's calls in the plan's order
    assert header_calls(WarpRole.CONSUMER, first) == expected_calls(
        protocol(first), WarpRole.CONSUMER
    )
    plain = [x.kind for x in _after(p)]
    assert plain.index(Kind.WGMMA) < plain.index(Kind.TMA_STORE)


def test_a_bulk_wait_right_after_the_loop_would_serialize_dvs_store():
    """The pass leaves dV's TMA store in flight at the loop's exit point (bulk.wait_at_exit
    with stores=False): no cp.async.bulk.wait_group between dV's commit and dK's staging."""
    after = _after(replace(LAG, dv_out_first=True))
    commit_v = next(n for n, x in enumerate(after) if x.kind is Kind.BULK_COMMIT)
    stage_k = next(n for n, x in enumerate(after) if x.kind is Kind.ST_SHARED and n > commit_v)
    between = {x.kind for x in after[commit_v:stage_k]}
    assert not between & {Kind.BULK_WAIT, Kind.BULK_WAIT_READ}


def test_the_tuner_flips_it_where_dk_and_dv_go_by_tma():
    tma = compile_source(training_spec("fa3_causal"), FILE).kernel.backward
    flipped = [c for c in candidates(tma, True) if c.settings.get("dv_out_first") == "on"]
    assert len(flipped) == 1 and ", dV stored before the last dQ" in flipped[0].label
    registers = compile_source(training_spec("fa3_causal-dkv_tma"), FILE).kernel.backward
    assert not any("dv_out_first" in c.settings for c in candidates(registers, True))
    # a block with the key: candidates without dK and dV by TMA turn it off
    first = compile_source(training_spec("fa3_causal+dv_out_first"), FILE).kernel.backward
    for c in candidates(first, True):
        stored = c.paths.get("dK", "tma") is None or "scheduler" in c.settings
        if stored or not c.settings.get("dq_lag", "on") == "on":
            assert c.settings.get("dv_out_first") == "off", c.label


def test_the_build_issues_dvs_tma_store_before_the_last_wgmma():
    """In the SASS (NVRTC, nvdisasm): with the key dV's TMA stores (UTMASTG, one per 64-column
    panel) come before the kernel's last HGMMA (the last m-block's dQ); without it every TMA
    store follows it."""
    disassembler = sass.nvdisasm()
    if not can_compile() or disassembler is None:
        pytest.skip("needs NVRTC and nvdisasm")
    before = {}
    for name in ("fa3_causal+dv_out_first", "fa3_causal"):
        backward = fadsl.load(training_spec(name), verbose=False)._backward_kernels()
        text = sass.disassemble(backward.cubin(Dtype.BF16, "sm_90a").cubin, disassembler)
        ins = [line for line in text.split("\n") if re.search(r"/\*[0-9a-f]+\*/\s+\S", line)]
        stores = [n for n, line in enumerate(ins) if "UTMASTG" in line]
        last_wgmma = max(n for n, line in enumerate(ins) if "HGMMA" in line)
        assert len(stores) == 4, (name, stores)  # dK's and dV's two panels each
        before[name] = sum(n < last_wgmma for n in stores)
    assert before == {"fa3_causal+dv_out_first": 2, "fa3_causal": 0}, before


# the syncs after the loop that dV's early store and dK's store need (dV's commit is not: the
# exit's wait retires both stores' reads either way), by kind and occurrence from the
# epilogue's first step (dV's staging)
NEEDED = {
    "dV's proxy fence": (Kind.FENCE_PROXY_ASYNC_SMEM, 0),
    "dV's barrier": (Kind.NAMED_BAR_SYNC, 0),
    "the wait for every warpgroup's last dQ": (Kind.MBAR_WAIT, 1),
    "dK's proxy fence": (Kind.FENCE_PROXY_ASYNC_SMEM, 1),
    "dK's barrier": (Kind.NAMED_BAR_SYNC, 1),
    "dK's commit": (Kind.BULK_COMMIT, 1),
    "the exit's wait_group.read": (Kind.BULK_WAIT_READ, 0),
}


@pytest.mark.parametrize("what", NEEDED)
@pytest.mark.parametrize("p", SHAPES[:2], ids=lambda p: p.describe())
def test_each_sync_of_the_reordered_epilogue_is_needed(p, what):
    """Each, left out of the plan with `dv_out_first on` (two consumers), fails the proof."""
    proto = protocol(replace(p, dv_out_first=True))
    consumer = proto.consumer
    tail = next(n for n, x in enumerate(consumer) if x.phase is LoopPhase.AFTER)
    kind, nth = NEEDED[what]
    at = [n for n, x in enumerate(consumer) if n >= tail and x.kind is kind][nth]
    if kind is Kind.MBAR_WAIT:  # (the first is the last dQ's wait for its dS^T)
        assert consumer[at].guard is Guard.LAGGED and consumer[at].mbar.value == "ds_empty"
    mutant = proto.with_role(WarpRole.CONSUMER, consumer[:at] + consumer[at + 1 :])
    assert check_protocol(mutant), f"{what} left out: still proven"
