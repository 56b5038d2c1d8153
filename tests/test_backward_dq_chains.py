"""`dq_chains N` (sm90_bwd_writer.cuh): the deterministic writer warps' dQ tickets in N chains,
place p adding into chain p mod N after place p - N, each chain a copy of the m-block's
accumulator and counters, the conversion summing the chains in chain order. What a GPU is
not needed for: the key read, printed, explained and read back; refused at the key without
the deterministic writer warps or out of range; the generated Cfg's constant; the host's
workspace (N accumulators and N sets of counters per m-block); the header's layout
(evaluated: the chains' copies and the shares tile the m-block's N B_r head_dim floats and N
kDqSemaphores counters once each, chain 0's addresses those of one chain); the tuner's
candidates; and the kernels building without spills. The writer's chain and ticket
expressions: tests/test_writer_ticket_header.py. On the GPU: tests/test_gpu_backward.py
(CHAINS, DETERMINISTIC)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT
from register_usage import assert_no_spills, kernel_usages
from fadsl.codegen.render import render_backward
from fadsl.errors import SpecError
from fadsl.targets import target_of
from fadsl.ir.backward import read_backward
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.backward import host
from fadsl.targets.sm90.backward.tune_space import candidates, knobs_of, label_of
from fadsl.tools.report import explain_data, explain_text
from training_specs import training_spec

FILE = "chains.fa"
WRITER = "fa3_hdim64+deterministic+dq_writer-dqred+p32"
HEADER = ROOT / "emit" / "sm90" / "include" / "fadsl"


def chains(n: int, base: str = WRITER) -> str:
    return training_spec(f"{base}+chains{n}")


def test_the_key_is_read_printed_explained_and_read_back():
    for n in (2, 3, 4):
        compiled = compile_source(chains(n), FILE)
        bwd = compiled.kernel.backward
        assert bwd.dq_chains == n
        assert f" dq_writer=on dq_chains={n}" in bwd.text()
        assert read_backward(bwd.text(), bwd.loc).dq_chains == n
        assert explain_data(compiled)["backward"]["settings"]["dq_chains"] == n
        assert f"dq_chains {n} (dQ's ordered adds in {n} chains" in explain_text(compiled)
    one = compile_source(chains(1), FILE)
    assert one.kernel.backward.dq_chains == 1 and "dq_chains" not in one.kernel.backward.text()
    assert "dq_chains" not in explain_data(one)["backward"]["settings"]
    assert (
        one.kernel.backward.text()
        == compile_source(training_spec(WRITER), FILE).kernel.backward.text()
    )


@pytest.mark.parametrize(
    "name, why",
    [
        ("fa3_hdim64-deterministic+dq_writer-dqred+p32", "deterministic off"),
        ("fa3_hdim64+deterministic-dq_writer", "dq_writer off"),
        ("fa3_hdim64-deterministic-dq_writer", "deterministic off"),
    ],
)
def test_without_the_deterministic_writer_it_is_refused_at_the_key(name, why):
    text = training_spec(f"{name}+chains2")
    with pytest.raises(SpecError) as info:
        compile_source(text, FILE)
    found = [d for d in info.value.diagnostics if d.message.startswith("dq_chains 2")]
    assert found and why in found[0].message, [d.message for d in info.value.diagnostics]
    assert "use dq_chains 1 (the default)" in found[0].message
    line = next(i for i, l in enumerate(text.split("\n"), 1) if "dq_chains 2" in l)
    assert found[0].loc.line == line


@pytest.mark.parametrize("value", ["0", "5", "two"])
def test_a_count_out_of_range_is_refused_at_the_number(value):
    text = chains(2).replace("dq_chains 2", f"dq_chains {value}")
    with pytest.raises(SpecError) as info:
        compile_source(text, FILE)
    (found,) = [d for d in info.value.diagnostics if "dq_chains" in d.message]
    line_no, line = next(
        (i, l) for i, l in enumerate(text.split("\n"), 1) if f"dq_chains {value}" in l
    )
    assert (found.loc.line, found.loc.col) == (line_no, line.index(value) + 1)
    assert ("out of range (1 to 4)" if value != "two" else "must be a number") in found.message


def test_the_cfg_sets_the_chains_and_one_chain_sets_nothing():
    for n, expected in ((1, None), (2, "2"), (4, "4")):
        kernel = compile_source(chains(n), FILE).kernel
        source, *_ = render_backward(kernel, target_of(kernel), FILE)
        source = source.text
        found = re.findall(r"static constexpr int kDqChains = (\d+);", source)
        assert found == ([expected] if expected else []), found
        assert ("in %d chains of tickets (dq_chains)" % n in source) == (n > 1)


def _workspace(n: int, seqlen: int = 1000, batch: int = 2, heads: int = 3):
    kernel = compile_source(chains(n), FILE).kernel
    q = torch.empty(batch, seqlen, heads, 64)
    layout = SimpleNamespace(rows=-(-seqlen // 128) * 128, cu_q=0)
    got = host.sizes(kernel, layout, q, q)
    parts = dict(got.parts)
    names = [name for name, _ in got.parts]
    ends = [offset for _, offset in got.parts[1:]] + [4 * got.workspace_floats]
    size = {name: (end - parts[name]) // 4 for name, end in zip(names, ends)}
    return got, size


def test_the_workspace_holds_each_chains_accumulator_and_counters():
    one, size_one = _workspace(1)
    for n in (2, 3, 4):
        got, size = _workspace(n)
        rows = 2 * 3 * got.rows
        assert size["dq_accum"] >= n * rows * 64 > size_one["dq_accum"] * (n - 1)
        # kDqSemaphores = 2 (dQ by queries: a share per consumer) per chain and m-block
        counters = 2 * 3 * got.m_blocks * 2 * n
        assert counters <= size["semaphore"] < counters + host.WORKSPACE_ALIGN
    assert 2 * 3 * one.m_blocks * 2 <= size_one["semaphore"]


def _function(text: str, name: str) -> str:
    start = re.search(rf"\b{name}\(", text).start()
    return text[start : text.index("\n}\n", start)]


def _cpp_int(expr: str, names: dict) -> int:
    """A header's integer expression evaluated (C's / on non-negative ints is //)."""
    expr = re.sub(r"static_cast<\w+>", "", " ".join(expr.split())).replace("Cfg::", "")
    expr = re.sub(r"(bwd_dq_\w+)<Cfg>\(\)", r"\1", expr)  # (the constexpr functions: in names)
    assert re.fullmatch(r"[\w\s()+*/%?:]+", expr), expr
    expr = re.sub(r"\(([^()?]+)\?([^():]+):([^()]+)\)", r"((\2) if \1 else (\3))", expr)
    return eval(expr.replace("/", "//"), {}, names)


