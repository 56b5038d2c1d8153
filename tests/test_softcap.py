"""`softcap N` (sm_90a): the spec line, the IR, the generated code, and the tanh the kernel
computes (emit/sm90/include/fadsl/sm90.cuh, apply_softcap) modelled in float32."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from fadsl.codegen.render import render
from fadsl.errors import SpecError
from fadsl.ir.printer import format_kernel
from ir_reader import read_kernel
from fadsl.pipeline import compile_file, compile_source

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "tests" / "specs" / "sm90" / "fa3_softcap.fa"


def test_the_cap_reaches_the_ir_and_reads_back():
    compiled = compile_file(str(SPEC))
    assert compiled.kernel.config.ext.softcap == 50
    text = format_kernel(compiled.kernel)
    assert " softcap=50" in text.splitlines()[1]
    assert format_kernel(read_kernel(text)) == text


def test_the_kernel_caps_before_the_mask_in_every_block():
    compiled = compile_file(str(SPEC).replace("fa3_softcap.fa", "fa3_softcap_hdim64.fa"))
    source = render(compiled.kernel, compiled.target, compiled.file)[0].text
    assert "static constexpr float kSoftcap = 30.f;" in source
    calls = [m.start() for m in re.finditer(r"apply_softcap<Cfg>\(s, scale_log2\);", source)]
    masks = [m.start() for m in re.finditer(r"mask_scores<Cfg>\(s,", source)]
    assert len(calls) == len(masks) == 2  # the tile's first block, the mainloop's
    assert all(call < mask for call, mask in zip(calls, masks))


def test_a_spec_without_the_line_has_no_cap():
    source = render(*_compiled(ROOT / "examples" / "fa3_hopper.fa"))[0].text
    assert "apply_softcap" not in source and "kSoftcap" not in source


def _compiled(path):
    compiled = compile_file(str(path))
    return compiled.kernel, compiled.target, compiled.file


@pytest.mark.parametrize(
    "line, message",
    [
        ("softcap    0", r"softcap = 0 is out of range \(1 to 1000\)"),
        ("softcap    5000", r"softcap = 5000 is out of range \(1 to 1000\)"),
        ("softcap    high", r"softcap must be a number"),
    ],
)
def test_a_bad_cap_is_refused_where_it_stands(line, message):
    text = SPEC.read_text().replace("softcap    50", line)
    with pytest.raises(SpecError, match=message) as err:
        compile_source(text, "capped.fa")
    assert f"capped.fa:{_line_of(text, line)}:" in str(err.value)


def test_sm80_has_no_cap():
    text = (
        (ROOT / "examples" / "fa2_kernel1.fa")
        .read_text()
        .replace("  swizzle none", "  swizzle none\n  softcap 30")
    )
    with pytest.raises(SpecError, match=r"'softcap' is not a setting of target sm_80"):
        compile_source(text, "fa2_capped.fa")


def _line_of(text: str, line: str) -> int:
    return next(i for i, t in enumerate(text.splitlines(), 1) if line in t)


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def kernel_softcap(s: torch.Tensor, softmax_scale: float, cap: float) -> torch.Tensor:
    """apply_softcap in float32: S <- (cap log2 e / c) (1 - 2 / (2^(S 2c / cap) + 1)), the
    MUFU results rounded to fp32 (ex2 to inf from 128 up; rcp of inf is 0)."""
    c = _f32(torch.tensor(softmax_scale) * _f32(torch.tensor(1.4426950408889634)))
    cap_log2 = _f32(torch.tensor(cap) * _f32(torch.tensor(1.4426950408889634)))
    into = _f32(c * _f32(torch.tensor(2.0 / cap)))
    out = _f32(cap_log2 * _f32(1.0 / c.double()))
    e = _f32(torch.exp2((s * into).double()))
    return _f32(out * (1.0 - 2.0 * _f32(1.0 / (e + 1.0).double())))


@pytest.mark.parametrize("cap", [1, 30, 50, 1000])
def test_the_kernels_tanh_is_the_cap_to_about_2_to_the_minus_20(cap):
    """The capped score in log2 units, S' c, against cap log2(e) tanh(s softmax_scale / cap)
    in float64, over scores from 0 to far past the cap, both signs, and inf."""
    scale = 128**-0.5
    s = torch.cat([torch.linspace(-50 * cap / scale, 50 * cap / scale, 20001), torch.zeros(1)])
    got = kernel_softcap(s.float(), scale, cap).double() * (scale * 1.4426950408889634)
    want = cap * 1.4426950408889634 * torch.tanh(s.double() * scale / cap)
    assert (got - want).abs().max().item() <= cap * 1.4426950408889634 * 2.0**-20
    ends = kernel_softcap(torch.tensor([math.inf, -math.inf]), scale, cap)
    assert ends.tolist() == pytest.approx([cap / scale, -cap / scale], rel=1e-6)


def _ftz(x: torch.Tensor) -> torch.Tensor:
    """A MUFU result in fp32, subnormals flushed to zero (ex2.approx.ftz, rcp.approx.ftz)."""
    x = _f32(x)
    return torch.where(x.abs() < 2.0**-126, torch.zeros_like(x), x)


def kernel_cap_derivative(s: torch.Tensor, softmax_scale: float, cap: float, naive=False):
    """The backward's bwd_softcap in float32: e = 2^(S 2c / cap), r = 1 / (e + 1), and
    1 - tanh^2 as 4 r (1 - r) where e >= 1, else 4 e r^2 (``naive``: 1 - (1 - 2r)^2)."""
    c = _f32(torch.tensor(softmax_scale) * _f32(torch.tensor(1.4426950408889634)))
    into = _f32(c * _f32(torch.tensor(2.0 / cap)))
    e = _ftz(torch.exp2(_f32(s * into).double()))
    r = _ftz(1.0 / _f32(e + 1.0).double())
    if naive:
        t = _f32(1.0 - _f32(2.0 * r))
        return _f32(1.0 - _f32(t * t))
    wide = _f32(_f32(4.0 * r) * _f32(1.0 - r))
    narrow = _f32(_f32(_f32(4.0 * e) * r) * r)
    return torch.where(e >= 1.0, wide, narrow)


def _true_derivative(s: torch.Tensor, softmax_scale: float, cap: float) -> torch.Tensor:
    """1 - tanh^2 in float64 at the kernel's own float32 argument (so that only the formula's
    error is measured): 4 e / (e + 1)^2, e = 2^arg."""
    c = _f32(torch.tensor(softmax_scale) * _f32(torch.tensor(1.4426950408889634)))
    into = _f32(c * _f32(torch.tensor(2.0 / cap)))
    arg = _f32(s * into).double()
    return 4.0 / (torch.exp2(arg) + 2.0 + torch.exp2(-arg))


@pytest.mark.parametrize("cap", [1, 30, 50, 1000])
def test_the_backwards_cap_derivative_is_a_normal_number_or_zero_and_accurate(cap):
    """dS's factor 1 - tanh^2 (sm90_bwd.cuh, bwd_softcap) over scores from far below to far
    past the cap, both sides of the branch at e = 1 (s = 0) and densely around it, where e
    overflows to inf (the argument 128 and up) and where it underflows (-126 and below):
    always 0 or a normal fp32 up to 1 + 2^-21 (rounding near s = 0), within 2^-19 relative of 4e / (e + 1)^2 wherever
    that is a normal number, and never NaN. The naive 1 - (1 - 2r)^2 loses every digit near
    saturation (the reason for the two forms)."""
    scale = 128**-0.5
    into = scale * 1.4426950408889634 * 2.0 / cap
    edges = torch.tensor([-200.0, -150.0, -126.0, -125.0, -1.0, 1.0, 125.0, 127.0, 128.0, 200.0])
    s = torch.cat(
        [
            torch.linspace(-60 * cap / scale, 60 * cap / scale, 40001),
            torch.linspace(-1e-3, 1e-3, 2001) / into,  # e on both sides of 1
            edges / into,  # around ex2's overflow and underflow
            torch.tensor([0.0, math.inf, -math.inf]),
        ]
    ).float()
    got = kernel_cap_derivative(s, scale, cap).double()
    assert not got.isnan().any()
    assert ((got == 0) | ((got >= 2.0**-126) & (got <= 1 + 2.0**-21))).all()
    want = _true_derivative(s, scale, cap)
    normal = want >= 2.0**-120
    rel = ((got - want).abs() / want)[normal]
    assert rel.max().item() <= 2.0**-19, rel.max().item()
    assert (got[~normal] <= 2.0**-118).all()  # where the truth is tiny, so is the factor
    assert got[s == math.inf].item() == 0 and got[s == -math.inf].item() == 0
    naive = kernel_cap_derivative(s, scale, cap, naive=True).double()
    assert (((naive - want).abs() / want)[normal]).max().item() > 2.0**-4
