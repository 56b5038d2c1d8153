"""fadsl bench's round orders (bench.balanced_orders): a contender's clock depends on what ran
just before it, so every contender must come first, and follow each other one, equally often."""

from __future__ import annotations

from collections import Counter

import pytest

from fadsl.tools.bench import balanced_orders


@pytest.mark.parametrize("n", range(1, 9))
def test_each_contender_first_and_after_each_other_equally_often(n):
    orders = balanced_orders(n)
    assert len(orders) == (2 * n if n % 2 else n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    firsts = Counter(order[0] for order in orders)
    assert set(firsts.values()) == {len(orders) // n}
    pairs = Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    if n > 1:
        assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
        assert set(pairs.values()) == {2 if n % 2 else 1}


def test_the_rotation_it_replaces_was_not_balanced():
    """Rotating [0, 1, 2, 3] by one each round keeps 3 right before 0, 0 before 1 ...: the
    contender timed after FlashAttention-2 was always cuDNN (until 2026-11-24)."""
    rotated = [[(i + r) % 4 for i in range(4)] for r in range(4)]
    pairs = Counter((a, b) for order in rotated for a, b in zip(order, order[1:]))
    assert pairs[(2, 3)] == 3 and pairs[(3, 2)] == 0
