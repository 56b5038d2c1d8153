"""Serving knobs on sm_90a without a GPU: `varlen on`, `kv_cache contiguous|paged(N)`,
`pack_gqa on` and `splits auto` in a spec (the config, its IR line, the located refusals,
explain), the host's params structs over CPU tensors (the TMA encoder replaced by a
recorder), the split count, the varlen workspace bounds, bench_varlen's lengths
(append_kv: tests/test_append_kv.py). The GPU runs the kernels: tests/test_gpu_varlen.py,
tests/test_gpu_kvcache.py."""

from __future__ import annotations

import functools
import random
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import fadsl
import fadsl.targets.sm90.host.kvcache as kvcache
import fadsl.targets.sm90.host.launch as sm90_launch
import fadsl.targets.sm90.host.tma as tma
import fadsl.targets.sm90.host.varlen as varlen
from conftest import ROOT
from decode_text import one_cta
from fadsl.cli import main
from fadsl.errors import SpecError
from fadsl.ir.printer import format_kernel
from ir_reader import read_kernel
from fadsl.pipeline import compile_source
from fadsl.targets.launch import FWD_PARAMS, FWD_PARAMS_FIELDS
from fadsl.targets.sm90.config import Sm90Config, read_config
from fadsl.targets.sm90.host.launch import DIVISORS, SM90_BASE_OFFSET, SM90_PARAMS_BYTES
from fadsl.targets.sm90.host.launch import SPLIT_TAIL, VARLEN_OFFSET, VARLEN_TAIL, fast_div
from fadsl.tools.bench_varlen import lengths_for

SPECS = ROOT / "tests" / "specs" / "sm90"
SERVING = ROOT / "examples" / "serving"
VARLEN = SERVING / "fa3_varlen_causal.fa"
VARLEN64 = SERVING / "fa3_varlen_hdim64.fa"
DECODE = SPECS / "fa3_decode.fa"  # kv_cache contiguous, pack_gqa on, splits auto
PAGED = SERVING / "fa3_decode_paged.fa"  # kv_cache paged(64), pack_gqa on, splits auto
DEC, PAGE = DECODE.read_text(), PAGED.read_text()


@functools.cache
def _kernel(text: str):
    return compile_source(text, "s.fa").kernel


def _no_backward(text: str) -> str:
    return re.sub(r"^[ \t]*backward\s*\{[^}]*\}[^\n]*\n", "", text, flags=re.M)


def _add(text: str, line: str, after: str = "  stages") -> str:
    """``text`` with ``line`` after its first line starting with ``after``."""
    lines = text.splitlines(keepends=True)
    i = next(i for i, t in enumerate(lines) if t.startswith(after))
    return "".join(lines[: i + 1] + [line + "\n"] + lines[i + 1 :])


