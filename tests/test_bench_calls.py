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
