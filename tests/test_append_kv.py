"""The guarded append kernel (emit/common/append_kv.cu, fadsl/runtime/append.py; issue 45)
without a GPU: its source compiles with NVRTC for sm_80 and sm_90a and is packaged, the
params struct packed in Python matches AppendKvParams byte for byte (NVRTC checks every
offset and the size with static_assert, and a wrong offset is caught), the cubin is built
once through fadsl's cache, the packed fields (byte strides, capacity, the element size, the
16-byte flag) of 16- and 8-bit caches, and each argument error names its argument. The GPU runs
the kernel: tests/test_gpu_append_kv.py.
"""

from __future__ import annotations

import fnmatch
import re
import struct
import tomllib

import pytest
import torch

from conftest import ROOT
from fadsl.build.nvrtc import compile_cubin, nvrtc_available
from fadsl.errors import BuildError
from fadsl.runtime import append
from fadsl.runtime.append import PARAMS, PARAMS_FIELDS, pack

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (cuda-bindings)")
SOURCE = ROOT / "emit" / "common" / "append_kv.cu"


def offsets() -> dict[str, int]:
    """Each field's offset in PARAMS's layout, from its format (padding codes hold no
    field)."""
    found, offset = {}, 0
    names = iter(PARAMS_FIELDS)
    for count, code in re.findall(r"(\d*)([a-zA-Z])", PARAMS.format.lstrip("<")):
        for _ in range(int(count or 1)):
            if code != "x":
                found[next(names)] = offset
            offset += struct.calcsize("<" + code)
    assert next(names, None) is None, "PARAMS_FIELDS has more names than PARAMS has fields"
    return found


def layout_checks(table: dict[str, int], size: int) -> str:
    checks = [f'static_assert(sizeof(AppendKvParams) == {size}, "size");']
    for name, offset in table.items():
        checks.append(
            f'static_assert(__builtin_offsetof(AppendKvParams, {name}) == {offset}, "{name}");'
        )
    return "\n".join(checks) + "\n"


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_kernel_compiles(tmp_path, arch):
    built = compile_cubin(append.source(), "append_kv.cu", append.KERNEL, arch, tmp_path)
    assert built.cubin and not built.ptxas()["spill_store_bytes"]


@needs_nvrtc
def test_python_layout_matches_the_cuda_struct(tmp_path):
    table = offsets()
    assert list(table) == list(PARAMS_FIELDS)
    source = append.source() + layout_checks(table, PARAMS.size)
    compile_cubin(source, "layout.cu", append.KERNEL, "sm_80", tmp_path)  # raises on a mismatch


@needs_nvrtc
def test_the_layout_check_catches_a_wrong_offset(tmp_path):
    table = offsets()
    table["capacity"], table["num_pages"] = table["num_pages"], table["capacity"]
    source = append.source() + layout_checks(table, PARAMS.size)
    with pytest.raises(BuildError, match="capacity"):
        compile_cubin(source, "layout.cu", append.KERNEL, "sm_80", tmp_path)
    with pytest.raises(BuildError, match="size"):
        compile_cubin(
            append.source() + layout_checks({}, PARAMS.size - 4),
            "layout.cu",
            append.KERNEL,
            "sm_80",
            tmp_path,
        )