def _swap(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


# --- the config and its IR line ----------------------------------------------------------


@pytest.mark.parametrize(
    "path, fields",
    [
        (VARLEN, dict(varlen=True, kv_cache=-1, pack_gqa=False, split_all=False, split_kv=False)),
        (VARLEN64, dict(varlen=True, kv_cache=-1, consumers=3, split_kv=False)),
        (DECODE, dict(varlen=False, kv_cache=0, pack_gqa=True, split_all=True, split_kv=True)),
        (PAGED, dict(varlen=False, kv_cache=64, pack_gqa=True, split_all=True, split_kv=True)),
    ],
    ids=lambda p: getattr(p, "stem", ""),
)
def test_each_serving_spec_compiles_to_its_config(path, fields):
    kernel = _kernel(path.read_text())
    hw = kernel.config.ext
    assert isinstance(hw, Sm90Config) and hw.cluster == 1
    assert {key: getattr(hw, key) for key in fields} == fields
    assert read_config(hw.text()) == hw
    # the IR's text form carries the knobs too
    assert read_kernel(format_kernel(kernel)).config.ext == hw


def test_the_config_line_spells_each_knob_and_reads_contiguous_as_zero():
    plain = Sm90Config(2, 2, 24, 240, 128, pingpong=True, overlap=True)
    assert not re.search(r"varlen|kv_cache|pack_gqa|splits", plain.text())
    assert read_config(plain.text()).kv_cache == -1
    for cache in (0, 16, 64, 256):
        cfg = replace(plain, consumers=1, kv_cache=cache, pack_gqa=True)
        assert f" kv_cache={cache} pack_gqa=on" in cfg.text()
        assert read_config(cfg.text()) == cfg and read_config(cfg.text()).kv_cache == cache
    split = replace(plain, kv_cache=0, split_kv=True, split_all=True)
    assert split.text().endswith(" tail=split_kv kv_cache=0 splits=auto")
    assert read_config(split.text()) == split
    assert read_config(replace(plain, varlen=True).text()).varlen
    with pytest.raises(ValueError):
        read_config(plain.text() + " kv_cache=contiguous")


# --- refusals, where they stand ----------------------------------------------------------


def _refused(text: str, key: str, col: int, fragment: str) -> str:
    """The SpecError's text: its first error ``fragment`` at ``key``'s line and ``col``, and
    the caret under that column of the quoted source line."""
    with pytest.raises(SpecError) as err:
        compile_source(text, "s.fa")
    found, lines = str(err.value), str(err.value).splitlines()
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith(f"  {key} "))
    assert lines[0].startswith(f"s.fa:{line}:{col}: ") and fragment in lines[0], found
    source = next(i for i, t in enumerate(lines) if not t.startswith("s.fa:"))
    assert lines[source].strip().startswith(key), found
    assert lines[source + 1].index("^") == 4 + col - 1, found
    return found


def _mask(text: str, value: str) -> str:
    return _swap(text, "mask       causal", f"mask       {value}")


def _paged(value: str) -> str:
    return _swap(PAGE, "kv_cache   paged(64)", f"kv_cache   {value}")


HOPPER = _no_backward((ROOT / "examples" / "fa3_hopper.fa").read_text())  # cluster 2
HDIM64 = _no_backward((ROOT / "examples" / "fa3_hdim64.fa").read_text())  # tail split_kv
CAUSAL = (ROOT / "examples" / "fa3_causal.fa").read_text()  # has a backward block
PLAIN = _no_backward(CAUSAL)
DEC_NONE = _mask(DEC, "none")


V_ON, KV = "  varlen     on", "  kv_cache   contiguous"
TAIL = _swap(DEC_NONE, "splits     auto", "tail       split_kv")
# id: (spec, the offending key, its value's column, a fragment of the message)
REFUSALS = {
    "varlen-cluster": (_add(HOPPER, V_ON), "cluster", 14, "varlen's tiles are dealt out"),
    "varlen-tail": (_add(HDIM64, V_ON), "tail", 14, "use 'tail whole' with 'varlen on'"),
    "kv-varlen": (_add(DEC, V_ON), "kv_cache", 14, "kv_cache and varlen on do not combine"),
    "kv-tail": (TAIL, "tail", 14, "with kv_cache, split the K/V blocks with 'splits auto'"),
    "paged-48": (_paged("paged(48)"), "kv_cache", 20, "page size 48: expected '16', '32', '64'"),
    "paged-4096": (_paged("paged(4096)"), "kv_cache", 20, "page size 4096: expected"),
    "paged-Bc-48": (
        _swap(PAGE, "B_c = 64", "B_c = 48"),
        "kv_cache",
        14,
        "paged(64) with B_c = 48",
    ),
    "paged-empty": (_paged("paged()"), "kv_cache", 14, "'paged' takes one number"),
    "kv-misspelt": (_paged("pagd(64)"), "kv_cache", 14, "expects 'contiguous' or 'paged(N)', not"),
    "pack-alone": (_add(PLAIN, "  pack_gqa   on"), "pack_gqa", 14, "'pack_gqa on' is for kv_cache"),
    "splits-alone": (_add(PLAIN, "  splits     auto"), "splits", 14, "'splits auto' is for kv_"),
    "pack-window": (_mask(DEC, "window(100, 30)"), "pack_gqa", 14, "with a sliding window is not"),
    "splits-grid": (_swap(DEC, "persistent", "grid"), "splits", 14, "needs 'scheduler persistent'"),
    "splits-window": (
        _mask(_swap(DEC, "pack_gqa   on", "pack_gqa   off"), "window(100, 30)"),
        "splits",
        14,
        "use 'splits off' with a window",
    ),
    "kv-backward": (_add(CAUSAL, KV), "kv_cache", 14, "is for serving; a kernel with a backward"),
    "kv-cluster": (_add(HOPPER, KV), "cluster", 14, "use 'cluster 1' with kv_cache"),
    "varlen-maybe": (_add(PLAIN, "  varlen     maybe"), "varlen", 14, "unknown varlen 'maybe'"),
}


