"""The params struct packed in Python matches fadsl::FwdParams byte for byte (NVRTC checks
every offset with static_assert), and the grid covers every query row."""

from __future__ import annotations

import struct

import pytest
import torch

import fadsl
from conftest import ROOT
from fadsl.compiler import compile_cubin, nvrtc_available
from fadsl.params import FWD_PARAMS, FWD_PARAMS_FIELDS, Args, launch_for

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
