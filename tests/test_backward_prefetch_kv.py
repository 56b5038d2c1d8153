"""`prefetch_kv on`: the producer fetches into the L2 the K and V tiles of the CTA launched a
wave after its own (sm90_bwd_producer.cuh, bwd_prefetch_later_kv). The key through the IR,
the template and the tuner; its refusal with `scheduler persistent`; the header's branch read
against the plan (it makes none of the plan's calls, and the reader walks it); the build's
SASS (one L2 tensor prefetch per K and V panel, none without the key)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from backward_header import HEADER, SPLIT_HEADER, expected_calls, header_calls
from host_program import run_host_program
from cpp_reader import function, strip
import fadsl
from fadsl.build.resources import can_compile
from fadsl.errors import SpecError
from fadsl.ir import Dtype
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward.emit import context
from fadsl.targets.sm90.backward.program import Params, WarpRole
from fadsl.targets.sm90.backward.protocol import protocol
from fadsl.targets.sm90.backward.tune_space import candidates
from fadsl.tools import sass
from training_specs import training_spec

FILE = "prefetch.fa"
EXAMPLES = ("fa3_hopper", "fa3_causal", "fa3_hdim64_causal")
# the producers the key reaches: the lagged consumer's (B_r 80 and 64), the meeting's, and
# head_dim 256's split producer
SHAPES = (
    Params(2, 2, 128, overlap=True, block_m=80, dq_red=True, dq_lag=True, prefetch_kv=True),
    Params(2, 2, 128, overlap=True, block_m=64, dq_red=True, dq_lag=True, prefetch_kv=True),
    Params(2, 2, 64, overlap=True, prefetch_kv=True),
    Params(2, 2, 256, dq_red=True, block_n=80, prefetch_kv=True),
)


def compiled(name: str):
    return compile_source(training_spec(name), FILE)


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_key_reaches_the_ir_and_the_template(example):
    kernel = compiled(f"{example}+prefetch_kv").kernel
    bwd = kernel.backward
    assert bwd.prefetch_kv and " prefetch_kv=on" in bwd.text()
    assert read_backward(bwd.text(), bwd.loc).prefetch_kv
    assert context(kernel, kernel.config.dtypes[0])["prefetch_kv"]
    plain = compiled(example).kernel
    assert not plain.backward.prefetch_kv and "prefetch_kv" not in plain.backward.text()
    assert not context(plain, plain.config.dtypes[0])["prefetch_kv"]
    assert Params.of(bwd, kernel.config.head_dim).prefetch_kv


def test_it_is_refused_with_persistent_ctas_at_the_key():
    text = training_spec("fa3_hdim64+prefetch_kv")  # (its block says scheduler persistent)
    assert re.search(r"^\s*scheduler\s+persistent\b", text, re.M)
    with pytest.raises(SpecError) as err:
        compile_source(text, FILE)
    message = str(err.value)
    line = next(n for n, x in enumerate(text.split("\n"), 1) if "prefetch_kv on" in x)
    assert f"{FILE}:{line}:" in message and "scheduler persistent" in message, message
    assert compile_source(training_spec("fa3_hdim64+prefetch_kv-persistent"), FILE)


def test_a_wrong_word_is_refused():
    text = training_spec("fa3_causal+prefetch_kv").replace("prefetch_kv on", "prefetch_kv often")
    with pytest.raises(SpecError, match="prefetch_kv"):
        compile_source(text, FILE)


@pytest.mark.parametrize("params", SHAPES, ids=lambda p: p.describe())
def test_the_producer_makes_the_plans_calls_with_the_key(params):
    # the plan is the block's without the key: the prefetch orders nothing
    without = replace(params, prefetch_kv=False)
    for role in (WarpRole.PRODUCER, WarpRole.CONSUMER, WarpRole.SETUP):
        assert expected_calls(protocol(params), role) == expected_calls(protocol(without), role)
        assert header_calls(role, params) == expected_calls(protocol(params), role), role


@pytest.mark.parametrize("params", SHAPES[1::2], ids=lambda p: p.describe())
def test_the_reader_walks_the_prefetch_branch(params):
    # a barrier arrival slipped into the branch is found (so the branch is read, not skipped)
    call = "if constexpr (Cfg::kPrefetchKv) bwd_prefetch_later_kv<Cfg>(P);"
    assert HEADER.count(call) == SPLIT_HEADER.count(call) == 1
    slipped = call[:-1] + "; mbar_arrive(bwd_bar_kv<Cfg>(smem)); }"
    slipped = slipped.replace("bwd_prefetch", "{ bwd_prefetch", 1)
    edited, split = (text.replace(call, slipped) for text in (HEADER, SPLIT_HEADER))
    found = header_calls(WarpRole.PRODUCER, params, header=edited, split_header=split)
    assert found != expected_calls(protocol(params), WarpRole.PRODUCER)
    off = replace(params, prefetch_kv=False)  # (the branch is not compiled without the key)
    found = header_calls(WarpRole.PRODUCER, off, header=edited, split_header=split)
    assert found == expected_calls(protocol(off), WarpRole.PRODUCER)


def test_the_prefetch_touches_no_smem_and_no_barrier():
    _, body = function(strip(HEADER), r"void bwd_prefetch_later_kv\(")
    calls = set(re.findall(r"\b(\w+)(?:<[^<>()]*>)?\(", body))
    # the later CTA's block, from the grid's shape and %nsmid, and the L2 prefetch: nothing else
    allowed = {"static_assert", "sm_id_count", "bwd_launched_after", "bwd_block_at"}
    assert calls == allowed | {"tma_prefetch_l2_4d"}, calls
    assert "smem" not in body


def test_the_tuner_flips_the_key_on_the_grid():
    for example, flips in (("fa3_causal", True), ("fa3_hdim64", False)):
        bwd = compiled(example).kernel.backward
        flipped = [c for c in candidates(bwd, True) if c.settings.get("prefetch_kv") == "on"]
        assert bool(flipped) == flips, example
    on = compiled("fa3_causal+prefetch_kv").kernel.backward
    to_persistent = [c for c in candidates(on, True) if "scheduler" in c.settings]
    assert to_persistent and all(c.settings["prefetch_kv"] == "off" for c in to_persistent)


def test_the_build_prefetches_each_panel_of_k_and_v():
    disassembler = sass.nvdisasm()
    if not can_compile() or disassembler is None:
        pytest.skip("needs NVRTC and nvdisasm")
    counts = {}
    for name in ("fa3_causal+prefetch_kv", "fa3_causal"):
        backward = fadsl.load(training_spec(name), verbose=False)._backward_kernels()
        text = sass.disassemble(backward.cubin(Dtype.BF16, "sm_90a").cubin, disassembler)
        counts[name] = len(re.findall(r"UTMAPF\.L2\.4D", text))
    # K and V of head_dim 128: two 64-column panels each
    assert counts == {"fa3_causal+prefetch_kv": 4, "fa3_causal": 0}, counts


LAUNCHED_AFTER = r"""
#include "fadsl/sm90_bwd.cuh"
#include <cstdio>
using namespace fadsl::sm90;
int main() {
  int x, y, z, gx, gy, gz, ahead;
  while (scanf("%d %d %d %d %d %d %d", &x, &y, &z, &gx, &gy, &gz, &ahead) == 7) {
    const BwdGridPos p = bwd_launched_after(x, y, z, gx, gy, gz, ahead);
    printf("%d %d %d %d\n", p.ok ? 1 : 0, p.x, p.y, p.z);
  }
}
"""


def test_the_later_cta_is_the_one_launched_that_many_places_after(tmp_path):
    # grids of the examples' shapes, a varlen grid's long x, one CTA; waves of H100/H200 SMs
    grids = [(8, 16, 16), (13, 3, 1), (1, 1, 1), (3_000_000, 32, 1), (5, 7, 9)]
    cases = []
    for gx, gy, gz in grids:
        total = gx * gy * gz
        for at in sorted({0, 1, gx - 1, gx, total // 2, total - 1}):
            if at >= total:
                continue
            for ahead in (0, 1, 132, 144, total):
                x, y, z = at % gx, at // gx % gy, at // (gx * gy)
                cases.append((x, y, z, gx, gy, gz, ahead))
    stdin = "".join(" ".join(map(str, c)) + "\n" for c in cases)
    out = run_host_program(tmp_path, "launched_after", LAUNCHED_AFTER, stdin).split()
    assert len(out) == 4 * len(cases)
    for k, (x, y, z, gx, gy, gz, ahead) in enumerate(cases):
        ok, lx, ly, lz = map(int, out[4 * k : 4 * k + 4])
        later = x + gx * (y + gy * z) + ahead
        assert ok == (later < gx * gy * gz), (x, y, z, gx, gy, gz, ahead)
        if ok:
            assert (lx, ly, lz) == (later % gx, later // gx % gy, later // (gx * gy))