@pytest.mark.parametrize("text, key, col, fragment", REFUSALS.values(), ids=REFUSALS.keys())
def test_a_serving_knob_is_refused_where_it_stands(text, key, col, fragment):
    _refused(text, key, col, fragment)


def test_the_split_tail_refusal_stands_alone_without_a_mask():
    found = _refused(*REFUSALS["kv-tail"])
    assert len(re.findall(r"^s\.fa:\d+:\d+: ", found, re.M)) == 1, found


@pytest.mark.parametrize("key, value", [("varlen", "on"), ("kv_cache", "contiguous")])
def test_sm80_refuses_the_serving_keys(key, value):
    text = _add((ROOT / "examples" / "fa2_kernel1.fa").read_text(), f"  {key} {value}", "  mask")
    _refused(text, key, 3, f"'{key}' is not a setting of target sm_80 (it is sm_90a's)")


@pytest.mark.parametrize("line", ["  varlen     off", "  pack_gqa   off", "  splits     off"])
def test_the_off_spellings_pass_a_backward_block(line):
    hw = _kernel(_add(CAUSAL, line)).config.ext
    assert (hw.varlen, hw.kv_cache, hw.pack_gqa, hw.split_all) == (False, -1, False, False)


def test_paged_page_sizes_that_tile_b_c_either_way_are_accepted():
    for size, b_c in ((16, 128), (128, 128), (256, 128), (64, 64)):
        text = _swap(_paged(f"paged({size})"), "B_c = 64", f"B_c = {b_c}")
        text = one_cta(text)  # two B_c = 128 rings do not fit an SM twice
        hw = _kernel(text).config.ext
        assert hw.kv_cache == size and _kernel(text).config.block_c == b_c


# --- explain -----------------------------------------------------------------------------


def _explain(capsys, path, *flags) -> str:
    assert main(["explain", "--no-compile", *flags, str(path)]) == 0
    return capsys.readouterr().out


def test_explain_shows_the_varlen_line_only_for_varlen(capsys):
    text = _explain(capsys, VARLEN)
    assert "\n  varlen     on: q, k, v and o packed as (tokens, heads, head_dim)" in text
    assert "(varlen: the padded order sequence by sequence, the longest K/V loops first)" in text
    assert "(a long and a short query block in pairs: causal, or a keep)" not in text
    padded = _explain(capsys, ROOT / "examples" / "fa3_causal.fa")
    assert "varlen" not in padded
    assert "(a long and a short query block in pairs: causal, or a keep)" in padded
    assert '"varlen": true' in _explain(capsys, VARLEN64, "--json")
    assert '"varlen"' not in _explain(capsys, ROOT / "examples" / "fa3_causal.fa", "--json")


def test_explain_and_check_show_the_kv_cache_knobs(capsys):
    paged = SERVING / "fa3_decode_paged.fa"
    text = _explain(capsys, paged)
    assert "\n  kv_cache   paged(64): K and V from a paged (pages, 64, heads_kv, head_dim)" in text
    assert "\n  pack_gqa   on: a tile's rows are (query row, query head) pairs" in text
    assert "\n  tail       split into pieces (splits auto): every tile's K/V blocks" in text
    assert "(splits auto: every tile's pieces in turn)" in text
    assert "the launch's last, part-full round" not in text
    data = _explain(capsys, paged, "--json")
    assert '"kv_cache": 64' in data and '"pack_gqa": true' in data and '"splits": "auto"' in data
    contiguous = _explain(capsys, SPECS / "fa3_decode.fa")
    assert "\n  kv_cache   contiguous: K and V from a contiguous" in contiguous
    assert "kv_cache" not in _explain(capsys, ROOT / "examples" / "fa3_causal.fa")


