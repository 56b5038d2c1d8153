"""Partial attention outputs merged by their LSE, in fp32 (context parallelism's combine).

Two partials of the same query rows over disjoint key sets, (o1, l1) and (o2, l2) with
o (batch, seqlen, heads, head_dim) and l (batch, heads, seqlen) natural-log LSEs, merge
exactly to l = log(e^l1 + e^l2) and o = o1 e^(l1 - l) + o2 e^(l2 - l).

Numerics: l >= max(l1, l2), so both factors e^(l1 - l), e^(l2 - l) lie in [0, 1] (one of
them is 1 up to rounding): no overflow, and a factor that underflows belongs to a partial
whose weight is below fp32's resolution beside the other's. A row that has seen no key yet
has l = -inf; where both are -inf the merged row stays 0 with l = -inf (the factors are
taken as 0, not as e^(-inf + inf) = NaN), and a partial's row with l = -inf contributes
nothing whatever its output holds.
"""

from __future__ import annotations

import torch


def _rows(lse: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seqlen) -> (batch, seqlen, heads, 1), to scale output rows."""
    return lse.transpose(1, 2).unsqueeze(-1)


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse):
    """Merge the partial (part_out, part_lse) into the fp32 accumulators (out, lse), in
    place; both cover the same rows."""
    merged = torch.logaddexp(lse, part_lse)
    seen = merged > float("-inf")
    base = torch.where(seen, merged, torch.zeros_like(merged))
    mine = torch.where(seen, torch.exp(lse - base), torch.zeros_like(merged))
    theirs = torch.where(part_lse > float("-inf"), torch.exp(part_lse - base), 0.0)
    weighted = torch.where(_rows(theirs) > 0, part_out.float() * _rows(theirs), 0.0)
    out.mul_(_rows(mine)).add_(weighted)
    lse.copy_(merged)
