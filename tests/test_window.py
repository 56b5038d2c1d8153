"""Sliding windows on sm_90a (`mask window(LEFT, RIGHT)`, `mask causal, window(LEFT)`): the
spec line and its located errors, the IR and its text form, check and explain, the rendered
kernel (and NVRTC's build of it), the kernel's K/V range of a tile (window_work in
emit/sm90/include/fadsl/sm90.cuh, mirrored here) against brute force, and the softmax of
every rescale mode over a window's masked blocks, in the float32 model (tests/softmax_model.py).
The GPU runs the kernels: tests/test_gpu_window.py."""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from fadsl.build import resources
from fadsl.build.spill_check import check_registers
from fadsl.codegen.render import render, render_backward
from fadsl.errors import SpecError
from fadsl.ir import Mask, Window
from fadsl.ir.printer import format_kernel
from ir_reader import read_kernel
from fadsl.pipeline import compile_file, compile_source, front_end
from fadsl.tools.report import explain_data, explain_text, summary
from softmax_cases import random_case
from softmax_model import Mode, attend, problems, scale_log2
from test_gpu_general import reference

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "tests" / "specs" / "sm90"
WINDOW = SPECS / "fa3_window.fa"  # mask causal, window(256)
CAPPED = SPECS / "fa3_window_softcap.fa"  # mask window(192, 64), softcap 30


def _with_mask(value: str, text: str | None = None) -> str:
    """The spec (fa3_window.fa by default) with ``value`` on its mask line."""
    text = text if text is not None else WINDOW.read_text()
    found = re.subn(
        r"^  mask       [^#\n]*?(\s*#|$)", f"  mask       {value}\\1", text, count=1, flags=re.M
    )
    assert found[1] == 1
    return found[0]


# --- the spec line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, mask, window, spelt",
    [
        ("window(128, 16)", Mask.NONE, Window(128, 16), "window(128, 16)"),
        ("causal, window(256)", Mask.CAUSAL, Window(256, 0), "causal, window(256)"),
        ("window(256), causal", Mask.CAUSAL, Window(256, 0), "causal, window(256)"),
        ("window(0, 0)", Mask.NONE, Window(0, 0), "window(0, 0)"),
        ("causal", Mask.CAUSAL, None, "causal"),
        ("none", Mask.NONE, None, "none"),
    ],
)
def test_the_mask_line_reads_a_window(value, mask, window, spelt):
    cfg = front_end(_with_mask(value), "w.fa").config
    assert (cfg.mask, cfg.window, cfg.mask_text) == (mask, window, spelt)
    if window is not None:
        assert cfg.loc_of("window").line == 12


def _error(text: str, file: str = "w.fa") -> str:
    with pytest.raises(SpecError) as err:
        compile_source(text, file)
    return str(err.value)


@pytest.mark.parametrize(
    "value, col, message",
    [
        ("window(-1, 0)", 21, r"unexpected '-': a spec's numbers are 0 or more; a window's"),
        ("window(4, -8)", 24, r"unexpected '-': a spec's numbers are 0 or more"),
        ("window(256)", 14, r"window\(LEFT\) bounds the left side only with the causal mask"),
        ("causal, window(256, 0)", 34, r"with 'causal' the window takes LEFT only"),
        (
            "window(1, 2, 3)",
            14,
            r".*takes 2 numbers \(keys left and right of the diagonal\), got 3",
        ),
        ("window(x, 2)", 21, r"window LEFT must be a number, not 'x'"),
        ("window(1, 99999999)", 24, r"window RIGHT = 99999999 is out of range \(0 to 16777216\)"),
        ("none, window(1, 2)", 14, r"'none' and a window contradict"),
        ("window(1, 2), window(3, 4)", 28, r"'mask' takes one window"),
        ("causal, causal, window(3)", 22, r"'causal' is given twice"),
        ("windw(1, 2)", 14, r"unknown mask 'windw\(...\)'.*\(did you mean 'window'\?\)"),
        ("casual, window(3)", 14, r"unknown mask 'casual'.*\(did you mean 'causal'\?\)"),
    ],
)
def test_a_bad_window_is_refused_where_it_stands(value, col, message):
    found = _error(_with_mask(value))
    assert re.search(rf"^w\.fa:12:{col}: {message}", found, re.M), found


def test_the_plain_masks_keep_their_messages():
    found = _error(_with_mask("casual"))
    assert "w.fa:12:14: unknown mask 'casual'; expected 'none' or 'causal' (did you mean" in found


def test_sm80_has_no_window_yet():
    text = (ROOT / "examples" / "fa2_kernel1.fa").read_text()
    text = text.replace("  mask     none", "  mask     window(64, 0)")
    found = _error(text, "k.fa")
    assert re.search(r"^k\.fa:8:12: mask window\(64, 0\) is not built for sm_80 yet", found, re.M)


