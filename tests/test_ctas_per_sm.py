"""`ctas_per_sm N` (sm_90a, the forward's attention kernel): two CTAs resident on an SM.

Without a GPU: the key through the config and its IR line, located refusals where the
setmaxnreg split or the SMEM plan does not fit an SM twice, the launch bounds and register
pool the kernel is built with (NVRTC: 128 registers a thread at launch, no spills for the
decode example's one-consumer shape at 40 / 216), explain's lines, and the persistent grids
that count two CTAs an SM while a kv-cache call's pieces stay planned per SM. The GPU runs it:
research/probes/decode_two_ctas.py timed the same build (docs/serving.md, "Two CTAs an SM")."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import fadsl.targets.sm90.host.kvcache as kvcache
import fadsl.targets.sm90.host.launch as launch
import fadsl.targets.sm90.host.varlen as varlen
from conftest import ROOT
from decode_text import DECODE, one_cta
from fadsl.cli import main
from fadsl.build.spill_check import check_registers, find_compiler
from fadsl.codegen.render import render
from fadsl.errors import SpecError
from fadsl.ir.printer import format_kernel
from fadsl.pipeline import compile_source
from fadsl.targets.sm90.caps import (
    default_registers,
    launch_registers,
    register_pool,
    registers_asked,
    smem_limit,
)
from fadsl.targets.sm90.config import read_config

VARLEN = (ROOT / "examples" / "serving" / "fa3_varlen_causal.fa").read_text()
PAGED = one_cta(DECODE)  # the decode example at one CTA an SM
ONE_CONSUMER_REGS = re.compile(r"^(\s*)registers\s+producer = 56, consumers = 256.*$", re.M)


def _two(text: str = PAGED, regs: str = "producer = 40, consumers = 216") -> str:
    """The decode example at two CTAs an SM with ``regs`` as its setmaxnreg split."""
    return ONE_CONSUMER_REGS.sub(rf"\1registers  {regs}\n\1ctas_per_sm 2", text, count=1)


def _refusal(text: str) -> str:
    with pytest.raises(SpecError) as err:
        compile_source(text, "s.fa")
    return str(err.value)


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_the_register_pool_and_smem_share_halve_at_two_ctas():
    assert launch_registers(256) == 256 and launch_registers(256, 2) == 128
    assert launch_registers(384, 2) == 80 and register_pool(256, 2) == 256 * 128
    assert smem_limit(1) == 227 * 1024  # one CTA: sm_90a's per-CTA cap
    assert smem_limit(2) == 228 * 1024 // 2 - 1024  # each of two, less its reserved kilobyte


def test_the_decode_example_ships_two_ctas_an_sm():
    assert PAGED != DECODE and "ctas_per_sm" not in PAGED
    shipped = compile_source(DECODE, "s.fa").kernel.config
    assert replace(shipped, key_locs=()) == replace(
        compile_source(_two(), "s.fa").kernel.config, key_locs=()
    )
    assert shipped.ext.ctas_per_sm == 2


def test_the_key_reaches_the_config_and_its_ir_line():
    kernel = compile_source(_two(), "s.fa").kernel
    ext = kernel.config.ext
    assert ext.ctas_per_sm == 2 and (ext.producer_regs, ext.consumer_regs) == (40, 216)
    assert " ctas_per_sm=2" in ext.text() and read_config(ext.text()) == ext
    assert read_config(replace(ext, ctas_per_sm=1).text()).ctas_per_sm == 1
    assert "ctas_per_sm" not in replace(ext, ctas_per_sm=1).text()  # the default: no word
    assert "ctas_per_sm=2" in format_kernel(kernel)
    assert compile_source(PAGED, "s.fa").kernel.config.ext.ctas_per_sm == 1


def _cuda(text: str) -> str:
    compiled = compile_source(text, "s.fa")
    return render(compiled.kernel, compiled.target, compiled.file)[0].text


def test_the_kernel_is_built_for_two_ctas_an_sm():
    two = _cuda(_two())
    assert "__launch_bounds__(Cfg::kThreads, 2) fa3_decode_paged_bf16(" in two
    # the pool the static_assert holds the split to is the halved launch allocation
    assert '<= Cfg::kThreads * 128, "register pool"' in two
    one = _cuda(PAGED)
    assert "__launch_bounds__(Cfg::kThreads, 1) fa3_decode_paged_bf16(" in one
    assert '<= Cfg::kThreads * 256, "register pool"' in one


def test_a_split_over_the_halved_pool_is_refused_with_one_that_fits():
    text = _two(regs="producer = 56, consumers = 256")
    message = _refusal(text)
    line = _line_of(text, "registers")
    assert f"s.fa:{line}:" in message
    assert "over the CTA's pool of 32768" in message and "at ctas_per_sm 2" in message
    assert "with producer = 56, consumers = 200 fits" in message
    # the suggested split compiles
    assert compile_source(_two(regs="producer = 56, consumers = 200"), "s.fa").kernel


def test_a_plan_that_does_not_fit_the_sm_twice_is_refused_at_the_key():
    text = _two().replace("stages     2 ", "stages     3 ", 1)
    assert "stages     3" in text
    message = _refusal(text)
    line = _line_of(text, "ctas_per_sm")
    assert f"s.fa:{line}:15: ctas_per_sm 2: the SMEM plan needs at least" in message
    assert f"over the {smem_limit(2)} each of 2 CTAs may have" in message
    # one CTA an SM takes the same plan
    one = text.replace("  ctas_per_sm 2\n", "").replace("producer = 40", "producer = 56")
    assert compile_source(one.replace("consumers = 216", "consumers = 256"), "s.fa").kernel


@pytest.mark.parametrize("value", ["0", "3", "two"])
def test_a_count_out_of_range_is_refused_where_it_stands(value):
    text = _two().replace("ctas_per_sm 2", f"ctas_per_sm {value}")
    message = _refusal(text)
    assert f"s.fa:{_line_of(text, 'ctas_per_sm')}:15:" in message


def test_explain_and_check_say_two_ctas(capsys, tmp_path):
    spec = tmp_path / "two.fa"
    spec.write_text(_two())
    assert main(["explain", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "(ctas_per_sm 2: that many CTAs share an SM's 65536)" in out
    assert "256 threads x 128, the CTA's pool" in out
    assert main(["check", str(spec), "--no-compile"]) == 0
    assert "per SM    2 CTAs at once (ctas_per_sm 2)" in capsys.readouterr().out


def test_the_compiler_builds_it_at_128_registers_without_spills():
    """ptxas's count is the launch allocation (setmaxnreg moves registers within it): 128 a
    thread at two CTAs an SM, none spilled at the decode example's 40 / 216."""
    compiler, name = find_compiler()
    if compiler is None:
        pytest.skip(name)
    check = check_registers(compile_source(_two(), "s.fa"), compiler, name)
    assert check.ran and {row.usage.registers for row in check.rows} == {128}
    assert not any(row.usage.short_of_registers for row in check.rows)


