"""The params structs packed in Python match fadsl::FwdParams and sm_90a's FwdParamsSm90
byte for byte (NVRTC checks every offset with static_assert), the TMA descriptors get the
boxes and byte strides the kernels expect, and the grid covers every query row."""

from __future__ import annotations

import struct
from dataclasses import replace

import pytest
import torch

import fadsl
import fadsl.targets.sm90.host.launch as params
from conftest import ROOT
from fadsl.build.nvrtc import compile_cubin, nvrtc_available
from fadsl.codegen.render import HEADERS
from fadsl.targets.sm90.config import Sm90Config
from hypothesis import example, given
from hypothesis import strategies as st

from fadsl.targets.sm90.host.launch import (
    DIVISOR_FIELDS,
    DIVISORS,
    SM90_BASE_OFFSET,
    SM90_PARAMS_BYTES,
    SPLIT_TAIL,
    SPLIT_TAIL_FIELDS,
    VARLEN_OFFSET,
    VARLEN_TAIL,
    VARLEN_TAIL_FIELDS,
    TENSOR_MAP_BYTES,
    fast_div,
    pack_fwd_params_sm90,
)
from fadsl.targets.launch import FWD_PARAMS, FWD_PARAMS_FIELDS, Args, pack_fwd_params
from fadsl.targets import launch_for

SPEC = ROOT / "examples" / "fa2_kernel1.fa"


def offsets() -> dict[str, int]:
    """Each field's offset in FWD_PARAMS's layout, from its format."""
    found, offset = {}, 0
    codes = FWD_PARAMS.format.lstrip("<")
    expanded = [c for count, c in _runs(codes) for _ in range(count)]
    for name, code in zip(FWD_PARAMS_FIELDS, expanded, strict=True):
        found[name] = offset
        offset += struct.calcsize("<" + code)
    return found


def _runs(codes: str):
    number = ""
    for c in codes:
        if c.isdigit():
            number += c
        else:
            yield int(number or 1), c
            number = ""


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (cuda-bindings)")
def test_python_layout_matches_the_cuda_struct(tmp_path):
    checks = [f'static_assert(sizeof(fadsl::FwdParams) == {FWD_PARAMS.size}, "size");']
    for name, offset in offsets().items():
        checks.append(
            f'static_assert(__builtin_offsetof(fadsl::FwdParams, {name}) == {offset}, "{name}");'
        )
    source = '#include "fadsl/sm80_ptx.cuh"\n' + "\n".join(checks) + "\n"
    source += 'extern "C" __global__ void probe(const __grid_constant__ fadsl::FwdParams p) {}\n'
    compile_cubin(source, "layout.cu", "probe", "sm_80", tmp_path)  # raises on a mismatch


