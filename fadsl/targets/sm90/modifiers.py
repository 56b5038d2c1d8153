"""Score and mask modifiers (issue 41) on sm_90a: what its forward kernel does not take with
them (validate_modifiers, called by validate). The kernel does not apply them yet: emit.py
refuses a kernel with modifiers until it does."""

from __future__ import annotations

from ...spec.checks import Checks
from ...spec.syntax import ExprLine, InputLine


def validate_modifiers(c: Checks) -> bool:
    """What the sm_90a forward does not take with modifiers yet, at the modifier's line."""
    lines = c.decl.modifiers
    if not lines:
        return True
    v, ok = c.values, True
    score = next((x for x in lines if isinstance(x, ExprLine) and x.keyword.text == "score"), None)
    keep = next((x for x in lines if isinstance(x, ExprLine) and x.keyword.text == "keep"), None)
    first = next((x for x in lines if not isinstance(x, InputLine)), lines[0])
    for key, what in (
        ("varlen", "varlen on (b and q_idx of a packed sequence)"),
        ("kv_cache", "kv_cache (per-batch cache lengths)"),
        ("pack_gqa", "pack_gqa on (rows of several heads in one tile)"),
    ):
        if v.get(key) not in (None, False, -1):
            c.error(first.loc, f"score and keep modifiers with {what} are not built yet")
            ok = False
    if score is not None and v.get("softcap"):
        c.error(
            score.loc,
            "a score modifier and 'softcap' do not combine: write the cap into the score, "
            f"e.g. score {v['softcap']} * tanh(s / {v['softcap']})",
        )
        ok = False
    if keep is not None:
        used = {
            "window": "window" in v,
            "cluster": v.get("cluster", 1) > 1,
            "tail": v.get("tail", False),
        }
        for key, why in (
            ("window", "write the window into keep, e.g. keep kv_idx >= q_idx + seqlen_k - "
             "seqlen_q - LEFT and kv_idx <= q_idx + seqlen_k - seqlen_q + RIGHT"),
            ("cluster", "a cluster's CTAs share every K/V block, but keep skips blocks per "
             "tile: use 'cluster 1'"),
            ("tail", "split pieces cut a tile's blocks by count, but keep skips blocks: use "
             "'tail whole'"),
        ):  # fmt: skip
            if used[key]:
                c.error(keep.loc, f"keep with '{key}' is not built yet: {why}")
                ok = False
    return ok
