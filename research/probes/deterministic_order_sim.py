"""How much `deterministic on`'s ordered dQ adds cost a backward launch without a mask, by
the visit order and the launch's residency: a simulation (no GPU) of research/
backward-dq-writer.md's hypothesis that the next (batch, head)'s early CTAs wait on n-blocks
not yet launched (which it refutes at the measured shapes: that section says how).

The model: CTAs launch in the grid's order ((batch, head) by (batch, head), n-blocks in
order), one an SM, the next as soon as one ends. A CTA's consumer runs its M m-blocks at
--step us each and stages each m-block's dQ; its writer (one serial agent) waits for the
staging, for its ticket (the release of the n-block placed before it at that m-block, seen
--poll us later), reads the staging (--read; the consumer may stage the next m-block's dQ
only after it), completes and releases (--release). A CTA ends --epilogue us after its last
m-block and its last release. Without tickets (the default's adds) the writer reads and
goes on. Orders (sm90_bwd_block.cuh):
  ring     the shipped visit order: n-block n of N starts at m-block n M / N and wraps; at
           each m-block the n-blocks that reach it in fewer steps add first (n + 1 before n);
  norder   n-block order: every n-block visits the m-blocks upwards, n after n - 1;
  prefixS  the ring for n-blocks S .. N - 1, after n-blocks 0 .. S - 1, which visit upwards in
           n-block order (the fix sketched in research/backward-dq-writer.md).
Prints each order's launch time over the default's (no tickets, same model) and the SMs'
busy share. Step times are the H200 trace's of 2026-12-03 (head_dim 64, deterministic,
meeting order: a 2.82 us m-block, acquire 0.46, read 0.75, completion and fences 0.11,
release 0.49 us).

Usage: python research/probes/deterministic_order_sim.py [--sms 132] [--shapes 4x4096,...]
  [--orders ring,norder,prefix4] [--jitter 0.1]
--jitter: each m-block's time drawn around --step (relative sigma, the same draws in every
order), which the ring's coupling (each CTA's add after its neighbour's) turns into waits
that the default's independent CTAs do not have.
"""

from __future__ import annotations

import argparse
import heapq
import random
import re

HEADS = 32  # hidden 2048 at head_dim 64
BLOCK = 128  # B_r = B_c = 128


def visit_orders(order: str, n_blocks: int, m_blocks: int):
    """Per n-block, its m-blocks in visit order, and per (n-block, m-block) its place."""
    visits = [[0] * m_blocks for _ in range(n_blocks)]
    places = [[0] * m_blocks for _ in range(n_blocks)]
    prefix = int(order[len("prefix") :]) if order.startswith("prefix") else 0
    if order == "norder":
        prefix = n_blocks
    for n in range(min(prefix, n_blocks)):
        visits[n] = list(range(m_blocks))
        places[n] = [n] * m_blocks
    ring = list(range(prefix, n_blocks))
    if ring:
        first = {n: k * m_blocks // len(ring) for k, n in enumerate(ring)}
        for n in ring:
            visits[n] = [(first[n] + i) % m_blocks for i in range(m_blocks)]
        for m in range(m_blocks):
            by_step = sorted(ring, key=lambda n: ((m - first[n]) % m_blocks, -n))
            for k, n in enumerate(by_step):
                places[n][m] = prefix + k
    return visits, places


def simulate(order: str, pairs: int, n_blocks: int, a) -> tuple[float, float]:
    """The launch's end and the SMs' busy share (the CTAs' own time, waits excluded, over
    SMs x the end); order "default": no tickets."""
    m_blocks = n_blocks
    rng = random.Random(a.seed)  # the same draws in every order: m-block times by (CTA, step)
    times = [
        [a.step * max(0.2, 1 + a.jitter * rng.gauss(0, 1)) for _ in range(m_blocks)]
        for _ in range(pairs * n_blocks)
    ]
    visits, places = visit_orders("ring" if order == "default" else order, n_blocks, m_blocks)
    ctas = [(p, n) for p in range(pairs) for n in range(n_blocks)]
    release: dict = {}  # (pair, m-block, place) -> time
    parked: dict = {}  # (pair, m-block, place awaited) -> CTA index
    state = {}  # CTA -> [step, consumer time, staging read, writer free]
    ends: list = []  # heap of (end, CTA)

    def run(x: int) -> None:
        work = [x]
        while work:
            x = work.pop()
            p, n = ctas[x]
            i, consumer, read, free = state[x]
            while i < m_blocks:
                m = visits[n][i]
                staged = max(consumer + times[x][i], read)
                place = places[n][m]
                ticket = 0.0
                if order != "default" and place > 0:
                    key = (p, m, place - 1)
                    if key not in release:
                        parked[key] = x
                        state[x] = [i, consumer, read, free]
                        break
                    ticket = release[key] + a.poll
                start = max(staged, free, ticket)
                read = start + a.read
                free = read + (a.done + a.release if order != "default" else 0.0)
                if order != "default":
                    release[(p, m, place)] = free
                    waiter = parked.pop((p, m, place), None)
                    if waiter is not None:
                        work.append(waiter)
                consumer = staged
                i += 1
            else:
                heapq.heappush(ends, (max(consumer, free) + a.epilogue, x))

    launched = min(a.sms, len(ctas))
    for x in range(launched):
        state[x] = [0, a.prologue, 0.0, 0.0]
        run(x)
    end = 0.0
    while ends:
        t, _ = heapq.heappop(ends)
        # (a parked CTA waits, at the end of its chain, on one not launched: it cannot end
        # before the next launch, so the next end known is the next slot)
        end = max(end, t)
        if launched < len(ctas):
            state[launched] = [0, t + a.prologue, t, t]
            launched += 1
            run(launched - 1)
    if parked:
        raise RuntimeError(f"{order}: {len(parked)} CTAs never got their tickets (deadlock)")
    busy = len(ctas) * (a.prologue + a.epilogue) + sum(map(sum, times))
    return end, busy / (a.sms * end)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--shapes", default="4x4096,3x4224,1x16384,1x16896")
    ap.add_argument("--orders", default="ring,norder,prefix4")
    ap.add_argument("--step", type=float, default=2.82)
    ap.add_argument("--poll", type=float, default=0.46)
    ap.add_argument("--read", type=float, default=0.75)
    ap.add_argument("--done", type=float, default=0.11)
    ap.add_argument("--release", type=float, default=0.49)
    ap.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="each m-block's time: step x (1 + jitter x N(0, 1))",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--prologue", type=float, default=3.0)
    ap.add_argument("--epilogue", type=float, default=3.0)
    a = ap.parse_args()
    orders = a.orders.split(",")
    for order in orders:  # (an unknown name would run as the ring)
        if order not in ("ring", "norder") and not re.fullmatch(r"prefix[0-9]+", order):
            ap.error(f"--orders: {order!r} is none of ring, norder, prefixS (S a count)")
    print(f"{'batch x seqlen':>15} {'default busy':>12} " + " ".join(f"{o:>16}" for o in orders))
    for shape in a.shapes.split(","):
        batch, seqlen = (int(v) for v in shape.split("x"))
        n_blocks = -(-seqlen // BLOCK)
        base, busy = simulate("default", batch * HEADS, n_blocks, a)
        cells = []
        for order in orders:
            try:
                end, _ = simulate(order, batch * HEADS, n_blocks, a)
                cells.append(f"{base / end:16.3f}")
            except RuntimeError:
                cells.append(f"{'deadlock':>16}")
        print(f"{shape:>15} {busy:12.3f} " + " ".join(cells))


if __name__ == "__main__":
    main()