@pytest.mark.parametrize(
    "example, message",
    [
        ("fa3_hopper", r"cluster 2 pairs CTAs that read the same K/V blocks; a sliding window"),
        ("fa3_hdim64", r"tail split_kv splits tiles that run the whole K/V sequence"),
    ],
)
def test_clusters_and_split_tails_take_no_window(example, message):
    text = (ROOT / "examples" / f"{example}.fa").read_text()
    text = re.sub(r"^[ \t]*backward\s*\{[^}]*\}[^\n]*\n", "", text, flags=re.M)
    found = _error(_with_mask("window(100, 20)", text), "e.fa")
    key = "cluster" if "cluster" in message else "tail"
    line = next(i for i, t in enumerate(text.splitlines(), 1) if t.startswith(f"  {key} "))
    assert re.search(rf"^e\.fa:{line}:14: {message}", found, re.M), found


def test_the_backward_block_takes_the_window():
    """The window compiles into the backward's Cfg beside the forward's (its m-block range
    and masks: tests/test_gpu_backward_variants.py runs them)."""
    text = _with_mask("causal, window(256)", (ROOT / "examples" / "fa3_causal.fa").read_text())
    # (without `peel_dead`, which is refused beside a window)
    text = re.sub(r"^\s*peel_dead\s+on\b.*\n", "", text, flags=re.M)
    compiled = compile_source(text, "c.fa")
    assert compiled.kernel.config.window == Window(256, 0)
    source, *_ = render_backward(compiled.kernel, compiled.target, "c.fa")
    cfg = source.text.split("struct Cfg", 1)[1].split("};", 1)[0]
    assert "kWindowLeft = 256;" in cfg and "kWindowRight = 0;" in cfg


# --- the IR, check and explain ----------------------------------------------------------


@pytest.mark.parametrize("spec", [WINDOW, CAPPED], ids=["causal", "softcap"])
def test_the_window_reaches_the_ir_and_reads_back_after_every_pass(spec):
    compiled = compile_file(spec.relative_to(ROOT))
    window = compiled.kernel.config.window
    assert window == (Window(256, 0) if spec == WINDOW else Window(192, 64))
    for stage, kernel in compiled.stages:
        text = format_kernel(kernel)
        assert text.splitlines()[0].endswith(f" window={window.left},{window.right}"), stage
        assert format_kernel(read_kernel(text)) == text, stage
        assert read_kernel(text).config.window == window
    assert compiled.kernel.config.ext.softcap == (30 if spec == CAPPED else 0)


def test_a_spec_without_a_window_prints_as_before():
    text = format_kernel(compile_file("examples/fa3_causal.fa").kernel)
    assert " window=" not in text and read_kernel(text).config.window is None


def test_check_and_explain_show_the_window():
    compiled = compile_file(WINDOW.relative_to(ROOT))
    assert "  mask      causal, window(256)\n" in summary(compiled)
    data = explain_data(compiled)["warp_specialisation"]
    assert data["window"] == {"left": 256, "right": 0, "causal": True}
    text = explain_text(compiled)
    assert "  window     causal, window(256): query i sees keys i + d - 256 .. i + d + 0" in text
    assert "(a window's in plain order)" in text
    assert "mask (leading and trailing iterations only: the window's two edges)" in text


# --- the rendered kernel ----------------------------------------------------------------


def _source(spec) -> str:
    compiled = compile_file(Path(spec).relative_to(ROOT) if Path(spec).is_absolute() else spec)
    return render(compiled.kernel, compiled.target, compiled.file)[0].text


def test_the_kernel_holds_the_window_and_masks_both_ends():
    source = _source(WINDOW)
    assert "mask causal, window(256):" in source
    assert "static constexpr int kWindowLeft = 256;" in source
    assert "static constexpr int kWindowRight = 0;" in source
    loops = re.findall(r"for \(; it < w\.(\w+); \+\+it\) iteration\(it, fadsl::sm90::(\w+)", source)
    masked, unmasked = "true_type", "false_type"
    assert loops == [("n_masked", masked), ("masked_from", unmasked), ("n_blocks", masked)]
    # the prologue's block may be cut by the left edge alone; blocks count down from the
    # window's last (block_end), not from the sequence's
    prologue = "if (w.n_masked > 0 || w.masked_from == 0) mask_scores<Cfg>(s, P.base, rows, "
    assert prologue + "w.block_end - 1 - (it), lane);" in source
    assert re.search(r"load_kv<Cfg>\(&P\.tma_k, [^;]*, w\.block_end - 1 - \(it\), w\);", source)