# --- the params structs over CPU tensors -------------------------------------------------


class Recorded(list):
    def __init__(self):
        super().__init__()
        self.streamed: list[bool] = []


@pytest.fixture
def encoded(monkeypatch):
    """The TMA encoder replaced by a recorder: (ptr, dims, strides, box) per map; which
    maps were encoded streamed (no L2 promotion) in ``calls.streamed``, by position."""
    calls = Recorded()

    def fake(ptr, dtype, dims, byte_strides, box_cols, box_rows, box=None, streamed=False):
        calls.append((ptr, tuple(dims), tuple(byte_strides), tuple(box or (box_cols, box_rows))))
        calls.streamed.append(streamed)
        return bytes([len(calls)]) * tma.MAP_BYTES

    monkeypatch.setattr(tma, "_encode_dims", fake)
    monkeypatch.setattr(tma, "_encoded", {})
    return calls


def _with(kernel, **ext):
    return replace(kernel, config=replace(kernel.config, ext=replace(kernel.config.ext, **ext)))


def _fields(raw: bytes) -> dict:
    return dict(zip(FWD_PARAMS_FIELDS, FWD_PARAMS.unpack_from(raw, SM90_BASE_OFFSET)))


def test_varlen_params_pack_packed_tensors_and_a_ragged_o_map(encoded):
    kernel = _kernel(VARLEN.read_text())
    tokens, heads_q, heads_kv = 300, 6, 2
    q = torch.zeros(tokens, heads_q, 128, dtype=torch.bfloat16)
    k = torch.zeros(tokens + 20, heads_kv, 128, dtype=torch.bfloat16)
    v, out = torch.zeros_like(k), torch.zeros_like(q)
    lse = torch.zeros(heads_q, tokens)
    cu_q = torch.tensor([0, 100, 101, 300], dtype=torch.int32)
    cu_k = torch.tensor([0, 120, 121, 320], dtype=torch.int32)
    work = torch.zeros(varlen.workspace_ints(3), dtype=torch.int32)
    a = varlen.VarlenArgs(q, k, v, out, lse, 0.125, cu_q, cu_k, work)
    raw = varlen.pack_varlen_params(kernel, a)
    assert len(raw) == SM90_PARAMS_BYTES
    assert [raw[i * tma.MAP_BYTES] for i in range(4)] == [1, 2, 3, 4]
    row, head = heads_q * 128 * 2, 128 * 2
    q_call, k_call, v_call, o_call = encoded
    assert q_call == (q.data_ptr(), (128, tokens, heads_q, 1), (row, head, head), (64, 128))
    assert k_call[:2] == (k.data_ptr(), (128, tokens + 20, heads_kv, 1))
    assert k_call[3] == v_call[3] == (64, 128)
    assert not any(encoded.streamed)  # varlen's K and V are read by every q tile
    ragged = (128, 64, heads_q, tokens + 1)  # (head_dim, r < 64, heads, anchor row)
    assert o_call == (out.data_ptr() - 64 * row, ragged, (row, head, row), (64, 64))
    f = _fields(raw)
    assert (f["batch"], f["heads_q"], f["heads_kv"]) == (3, heads_q, heads_kv)
    assert (f["seqlen_q"], f["seqlen_k"], f["softmax_scale"]) == (tokens, tokens + 20, 0.125)
    assert (f["q_seq_stride"], f["k_head_stride"], f["lse"]) == (heads_q * 128, 128, lse.data_ptr())
    tail = SM90_BASE_OFFSET + FWD_PARAMS.size
    assert SPLIT_TAIL.unpack_from(raw, tail) == (0, 0, 0, 1)
    divisors = DIVISORS.unpack_from(raw, tail + SPLIT_TAIL.size)
    assert divisors == (*fast_div(1), *fast_div(heads_q), *fast_div(3), *fast_div(1))
    pointers = VARLEN_TAIL.unpack_from(raw, VARLEN_OFFSET)
    assert pointers == (cu_q.data_ptr(), cu_k.data_ptr(), work.data_ptr() + 16, work.data_ptr())
    assert raw[VARLEN_OFFSET + VARLEN_TAIL.size :] == bytes(len(raw) - VARLEN_OFFSET - 32)
    no_lse = varlen.pack_varlen_params(kernel, a._replace(lse=None))
    assert _fields(no_lse)["lse"] == 0 and len(encoded) == 4  # the maps came from the cache


