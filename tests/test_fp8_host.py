"""The FP8 forward's host side (issue 42, research/fp8-forward.md §3.7, §6 test 6): the
packed Fp8Descales matches the header's struct byte for byte (NVRTC checks every offset with
static_assert), its strides and pointers as the kernel indexes them, the TMA maps of 8-bit
tensors (UINT8, 128-column boxes as load_q / load_kv read an 8-bit Cfg's; O's 16-bit 64 x 64), and
a launch plan's buffer with the second parameter after the first."""

from __future__ import annotations

import ctypes
import functools
import struct
from types import SimpleNamespace

import pytest
import torch

import fadsl
import fadsl.targets.sm90.host.launch as params
from conftest import ROOT
from fadsl.build.nvrtc import compile_cubin, nvrtc_available
from fadsl.runtime.driver import ParamsBuffer
from fadsl.targets.launch import Args, second_offset
from fadsl.targets.sm90.host import fp8 as fp8_host
from fadsl.targets.sm90.host import tma
from test_params import _runs

EXAMPLE = ROOT / "examples" / "fa3_fp8_hdim128.fa"


def descale_offsets() -> dict[str, int]:
    found, offset = {}, 0
    codes = [c for count, c in _runs(fp8_host.DESCALES.format.lstrip("<")) for _ in range(count)]
    for name, code in zip(fp8_host.DESCALES_FIELDS, codes, strict=True):
        found[name] = offset
        offset += struct.calcsize("<" + code)
    return found


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (cuda-bindings)")
def test_the_packed_descales_match_the_header_struct(tmp_path):
    checks = [f'static_assert(sizeof(Fp8Descales) == {fp8_host.DESCALES.size}, "size");']
    for name, offset in descale_offsets().items():
        checks.append(
            f'static_assert(__builtin_offsetof(Fp8Descales, {name}) == {offset}, "{name}");'
        )
    checks.append('static_assert(alignof(Fp8Descales) == 8, "alignment");')
    source = (
        '#include "fadsl/sm90.cuh"\n#include "fadsl/sm90_fp8.cuh"\nusing namespace fadsl::sm90;\n'
        + "\n".join(checks)
        + '\nextern "C" __global__ void probe(const __grid_constant__ FwdParamsSm90 P, '
        "const __grid_constant__ Fp8Descales D) {}\n"
    )
    compile_cubin(source, "layout.cu", "probe", "sm_90a", tmp_path)  # raises on a mismatch


def test_the_header_declares_the_fields_in_the_packed_order():
    """The struct's text lists the same fields in the same order (a rename on either side
    fails here even without NVRTC)."""
    header = (ROOT / "emit" / "sm90" / "include" / "fadsl" / "sm90_fp8.cuh").read_text()
    body = header[
        header.index("struct Fp8Descales {") : header.index(
            "};", header.index("struct Fp8Descales {")
        )
    ]
    names = [w.strip(" *;,") for line in body.splitlines()[1:] for w in line.split(",")]
    names = [n.split()[-1].lstrip("*") for n in names if n.strip()]
    assert tuple(names) == fp8_host.DESCALES_FIELDS


def _args(descales, lse=False, head_dim=128):
    q = torch.zeros(3, 130, 8, head_dim, dtype=torch.float8_e4m3fn)
    k = torch.zeros(3, 70, 2, head_dim, dtype=torch.float8_e4m3fn)
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    lse_t = torch.empty(3, 8, 130) if lse else None
    return Args(q, k, k.clone(), out, lse_t, 0.1, (), descales)


