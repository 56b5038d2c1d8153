"""Parsing and lowering of valid specs: what the IR holds."""

import pytest

from fadsl.errors import SpecError
from fadsl.ir import AliasPolicy, Dtype, Instr, Level, Mask, Role, Scope
from fadsl.ir.ops import Op
from fadsl.pipeline import front_end, read_spec
from variants import EAGER_ORDER, KERNEL1, variant


def test_kernel1_config_and_paths():
    k = front_end(KERNEL1, "k.fa")
    cfg = k.config
    assert (cfg.name, cfg.target, cfg.dtypes) == (
        "fa2_kernel1",
        "sm_80",
        (Dtype.BF16, Dtype.FP16),
    )
    assert (cfg.head_dim, cfg.block_r, cfg.block_c, cfg.warps) == (128, 64, 64, 4)
    assert (cfg.mask, cfg.swizzle, cfg.smem_alias) == (Mask.NONE, None, AliasPolicy.SCOPED)
    v = k.tensor(Role.V)
    assert [(h.src, h.dst, h.instr) for h in v.hops] == [
        (Level.GMEM, Level.SMEM, Instr.CP_ASYNC),
        (Level.SMEM, Level.RF, Instr.LDMATRIX_TRANS),
    ]
    assert v.smem_scope is Scope.CTA and k.tensor(Role.Q).smem_scope is Scope.WARP
    assert (v.loc.line, v.loc.col) == (13, 3)
    assert [s.op for s in k.mainloop] == [
        Op.K_G2S, Op.K_S2R, Op.QK, Op.SOFTMAX, Op.V_G2S, Op.V_S2R, Op.PV,
    ]  # fmt: skip


def test_explicit_mainloop_order_and_step_locations():
    k = front_end(variant(order=EAGER_ORDER), "k.fa")
    assert [s.op for s in k.mainloop] == [
        Op.K_G2S, Op.V_G2S, Op.K_S2R, Op.QK, Op.SOFTMAX, Op.V_S2R, Op.PV,
    ]  # fmt: skip
    assert k.mainloop[1].loc.line == 19  # the 'V -> smem' line


def test_swizzle_and_alias_knobs():
    k = front_end(variant(swizzle="xor(3, 3, 4)", alias="any"), "k.fa")
    assert (k.config.swizzle.bits, k.config.swizzle.base, k.config.swizzle.shift) == (3, 3, 4)
    assert k.config.smem_alias is AliasPolicy.ANY
    assert all(b.swizzle == k.config.swizzle for b in k.buffers)


def test_crlf_line_endings_and_a_byte_order_mark(tmp_path):
    path = tmp_path / "k.fa"
    path.write_bytes(b"\xef\xbb\xbf" + KERNEL1.replace("\n", "\r\n").encode())
    assert front_end(read_spec(path), str(path)).config.name == "fa2_kernel1"


def test_a_keyword_glued_to_a_name_is_not_a_keyword():
    with pytest.raises(SpecError, match="unexpected 'kernelfa2_kernel1'"):
        front_end(KERNEL1.replace("kernel fa2_kernel1", "kernelfa2_kernel1"), "k.fa")


def test_comments_and_blank_lines_anywhere():
    text = (
        "\n# a\n\n"
        + KERNEL1.replace("  mask     none\n", "  mask     none\n\n  # x\n\n")
        + "\n# end\n"
    )
    assert front_end(text, "k.fa").config.mask is Mask.NONE


def test_cr_only_line_endings_read_as_line_breaks():
    k = front_end(KERNEL1.replace("\n", "\r"), "k.fa")
    assert k.config.name == "fa2_kernel1" and k.tensor(Role.V).loc.line == 13


def test_a_mixed_line_ending_error_is_located_on_its_line():
    text = KERNEL1.replace("warps    4", "warps    3").replace("\n", "\r", 3)
    with pytest.raises(SpecError, match=r"k.fa:7:12: warps = 3"):
        front_end(text, "k.fa")


def test_head_dim_96_takes_a_swizzle_whose_span_divides_the_row():
    k = front_end(variant(head_dim=96, swizzle="xor(2, 3, 3)"), "k.fa")
    swz = k.config.swizzle
    assert (k.config.head_dim, swz.bits, swz.base, swz.shift) == (96, 2, 3, 3)
    # Every row of 96 elements is mapped onto itself, and no two elements collide.
    for row in range(64):
        cols = [row * 96 + c for c in range(96)]
        assert sorted(a ^ ((a >> 3) & (0b11 << 3)) for a in cols) == cols


def test_head_dim_96_refuses_a_swizzle_that_spans_rows_and_says_which_fit():
    with pytest.raises(SpecError) as err:
        front_end(variant(head_dim=96, swizzle="xor(3, 3, 3)"), "k.fa")
    message = str(err.value)
    assert "spans of 64 elements, which do not tile a 96-element row" in message
    assert "M + B <= 5, e.g. xor(2, 3, 3)" in message
