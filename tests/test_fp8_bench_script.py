"""scripts/fp8_bench.py's pure parts on the CPU (issue 42's comparison with cuDNN runs on the
GPU machine only): FLOPs, the grid, the outlier inputs, the schemes, the reference, the tables."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_SPEC = importlib.util.spec_from_file_location(
    "fp8_bench", Path(__file__).resolve().parent.parent / "scripts" / "fp8_bench.py"
)
fb = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fb)


def test_flops_are_four_b_h_s2_d_halved_when_causal():
    assert fb.attention_flops(1, 16, 16384, 128, False) == 4 * 16 * 16384**2 * 128
    assert fb.attention_flops(2, 8, 1024, 256, True) == 2 * 2 * 8 * 1024**2 * 256


def test_default_grid_is_issue_42s():
    grid = fb.build_grid(fb.parse_args([]))
    assert len(grid) == 2 * 5 * 2
    assert {(p["head_dim"], p["heads"]) for p in grid} == {(128, 16), (256, 8)}
    assert {(p["seqlen"], p["batch"]) for p in grid} == {
        (1024, 16), (2048, 8), (4096, 4), (8192, 2), (16384, 1)
    }  # fmt: skip
    assert all(p["batch"] * p["seqlen"] == 16384 for p in grid)
    assert {p["causal"] for p in grid} == {False, True}


def test_arguments_narrow_the_grid_and_bad_ones_are_refused():
    args = fb.parse_args(["--head-dims", "256", "--seqlens", "16384", "--causal", "no"])
    assert fb.build_grid(args) == [dict(head_dim=256, seqlen=16384, causal=False, heads=8, batch=1)]
    assert args.parts == {"speed", "error"}
    assert fb.parse_args(["--parts", "speed"]).parts == {"speed"}
    for bad in (["--parts", "speedy"], ["--head-dims", "96"], ["--seqlens", "0"],
                ["--outlier-scale", "50,20"], ["--outlier-cols", "40", "--head-dims", "64"]):  # fmt: skip
        with pytest.raises(SystemExit):
            fb.parse_args(bad)


def test_outlier_columns_are_disjoint_scaled_in_range_and_only_in_q_and_k():
    shape, cols = (2, 32, 4, 64), 4
    base = fb.normal_inputs(shape, 3, "cpu")
    q, k, v, meta = fb.outlier_inputs(shape, 3, cols, (20.0, 50.0), "cpu")
    assert torch.equal(v, base[2])  # v untouched
    for h in range(shape[2]):
        qc, kc = set(meta["q_cols"][h].tolist()), set(meta["k_cols"][h].tolist())
        assert len(qc) == len(kc) == cols and not qc & kc
    for name, x, b in (("q", q, base[0]), ("k", k, base[1])):
        ratio = x / b
        for h in range(shape[2]):
            chosen = meta[f"{name}_cols"][h]
            others = [c for c in range(shape[3]) if c not in set(chosen.tolist())]
            assert torch.equal(x[:, :, h, others], b[:, :, h, others])
            for c, f in zip(chosen.tolist(), meta[f"{name}_factors"][h].tolist()):
                assert 20.0 <= f <= 50.0
                assert torch.allclose(ratio[:, :, h, c], torch.full_like(ratio[:, :, h, c], f))


def test_outlier_inputs_are_seeded():
    a = fb.outlier_inputs((1, 8, 2, 32), 5, 2, (20.0, 50.0), "cpu")
    b = fb.outlier_inputs((1, 8, 2, 32), 5, 2, (20.0, 50.0), "cpu")
    c = fb.outlier_inputs((1, 8, 2, 32), 6, 2, (20.0, 50.0), "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))
    assert not torch.equal(a[0], c[0])


def test_per_tensor_scheme_is_one_descale_cudnn_and_fadsl_read_alike():
    q, k, v = fb.normal_inputs((2, 16, 4, 32), 0, "cpu")
    qs = fb.quantize_scheme(q, k, v, "tensor")
    for n, x in (("q", q), ("k", k), ("v", v)):
        assert qs[n].dtype == torch.float8_e4m3fn and qs[n].shape == x.shape
        assert qs[f"{n}_scalar"].shape == (1,)
        assert qs[f"{n}_descale"].shape == (2, 4)
        assert torch.all(qs[f"{n}_descale"] == qs[f"{n}_scalar"])
        assert qs[f"{n}_scalar"].item() == pytest.approx(x.abs().max().item() / 448)
        assert torch.allclose(qs[f"{n}_deq"], x, rtol=2**-3, atol=qs[f"{n}_scalar"].item())
    head = fb.quantize_scheme(q, k, v, "head")
    assert "q_scalar" not in head and head["q_descale"].shape == (2, 4)


def test_rotation_keeps_the_attention_q_and_k_rotated_alike():
    """q and k rotated with one seed: the attention moves by quantization's error only (two
    different rotations scramble the scores: an RMSE of 0.54 here)."""
    q, k, v = fb.normal_inputs((1, 8, 2, 32), 1, "cpu")
    rot = fb.quantize_scheme(q, k, v, "tensor+rot")
    plain = fb.quantize_scheme(q, k, v, "tensor")
    rows = fb.row_index(8, 0)
    a = fb.reference_rows(rot["q_deq"], rot["k_deq"], rot["v_deq"], rows, False, 0.2)
    b = fb.reference_rows(q, k, v, rows, False, 0.2)
    c = fb.reference_rows(plain["q_deq"], plain["k_deq"], plain["v_deq"], rows, False, 0.2)
    assert fb.errors(a, b)["rmse"] < 0.03 and fb.errors(c, b)["rmse"] < 0.03
    assert not torch.equal(rot["q"].float(), plain["q"].float())


@pytest.mark.parametrize("causal", [False, True])
def test_reference_rows_match_sdpa_in_float64(causal):
    q, k, v = fb.normal_inputs((2, 40, 3, 16), 2, "cpu")
    rows = fb.row_index(40, 7)
    assert rows[0] == 0 and rows[-1] == 39 and len(rows) == 7
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).double() for x in (q, k, v)), is_causal=causal, scale=0.3
    ).transpose(1, 2)[:, rows]
    for budget in (1, 2**30):  # a row at a time, all at once
        got = fb.reference_rows(q, k, v, rows, causal, 0.3, budget=budget)
        assert torch.allclose(got.double(), want, atol=1e-5)


def test_e4m3_rounding_floor_is_within_e4m3s_half_ulp():
    ref = torch.randn(4, 8, 2, 16)
    err = (fb.e4m3_rounded(ref) - ref).abs()
    assert 0 < err.max() <= ref.abs().max() / 448 * 32 / 2  # 448's ulp is 32
    assert torch.all(err <= ref.abs() * 2**-4 + ref.abs().max() / 448 * 2**-9)


def test_tables_and_verdicts():
    speed = [
        dict(head_dim=256, seqlen=16384, batch=1, causal=False,
             tflops={"fadsl fp8": 1210.0, "cudnn fp8": 1000.0}),
        dict(head_dim=128, seqlen=1024, batch=16, causal=True, tflops={"fadsl bf16": 500.0}),
    ]  # fmt: skip
    table = fb.speed_table(speed).splitlines()
    assert table[0].startswith("| d | seqlen | batch | causal | fadsl fp8 | cudnn fp8 |")
    assert table[2] == "| 256 | 16384 | 1 | no | 1210 | 1000 | - | - | - | 1.21 |"
    assert table[3] == "| 128 | 1024 | 16 | yes | - | - | 500 | - | - | - |"
    base = dict(head_dim=128, seqlen=1024, causal=True, inputs="outlier cols", scheme="tensor")
    errs = [
        fb.error_row(base, "fadsl fp8", "bf16", torch.ones(4) * 1.5, torch.ones(4), torch.ones(4)),
        fb.error_row(base, "cudnn fp8", "e4m3", torch.ones(4) * 1.25, torch.ones(4), torch.ones(4)),
    ]
    assert errs[0]["rmse"] == 0.5 and errs[0]["max_abs"] == 0.5 and errs[0]["rmse_exact"] == 0.5
    rows = fb.error_table(errs).splitlines()
    assert rows[2] == (
        "| 128 | 1024 | yes | outlier cols | tensor | fadsl fp8 | bf16 | 5.00e-01 | 5.00e-01 "
        "| 5.00e-01 |"
    )
    lines = fb.verdicts(speed, errs)
    assert lines[0].startswith("PASS speed d 256 s 16384 causal False: 1.21x")
    assert lines[1].startswith("PASS 1210 TF/s")
    assert lines[2].startswith("FAIL error") and "rmse 5.00e-01, cuDNN 2.50e-01" in lines[2]
    assert fb.verdicts([], []) == ["no fadsl-cuDNN pair measured: no verdict"]
    assert fb.fmt(float("nan")) == "nan" and fb.fmt(None) == "-"