@pytest.mark.parametrize("example", ["fa3_causal", "fa3_hdim64", "fa3_hopper"])
def test_a_kernel_without_a_window_has_none_of_it(example):
    source = _source(f"examples/{example}.fa")
    assert not re.search(r"kWindow|masked_from|window", source)


@pytest.mark.skipif(not resources.can_compile(), reason="needs NVRTC or nvcc")
@pytest.mark.parametrize("spec", [WINDOW, CAPPED], ids=["causal", "softcap"])
def test_the_window_kernels_build_without_spills(spec):
    """`fadsl check`'s compile: every dtype for sm_90a, refused if it spills or has a stack
    frame (the masked iterations' loop body is inlined at two places)."""
    check = check_registers(compile_file(spec.relative_to(ROOT)))
    assert check.ran and all(not row.usage.spills for row in check.rows)


# --- the K/V range of a tile (window_work), against brute force ---------------------------


def window_work(m0, sq, sk, block_m, block_n, left, right):
    """sm90.cuh's window_work: (block_end, n_blocks, n_masked, masked_from). Its operands are
    never negative where it divides, so // is C++'s /."""
    diag = sk - sq
    last = min(m0 + block_m, sq) - 1
    kv_begin = max(0, m0 + diag - left)
    kv_end = min(sk, last + diag + right + 1)
    first = kv_begin // block_n
    block_end = -(-kv_end // block_n) if kv_end > kv_begin else first
    n_blocks = block_end - first
    right_full = min(sk, m0 + diag + right + 1) - 1
    unmasked_end = first if right_full < 0 else max(first, right_full // block_n)
    n_masked = block_end - min(block_end, unmasked_end)
    left_full = max(0, last + diag - left)
    left_masked = min(n_blocks, max(0, -(-left_full // block_n) - first))
    return block_end, n_blocks, n_masked, max(n_masked, n_blocks - left_masked)


def visible(sq, sk, left, right, rows: torch.Tensor) -> torch.Tensor:
    """(rows, sk): whether each row sees each key; rows past seqlen_q as its last (mask_scores)."""
    i = rows.clamp(max=sq - 1)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    return (j >= i - left) & (j <= i + right)


def tiles(rng: random.Random, count: int):
    for _ in range(count):
        block_m, block_n = rng.choice([(64, 64), (128, 128), (128, 80), (192, 128), (128, 176)])
        sq, sk = rng.randint(1, 700), rng.randint(1, 700)
        left = rng.choice([0, 1, 3, block_n - 1, block_n, 200, 10**5])
        right = rng.choice([0, 0, 2, block_n + 1, 64, 10**5])
        for m0 in range(0, sq, block_m):
            yield sq, sk, block_m, block_n, left, right, m0


def test_a_tile_visits_exactly_its_windows_blocks_and_masks_where_they_cut():
    checked = Counter()
    for sq, sk, block_m, block_n, left, right, m0 in tiles(random.Random(31), 400):
        block_end, n_blocks, n_masked, masked_from = window_work(
            m0, sq, sk, block_m, block_n, left, right
        )
        assert 0 <= n_masked <= masked_from <= n_blocks
        sees = visible(sq, sk, left, right, torch.arange(m0, m0 + block_m))
        real = sees[: min(block_m, sq - m0)]
        keys = real.any(dim=0).nonzero().flatten()
        assert (n_blocks == 0) == (len(keys) == 0)  # no key: the tile stores O = 0, LSE -inf
        if n_blocks == 0:
            checked["empty"] += 1
            continue
        first = block_end - n_blocks
        # every block run holds a key of the tile, every key of the tile is in one
        assert keys[0] // block_n == first and keys[-1] // block_n == block_end - 1
        for it in range(n_blocks):
            b = block_end - 1 - it
            cols = sees[:, b * block_n : min((b + 1) * block_n, sk)]
            if n_masked <= it < masked_from:  # unmasked: every row sees the whole block
                assert cols.all() and (b + 1) * block_n <= sk
                checked["unmasked"] += 1
        if n_masked < masked_from:  # before the first unmasked block each row saw a key
            seen = sees[:, (block_end - n_masked) * block_n :].any(dim=1)
            assert torch.equal(seen, sees.any(dim=1))
        checked["left edge masked"] += masked_from < n_blocks
    assert min(checked.values()) > 20, checked


# --- the softmax of every mode over a window's blocks (the float32 model) ----------------


def window_tile_scores(rng, sq, sk, block_m, block_n, left, right, m0, adversarial):
    """The tile's scores (warps of 16 rows, keys of its blocks) with -inf outside each row's
    window, and which blocks (in key order) the kernel masks; None for an empty tile."""
    block_end, n_blocks, n_masked, masked_from = window_work(
        m0, sq, sk, block_m, block_n, left, right
    )
    if n_blocks == 0:
        return None
    first = block_end - n_blocks
    warps = block_m // 16
    if adversarial:
        scores, _ = random_case(rng, block_n, n_blocks, warps=warps, masks=False)
    else:
        scores = torch.zeros(warps, 16, n_blocks * block_n)
    cols = torch.arange(first * block_n, block_end * block_n)
    sees = visible(sq, sk, left, right, torch.arange(m0, m0 + block_m))
    sees = torch.cat([sees, torch.zeros(block_m, max(0, block_n * block_end - sk), dtype=bool)], 1)
    scores = scores.masked_fill(~sees[:, cols].reshape(warps, 16, -1), -math.inf)
    masked_iteration = [it < n_masked or it >= masked_from for it in range(n_blocks)]
    masked = torch.tensor(masked_iteration[::-1]).expand(warps, n_blocks)  # key order
    return scores, masked


@pytest.mark.parametrize("mode", list(Mode), ids=[m.value for m in Mode])
def test_every_mode_is_exact_over_a_windows_masked_blocks(mode):
    """Rows whose max is still -inf after a block (a window's first blocks), rows fully masked
    in a trailing block, rows that see no key: exact up to P's 16-bit rounding, as
    docs/numerics.md has it, on adversarial jumps."""
    rng = random.Random(7)
    runs = 0
    for sq, sk, block_m, block_n, left, right, m0 in tiles(rng, 60):
        tile = window_tile_scores(rng, sq, sk, block_m, block_n, left, right, m0, True)
        if tile is None or block_n not in (64, 128):
            continue
        scores, masked = tile
        for dtype in (torch.bfloat16, torch.float16):
            result = attend(scores, block_n, scale_log2(math.log(2)), mode, dtype, masked)
            assert problems(result, scores, math.log(2), dtype) == []
        runs += 1
    assert runs > 30


def test_no_guarded_block_starts_a_row_at_minus_infinity():
    """Leading iterations mask down to row m0's last key's block, so that no row enters a
    guarded block with no max yet (the redo path's work: S again from SMEM). The causal
    rule, masking only the blocks the diagonal cuts, leaves such rows where a row's last
    key ends a block."""
    stats = Counter()
    rng = random.Random(3)
    for sq, sk, block_m, block_n, left, right, m0 in tiles(rng, 200):
        tile = window_tile_scores(rng, sq, sk, block_m, block_n, left, right, m0, False)
        if tile is not None and block_n in (64, 128):
            attend(tile[0], block_n, 1.0, Mode.GUARDED, masked=tile[1], stats=stats)
    assert stats["guarded kept"] > 0 and stats["guarded redo"] == 0, stats
    # the shape the rule is for: the tile's first row sees keys .. 127, the last block's end
    scores = torch.zeros(8, 16, 256)
    for row in range(128):  # window(0, 127), sq = sk = 256, the tile of rows 0 .. 127
        scores.view(128, 256)[row, : max(0, row)] = -math.inf
        scores.view(128, 256)[row, row + 128 :] = -math.inf
    causal_rule = torch.tensor([False, True]).expand(8, 2)  # block 1 masked, block 0 not
    stats = Counter()
    attend(scores, 128, 1.0, Mode.GUARDED, masked=causal_rule, stats=stats)
    assert stats["guarded redo"] > 0
    assert window_work(0, 256, 256, 128, 128, 0, 127)[2:] == (2, 2)  # both blocks masked


def test_the_reference_masks_a_window_as_flashattention_does():
    """tests/test_gpu_general.reference's window (the GPU tests' reference): key j of query
    i iff i + sk - sq - left <= j <= i + sk - sq + right; its default is unchanged."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 16, generator=gen) for n in (5, 9, 9))
    out, lse = reference(q, k, v, 0.25, False, torch.float64, window=(2, 1))
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * 0.25
    for i in range(5):
        for j in range(9):
            if not i + 4 - 2 <= j <= i + 4 + 1:
                scores[:, :, i, j] = -math.inf
    assert torch.allclose(lse, torch.logsumexp(scores, -1))
    want = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, -1), v.double())
    assert torch.allclose(out, want)
    plain = reference(q, k, v, 0.25, True, torch.float64)
    assert torch.equal(plain[1], reference(q, k, v, 0.25, True, torch.float64, window=None)[1])
    # causal with a window of left 0: the diagonal key alone
    _, lse0 = reference(q, k, v, 0.25, True, torch.float64, window=(0, 0))
    diag = (q.double() * k.double()[:, 4:]).sum(-1).transpose(1, 2) * 0.25
    assert torch.allclose(lse0, diag)
