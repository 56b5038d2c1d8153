"""`keep` in the sm_90a tile loop (issue 41): a mirror of the header's keep_work (the tile's
EMPTY blocks trimmed off both ends of its range, fadsl/sm90_tiles.cuh) over the modifier
examples' tile rules, on random lengths and prefixes. No block with a kept score is skipped;
with an exact rule the range is exactly the blocks with kept scores; `mask causal` written as
`keep` visits no block the built-in's range does not. The kernels: the template's slots."""

from __future__ import annotations

import random

import pytest

from conftest import ROOT
from fadsl.codegen.render import render
from fadsl.pipeline import compile_file
from modifier_eval import evaluate

B_R, B_C = 128, 128
CAUSAL = ROOT / "tests" / "specs" / "sm90" / "modifiers_causal.fa"
WINDOW = ROOT / "tests" / "specs" / "sm90" / "modifiers_window.fa"
PREFIX_LM = ROOT / "examples" / "modifiers" / "prefix_lm.fa"


def modifiers_of(path):
    return compile_file(path.relative_to(ROOT)).kernel.config.modifiers


def keep_range(m, m0: int, sq: int, sk: int, env: dict, inputs: dict) -> tuple[int, int]:
    """keep_work's [first block, block_end) for the tile at row m0, after kv_work without a
    mask (every block, the last one masked for the seqlen_k tail)."""
    n_blocks = block_end = -(-sk // B_C)
    q_lo, q_hi = m0, min(m0 + B_R, sq) - 1

    def empty(n):
        bounds = {"q_lo": q_lo, "q_hi": q_hi, "kv_lo": n * B_C, "kv_hi": min(n * B_C + B_C, sk) - 1}
        return evaluate(m.rule.empty, {**env, **bounds}, inputs)

    while n_blocks > 0 and empty(block_end - 1):
        block_end -= 1
        n_blocks -= 1
    while n_blocks > 0 and empty(block_end - n_blocks):
        n_blocks -= 1
    return block_end - n_blocks, block_end


def kept_blocks(m, m0, sq, sk, env, inputs) -> set[int]:
    """The blocks where some real row of the tile keeps some real key."""
    found = set()
    for i in range(m0, min(m0 + B_R, sq)):
        for n in range(-(-sk // B_C)):
            if n in found:
                continue
            keys = range(n * B_C, min(n * B_C + B_C, sk))
            if any(evaluate(m.keep, {**env, "q_idx": i, "kv_idx": j}, inputs) for j in keys):
                found.add(n)
    return found


def cases(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        sq, sk = rng.randint(1, 420), rng.randint(1, 420)
        prefix = [rng.choice((0, 1, rng.randint(0, sk), sk, sk + 9)) for _ in range(2)]
        b = rng.randrange(2)
        env = {"seqlen_q": sq, "seqlen_k": sk, "b": b, "h": 0, "batch": 2, "heads": 1}
        yield sq, sk, env, {"prefix": lambda i, p=prefix: p[i]}


@pytest.mark.parametrize("path", [CAUSAL, WINDOW, PREFIX_LM], ids=lambda p: p.stem)
def test_a_tile_visits_exactly_the_blocks_it_keeps_a_score_of(path):
    m = modifiers_of(path)
    assert m.rule.exact
    for sq, sk, env, inputs in cases(len(path.stem), 25):
        for m0 in range(0, sq, B_R):
            first, end = keep_range(m, m0, sq, sk, env, inputs)
            kept = kept_blocks(m, m0, sq, sk, env, inputs)
            where = f"{path.stem} sq {sq} sk {sk} m0 {m0} {env} {inputs['prefix'](env['b'])}"
            assert kept <= set(range(first, end)), f"a kept block skipped: {where}"
            if kept:  # an exact rule trims exactly to the kept blocks' span
                assert (first, end) == (min(kept), max(kept) + 1), where
            else:
                assert first == end, where


def test_causal_as_keep_visits_no_block_the_built_in_does_not():
    m = modifiers_of(CAUSAL)
    for sq, sk, env, inputs in cases(7, 60):
        for m0 in range(0, sq, B_R):
            # the built-in's kv_work: keys below m0 + B_r + seqlen_k - seqlen_q
            kv_end = min(sk, max(0, m0 + B_R + sk - sq))
            first, end = keep_range(m, m0, sq, sk, env, inputs)
            assert first == 0 or first == end
            assert end <= -(-kv_end // B_C), (sq, sk, m0)


def test_the_kernel_trims_masks_and_skips_with_the_rule():
    bf16, _ = [s for s in render(*_compiled(PREFIX_LM))]
    text = bf16.text
    assert "static constexpr bool kKeep = true;" in text
    assert "return kv_idx <= q_idx + P.base.seqlen_k - P.base.seqlen_q || kv_idx < u.v0;" in text
    assert "return kv_lo - q_hi > P.base.seqlen_k - P.base.seqlen_q && kv_lo >= " in text
    # blocks counted from the trimmed range's end, the first block masked where PARTIAL, the
    # loop's blocks masked where the warpgroup's rows do not keep the whole block
    assert "w.block_end - 1 - (it)" in text and "w.n_blocks - 1 - (it)" not in text
    assert "const int n_block = w.block_end - 1 - (it);" in text
    assert "if (keep_partial<Cfg>(P, w, wg, n_block)) mask_keep<Cfg>" in text
    assert (
        "if (keep_partial<Cfg>(P, w, wg, w.block_end - 1 - (it))) iteration(it, fadsl::sm90::true_type{});"
        in text
    )
    assert "if constexpr (kMask) mask_keep<Cfg>(s, P, uniforms, site);" in text
    # a keep without a score leaves S in softmax_scale log2 e units
    assert "const float scale_log2 = P.base.softmax_scale * 1.4426950408889634f;" in text


def _compiled(path):
    c = compile_file(path.relative_to(ROOT))
    return c.kernel, c.target, c.file
