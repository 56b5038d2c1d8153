"""The varlen backward's host side without a GPU: host.run_varlen on CPU tensors with the TMA
encoder replaced and each launch recorded. The gradients are allocated uninitialised, and
the preprocess's params name the ones whose rows outside every sequence it zeroes
(sm90_bwd_prep.cuh's bwd_zero_outside): dq always, dk and dv where the main kernel stores them in
place (no GQA), cu_seqlens_k, the keys' rows and the bytes of a row; a padded call names
none."""

from __future__ import annotations

import pytest
import torch

from fadsl.pipeline import compile_file
from fadsl.targets.sm90.backward import host
from fadsl.targets.sm90.host import tma

VARLEN = "examples/serving/fa3_varlen_hdim64.fa"
PADDED = "examples/fa3_hdim64.fa"


@pytest.fixture(autouse=True)
def no_driver(monkeypatch):
    monkeypatch.setattr(tma, "_encode", lambda *args: bytes(tma.MAP_BYTES))
    monkeypatch.setattr(tma, "_encoded", {})
    # (examples/fa3_hdim64.fa's `scheduler persistent` sizes its grid by the SMs)
    monkeypatch.setattr(host, "sm_count", lambda index: 132)


def _zero_fields(launch) -> tuple[int, ...]:
    return host.PREP.unpack(launch.params)[-7:]


@pytest.mark.parametrize("heads_kv", [4, 2], ids=["mha", "gqa"])
def test_the_preprocess_zeroes_the_rows_outside_the_sequences(heads_kv):
    kernel = compile_file(VARLEN).kernel
    tokens_q, tokens_k, heads_q, d = 300, 410, 4, 64
    q = torch.randn(tokens_q, heads_q, d, dtype=torch.bfloat16)
    k = torch.randn(tokens_k, heads_kv, d, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(heads_q, tokens_q)
    cu_q = torch.tensor([10, 100, 290], dtype=torch.int32)
    cu_k = torch.tensor([0, 200, 400], dtype=torch.int32)
    launches = []
    dq, dk, dv = host.run_varlen(
        kernel, launches.append, q, k, v, out, lse, dout, None, cu_q, cu_k, 0.125
    )
    prep = launches[0]
    assert prep.suffix == "_preprocess" and len(prep.params) == host.PREP.size == 208
    ptr_dq, ptr_dk, ptr_dv, ptr_cu_k, rows_k, q_row, k_row = _zero_fields(prep)
    assert ptr_dq == dq.data_ptr() and dq.is_contiguous()
    assert (ptr_cu_k, rows_k) == (cu_k.data_ptr(), tokens_k)
    assert q_row == heads_q * d * 2
    if heads_kv == heads_q:  # stored in place by the main kernel
        assert (ptr_dk, ptr_dv, k_row) == (dk.data_ptr(), dv.data_ptr(), heads_kv * d * 2)
        assert dk.is_contiguous() and dv.is_contiguous()
    else:  # cast from the zeroed fp32 accumulators: nothing to zero
        assert (ptr_dk, ptr_dv, k_row) == (0, 0, 0)


def test_a_padded_call_names_nothing_to_zero():
    kernel = compile_file(PADDED).kernel
    q, k, v = (torch.randn(1, 130, 4, 64, dtype=torch.bfloat16) for _ in range(3))
    out, dout = torch.randn_like(q), torch.randn_like(q)
    launches = []
    host.run(kernel, launches.append, q, k, v, out, torch.randn(1, 4, 130), dout, None, 0.125)
    assert _zero_fields(launches[0]) == (0,) * 7