def test_the_struct_fields_are_the_python_fields_in_order():
    """The CUDA struct's members, read from the source, are PARAMS_FIELDS (with the offsets
    test: a field added on one side only is caught even where padding hides it)."""
    body = re.search(r"struct AppendKvParams \{(.*?)\};", SOURCE.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    members = re.findall(r"(\w+)\s*;", body)
    assert tuple(members) == PARAMS_FIELDS
    assert PARAMS.size % 8 == 0  # the struct's alignment (its long longs and pointers)


def test_a_plans_8_byte_write_of_the_flag_is_the_flag_and_padding():
    """A plan writes vector16 as an 8-byte field (append.SOURCES): the int, then the 4 bytes
    of padding that end the struct, so no other field (elem_bytes) is overwritten."""
    table = offsets()
    assert append.VECTOR16_OFFSET == table["vector16"] == PARAMS.size - 8
    assert max(table.values()) == table["vector16"]
    assert append.SOURCES[-1] == "vector16"


def test_the_source_is_package_data():
    """An installed fadsl carries the kernel's source (pyproject's package-data of
    fadsl.emit), and the runtime reads it through fadsl._data."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["fadsl.emit"]
    assert data["package-dir"]["fadsl.emit"] == "emit"
    assert any(fnmatch.fnmatch("common/append_kv.cu", p) for p in patterns), patterns
    assert append.source() == SOURCE.read_text()


@needs_nvrtc
def test_the_cubin_is_built_once_through_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    first = append.cubin("sm_80")
    assert len(list(tmp_path.glob("fadsl_append_kv.sm_80.*.cubin"))) == 1

    def refuse(*args):
        raise AssertionError("built again")

    monkeypatch.setattr(append, "compile_cubin", refuse)
    assert append.cubin("sm_80") == first


# --- packing ------------------------------------------------------------------------------


def fields(params: bytes) -> dict[str, int]:
    values = PARAMS.unpack(params)
    return dict(zip(PARAMS_FIELDS, values, strict=True))


def test_pack_contiguous_in_bytes_with_16_byte_vectors():
    k_cache = torch.zeros(3, 40, 2, 64, dtype=torch.bfloat16)
    v_cache = torch.zeros(3, 40, 2, 64, dtype=torch.bfloat16)
    k_new = torch.zeros(3, 5, 2, 64, dtype=torch.bfloat16)
    seqlens = torch.zeros(3, dtype=torch.int32)
    f = fields(pack(k_cache, v_cache, k_new, k_new, seqlens, None, None))
    assert f["k_cache"] == k_cache.data_ptr() and f["v_new"] == k_new.data_ptr()
    assert f["k_cache_batch_stride"] == 40 * 2 * 64 * 2 and f["k_cache_row_stride"] == 256
    assert f["k_new_batch_stride"] == 5 * 256 and f["v_new_row_stride"] == 256
    assert f["capacity"] == 40 and f["page_table"] == 0 and f["seqlens_out"] == 0
    assert (f["row_bytes"], f["new_tokens"], f["batch"]) == (256, 5, 3)
    assert f["vector16"] == 1 and f["elem_bytes"] == 2


def test_pack_paged_and_the_2_byte_path():
    k_cache = torch.zeros(7, 16, 1, 4, dtype=torch.float16)  # rows of 8 bytes
    table = torch.zeros(2, 10, dtype=torch.int32)[:, :3]  # a row stride of 10 entries
    k_new = torch.zeros(2, 1, 1, 4, dtype=torch.float16)
    seqlens, out = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    f = fields(pack(k_cache, k_cache, k_new, k_new, seqlens, table, out))
    assert f["page_table"] == table.data_ptr() and f["seqlens_out"] == out.data_ptr()
    assert (f["page_table_stride"], f["page_size"], f["num_pages"]) == (10, 16, 7)
    assert f["capacity"] == 3 * 16 and f["row_bytes"] == 8 and f["vector16"] == 0
    assert f["elem_bytes"] == 2
    # 16-byte rows, but a base 2 bytes off 16: 2 bytes a step
    n = 7 * 16 * 8
    buffer = torch.zeros(8 + n, dtype=torch.float16)
    assert buffer.data_ptr() % 16 == 0
    shifted = buffer[1 : 1 + n].view(7, 16, 1, 8)
    k_new = torch.zeros(2, 1, 1, 8, dtype=torch.float16)
    assert fields(pack(shifted, shifted, k_new, k_new, seqlens, table, None))["vector16"] == 0
    aligned = buffer[8:].view(7, 16, 1, 8)  # 16 bytes on
    assert fields(pack(aligned, aligned, k_new, k_new, seqlens, table, None))["vector16"] == 1


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_IDS = ["e4m3", "e5m2"]


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_pack_8_bit_rows_in_bytes_with_1_byte_units(dtype):
    """An 8-bit cache: strides and rows in bytes, elem_bytes 1 (the kernel's unit without
    16-byte vectors), the 16-byte path only where every row, stride and base allows it."""
    k_cache = torch.zeros(3, 40, 2, 64, dtype=dtype)  # rows of 128 bytes
    k_new = torch.zeros(3, 5, 2, 64, dtype=dtype)
    seqlens = torch.zeros(3, dtype=torch.int32)
    f = fields(pack(k_cache, k_cache, k_new, k_new, seqlens, None, None))
    assert (f["elem_bytes"], f["row_bytes"], f["vector16"]) == (1, 128, 1)
    assert f["k_cache_batch_stride"] == 40 * 128 and f["k_cache_row_stride"] == 128
    assert f["k_new_batch_stride"] == 5 * 128 and f["v_new_row_stride"] == 128
    # heads_kv x head_dim odd: rows of 15 bytes, 1 byte a step
    k_cache = torch.zeros(7, 16, 3, 5, dtype=dtype)
    k_new = torch.zeros(2, 1, 3, 5, dtype=dtype)
    table = torch.zeros(2, 3, dtype=torch.int32)
    f = fields(pack(k_cache, k_cache, k_new, k_new, seqlens[:2], table, None))
    assert (f["elem_bytes"], f["row_bytes"], f["vector16"]) == (1, 15, 0)
    assert f["k_cache_row_stride"] == 15 and f["k_cache_batch_stride"] == 16 * 15
    assert append.vector16_by_strides(k_cache, k_cache, k_new, k_new) is False
    # 16-byte rows, but a base 1 byte off 16 (an odd address: 2-byte units would misalign)
    n = 7 * 16 * 16
    buffer = torch.zeros(16 + n, dtype=dtype)
    assert buffer.data_ptr() % 16 == 0
    shifted = buffer[1 : 1 + n].view(7, 16, 1, 16)
    k_new = torch.zeros(2, 1, 1, 16, dtype=dtype)
    f = fields(pack(shifted, shifted, k_new, k_new, seqlens[:2], table, None))
    assert (f["elem_bytes"], f["row_bytes"], f["vector16"]) == (1, 16, 0)
    assert append.vector16_by_strides(shifted, shifted, k_new, k_new) is True  # the base's
    aligned = buffer[16:].view(7, 16, 1, 16)
    assert fields(pack(aligned, aligned, k_new, k_new, seqlens[:2], table, None))["vector16"] == 1


# --- argument checks ----------------------------------------------------------------------


def good(paged: bool = False, dtype=torch.bfloat16) -> dict:
    """Arguments that pass every check but the last (the cache is on the CPU)."""
    return {
        "k_cache": torch.zeros(6 if paged else 2, 8, 2, 4, dtype=dtype),
        "v_cache": torch.zeros(6 if paged else 2, 8, 2, 4, dtype=dtype),
        "k_new": torch.zeros(2, 3, 2, 4, dtype=dtype),
        "v_new": torch.zeros(2, 3, 2, 4, dtype=dtype),
        "cache_seqlens": torch.zeros(2, dtype=torch.int32),
        "page_table": torch.zeros(2, 3, dtype=torch.int32) if paged else None,
        "seqlens_out": torch.zeros(2, dtype=torch.int32),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FP8],
                         ids=["bf16", "fp16", *FP8_IDS])  # fmt: skip
@pytest.mark.parametrize("paged", [False, True])
def test_good_arguments_fail_only_on_the_device(paged, dtype):
    """fadsl's 16- and 8-bit dtypes (arguments.torch_dtypes) pass every check."""
    with pytest.raises(ValueError, match=r"^k_cache must be on a CUDA device, got cpu"):
        append.append_kv(**good(paged, dtype))


@pytest.mark.parametrize("dtype", FP8, ids=FP8_IDS)
def test_8_bit_caches_pass_the_checks_as_fake_tensors(dtype):
    """The custom op's fake kernel runs check_append on meta tensors: an 8-bit append on
    meta tensors fails only on the device too, and odd rows (3 x 5 bytes) are accepted."""
    args = good(True, dtype)
    args.update(
        k_cache=torch.zeros(6, 8, 3, 5, dtype=dtype),
        v_cache=torch.zeros(6, 8, 3, 5, dtype=dtype),
        k_new=torch.zeros(2, 3, 3, 5, dtype=dtype),
        v_new=torch.zeros(2, 3, 3, 5, dtype=dtype),
    )
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(ValueError, match=r"^k_cache must be on a CUDA device, got meta"):
        append.check_append(*meta.values())


def with_(paged: bool = False, **changes) -> dict:
    args = good(paged)
    args.update(changes)
    return args


bf16 = torch.bfloat16
# the dtypes a cache may have, as the refusal names them: fadsl's (arguments.torch_dtypes)
ACCEPTED = re.escape("torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2")
BAD = {
    "k_cache not a tensor": (with_(k_cache=3), TypeError, r"^k_cache must be a torch.Tensor"),
    "v_cache 3-D": (
        with_(v_cache=torch.zeros(2, 8, 8, dtype=bf16)),
        ValueError,
        r"^v_cache must be a 4-D tensor",
    ),
    "cache shapes differ": (
        with_(v_cache=torch.zeros(2, 9, 2, 4, dtype=bf16)),
        ValueError,
        r"^k_cache and v_cache must have the same shape",
    ),
    "float32 caches": (
        with_(k_cache=torch.zeros(2, 8, 2, 4), v_cache=torch.zeros(2, 8, 2, 4)),
        ValueError,
        rf"^k_cache and v_cache must have the same dtype, one of {ACCEPTED}, got torch.float32",
    ),
    "cache dtypes differ": (
        with_(v_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float16)),
        ValueError,
        r"^k_cache and v_cache must have the same dtype, .*got torch.bfloat16 and torch.float16",
    ),
    **{
        f"{dtype} caches": (
            with_(
                k_cache=torch.zeros(2, 8, 2, 4, dtype=dtype),
                v_cache=torch.zeros(2, 8, 2, 4, dtype=dtype),
                k_new=torch.zeros(2, 3, 2, 4, dtype=dtype),
                v_new=torch.zeros(2, 3, 2, 4, dtype=dtype),
            ),
            ValueError,
            rf"^k_cache and v_cache must have the same dtype, one of {ACCEPTED}, got {dtype}",
        )
        for dtype in (torch.int8, torch.uint8, torch.float64, torch.int16)
    },
    "8-bit caches differ": (
        with_(
            k_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn),
            v_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float8_e5m2),
        ),
        ValueError,
        r"^k_cache and v_cache must have the same dtype, .*got torch.float8_e4m3fn and "
        r"torch.float8_e5m2",
    ),
    "v_cache 8-bit, k_cache bf16": (
        with_(v_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn)),
        ValueError,
        r"^k_cache and v_cache must have the same dtype, .*got torch.bfloat16 and "
        r"torch.float8_e4m3fn",
    ),
    "k_new bf16 into an 8-bit cache": (
        with_(
            k_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn),
            v_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn),
            v_new=torch.zeros(2, 3, 2, 4, dtype=torch.float8_e4m3fn),
        ),
        ValueError,
        r"^k_new \(2, 3, 2, 4\) torch.bfloat16 does not match the cache's heads, head_dim and "
        r"dtype \(2, 4\) torch.float8_e4m3fn \(quantize the new tokens with the cache's "
        r"descales first\)",
    ),
    "v_new e5m2 into an e4m3 cache": (
        with_(
            k_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn),
            v_cache=torch.zeros(2, 8, 2, 4, dtype=torch.float8_e4m3fn),
            k_new=torch.zeros(2, 3, 2, 4, dtype=torch.float8_e4m3fn),
            v_new=torch.zeros(2, 3, 2, 4, dtype=torch.float8_e5m2),
        ),
        ValueError,
        r"^v_new \(2, 3, 2, 4\) torch.float8_e5m2 does not match .* torch.float8_e4m3fn",
    ),
    "k_new fp8 into a bf16 cache": (
        with_(k_new=torch.zeros(2, 3, 2, 4, dtype=torch.float8_e4m3fn)),
        ValueError,
        r"^k_new .* torch.float8_e4m3fn does not match .* torch.bfloat16$",
    ),
    "no head_dim": (
        with_(
            k_cache=torch.zeros(2, 8, 2, 0, dtype=bf16),
            v_cache=torch.zeros(2, 8, 2, 0, dtype=bf16),
        ),
        ValueError,
        r"^k_cache has no head or no head_dim",
    ),
    "k_cache rows strided": (
        with_(k_cache=torch.zeros(2, 8, 4, 2, dtype=bf16).transpose(2, 3)),
        ValueError,
        r"^k_cache is written in place, so each \(heads_kv, head_dim\) row must be contiguous",
    ),
    "v_cache heads strided": (
        with_(v_cache=torch.zeros(2, 8, 2, 8, dtype=bf16)[..., :4]),
        ValueError,
        r"^v_cache is written in place",
    ),
    "k_new a list": (with_(k_new=[1]), TypeError, r"^k_new must be a torch.Tensor, got list"),
    "k_new heads": (
        with_(k_new=torch.zeros(2, 3, 3, 4, dtype=bf16)),
        ValueError,
        r"^k_new \(2, 3, 3, 4\) torch.bfloat16 does not match the cache's heads",
    ),
    "v_new dtype": (
        with_(v_new=torch.zeros(2, 3, 2, 4, dtype=torch.float16)),
        ValueError,
        r"^v_new .* dtype",
    ),
    "new shapes differ": (
        with_(v_new=torch.zeros(2, 4, 2, 4, dtype=bf16)),
        ValueError,
        r"^k_new and v_new must have the same shape",
    ),
    "cache_seqlens int64": (
        with_(cache_seqlens=torch.zeros(2, dtype=torch.int64)),
        ValueError,
        r"^cache_seqlens must be a 1-D int32 tensor",
    ),
    "cache_seqlens short": (
        with_(cache_seqlens=torch.zeros(1, dtype=torch.int32)),
        ValueError,
        r"^cache_seqlens has 1 rows; k_new's batch is 2",
    ),
    "cache_seqlens strided": (
        with_(cache_seqlens=torch.zeros(4, dtype=torch.int32)[::2]),
        ValueError,
        r"^cache_seqlens must be contiguous in its last dimension",
    ),
    "contiguous cache batch": (
        with_(
            k_new=torch.zeros(1, 3, 2, 4, dtype=bf16),
            v_new=torch.zeros(1, 3, 2, 4, dtype=bf16),
            cache_seqlens=torch.zeros(1, dtype=torch.int32),
            seqlens_out=None,
        ),
        ValueError,
        r"^k_new has batch 1 but k_cache has 2",
    ),
    "page_table int64": (
        with_(True, page_table=torch.zeros(2, 3, dtype=torch.int64)),
        ValueError,
        r"^page_table must be a 2-D int32 tensor",
    ),
    "page_table 1-D": (
        with_(True, page_table=torch.zeros(2, dtype=torch.int32)),
        ValueError,
        r"^page_table must be a 2-D int32 tensor",
    ),
    "page_table rows": (
        with_(True, page_table=torch.zeros(3, 3, dtype=torch.int32)),
        ValueError,
        r"^page_table has 3 rows; k_new's batch is 2",
    ),
    "page_table columns strided": (
        with_(True, page_table=torch.zeros(3, 2, dtype=torch.int32).t()),
        ValueError,
        r"^page_table must be contiguous in its last dimension",
    ),
    "pages of no row": (
        with_(
            True,
            k_cache=torch.zeros(6, 0, 2, 4, dtype=bf16),
            v_cache=torch.zeros(6, 0, 2, 4, dtype=bf16),
        ),
        ValueError,
        r"^k_cache has pages of no row",
    ),
    "seqlens_out float": (
        with_(seqlens_out=torch.zeros(2)),
        ValueError,
        r"^seqlens_out must be a 1-D int32 tensor",
    ),
    "seqlens_out short": (
        with_(seqlens_out=torch.zeros(3, dtype=torch.int32)),
        ValueError,
        r"^seqlens_out has 3 rows",
    ),
    "seqlens_out not a tensor": (
        with_(seqlens_out=[0, 0]),
        TypeError,
        r"^seqlens_out must be a torch.Tensor",
    ),
    "k_new on another device": (
        with_(k_new=torch.zeros(2, 3, 2, 4, dtype=bf16, device="meta")),
        ValueError,
        r"^k_new must be on k_cache's device cpu, got meta",
    ),
    "page_table on another device": (
        with_(True, page_table=torch.zeros(2, 3, dtype=torch.int32, device="meta")),
        ValueError,
        r"^page_table must be on k_cache's device cpu, got meta",
    ),
    "seqlens_out on another device": (
        with_(seqlens_out=torch.zeros(2, dtype=torch.int32, device="meta")),
        ValueError,
        r"^seqlens_out must be on k_cache's device cpu, got meta",
    ),
    "caches on meta": (
        {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in good().items()},
        ValueError,
        r"^k_cache must be on a CUDA device, got meta",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_argument_is_named(case):
    args, error, message = BAD[case]
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(error, match=message):
        append.append_kv(**args)
    for name, t in before.items():
        if t.device.type != "meta":
            assert torch.equal(args[name], t), f"{name} changed"


def test_non_contiguous_new_rows_are_accepted():
    """k_new and v_new with strided rows are copied, not refused: they fail only on the
    device (and check_append hands back contiguous rows)."""
    k_new = torch.zeros(2, 3, 4, 2, dtype=bf16).transpose(2, 3)
    with pytest.raises(ValueError, match=r"^k_cache must be on a CUDA device"):
        append.append_kv(**with_(k_new=k_new, v_new=k_new))


def test_the_errors_use_the_callers_names():
    """attention_with_kvcache calls the new tokens k and v: its errors say so."""
    cache = torch.zeros(2, 8, 2, 4, dtype=torch.bfloat16)
    new = torch.zeros(3, 1, 2, 4, dtype=torch.bfloat16)
    seqlens = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^k has batch 3 but k_cache has 2"):
        append.check_append(cache, cache, new, new, seqlens, None, None, names=("k", "v"))
    with pytest.raises(ValueError, match=r"^cache_seqlens has 2 rows; k's batch is 3"):
        append.check_append(cache, cache, new, new, seqlens[:2], None, None, names=("k", "v"))