def test_descales_pack_pointers_and_batch_head_strides():
    per_head = torch.rand(3, 2)
    scalar = torch.tensor([0.5]).expand(3, 2)
    strided = torch.rand(2, 3).t()  # (batch, head) strides (1, 3)
    packed = fp8_host.pack_descales(_args((per_head, scalar, strided)))
    fields = dict(zip(fp8_host.DESCALES_FIELDS, fp8_host.DESCALES.unpack(packed)))
    assert (fields["q"], fields["k"], fields["v"]) == (
        per_head.data_ptr(),
        scalar.data_ptr(),
        strided.data_ptr(),
    )
    assert (fields["q_batch_stride"], fields["q_head_stride"]) == (2, 1)
    assert (fields["k_batch_stride"], fields["k_head_stride"]) == (0, 0)  # one descale
    assert (fields["v_batch_stride"], fields["v_head_stride"]) == (1, 3)
    # the kernel's index b * batch_stride + h * head_stride reaches each (b, h)'s element
    for t, name in ((per_head, "q"), (strided, "v")):
        flat = t.as_strided((t.untyped_storage().nbytes() // 4,), (1,))
        for b in range(3):
            for h in range(2):
                at = b * fields[f"{name}_batch_stride"] + h * fields[f"{name}_head_stride"]
                assert flat[at] == t[b, h]


def test_absent_descales_pack_null_pointers():
    packed = fp8_host.pack_descales(_args((None, torch.rand(3, 2), None)))
    values = fp8_host.DESCALES.unpack(packed)
    assert values[0] == 0 and values[2] == 0 and values[1] != 0
    assert fp8_host.pack_descales(_args(None)) == fp8_host.DESCALES.pack(0, 0, 0, 0, 0, 0, 0, 0, 0)


def test_a_size_one_dimension_has_stride_zero():
    t = torch.rand(1, 2)
    assert fp8_host.descale_strides(t) == (0, 1)
    assert fp8_host.descale_strides(torch.rand(3, 1)) == (1, 0)


@pytest.fixture
def encoded_maps(monkeypatch):
    """The TMA encoder replaced by a recorder: (dtype, dims, strides, box cols, box rows)."""
    encoded = []

    def record(ptr, dtype, dims, byte_strides, box_cols, box_rows, box=None, streamed=False):
        encoded.append((dtype, tuple(dims), tuple(byte_strides), box_cols, box_rows))
        return bytes(tma.MAP_BYTES)

    monkeypatch.setattr(tma, "_encode_dims", record)
    monkeypatch.setattr(tma, "_encoded", {})
    monkeypatch.setattr(params, "_SM90_PACKED", {})
    return encoded


def test_8bit_maps_are_uint8_with_128_column_boxes(encoded_maps):
    """Q, K and V of an 8-bit call: 128 one-byte columns a box (load_q / load_kv by the Cfg's
    kInPanelCols), B_r and B_c rows, byte strides; O: 64 16-bit columns by 64 rows."""
    kern = fadsl.load(EXAMPLE, verbose=False)
    a = _args((None, None, None))
    packed = params.pack_fwd_params_sm90(kern.compiled.kernel, a)
    assert len(packed) == params.SM90_PARAMS_BYTES
    q, k, v, o = encoded_maps
    assert q == (torch.float8_e4m3fn, (128, 130, 8, 3), (8 * 128, 128, 130 * 8 * 128), 128, 128)
    assert k[3:] == (128, 192) and v[3:] == (128, 192) and k[2] == (256, 128, 70 * 256)
    assert o == (torch.bfloat16, (128, 130, 8, 3), (8 * 256, 256, 130 * 8 * 256), 64, 64)
    cfg_source = kern.source("e4m3")
    assert "load_q<Cfg>" in cfg_source and "Fp8FwdConfig" in cfg_source
    header = (ROOT / "emit" / "sm90" / "include" / "fadsl" / "sm90_fp8.cuh").read_text()
    assert "static constexpr int kInPanelCols = kHeadDim_ < 128 ? 64 : 128;" in header


def test_head_dim_64_maps_have_64_column_boxes(encoded_maps, monkeypatch):
    """8-bit head_dim 64: Q, K and V boxes of 64 one-byte columns (64-byte rows: tma.py gives
    them the 64-byte swizzle, as Fp8FwdConfig's kInPanelCols and the descriptors read them);
    O's 16-bit boxes stay 64 x 64."""
    kern = fadsl.load(ROOT / "examples" / "fa3_fp8_hdim64.fa", verbose=False)
    # (its `tail split_kv` counts the SMs: one SM, so every round is whole and no split
    # workspace is made)
    monkeypatch.setattr(params, "sm_count", lambda index: 1)
    params.pack_fwd_params_sm90(kern.compiled.kernel, _args((None, None, None), head_dim=64))
    q, k, v, o = encoded_maps
    rows, keys = kern.config.block_r, kern.config.block_c  # (192 x 128 since 2026-12-04)
    assert q == (torch.float8_e4m3fn, (64, 130, 8, 3), (8 * 64, 64, 130 * 8 * 64), 64, rows)
    assert k[3:] == v[3:] == (64, keys) and k[2] == (128, 64, 70 * 128)
    assert o == (torch.bfloat16, (64, 130, 8, 3), (8 * 128, 128, 130 * 8 * 128), 64, 64)


def _named_driver(monkeypatch):
    """The driver's enums stood in for by their names (no driver library here)."""

    class Names:
        def __getattr__(self, name):
            return name

    fake = SimpleNamespace(
        **{
            e: Names()
            for e in ("CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle")
        },
        CUtensorMapL2promotion=Names(),
        CUtensorMapFloatOOBfill=Names(),
        cuuint32_t=int,
    )
    monkeypatch.setattr(tma, "_driver", lambda: fake)
    for cached in (tma._constants, tma._swizzle, tma._promotion):
        monkeypatch.setattr(tma, cached.__name__, functools.cache(cached.__wrapped__))


def test_a_box_row_picks_its_swizzle_and_a_streamed_map_no_promotion(monkeypatch):
    """128-byte box rows (16-bit panels, 8-bit ones of 128 columns) take the 128-byte swizzle,
    8-bit head_dim 64's 64-byte rows the 64-byte one; a streamed map (a KV cache's K and V)
    asks the L2 for no promotion, every other map for 256-byte lines."""
    _named_driver(monkeypatch)
    assert tma._swizzle(128) == "CU_TENSOR_MAP_SWIZZLE_128B"
    assert tma._swizzle(64) == "CU_TENSOR_MAP_SWIZZLE_64B"
    assert tma._promotion(True) == "CU_TENSOR_MAP_L2_PROMOTION_NONE"
    assert tma._promotion(False) == "CU_TENSOR_MAP_L2_PROMOTION_L2_256B"


def test_float8_maps_encode_as_uint8(monkeypatch):
    """The map types by torch dtype (the driver's enums stood in for by their names: no
    driver library here)."""
    _named_driver(monkeypatch)
    types = tma._constants()[1]
    uint8 = types[torch.float8_e4m3fn]
    assert types[torch.float8_e5m2] == uint8
    assert "UINT8" in str(uint8) and types[torch.bfloat16] != uint8


def test_the_plan_slots_name_the_descales_present():
    kern = fadsl.load(EXAMPLE, verbose=False)
    per_head = torch.rand(3, 2)
    slots = params.address_slots(kern.compiled.kernel, _args((per_head, None, per_head), True))
    base = second_offset(params.SM90_PARAMS_BYTES)
    descale = [s for s in slots if s.source.endswith("_descale")]
    assert [(s.offset, s.source) for s in descale] == [
        (base, "q_descale"),
        (base + 16, "v_descale"),
    ]
    assert not any(s.tensor_map for s in descale)
    sixteen = params.address_slots(kern.compiled.kernel, _args(None, True))
    assert not any(s.source.endswith("_descale") for s in sixteen)


def test_a_params_buffer_holds_the_second_parameter_after_the_first():
    first, second = bytes(range(256)) * 3 + b"\x01" * 128, b"\x07" * fp8_host.DESCALES.size
    buffer = ParamsBuffer(first, second)
    pointers = (ctypes.c_void_p * 2).from_address(buffer.argument)
    assert pointers[0] == buffer.address and buffer.address % 128 == 0
    assert pointers[1] == buffer.address + second_offset(len(first)) == buffer.address + 896
    assert buffer.raw() == first and buffer.raw_second() == second
    struct.pack_into("<Q", buffer.view, second_offset(len(first)) + 8, 0xABC)  # a slot's write
    assert buffer.raw_second()[8:16] == struct.pack("<Q", 0xABC) and buffer.raw() == first
    single = ParamsBuffer(first)
    assert single.raw_second() is None
    assert (ctypes.c_void_p * 1).from_address(single.argument)[0] == single.address


def test_only_8bit_specs_are_fp8_and_name_an_output_type():
    kern = fadsl.load(ROOT / "examples" / "fa3_hopper.fa", verbose=False)
    assert not kern.is_fp8 and kern.out_torch_dtype is None
    fp8 = fadsl.load(EXAMPLE, verbose=False)
    assert fp8.is_fp8 and fp8.out_torch_dtype == torch.bfloat16