def test_persistent_grids_count_two_ctas_an_sm_and_pieces_stay_per_sm(monkeypatch):
    for module in (launch, kvcache):  # varlen's bound is launch.grid_ctas
        monkeypatch.setattr(module, "sm_count", lambda index: 132)
    two = compile_source(_two(), "s.fa").kernel
    one = compile_source(PAGED, "s.fa").kernel
    assert launch.resident_ctas(0, 1, 2) == 264 and launch.resident_ctas(0, 2, 2) == 264
    assert launch.resident_ctas(0, 1) == 132
    many = SimpleNamespace(
        q=torch.empty(128, 1, 32, 128, device="meta"),
        k_cache=torch.empty(20000, 64, 8, 128, device="meta"),
        page_table=torch.empty(128, 128),
        splits=1,
    )
    assert kvcache.tiles(two, many) == 1024
    assert kvcache.kvcache_grid(two, many) == (264, 1, 1)
    assert kvcache.kvcache_grid(one, many) == (132, 1, 1)
    few = SimpleNamespace(**{**vars(many), "q": torch.empty(1, 1, 32, 128, device="meta")})
    few.page_table = torch.empty(1, 2048)
    assert kvcache.choose_splits(two, few, 0, None) == kvcache.choose_splits(one, few, 0, None)
    # (the grid reads the config only: the varlen example's own plan is too large for two)
    varlen_one = compile_source(VARLEN, "s.fa").kernel
    ext = replace(varlen_one.config.ext, ctas_per_sm=2)
    varlen_two = replace(varlen_one, config=replace(varlen_one.config, ext=ext))
    big = SimpleNamespace(q=torch.empty(40000, 4, 128, device="meta"), cu_seqlens_q=torch.empty(2))
    assert varlen.varlen_grid(varlen_two, big) == (264, 1, 1)
    assert varlen.varlen_grid(varlen_one, big) == (132, 1, 1)


