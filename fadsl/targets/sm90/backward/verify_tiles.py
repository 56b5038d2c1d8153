"""`scheduler persistent` in the proof of the backward's sync plan (verify.py): the tile
sequences a CTA's program is unrolled over, the unrolling itself (the m-block index running on
over the tiles, the tiles with an m-block counted for K and V's phase) and the
configurations the tests prove."""

from __future__ import annotations

from dataclasses import replace

from .program import BLOCK_M, TRANSPOSED_BLOCK_M, Item, Params, unrolled


def tile_counts(p: Params) -> tuple[tuple[int, ...], ...]:
    """`scheduler persistent`: the CTAs' tile sequences the plan is proven for. A tile
    starts where every wgmma group of the last is retired, every named barrier generation
    complete and (dQ staged) at most its last bulk group in flight, so the next tile
    depends on the past only through the running m-block index (ring slot i % stages, its
    parity (i / stages) & 1, dS^T's buffer i % 2), kv_full's and kv_empty's phase (the
    round t of tiles with an m-block) and that bulk group. Two tiles whose first has 0 ..
    2 stages + 1 m-blocks start the second at every ring position and dS^T buffer with
    either kv phase, and the second's 0 .. stages + 2 m-blocks reuse each slot; three tiles
    of 0 .. 2 m-blocks add a third round of kv_full and kv_empty (a wait on a barrier that
    is no longer fresh) and tiles without an m-block between tiles with some."""
    pairs = tuple(
        (a, b) for a in range(0, 2 * p.stages + 2) for b in range(0, p.stages + 3) if a or b
    )
    triples = tuple((a, b, c) for a in range(3) for b in range(3) for c in range(3))
    return pairs + triples


def tiles_unrolled(
    items: tuple[Item, ...], m_count: int | tuple[int, ...], peeled: bool = False
) -> list:
    """(item, m-block, tile round) in one thread's order: ``unrolled`` for one tile of
    m_count m-blocks, or with `scheduler persistent` for each tile of a sequence in turn, the
    m-block index running on over the tiles and the round counting the tiles with an
    m-block (the header's BwdRun: m0 and kv). ``peeled``: the warpgroup's first m-block
    peeled (`peel_dead on`, one tile per CTA)."""
    counts = m_count if isinstance(m_count, tuple) else (m_count,)
    assert not peeled or len(counts) == 1, "peel_dead: one tile per CTA"
    out, m0, t = [], 0, 0
    for m in counts:
        steps = unrolled(items, m, m0, peeled)
        out += [(x, None if i is None else m0 + i, t) for x, i in steps]
        m0, t = m0 + m, t + (m > 0)
    return out


def persistent_space(space: tuple[Params, ...]) -> tuple[Params, ...]:
    """`scheduler persistent`'s configurations the tests prove (validate.py admits it without
    deterministic mode, dQ writers, head_dim 256, dK and dV by TMA, peel_dead or late_v): each of
    ``space``'s (verify.py's parameter_space) others with 2 stages and dS by st.shared, and
    the examples' blocks (fa3_hopper's B_r 80 with 3 stages, fa3_causal's with 2, the head_dim 64 ones' B_r 128
    with dS by stmatrix)."""
    keep = lambda p: not (
        p.deterministic or p.dq_writer or p.split or p.dkv_tma or p.peel_dead or p.late_v
    )  # noqa: E731
    base = tuple(p for p in space if keep(p) and p.stages == 2 and not p.ds_stmatrix)
    examples = (
        Params(2, 3, 128, overlap=True, block_m=TRANSPOSED_BLOCK_M, dq_red=True),
        Params(2, 2, 64, overlap=True, block_m=2 * BLOCK_M, dq_red=True, ds_stmatrix=True),
    )
    return tuple(replace(p, persistent=True) for p in base + examples)