def test_varlen_grid_is_bounded_by_the_sms_and_the_pairs(monkeypatch):
    kernel = _kernel(VARLEN.read_text())  # B_r = 128, persistent
    monkeypatch.setattr(sm90_launch, "sm_count", lambda index: 132)  # (launch.grid_ctas)
    a = SimpleNamespace(q=torch.empty(1000, 4, 128, device="meta"), cu_seqlens_q=torch.empty(9))
    assert varlen.tile_bound(kernel, a) == (1000 // 128 + 8) * 4
    assert varlen.varlen_grid(kernel, a) == (60, 1, 1)
    grid = _with(kernel, persistent=False)
    big = SimpleNamespace(q=torch.empty(40000, 4, 128, device="meta"), cu_seqlens_q=torch.empty(2))
    assert varlen.varlen_grid(kernel, big) == (132, 1, 1)
    assert varlen.varlen_grid(grid, big) == ((40000 // 128 + 1) * 4, 1, 1)


def _decode_args(kernel, batch, pages, max_pages, splits=1, page_stride=None):
    q = torch.zeros(batch, 1, 32, 128, dtype=torch.bfloat16)
    if kernel.config.ext.kv_cache > 0:
        k = torch.zeros(pages, kernel.config.ext.kv_cache, 8, 128, dtype=torch.bfloat16)
        table = torch.zeros(batch, page_stride or max_pages, dtype=torch.int32)[:, :max_pages]
    else:
        k, table = torch.zeros(batch, pages, 8, 128, dtype=torch.bfloat16), None
    partials = torch.zeros(16) if splits > 1 else None
    seqlens, out = torch.zeros(batch, dtype=torch.int32), torch.zeros_like(q)
    args = (q, k, torch.zeros_like(k), out, None, 0.5, seqlens, table, splits, partials)
    return kvcache.KvCacheArgs(*args)


def test_kvcache_params_pack_gqa_maps_and_the_page_table(encoded):
    kernel = _kernel(PAGE)
    a = _decode_args(kernel, batch=2, pages=10, max_pages=5, splits=3, page_stride=16)
    raw = kvcache.pack_kvcache_params(kernel, a)
    assert len(raw) == SM90_PARAMS_BYTES
    q_call, o_call, k_call, v_call = encoded  # Q's and O's maps encoded first
    assert [raw[i * tma.MAP_BYTES] for i in range(4)] == [1, 3, 4, 2]  # then Q, K, V, O
    head = 128 * 2
    # (head_dim, group, seqlen, heads / group, batch): 16 query rows x 4 heads a 64-row box
    dims, strides = (128, 4, 1, 8, 2), (head, 32 * head, 4 * head, 32 * head)
    assert q_call == (a.q.data_ptr(), dims, strides, (64, 4, 16, 1, 1))
    assert o_call == (a.out.data_ptr(), *q_call[1:3], (64, 4, 16, 1, 1))
    assert k_call[1] == (128, 64, 8, 10) and k_call[3] == (64, 64)  # a page a box
    assert v_call[0] == a.v_cache.data_ptr() and v_call[3] == (64, 64)
    # K and V are read once: their maps ask the L2 for no promotion; Q's and O's keep it
    assert encoded.streamed == [False, False, True, True]
    f = _fields(raw)
    assert (f["batch"], f["heads_q"], f["heads_kv"], f["seqlen_q"]) == (2, 32, 8, 1)
    assert f["seqlen_k"] == 5 * 64  # the capacity: the table's pages x the page's rows
    tail = SM90_BASE_OFFSET + FWD_PARAMS.size
    assert SPLIT_TAIL.unpack_from(raw, tail) == (a.partials.data_ptr(), 0, 0, 3)
    divisors = DIVISORS.unpack_from(raw, tail + SPLIT_TAIL.size)
    assert divisors == (*fast_div(1), *fast_div(8), *fast_div(4), *fast_div(3))
    assert VARLEN_TAIL.unpack_from(raw, VARLEN_OFFSET) == (0, 0, 0, 0)
    found = kvcache.KVCACHE_TAIL.unpack_from(raw, kvcache.KVCACHE_OFFSET)
    # the table's row stride, then the cache's pages (kv_input_bad's bound)
    assert found == (a.cache_seqlens.data_ptr(), a.page_table.data_ptr(), 16, 10)
    end = kvcache.KVCACHE_OFFSET + kvcache.KVCACHE_TAIL.size
    assert raw[end:] == bytes(SM90_PARAMS_BYTES - end)


def test_kvcache_params_of_a_contiguous_cache(encoded):
    kernel = _kernel(DEC)
    a = _decode_args(kernel, batch=3, pages=1000, max_pages=0)
    raw = kvcache.pack_kvcache_params(kernel, a)
    assert encoded[2][1] == (128, 1000, 8, 3) and encoded[2][3] == (64, 128)  # B_c rows
    assert encoded.streamed == [False, False, True, True]  # a contiguous cache's K, V too
    assert _fields(raw)["seqlen_k"] == 1000
    tail = SM90_BASE_OFFSET + FWD_PARAMS.size
    assert SPLIT_TAIL.unpack_from(raw, tail) == (0, 0, 8 * 3, 1)  # one piece: the tile count
    found = kvcache.KVCACHE_TAIL.unpack_from(raw, kvcache.KVCACHE_OFFSET)
    assert found == (a.cache_seqlens.data_ptr(), 0, 0, 0)


# --- the split count and the grids -------------------------------------------------------


def _shape(batch, capacity, paged=False, heads_q=32, splits=1):
    q = torch.empty(batch, 1, heads_q, 128, device="meta")
    if paged:
        k, table = torch.empty(100, 64, 8, 128, device="meta"), torch.empty(batch, capacity // 64)
    else:
        k, table = torch.empty(batch, capacity, 8, 128, device="meta"), None
    return SimpleNamespace(q=q, k_cache=k, page_table=table, splits=splits)


@pytest.mark.parametrize("paged", [False, True])
def test_choose_splits_fills_one_wave_of_sms(monkeypatch, paged):
    monkeypatch.setattr(kvcache, "sm_count", lambda index: 132)
    monkeypatch.setattr(sm90_launch, "sm_count", lambda index: 132)
    kernel = _kernel(PAGE if paged else DEC)
    one = _shape(1, 131072, paged)
    assert kvcache.tiles(kernel, one) == 8  # 4 packed rows a K/V head: one tile each
    assert kvcache.choose_splits(kernel, one, 0, None) == 16  # 132 // 8
    assert kvcache.choose_splits(kernel, _shape(16, 131072, paged), 0, None) == 1  # 128 tiles
    assert kvcache.choose_splits(kernel, _shape(128, 131072, paged), 0, None) == 1
    assert kvcache.choose_splits(kernel, one, 0, 3) == 3
    assert kvcache.choose_splits(kernel, one, 0, 1000) == kvcache.MAX_SPLITS
    # a short cache: at least MIN_BLOCKS_PER_SPLIT blocks a piece, and never under 1
    b_c = kernel.config.block_c
    assert kvcache.choose_splits(kernel, _shape(1, 1024, paged), 0, None) == 1024 // b_c // 4
    assert kvcache.choose_splits(kernel, _shape(1, 2 * b_c, paged), 0, None) == 1
    assert kvcache.choose_splits(kernel, _shape(1, 2 * b_c, paged), 0, 3) == 2  # 2 blocks
    for capacity in (64, 640, 4096, 50000, 131072):
        blocks = -(-capacity // b_c)
        assert kvcache.choose_splits(kernel, _shape(1, capacity), 0, None) <= max(1, blocks // 4)
    # blocks of 256 keys (the 8-bit decode example's): a block a piece
    wide = replace(kernel, config=replace(kernel.config, block_c=256))
    assert kvcache.choose_splits(wide, _shape(1, 2048, paged), 0, None) == 8
    assert kvcache.choose_splits(wide, _shape(1, 8192, paged), 0, None) == 16  # 132 // 8


def test_choose_splits_is_one_without_splits_auto(monkeypatch):
    monkeypatch.setattr(kvcache, "sm_count", lambda index: 132)
    monkeypatch.setattr(sm90_launch, "sm_count", lambda index: 132)
    kernel = _kernel(_swap(DEC, "splits     auto", "splits     off"))
    assert not kernel.config.ext.split_all and not kernel.config.ext.split_kv
    assert kvcache.choose_splits(kernel, _shape(1, 131072), 0, None) == 1
    assert kvcache.choose_splits(kernel, _shape(1, 131072), 0, 8) == 1


def test_kvcache_grids_and_partials(monkeypatch):
    monkeypatch.setattr(kvcache, "sm_count", lambda index: 132)
    monkeypatch.setattr(sm90_launch, "sm_count", lambda index: 132)
    kernel = _kernel(DEC)
    a = _shape(2, 4096)
    assert kvcache.tiles(kernel, a) == 16
    assert kvcache.kvcache_grid(kernel, _shape(2, 4096, splits=4)) == (64, 1, 1)
    assert kvcache.kvcache_grid(kernel, _shape(2, 4096, splits=20)) == (132, 1, 1)  # one per SM
    # one consumer warpgroup a tile; head_dim 128 in slices of 16 columns
    assert kvcache.combine_grid(kernel, a) == (16, 8, 1)
    assert kvcache.partial_floats(kernel, a, 4) == 16 * 4 * 128 * (64 + 4)
    unpacked = _with(kernel, pack_gqa=False)
    assert kvcache.tiles(unpacked, a) == 2 * 32  # a tile per query head


@pytest.mark.parametrize("num_splits", [None, 1])
def test_a_split_call_launches_its_combine_as_a_programmatic_dependent(
    encoded, monkeypatch, num_splits
):
    """A split call: the attention kernel launched plainly, then the combine kernel as its
    programmatic dependent (PDL: the combine waits for the pieces on the device); a call of
    one piece launches the attention kernel alone."""
    monkeypatch.setattr(kvcache, "sm_count", lambda index: 132)
    monkeypatch.setattr(sm90_launch, "sm_count", lambda index: 132)
    kernel = _kernel(PAGE)
    a = _decode_args(kernel, batch=1, pages=64, max_pages=64)
    plan = kvcache.plan_kvcache(
        kernel, a.q, a.k_cache, a.v_cache, a.cache_seqlens, a.page_table, a.out, None, 0.5,
        num_splits,
    )  # fmt: skip
    launched = plan.launches()
    suffixes = [(kl.suffix, kl.dependent) for kl in launched]
    if num_splits == 1:
        assert suffixes == [("", False)]
    else:
        assert suffixes == [("", False), (kvcache.COMBINE_SUFFIX, True)]
        assert launched[1].grid == kvcache.combine_grid(kernel, a)
        assert launched[0].params == launched[1].params


# --- the varlen workspace and bench_varlen's lengths -------------------------------------


def test_workspace_ints_and_max_pairs_bound_every_batch():
    assert varlen.workspace_ints(5) == 4 + 8 * 5
    assert varlen.workspace_ints(0) == varlen.workspace_ints(1) == 12
    rng = random.Random(5)
    for path in (VARLEN, VARLEN64):
        kernel = _kernel(path.read_text())
        b_r = kernel.config.block_r
        for _ in range(300):
            picks = [0, 1, b_r - 1, b_r, b_r + 1, rng.randint(0, 700)]
            lengths = [rng.choice(picks) for _ in range(rng.randint(1, 12))]
            tokens = sum(lengths)
            pairs = sum(-(-n // b_r) for n in lengths)
            assert pairs <= varlen.max_pairs(kernel, tokens, len(lengths)) <= max(tokens, 0)
    kernel = _kernel(VARLEN.read_text())
    assert varlen.max_pairs(kernel, 128 * 10, 10) == 20 and varlen.max_pairs(kernel, 7, 7) == 7


@pytest.mark.parametrize("max_len, tokens", [(1, 5), (64, 1000), (4096, 32768), (8192, 100)])
def test_lengths_for_adds_up_and_stays_in_range(max_len, tokens):
    lengths = lengths_for(max_len, tokens)
    assert sum(lengths) == tokens and all(1 <= n <= max_len for n in lengths)
    assert all(n >= max(1, max_len // 8) for n in lengths[:-1])
    assert lengths_for(max_len, tokens) == lengths
    if len(lengths) > 4 and max_len > 1:
        assert lengths_for(max_len, tokens, seed=1) != lengths


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_bench_varlen_check_chunks_heads_and_still_catches_a_wrong_row(
    monkeypatch, causal, heads_kv
):
    """bench_varlen's float32 check, a head at a time (its scores bounded), passes the right
    output of packed sequences (GQA included) and refuses one wrong value in one head."""
    import fadsl.tools.bench_varlen as bench_varlen
    import torch.nn.functional as F

    monkeypatch.setattr(bench_varlen, "REFERENCE_SCORES", 40 * 40)  # one head a chunk
    lengths, heads_q, d = [0, 7, 40, 3], 4, 16  # (the first, checked, is empty)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lengths), heads_q, d, generator=gen)
    k, v = (torch.randn(sum(lengths), heads_kv, d, generator=gen) for _ in range(2))
    out, start = torch.empty_like(q), 0
    for n in filter(None, lengths):
        rows = slice(start, start + n)
        ref = F.scaled_dot_product_attention(
            *(t[rows].transpose(0, 1) for t in (q, k, v)), is_causal=causal, enable_gqa=True
        )
        out[rows] = ref.transpose(0, 1)
        start += n
    bench_varlen._check(out, q, k, v, lengths, d**-0.5, causal, 40)
    out[7 + 39, 3, 5] += 1.0  # the longest sequence's last row, the last head
    with pytest.raises(RuntimeError, match="sequence 2 .* differs from float32"):
        bench_varlen._check(out, q, k, v, lengths, d**-0.5, causal, 40)


def test_bench_varlen_against_a_padded_spec_refuses_what_is_not_equal_work():
    """`fadsl bench VARLEN --against PADDED` times both on equal lengths: refused (before any
    tensor is made) for a varlen spec against, a padded spec without a backward block when
    the backward is timed, another head_dim, and tokens that are not whole sequences."""
    import fadsl.tools.bench_varlen as bench_varlen

    varlen = fadsl.load(str(VARLEN64), verbose=False)
    padded = fadsl.load(str(ROOT / "examples" / "fa3_hdim64.fa"), verbose=False)
    text = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
    forward_only = fadsl.load(
        re.sub(r"\n  # The backward pass.*?\n  }\n", "\n", text, flags=re.S), verbose=False
    )
    assert not forward_only.has_backward
    with pytest.raises(ValueError, match="a padded spec is what a varlen spec is timed against"):
        bench_varlen.run(varlen, against=(varlen,))
    with pytest.raises(ValueError, match="a padded spec with a backward block"):
        bench_varlen.run(varlen, against=(forward_only,), backward=True)
    with pytest.raises(ValueError, match="head_dim 128"):
        bench_varlen.run(
            varlen, against=(fadsl.load(str(ROOT / "examples" / "fa3_hopper.fa"), verbose=False),)
        )
    with pytest.raises(ValueError, match="--tokens 5000 is not a multiple of the sequence length"):
        bench_varlen.run(varlen, max_seqlens=(1024,), tokens=5000, against=(padded,))


def test_num_splits_needs_splits_auto():
    """A kv-cache call asking for pieces from a spec that runs whole tiles is refused by name
    (before any tensor is looked at: no GPU needed)."""
    text = (SPECS / "fa3_decode.fa").read_text().replace("splits     auto", "splits     off")
    kern = fadsl.load(text.replace("kernel fa3_decode", "kernel whole_tiles"), verbose=False)
    q = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_splits=3: kernel 'whole_tiles' runs whole tiles"):
        kern.kvcache(q, q, q, torch.zeros(1, dtype=torch.int32), num_splits=3)


def test_combine_slices_match_the_device_header():
    """The host's slice width is the header's kCombineVecs float4s of 8 columns each."""
    import re

    from fadsl.codegen.render import read_header

    text = read_header("fadsl/sm90_kvcache.cuh")
    vecs = int(re.search(r"kCombineVecs = (\d+)", text).group(1))
    assert kvcache.COMBINE_SLICE_COLUMNS == 8 * vecs
