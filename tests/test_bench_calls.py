"""`fadsl bench --calls` without a GPU: the CLI's refusals, the paged cache the decode part
builds (bench_kvcache.decode_tensors) (every key where the page table says), and the table of a result.
"""

from __future__ import annotations

import pytest
import torch

from fadsl.cli import main
from fadsl.tools import bench_calls, bench_kvcache


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench"], "give a SPEC, or --calls"),
        (["bench", "--calls", "examples/fa3_hopper.fa"], "give no SPEC"),
        (["bench", "--calls", "--backward"], "takes none of"),
        (["bench", "--calls", "--against", "examples/fa3_causal.fa"], "takes none of"),
    ],
)
def test_the_cli_refuses_what_calls_does_not_take(capsys, argv, message):
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_without_a_gpu_calls_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--calls"]) == 1
    assert "--calls needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("batch, length", [(1, 64), (3, 130), (2, 1)])
def test_the_paged_decode_cache_holds_each_key_where_the_table_says(batch, length):
    torch.manual_seed(batch * length)
    q, k, v, (k_cache, v_cache), table, seqlens = bench_kvcache.decode_tensors(
        batch, length, bench_calls.HEADS_Q, bench_calls.HEADS_KV, bench_calls.HEAD_DIM,
        bench_calls.PAGE, torch.bfloat16, "cpu",
    )  # fmt: skip
    page = bench_calls.PAGE
    assert q.shape == (batch, 1, bench_calls.HEADS_Q, bench_calls.HEAD_DIM)
    assert table.shape == (batch, -(-length // page)) and seqlens.tolist() == [length] * batch
    assert sorted(table.flatten().tolist()) == list(range(k_cache.shape[0]))  # each page once
    for b in range(batch):
        for j in (0, length // 2, length - 1):
            row = table[b, j // page], j % page
            assert torch.equal(k_cache[row], k[b, :, j]) and torch.equal(v_cache[row], v[b, :, j])


def test_the_table_has_a_line_per_call_and_per_shape():
    result = {
        "host": {"rows": [{"call": "attention", "us": {"fadsl": 30.0, "flash": 40.0}}]},
        "decode": {
            "rows": [
                {"batch": 1, "length": 8192, "tb_per_s": {"fadsl": 1.5, "cudnn": 1.0}},
                {"batch": 8, "length": 8192, "tb_per_s": {"fadsl": 2.0, "cudnn": 2.5}},
            ]
        },
    }
    lines = bench_calls.table(result).splitlines()
    host = next(line for line in lines if line.startswith("attention "))
    assert host.split()[-3:] == ["30.0", "40.0", "0.75"]
    decode = [line for line in lines if "x   8192" in line]
    assert [line.split()[-1] for line in decode] == ["1.50", "0.80"]


@pytest.mark.parametrize("page", [0, 64])
def test_an_8bit_decode_step_pages_the_quantized_cache_the_others_read_dequantized(page):
    """bench_kvcache.quantized_step: the 8-bit cache holds each key's bytes where the table
    says (contiguous: in order), and the bf16 k, v the other contenders read are the 8-bit
    values times their (batch, K/V head) descale; q's descale is its K/V head's."""
    torch.manual_seed(page)
    batch, length, hq, hkv, d = 2, 130, 8, 2, 64
    q, k, v, _, table, _ = bench_kvcache.decode_tensors(
        batch, length, hq, hkv, d, page, torch.float32, "cpu"
    )
    q8, (k8, v8), (qd, kd, vd), q16, k16, v16 = bench_kvcache.quantized_step(
        q, k, v, table, page, torch.float8_e4m3fn
    )
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and qd.shape == kd.shape == (batch, hkv)
    assert q16.dtype == k16.dtype == torch.bfloat16 and k16.shape == k.shape
    for b in range(batch):
        for j in (0, 64, length - 1):
            at = (table[b, j // page], j % page) if page else (b, j)
            for cache, t16, descale in ((k8, k16, kd), (v8, v16, vd)):
                want = (cache[at].float() * descale[b][:, None]).to(torch.bfloat16)
                assert torch.equal(want, t16[b, :, j])
        assert torch.equal(q16[b, 0, 5], (q8[b, 0, 5].float() * qd[b, 5 // 4]).to(torch.bfloat16))
    # the quantized values stay close to the drawn ones (per-head descales, e4m3's 2^-4)
    assert (k16.float() - k).abs().max() <= 2**-4 * k.abs().max() * 1.01
