"""How evenly the forward's tile orders spread a causal or prefix-LM launch over the SMs: a
simulation of sm90_tiles.cuh's orders over each tile's count of K/V blocks (no GPU).

Each tile (one query block of B_r rows of a (batch, head)) costs its K/V blocks plus a fixed
overhead (--overhead, in blocks: its prologue and epilogue). The orders:
  pairs    `scheduler persistent` as shipped for causal and `keep` (longest_tiles_first): a
           head's long and short query blocks in pairs (m = M - 1 - k with k), CTA c running
           pairs c, c + G, c + 2G, ... (tile_index, tile_coords);
  rotated33 the pairs as shipped, CTA c taking position (c + 33 s) mod G of step s's G pairs
           (the same pairs in flight, another CTA for each);
  golden   a head's pairs in the order k = j a mod M/2, a the odd number nearest 0.618 M/2;
  grouped16 pairs enumerated over groups of 16 heads: the group, then k, then the head;
  dynamic tiles  a persistent CTA taking the next tile from a counter as soon as it is
           free, the tiles of each WINDOW heads sorted longest first (FlashAttention-3's
           dynamic scheduler, with L2 locality kept to a window of heads);
  dynamic pairs  the same over the shipped order's pairs, as they come;
  sorted pairs   the same, the pairs of each WINDOW heads sorted longest first.
Prints, per shape, the busiest CTA's work over the mean (1.000: perfectly even; the launch's
time is the busiest CTA's). Work per tile: causal max(m + 1, prefix blocks) for query block m,
the prefix given per batch row in blocks.

Usage: python research/probes/tile_order_sim.py [--sms 132] [--overhead 2] [--window 2]
"""

from __future__ import annotations

import argparse
import heapq
import math

HEADS = 16


def tile_blocks(m_blocks: int, prefixes: list[int]) -> list[list[int]]:
    """Per (batch, head), each query block's K/V blocks (causal, a prefix of whole blocks)."""
    return [[max(m + 1, p) for m in range(m_blocks)] for p in prefixes for _ in range(HEADS)]


def pairs(work: list[list[int]], sms: int, overhead: float) -> list[float]:
    load = [0.0] * sms
    index = 0
    for head in work:
        m = len(head)
        for k in range(m // 2):
            load[index % sms] += head[m - 1 - k] + head[k] + 2 * overhead
            index += 1
    return load


def rotated33(work, sms: int, overhead: float, window: int) -> list[float]:
    units = [u for head in work for u in head_pairs(head, overhead)]
    load = [0.0] * sms
    for cta in range(sms):
        for step in range(-(-len(units) // sms)):
            index = step * sms + (cta + 33 * step) % sms
            if index < len(units):
                load[cta] += units[index]
    return load


def golden(work, sms: int, overhead: float, window: int) -> list[float]:
    half = len(work[0]) // 2
    a = max(1, round(0.618 * half)) | 1
    while math.gcd(a, half) != 1:
        a += 2
    units = []
    for head in work:
        pairs_of_head = head_pairs(head, overhead)
        units += [pairs_of_head[j * a % half] for j in range(half)]
    return [sum(units[c::sms]) for c in range(sms)]


def grouped16(work, sms: int, overhead: float, window: int) -> list[float]:
    units = []
    for first in range(0, len(work), 16):
        heads = [head_pairs(head, overhead) for head in work[first : first + 16]]
        units += [pairs_of_head[k] for k in range(len(heads[0])) for pairs_of_head in heads]
    return [sum(units[c::sms]) for c in range(sms)]


def take(units, sms: int) -> list[float]:
    """Each unit, in turn, to the CTA that is free first (a counter's dynamic order)."""
    free = [(0.0, c) for c in range(sms)]
    for cost in units:
        t, c = heapq.heappop(free)
        heapq.heappush(free, (t + cost, c))
    return [t for t, _ in free]


def head_pairs(head: list[int], overhead: float) -> list[float]:
    m = len(head)
    return [head[m - 1 - k] + head[k] + 2 * overhead for k in range(m // 2)]


def windows(work: list[list[int]], window: int):
    for first in range(0, len(work), window):
        yield work[first : first + window]


def dynamic_tiles(work, sms: int, overhead: float, window: int) -> list[float]:
    units = []
    for heads in windows(work, window):
        units += sorted((b + overhead for head in heads for b in head), reverse=True)
    return take(units, sms)


def dynamic_pairs(work, sms: int, overhead: float, window: int) -> list[float]:
    return take([u for head in work for u in head_pairs(head, overhead)], sms)


def sorted_pairs(work, sms: int, overhead: float, window: int) -> list[float]:
    units = []
    for heads in windows(work, window):
        units += sorted((u for head in heads for u in head_pairs(head, overhead)), reverse=True)
    return take(units, sms)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--overhead", type=float, default=2.0)
    parser.add_argument("--window", type=int, default=2)
    args = parser.parse_args()
    shapes = {  # name: (query blocks of 128 rows, prefix blocks per batch row)
        "causal 1 x 16k": (128, [0]),
        "prefix 1 x 16k, n/4": (128, [32]),
        "prefix 1 x 16k, n/2": (128, [64]),
        "causal 4 x 4k": (32, [0] * 4),
        "prefix 4 x 4k, n/4 n/8 n/2 0": (32, [8, 4, 16, 0]),
        "causal 16 x 1k": (8, [0] * 16),
    }
    print(f"{args.sms} SMs, {HEADS} heads, overhead {args.overhead} blocks a tile")
    orders = {"rotated33": rotated33, "golden": golden, "grouped16": grouped16}
    orders.update({"dynamic tiles": dynamic_tiles, "dynamic pairs": dynamic_pairs})
    orders["sorted pairs"] = sorted_pairs
    print(f"{'shape':30s} {'pairs':>7s}" + "".join(f" {name:>13s}" for name in orders))
    for name, (m_blocks, prefixes) in shapes.items():
        work = tile_blocks(m_blocks, prefixes)
        mean = (sum(map(sum, work)) + args.overhead * m_blocks * len(work)) / args.sms
        cells = [max(pairs(work, args.sms, args.overhead)) / mean]
        for order in orders.values():
            cells.append(max(order(work, args.sms, args.overhead, args.window)) / mean)
        print(f"{name:30s} {cells[0]:7.3f}" + "".join(f" {c:13.3f}" for c in cells[1:]))


if __name__ == "__main__":
    main()
