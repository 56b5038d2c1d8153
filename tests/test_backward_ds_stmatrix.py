"""`dS: rf -stmatrix-> smem[cta] -wgmma-> rf` (Cfg::kDsStmatrix, sm90_bwd_ds.cuh's
store_ds_stmatrix): dS^T's 8 x 8 blocks stored by stmatrix .x4, the bytes store_ds's
st.shared write.

The register layout is the accumulator's: x[2j + r] of lane l holds dS^T at key row
64 wg + 16 warp + l / 4 + 8r, queries 8j + 2 (l % 4) + {0, 1} (low half first). stmatrix
(PTX ISA, "stmatrix"; .x4, non-transposed): lane l's register I holds row l / 4, columns
2 (l % 4) and 2 (l % 4) + 1 of matrix I, and lane 8I + k gives the address of matrix I's
row k, 8 contiguous 16-bit elements. Both maps are modelled here per lane, register and
16-bit half, through the header's swizzle (sm90_ptx.cuh's swizzle128), for B_r 64 (1-3
consumers) and 128, each warpgroup and warp: every element lands on the same byte, every
byte of the buffer is written once, and a mutated stmatrix address map is caught. The
header's own address functions (ds_pair_byte, ds_stmatrix_row_byte) are compiled for the
host with nvcc and checked against the model. Then the spec: where the path is admitted,
what the generated Cfg says, and that the training variants build without spills with the
stores the option promises (SASS)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from conftest import ROOT
from fadsl.build.spill_check import check_registers, find_compiler
from fadsl.codegen.render import render_backward
from fadsl.errors import SpecError
from fadsl.pipeline import compile_source
from test_gpu_backward import DS_STMATRIX
from training_specs import training_spec
from host_program import run_host_program

ROW_BYTES = 128  # a key's row of one 64-query panel (the 128-byte swizzle's row)
LANES, WARPS, HALF = 32, 4, 2  # HALF: bytes of a 16-bit element


def swizzle128(byte: int) -> int:
    """sm90_ptx.cuh's swizzle128: the 16-byte chunk XOR the row within 8 rows."""
    return byte ^ (((byte >> 7) & 7) << 4)


@dataclass(frozen=True)
class Shape:
    block_m: int  # B_r: the queries of an m-block (dS^T's columns)
    consumers: int  # warpgroups of 64 keys; B_c = 64 consumers

    @property
    def panel_bytes(self) -> int:  # one 64-query panel of every key (kDSPanelBytes)
        return 64 * self.consumers * ROW_BYTES

    @property
    def buffer_bytes(self) -> int:  # kDSBytes
        return 64 * self.consumers * self.block_m * HALF


SHAPES = (Shape(64, 1), Shape(64, 2), Shape(64, 3), Shape(128, 2))