def test_pack_and_grid():
    kern = fadsl.load(SPEC, verbose=False)
    q = torch.zeros(3, 130, 5, 128, dtype=torch.bfloat16)
    k = torch.zeros(3, 70, 1, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(3, 5, 130)
    args = Args(q, k, k, out, lse, 0.25)
    launch = launch_for(kern.config.target)
    values = dict(
        zip(FWD_PARAMS_FIELDS, FWD_PARAMS.unpack(launch.pack(kern.compiled.kernel, args)))
    )
    assert values["q"] == q.data_ptr() and values["lse"] == lse.data_ptr()
    assert values["q_seq_stride"] == 5 * 128 and values["k_batch_stride"] == 70 * 128
    assert (values["batch"], values["heads_q"], values["heads_kv"]) == (3, 5, 1)
    assert (values["seqlen_q"], values["seqlen_k"]) == (130, 70)
    assert values["lse_head_stride"] == 130 and values["softmax_scale"] == 0.25
    assert launch.grid(kern.compiled.kernel, args) == (3, 5, 3)  # ceil(130 / 64) q blocks
    assert launch.block(kern.compiled.kernel) == (128, 1, 1)
    no_lse = dict(zip(FWD_PARAMS_FIELDS, FWD_PARAMS.unpack(
        launch.pack(kern.compiled.kernel, Args(q, k, k, out, None, 1.0)))))  # fmt: skip
    assert no_lse["lse"] == 0 and no_lse["lse_batch_stride"] == 0


# ---------------------------------------------------------------------------------- sm_90a
SM90_MAPS = ("tma_q", "tma_k", "tma_v", "tma_o")


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (cuda-bindings)")
@pytest.mark.skipif("fadsl/sm90.cuh" not in HEADERS, reason="the sm_90a target is not built in")
def test_sm90_layout_matches_the_cuda_struct(tmp_path):
    """FwdParamsSm90 as NVRTC sees it (the opaque 128-byte CUtensorMap): the four maps, then
    FwdParams at SM90_BASE_OFFSET with every field where FWD_PARAMS puts it."""
    struct_name = "fadsl::sm90::FwdParamsSm90"
    checks = [f'static_assert(sizeof({struct_name}) == {SM90_PARAMS_BYTES}, "size");']
    for i, name in enumerate(SM90_MAPS):
        checks.append(
            f"static_assert(__builtin_offsetof({struct_name}, {name}) == "
            f'{i * TENSOR_MAP_BYTES}, "{name}");'
        )
    for name, offset in offsets().items():
        checks.append(
            f"static_assert(__builtin_offsetof({struct_name}, base) + "
            f"__builtin_offsetof(fadsl::FwdParams, {name}) == {SM90_BASE_OFFSET + offset}, "
            f'"{name}");'
        )
    tail = SM90_BASE_OFFSET + FWD_PARAMS.size  # tail split_kv's fields after FwdParams
    for name, (offset, _) in zip(SPLIT_TAIL_FIELDS, _struct_offsets(SPLIT_TAIL)):
        checks.append(
            f'static_assert(__builtin_offsetof({struct_name}, {name}) == {tail + offset}, "{name}");'
        )
    divisors = tail + SPLIT_TAIL.size  # the scheduler's FastDiv pairs (mul, shift) after them
    for i, name in enumerate(DIVISOR_FIELDS):
        checks.append(
            f"static_assert(__builtin_offsetof({struct_name}, {name}) == {divisors + 8 * i} && "
            f"__builtin_offsetof({struct_name}, {name}.shift) == {divisors + 8 * i + 4}, "
            f'"{name}");'
        )
    assert len(DIVISOR_FIELDS) * 8 == DIVISORS.size
    varlen = divisors + DIVISORS.size  # `varlen on`'s pointers after the divisors
    assert varlen == VARLEN_OFFSET
    for name, (offset, _) in zip(VARLEN_TAIL_FIELDS, _struct_offsets(VARLEN_TAIL)):
        checks.append(
            f'static_assert(__builtin_offsetof({struct_name}, {name}) == {varlen + offset}, "{name}");'
        )
    from fadsl.targets.sm90.host.kvcache import KVCACHE_OFFSET, KVCACHE_TAIL, KVCACHE_TAIL_FIELDS

    for name, (offset, _) in zip(KVCACHE_TAIL_FIELDS, _struct_offsets(KVCACHE_TAIL)):
        checks.append(
            f"static_assert(__builtin_offsetof({struct_name}, {name}) == "
            f'{KVCACHE_OFFSET + offset}, "{name}");'
        )
    # the score and mask modifiers' input pointers (issue 41), after the kv-cache fields
    from fadsl.targets.sm90.host.launch import INPUTS, INPUTS_OFFSET

    assert INPUTS_OFFSET == KVCACHE_OFFSET + KVCACHE_TAIL.size
    checks.append(
        f"static_assert(__builtin_offsetof({struct_name}, inputs) == {INPUTS_OFFSET} && "
        f'sizeof(fadsl::sm90::FwdParamsSm90::inputs) == {INPUTS.size}, "inputs");'
    )
    source = '#include "fadsl/sm90.cuh"\n' + "\n".join(checks) + "\n"
    source += f'extern "C" __global__ void probe(const __grid_constant__ {struct_name} p) {{}}\n'
    compile_cubin(source, "layout90.cu", "probe", "sm_90a", tmp_path)  # raises on a mismatch


def _struct_offsets(layout: struct.Struct) -> list[tuple[int, str]]:
    """(offset, format) of each field of a little-endian, unpadded struct format."""
    out, offset = [], 0
    for code in layout.format.lstrip("<"):
        out.append((offset, code))
        offset += struct.calcsize("<" + code)
    return out


def test_sm90_pack_places_the_maps_and_params(monkeypatch):
    """pack_fwd_params_sm90 with the driver's encoder replaced by one that records its
    arguments: Q's boxes are B_r rows, K's and V's B_c, O's 64; 64-column panels; strides in
    bytes in TMA's order (seqlen, heads, batch), a size-1 dimension's made the row's bytes;
    FwdParams at byte 512; 896 bytes in all; a second call with the same tensors encodes
    nothing."""
    import fadsl.targets.sm90.host.tma as tma

    calls = []

    def fake_encode(ptr, dtype, shape, strides, element_size, box_cols, box_rows, streamed=False):
        calls.append((ptr, tuple(shape), tma.tma_strides(shape, strides, element_size)))
        calls[-1] += (box_cols, box_rows)
        return bytes([len(calls)]) * tma.MAP_BYTES

    monkeypatch.setattr(tma, "_encode", fake_encode)
    monkeypatch.setattr(tma, "_encoded", {})
    monkeypatch.setattr(params, "_SM90_PACKED", {})
    kernel = _sm90_kernel(block_r=128, block_c=176)
    qkv = torch.zeros(3, 130, 3, 5, 128, dtype=torch.bfloat16)  # packed: strided views
    q, k, v = qkv.unbind(2)
    out = torch.empty(3, 130, 5, 128, dtype=torch.bfloat16)[:1]  # batch 1 (a free stride)
    q1 = q[:1]
    args = Args(q1, k[:1], v[:1], out, None, 0.5)
    raw = pack_fwd_params_sm90(kernel, args)
    assert len(raw) == SM90_PARAMS_BYTES
    assert [raw[i * TENSOR_MAP_BYTES] for i in range(4)] == [1, 2, 3, 4]
    base = raw[SM90_BASE_OFFSET : SM90_BASE_OFFSET + FWD_PARAMS.size]
    assert base == pack_fwd_params(kernel, args)
    tail = SM90_BASE_OFFSET + FWD_PARAMS.size
    assert raw[tail : tail + SPLIT_TAIL.size] == bytes(SPLIT_TAIL.size)  # no split
    # ceil(130 / 128) = 2 query blocks, 5 heads, 5 / 5 = 1 query head per K/V head, 1 piece
    divisors = DIVISORS.unpack_from(raw, tail + SPLIT_TAIL.size)
    assert divisors == (*fast_div(2), *fast_div(5), *fast_div(1), *fast_div(1))
    assert raw[tail + SPLIT_TAIL.size + DIVISORS.size :] == bytes(len(raw) - 744)  # no varlen
    packed_row = 3 * 5 * 128 * 2  # bytes from one token to the next in qkv
    q_call, k_call, v_call, o_call = calls
    assert q_call == (q1.data_ptr(), (1, 130, 5, 128), (packed_row, 256, 256), 64, 128)
    assert k_call[0] == k.data_ptr() and k_call[3:] == (64, 176)
    assert v_call[2] == (packed_row, 256, 256) and v_call[3:] == (64, 176)
    assert o_call[2] == (5 * 128 * 2, 256, 256) and o_call[3:] == (64, 64)
    pack_fwd_params_sm90(kernel, args)
    assert len(calls) == 4, "the same tensors must reuse their descriptors"

    def base_and_pad(a):  # FwdParamsSm90 past its four tensor maps
        return pack_fwd_params(kernel, a) + raw[tail:]

    # A call on tensors seen before is one lookup of the whole struct: no descriptor lookups.
    looked_up = []
    real_map = tma.tensor_map
    monkeypatch.setattr(tma, "tensor_map", lambda *a: looked_up.append(a) or real_map(*a))
    assert pack_fwd_params_sm90(kernel, args) == raw and not looked_up
    # Anything the struct is made of is in the key: another scale repacks FwdParams (the
    # descriptors come from their own cache), another lse or out pointer too.
    rescaled = pack_fwd_params_sm90(kernel, args._replace(softmax_scale=0.25))
    assert rescaled[:SM90_BASE_OFFSET] == raw[:SM90_BASE_OFFSET] and rescaled != raw
    assert len(looked_up) == 4 and len(calls) == 4
    lse = torch.empty(1, 5, 130)
    with_lse = pack_fwd_params_sm90(kernel, args._replace(lse=lse))
    assert with_lse[SM90_BASE_OFFSET:] == base_and_pad(args._replace(lse=lse))
    assert len(calls) == 4  # the descriptors did not change
    store = torch.empty(1, 130 * 5)  # one buffer, two views: same pointer and shape
    lse_rows, lse_cols = store.view(1, 5, 130), store.view(1, 130, 5).transpose(1, 2)
    assert lse_rows.data_ptr() == lse_cols.data_ptr() and lse_rows.shape == lse_cols.shape
    by_rows = pack_fwd_params_sm90(kernel, args._replace(lse=lse_rows))
    by_cols = pack_fwd_params_sm90(kernel, args._replace(lse=lse_cols))
    assert by_cols != by_rows  # the strides alone are in the key
    assert by_cols[SM90_BASE_OFFSET:] == base_and_pad(args._replace(lse=lse_cols))
    other_out = torch.empty(1, 130, 5, 128, dtype=torch.bfloat16)
    moved = pack_fwd_params_sm90(kernel, args._replace(out=other_out))
    assert moved[3 * TENSOR_MAP_BYTES] == 5 and len(calls) == 5  # O's map encoded anew
    launch = launch_for("sm_90a")
    # one CTA per tile: ceil(130 / 128) q blocks x 5 heads x batch 1
    assert launch.grid(kernel, args) == (10, 1, 1)
    hopper = Sm90Config(2, 2, 24, 240, 128, pingpong=True, overlap=True, persistent=True)
    persistent = replace(kernel, config=replace(kernel.config, ext=hopper))
    monkeypatch.setattr(params, "sm_count", lambda index: 4)
    assert launch.grid(persistent, args) == (4, 1, 1)  # one CTA per SM
    monkeypatch.setattr(params, "sm_count", lambda index: 132)
    assert launch.grid(persistent, args) == (10, 1, 1)  # never more CTAs than tiles
    too_many = args._replace(q=torch.empty(2**16, 130, 2**15, 128, device="meta"))
    with pytest.raises(ValueError, match="tiles"):
        launch.grid(kernel, too_many)
    assert launch.symbol("fa3_hopper_bf16") == "fa3_hopper_bf16" and launch.launch_info


def _sm90_kernel(block_r: int, block_c: int):
    """An sm_80 example's kernel with its tile changed: the sm_90a packer reads only the
    config's B_r and B_c (and FwdParams' fields), whatever the target."""
    kern = fadsl.load(SPEC, verbose=False).compiled.kernel
    config = replace(kern.config, block_r=block_r, block_c=block_c)
    return replace(kern, config=config)


@given(st.integers(1, 2**31 - 1), st.integers(0, 2**31 - 1))
@example(1, 2**31 - 1)
@example(3, 2**31 - 1)
@example(2**30 + 1, 2**31 - 1)
@example(2**31 - 1, 2**31 - 2)
@example(7, 6)
def test_fast_div_divides_every_31_bit_dividend(d, n):
    """The kernel's FastDiv: n / d as (n * mul) >> shift, mul a 32-bit number."""
    mul, shift = fast_div(d)
    assert 0 < mul < 2**32 and 31 <= shift <= 62
    for m in (n, n - n % d, n - n % d - 1, d - 1, d, 2 * d - 1):  # around multiples of d
        if 0 <= m < 2**31:
            assert (m * mul) >> shift == m // d, (d, m)


def test_fast_div_refuses_what_it_cannot_divide():
    for d in (0, -3, 2**31):
        with pytest.raises(ValueError, match="divisor"):
            fast_div(d)
