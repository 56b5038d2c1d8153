"""Every sm_90a example's forward kernel, as rendered, makes exactly the syncs of the plan that
verify proved: per role (the producer's and the consumers' branches), the same calls in the
same order. Until 2026-11-30 the emitter moved every elected epilogue item into the TMA
store's block, and fa3_decode_paged's wait for the previous tile's store then followed O's
stmatrix, a WAR the proof orders and the kernel did not (found by the FP8 kernels' version of
this check, tests/test_fp8_codegen.py)."""

from __future__ import annotations

import re

import pytest

from conftest import ROOT
from emitted_syncs import emitted_syncs, planned_syncs, rendered

SM90 = sorted(
    p
    for p in list((ROOT / "examples").glob("*.fa")) + list((ROOT / "examples").glob("*/*.fa"))
    if re.search(r"^\s*target\s+sm_90a\b", p.read_text(), re.M)
)
PRODUCER = "===================== producer warpgroup ====================="
CONSUMERS = "===================== consumer warpgroups ====================="


@pytest.mark.parametrize("spec", SM90, ids=[p.stem for p in SM90])
def test_the_rendered_kernel_makes_the_proven_plans_syncs_in_order(spec):
    compiled, sources = rendered(spec)
    body = sources[0].text.split(PRODUCER, 1)[1]
    producer, consumers = body.split(CONSUMERS)
    assert emitted_syncs(producer) == planned_syncs(compiled.kernel, "producer")
    assert emitted_syncs(consumers) == planned_syncs(compiled.kernel, "consumers")


def test_the_decode_kernel_waits_for_the_previous_store_before_writing_o():
    compiled, sources = rendered(ROOT / "examples/serving/fa3_decode_paged.fa")
    text = sources[0].text
    wait = text.index("if (warp == 0 && elect_one()) tma_store_wait_read<0>();")
    assert wait < text.index("store_o_smem<Cfg>(")