def test_the_chains_and_shares_tile_the_m_blocks_floats_and_counters_once():
    """dq_accum_share's and dq_semaphore_share's offsets (the header's expressions) over every
    (m-block, chain, share): disjoint kDqFloats runs covering bwd_dq_block_floats per m-block,
    counters covering bwd_dq_counters, and chain 0's the layout of one chain."""
    text = (HEADER / "sm90_bwd_dq_reduce.cuh").read_text()
    floats = re.search(r"bwd_dq_block_floats\(\) \{.*?return (.+?);", text, re.S)[1]
    counters = re.search(r"bwd_dq_counters\(\) \{.*?return (.+?);", text, re.S)[1]
    accum = re.search(r"return P\.dq_accum \+ (.+?);", _function(text, "dq_accum_share"), re.S)[1]
    counter = re.search(r"return P\.dq_semaphore \+ (.+?);", _function(text, "dq_semaphore_share"))[
        1
    ]
    for n, shares in ((1, 2), (2, 2), (3, 2), (4, 2)):
        names = dict(kBlockM=128, kHeadDim=64, kDqChains=n, kDqSemaphores=shares)
        names |= dict(kDqFloats=64 * 64, kDqByKeys=False, accum_head=0)
        per_block = _cpp_int(floats, names)
        per_counters = _cpp_int(counters, names)
        names |= dict(bwd_dq_block_floats=per_block, bwd_dq_counters=per_counters)
        assert (per_block, per_counters) == (128 * 64 * n, shares * n)
        runs, ints = [], []
        for m in range(3):
            for chain in range(n):
                for share in range(shares):
                    at = dict(names, m=m, chain=chain, share=share)
                    runs.append(_cpp_int(accum, at))
                    ints.append(_cpp_int(counter, at))
                    if chain == 0:  # (one chain's layout: before dq_chains)
                        assert runs[-1] == m * 128 * 64 * n + share * 64 * 64
        assert sorted(runs) == list(range(0, 3 * per_block, 64 * 64))
        assert sorted(ints) == list(range(3 * per_counters))