@pytest.mark.parametrize("consumers", [1, 2, 3])
def test_the_default_split_fills_the_halved_pool_and_straddles_the_launch_count(consumers):
    producer, consumer = default_registers(consumers, 2)
    threads = 128 * (1 + consumers)
    assert registers_asked(producer, consumers, consumer) <= register_pool(threads, 2)
    assert producer <= launch_registers(threads, 2) <= consumer
    assert default_registers(consumers) == default_registers(consumers, 1)


def test_without_a_registers_line_two_ctas_take_the_halved_default():
    text = ONE_CONSUMER_REGS.sub(r"\1ctas_per_sm 2", PAGED, count=1)
    assert "registers" not in text.split("kernel", 1)[1].split("{", 1)[1].split("Q:")[0]
    ext = compile_source(text, "s.fa").kernel.config.ext
    assert (ext.producer_regs, ext.consumer_regs, ext.ctas_per_sm) == (40, 216, 2)


def test_a_producer_over_the_launch_count_is_refused():
    """setmaxnreg.dec only lowers: at two CTAs a thread launches with 128 registers, so a
    producer of 152 (the pool's total would allow it beside consumers of 104) is refused."""
    text = _two(PAGED.replace("head_dim   128", "head_dim   64"), "producer = 152, consumers = 104")
    message = _refusal(text)
    line = _line_of(text, "registers")
    assert f"s.fa:{line}:" in message and "producer = 152: setmaxnreg.dec only lowers" in message
    assert "launch with 128 each at ctas_per_sm 2; use producer = 128 or fewer" in message


def test_a_split_tail_deals_its_last_round_over_two_ctas_an_sm(monkeypatch):
    """`tail split_kv`: the whole rounds before the split are whole rounds of the grid, which
    is twice the SMs (sm90_tiles.cuh's rule), and nothing is split where every tile fits."""
    monkeypatch.setattr(launch, "sm_count", lambda index: 132)
    text = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
    text = re.sub(r"^[ \t]*backward\s*\{[^}]*\}[^\n]*\n", "", text, flags=re.M)
    one = compile_source(text, "s.fa").kernel
    if not one.config.ext.split_kv:
        pytest.skip("fa3_hdim64 no longer splits its tail")
    ext = replace(one.config.ext, ctas_per_sm=2)
    two = replace(one, config=replace(one.config, ext=ext))
    assert launch.grid_ctas(two, 0) == 264 and launch.grid_ctas(one, 0) == 132
    for tiles in (150, 264, 400, 1000):
        start, splits = launch.split_plan(tiles, launch.grid_ctas(two, 0), 64)
        assert start == tiles // 264 * 264 or splits == 1, tiles  # whole rounds of 264
    # 150 tiles: one part-full round of the 264-CTA grid, split (the SM count's plan kept
    # 132 tiles whole, a round that is not the grid's)
    assert launch.split_plan(150, 264, 64)[0] == 0 and launch.split_plan(150, 132, 64)[0] == 132