def pair_byte(s: Shape, j: int, r: int, wg: int, warp: int, lane: int) -> int:
    """store_ds's byte of x[2j + r]'s pair, before the swizzle (ds_pair_byte)."""
    row = 64 * wg + 16 * warp + lane // 4
    return (j // 8) * s.panel_bytes + (row + 8 * r) * ROW_BYTES + (8 * (j % 8) + 2 * (lane % 4)) * 2


def stmatrix_row_byte(s: Shape, n: int, wg: int, warp: int, lane: int) -> int:
    """The row address lane ``lane`` gives in store_ds_stmatrix's n-th x4, before the swizzle
    (ds_stmatrix_row_byte): matrix lane / 8 is block (2n + I / 2, I % 2), its row lane % 8."""
    block = lane // 8
    j, key = 2 * n + block // 2, 64 * wg + 16 * warp + 8 * (block % 2) + lane % 8
    return (j // 8) * s.panel_bytes + key * ROW_BYTES + (j % 8) * 16


def st_shared_map(s: Shape, wg: int, warp: int, pair=pair_byte) -> dict[tuple, int]:
    """(lane, register, half) -> the SMEM byte store_ds writes it to."""
    out = {}
    for lane in range(LANES):
        for j in range(s.block_m // 8):
            for r in range(2):
                at = swizzle128(pair(s, j, r, wg, warp, lane))
                for e in range(2):  # st.shared.b32: the low half at the lower address
                    out[lane, 2 * j + r, e] = at + HALF * e
    return out


def stmatrix_map(s: Shape, wg: int, warp: int, rows) -> dict[tuple, int]:
    """(lane, register, half) -> the SMEM byte stmatrix .x4 writes it to, the row addresses
    of each instruction n being ``rows(n)[lane]`` (before the swizzle), by the PTX ISA's
    semantics: register I of lane l is row l / 4, columns 2 (l % 4) + e of matrix I, whose
    row k lane 8I + k addresses."""
    out = {}
    for n in range(s.block_m // 16):
        addresses = [swizzle128(b) for b in rows(n)]
        for lane in range(LANES):
            for i in range(4):
                row_at = addresses[8 * i + lane // 4]
                for e in range(2):
                    out[lane, 4 * n + i, e] = row_at + HALF * (2 * (lane % 4) + e)
    return out


def header_rows(s: Shape, wg: int, warp: int, row_byte=stmatrix_row_byte):
    return lambda n: [row_byte(s, n, wg, warp, lane) for lane in range(LANES)]


def element_byte(s: Shape, key: int, query: int) -> int:
    """dS^T's layout, which dQ's and dK's wgmmas read: key rows of 64-query panels, 128-byte
    swizzled rows."""
    return swizzle128((query // 64) * s.panel_bytes + key * ROW_BYTES + (query % 64) * HALF)


@pytest.mark.parametrize("s", SHAPES, ids=lambda s: f"B_r {s.block_m} x{s.consumers}")
def test_stmatrix_writes_each_element_where_st_shared_does(s):
    written = []
    for wg in range(s.consumers):
        for warp in range(WARPS):
            plain = st_shared_map(s, wg, warp)
            assert stmatrix_map(s, wg, warp, header_rows(s, wg, warp)) == plain, (wg, warp)
            # and that is dS^T's layout: x[2j + r] holds keys ... + lane / 4 + 8r, queries
            # 8j + 2 (lane % 4) + e
            for (lane, reg, e), at in plain.items():
                j, r = divmod(reg, 2)
                key = 64 * wg + 16 * warp + lane // 4 + 8 * r
                assert at == element_byte(s, key, 8 * j + 2 * (lane % 4) + e)
            written += plain.values()
    # every 16-bit element of the buffer once, by the warpgroups together
    assert sorted(written) == list(range(0, s.buffer_bytes, HALF))


def _swap_matrices(rows, a: int, b: int):
    def swapped(n):
        out = list(rows(n))
        out[8 * a : 8 * a + 8], out[8 * b : 8 * b + 8] = (
            out[8 * b : 8 * b + 8],
            out[8 * a : 8 * a + 8],
        )
        return out

    return swapped


def _next_chunk(s, n, wg, warp, lane):  # each row one 16-byte chunk to the right
    return stmatrix_row_byte(s, n, wg, warp, lane) + 16 * (lane // 8 < 2)


def _keys_swapped(s, n, wg, warp, lane):  # blocks r = 0 and 1 exchanged (keys +-8)
    return stmatrix_row_byte(s, n, wg, warp, lane ^ 8)


def _rows_reversed(s, n, wg, warp, lane):  # a matrix's rows in the wrong lanes
    return stmatrix_row_byte(s, n, wg, warp, lane ^ 7)


def _transposed(s, wg, warp, rows):
    """stmatrix .trans's semantics on the same addresses: register I's element (l / 4,
    2 (l % 4) + e) lands in row 2 (l % 4) + e, column l / 4 of matrix I."""
    out = {}
    for n in range(s.block_m // 16):
        addresses = [swizzle128(b) for b in rows(n)]
        for lane in range(LANES):
            for i in range(4):
                for e in range(2):
                    row_at = addresses[8 * i + 2 * (lane % 4) + e]
                    out[lane, 4 * n + i, e] = row_at + HALF * (lane // 4)
    return out


MUTATIONS = {
    "matrices 0 and 1 swapped": lambda s, wg, warp: stmatrix_map(
        s, wg, warp, _swap_matrices(header_rows(s, wg, warp), 0, 1)
    ),
    "matrices 1 and 2 swapped": lambda s, wg, warp: stmatrix_map(
        s, wg, warp, _swap_matrices(header_rows(s, wg, warp), 1, 2)
    ),
    "a chunk off": lambda s, wg, warp: stmatrix_map(
        s, wg, warp, header_rows(s, wg, warp, _next_chunk)
    ),
    "key blocks swapped": lambda s, wg, warp: stmatrix_map(
        s, wg, warp, header_rows(s, wg, warp, _keys_swapped)
    ),
    "rows reversed": lambda s, wg, warp: stmatrix_map(
        s, wg, warp, header_rows(s, wg, warp, _rows_reversed)
    ),
    "stmatrix .trans": lambda s, wg, warp: _transposed(s, wg, warp, header_rows(s, wg, warp)),
}


@pytest.mark.parametrize("what", MUTATIONS)
@pytest.mark.parametrize("s", SHAPES, ids=lambda s: f"B_r {s.block_m} x{s.consumers}")
def test_a_mutated_stmatrix_map_is_caught(s, what):
    mutated = MUTATIONS[what]
    assert any(
        mutated(s, wg, warp) != st_shared_map(s, wg, warp)
        for wg in range(s.consumers)
        for warp in range(WARPS)
    ), what


# --- the header's own address functions, compiled for the host -----------------------------

PROGRAM = r"""
#include "fadsl/sm90_bwd.cuh"
#include <cstdio>
using namespace fadsl::sm90;
template <class Cfg>
void dump(int block_m, int consumers) {
  for (int wg = 0; wg < consumers; ++wg)
    for (int warp = 0; warp < 4; ++warp)
      for (int lane = 0; lane < 32; ++lane) {
        for (int j = 0; j < block_m / 8; ++j)
          for (int r = 0; r < 2; ++r)
            printf("pair %d %d %d %d %d %d %d %u\n", block_m, consumers, wg, warp, lane, j, r,
                   ds_pair_byte<Cfg>(j, r, wg, warp, lane));
        for (int n = 0; n < block_m / 16; ++n)
          printf("row %d %d %d %d %d %d %u\n", block_m, consumers, wg, warp, lane, n,
                 ds_stmatrix_row_byte<Cfg>(n, wg, warp, lane));
      }
}
int main() {
  dump<BwdConfig<__nv_bfloat16, 64, 64, 64, 1, 2, false>>(64, 1);
  dump<BwdConfig<__nv_bfloat16, 128, 64, 128, 2, 2, false>>(64, 2);
  dump<BwdConfig<__nv_bfloat16, 64, 64, 192, 3, 2, false>>(64, 3);
  dump<BwdConfig<__nv_bfloat16, 64, 128, 128, 2, 2, false>>(128, 2);
}
"""


@pytest.fixture(scope="module")
def header_bytes(tmp_path_factory):
    lines = run_host_program(tmp_path_factory.mktemp("ds_stmatrix"), "ds", PROGRAM)
    found: dict[str, dict] = {"pair": {}, "row": {}}
    for line in lines.splitlines():
        kind, *values = line.split()
        *where, at = map(int, values)
        found[kind][tuple(where)] = at
    return found


@pytest.mark.parametrize("s", SHAPES, ids=lambda s: f"B_r {s.block_m} x{s.consumers}")
def test_the_headers_address_functions_are_the_model(s, header_bytes):
    """ds_pair_byte (store_ds's) and ds_stmatrix_row_byte (store_ds_stmatrix's), as nvcc
    compiles them: the model's bytes, so the two stores write the same bytes."""
    pairs = {k[2:]: v for k, v in header_bytes["pair"].items() if k[:2] == (s.block_m, s.consumers)}
    rows = {k[2:]: v for k, v in header_bytes["row"].items() if k[:2] == (s.block_m, s.consumers)}
    assert len(pairs) == s.consumers * WARPS * LANES * (s.block_m // 8) * 2
    assert len(rows) == s.consumers * WARPS * LANES * (s.block_m // 16)
    header_pair = lambda s_, j, r, wg, warp, lane: pairs[wg, warp, lane, j, r]  # noqa: E731
    header_row = lambda s_, n, wg, warp, lane: rows[wg, warp, lane, n]  # noqa: E731
    for wg in range(s.consumers):
        for warp in range(WARPS):
            plain = st_shared_map(s, wg, warp, header_pair)
            assert plain == st_shared_map(s, wg, warp)
            assert stmatrix_map(s, wg, warp, header_rows(s, wg, warp, header_row)) == plain


# --- the spec -----------------------------------------------------------------------------

HDIM64_EXAMPLE = (ROOT / "examples" / "fa3_hdim64.fa").read_text()
HDIM64 = re.sub(r"^\s*dS:[^\n]*\n", "", HDIM64_EXAMPLE, flags=re.MULTILINE)  # st.shared
DS_LINE = "    dS: rf -stmatrix-> smem[cta] -wgmma-> rf\n"


def with_ds(text: str, line: str = DS_LINE) -> str:
    head, block = text.split("backward {", 1)
    return head + "backward {\n" + line + block


def test_the_path_sets_the_flag_and_the_cfg():
    compiled = compile_source(with_ds(HDIM64), "x.fa")
    bwd = compiled.kernel.backward
    assert bwd.ds_stmatrix and "ds=stmatrix" in bwd.text().split()
    source, *_ = render_backward(compiled.kernel, compiled.target, "x.fa")
    assert "static constexpr bool kDsStmatrix = true;" in source.text
    plain = compile_source(HDIM64, "x.fa")
    assert not plain.kernel.backward.ds_stmatrix
    source, *_ = render_backward(plain.kernel, plain.target, "x.fa")
    assert "kDsStmatrix" not in source.text
    # the example's own line is the option's
    assert compile_source(HDIM64_EXAMPLE, "x.fa").kernel.backward.text() == bwd.text()
    # st.shared written out is the default
    stored = with_ds(HDIM64, "    dS: rf -st.shared-> smem[cta] -wgmma-> rf\n")
    assert compile_source(stored, "x.fa").kernel.backward.text() == plain.kernel.backward.text()


def test_b_r_80_and_head_dim_256_keep_their_own_stmatrix_trans():
    """At B_r 80 and head_dim 256 dS's one path is stmatrix (.trans): not the option."""
    for name in ("fa3_hopper", "fa3_hdim256"):
        text = (ROOT / "examples" / f"{name}.fa").read_text()
        bwd = compile_source(text, "x.fa").kernel.backward
        path = next(t for t in bwd.tensors if t.role.value == "dS").path_text()
        assert path == "rf -stmatrix-> smem[cta] -wgmma-> rf" and not bwd.ds_stmatrix, name


def test_a_wrong_store_names_both():
    text = with_ds(HDIM64, "    dS: rf -tma-> smem[cta] -wgmma-> rf\n")
    with pytest.raises(SpecError) as err:
        compile_source(text, "x.fa")
    assert "'st.shared' or 'stmatrix' do (dS: rf -st.shared-> smem[cta] -wgmma-> rf, or " in str(
        err.value
    )


# --- the build ----------------------------------------------------------------------------


def test_the_training_variants_build_with_stmatrix_stores():
    """Every GPU variant with dS by stmatrix (tests/test_gpu_backward.py's DS_STMATRIX) builds
    without spills and without ptxas serializing its wgmma; the main kernel's m-block loop
    stores dS^T with B_r / 16 STSM a thread and no STS (st.shared: B_r / 4 STS; NVRTC 13.5,
    2026-11-30, head_dim 64 B_r 128: the loop 939 -> 815 instructions)."""
    compiler, name = find_compiler()
    if compiler is None:
        pytest.skip(name)
    from fadsl.tools import sass

    seen = []

    def recording(source, arch):
        usage = compiler(source, arch)
        seen.append((source.kernel_name, usage))
        return usage

    # the head_dim 64 examples store by stmatrix; DS_STMATRIX holds their st.shared twins
    specs = ["fa3_hdim64", "fa3_hdim64_causal"]
    specs += [s for s in DS_STMATRIX if "-ds_stmatrix" not in s]
    for spec in specs:
        compiled = compile_source(training_spec(spec), "x.fa")
        assert compiled.kernel.backward.ds_stmatrix, spec
        assert check_registers(compiled, recording, name).ran, spec
    backward = [u for kernel, u in seen if "bwd" in kernel]
    assert len(backward) >= 2 * len(specs)
    assert not any(u.spills or u.wgmma_serialized for u in backward), backward
    tool = sass.nvdisasm()
    if tool is None:
        return
    import fadsl
    from fadsl.ir import Dtype

    for spec, block_m in (("fa3_hdim64", 128), ("fa3_hopper+br64+ds_stmatrix", 64)):
        kern = fadsl.load(training_spec(spec), verbose=False)
        entry = kern._backward_kernels().cubin(Dtype("bf16"), "sm_90a")
        text = sass.disassemble(entry.cubin, tool)
        parts = re.split(r"^\s*\.text\.(\S+):\s*$", text, flags=re.M)
        (body,) = [f for n, f in zip(parts[1::2], parts[2::2]) if n.endswith("_bwd_bf16")]
        # (the m-block loop; not the retry paths of waits, whose branch back is after EXIT)
        loops = [x for x in sass.loops(body) if x.count("HGMMA") and not x.count("EXIT")]
        inner = sass.innermost(loops)
        assert [(x.count("STSM"), x.count("STS ", "STS.")) for x in inner] == [(block_m // 16, 0)]