def test_the_preprocess_zeroes_and_the_conversion_sums_every_chain():
    """The preprocess zeroes each chain's copy of a row and the counters of every chain; the
    conversion's loads go through load_dq_chains, which sums the chains in chain order."""
    prep = (HEADER / "sm90_bwd_prep.cuh").read_text()
    # (chains past one are the deterministic writer's, whose first tickets store: the
    # accumulator's zeroing is one chain's alone)
    zero = prep[prep.index("if constexpr (!bwd_dq_stored_first<Cfg>()) {") :]
    zero = zero[: zero.index("\n}\n")]
    assert 'static_assert(Cfg::kDqChains == 1, "more chains than one' in zero
    assert "P.dq_accum + at * Cfg::kHeadDim" in zero
    assert "share < bwd_dq_counters<Cfg>()" in prep
    loads = _function(prep, "bwd_dq_unit_load")
    assert loads.count("load_dq_chains<Cfg, kL2>(") == 2 and "load_dq_accum" not in loads
    summed = _function(prep, "load_dq_chains")
    assert "for (int chain = 1; chain < Cfg::kDqChains; ++chain)" in summed
    assert summed.count("+= part[chain].") == 4


def test_the_tuner_flips_the_chains_of_the_deterministic_writer():
    base = compile_source(chains(2), FILE).kernel.backward
    found = candidates(base, causal=False)
    flips = [c for c in found if c.settings == {"dq_chains": "1"}]
    assert len(flips) == 1 and "chains" not in flips[0].label
    assert label_of(base).endswith(", dQ tickets in 2 chains")
    assert knobs_of(base) != knobs_of(compile_source(chains(1), FILE).kernel.backward)
    # the writer's candidates keep the input's chains, the others set one
    for c in found:
        if c.settings.get("dq_writer") == "off":
            assert c.settings.get("dq_chains") == "1", c
    one = compile_source(chains(1), FILE).kernel.backward
    assert [c.settings for c in candidates(one, False) if "dq_chains" in c.settings] == [
        {"dq_chains": "2"}
    ]
    plain = compile_source(training_spec("fa3_hdim64"), FILE).kernel.backward
    assert not any("dq_chains" in c.settings for c in candidates(plain, False))


@pytest.mark.parametrize(
    "name",
    [
        f"{WRITER}+chains2",
        f"{WRITER}+chains3",
        f"{WRITER}+chains4",
        "fa3_hopper+deterministic+dq_writer-dqred+s2+chains2",
    ],
)
def test_the_chained_kernels_build_without_spills(name):
    compiled = compile_source(training_spec(name), FILE)
    assert compiled.kernel.backward.dq_chains > 1
    assert_no_spills(kernel_usages(compiled))


def test_the_writers_chains_start_with_a_store_and_unwritten_chains_read_zero():
    """With the deterministic writer warps (bwd_dq_stored_first) each chain's ticket 0 stores
    (tests/test_writer_ticket_header.py: the store's condition), so the preprocess zeroes
    only the counters, and the conversion reads a chain whose share-0 counter stayed 0 as
    zeros; elsewhere every chain is zeroed and read. The conversion's counters travel third
    among its pointers, where the host packs them."""
    reduce = (HEADER / "sm90_bwd_dq_reduce.cuh").read_text()
    first = _function(reduce, "bwd_dq_stored_first")
    assert "return Cfg::kDeterministic && Cfg::kDqWriter;" in first
    store = _function(reduce, "bulk_store_or_add_f32")
    assert re.search(r"if \(store\) \{\s*bulk_store_f32\(dst, smem_src, bytes\);", store)
    prep = (HEADER / "sm90_bwd_prep.cuh").read_text()
    row = _function(prep, "bwd_preprocess_row")
    skip = row.index("if constexpr (!bwd_dq_stored_first<Cfg>()) {")
    assert skip < row.index("zero[0] = zero[1]") and row.index("P.dq_semaphore[") < skip
    written = _function(prep, "bwd_dq_written")
    assert "if constexpr (bwd_dq_stored_first<Cfg>())" in written
    assert "counts[chain * Cfg::kDqSemaphores] != 0" in written
    assert "return bwd_dq_all_chains<Cfg>();" in written
    chains = _function(prep, "load_dq_chains")
    assert "(written >> chain) & 1u ? load_dq_accum<kL2>(" in chains
    assert ": make_float4(0.f, 0.f, 0.f, 0.f);" in chains
    header = (HEADER / "sm90_bwd.cuh").read_text()
    fields = header[header.index("struct BwdConvertParams {") :]
    fields = fields[: fields.index("};")]
    pointers = re.findall(r"^\s*(?:const )?\w+\* (\w+);", fields, re.M)
    assert pointers[:3] == ["dq_accum", "dq", "dq_semaphore"], pointers
    assert host.CONVERT_ADDRESSES == ("dq_accum", "dq", "semaphore")
    assert host.CONVERT.size == 80 and "sizeof(BwdConvertParams) == 80" in header
