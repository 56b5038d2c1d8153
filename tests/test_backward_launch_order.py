"""`deterministic on` with the causal mask, in visit order (sm90_bwd_block.cuh): bwd_block_at
launches a (batch, head)'s n-blocks last first, so that the n-block whose ordered dQ add an
m-block waits for (the place before, causal_visit_place) always launched earlier. Checked on
the header itself, built with nvcc and run here: the launch is a permutation of the n-blocks,
every wait is on an earlier launch, and a simulation of the grid (CTAs placed on free SMs in
launch order, one m-block a step, each add after its ticket's predecessor) finishes on any
number of SMs, where the n-block order of the launch (the order before, 2026-12-01) needed
every n-block of a (batch, head) on the GPU at once and ran the next (batch, head)'s CTAs in
step with its last one launched; the host then asks for the visit order at any length
(host._in_visit_order)."""

from __future__ import annotations

from collections import defaultdict

import pytest

from host_program import run_host_program

# name, head_dim, B_r (B_c 128): the examples' tiles and B_r 64
CONFIGS = [("c80", 128, 80), ("c128", 64, 128), ("c64", 128, 64)]
LENGTHS = [(1, 1), (128, 128), (1000, 1000), (640, 1000), (1000, 333), (2048, 2048)]

PROGRAM = r"""
#include "fadsl/sm90_bwd.cuh"
#include <cstdio>
using namespace fadsl::sm90;
{configs}
template <class Cfg>
void run(const char* name) {{
  const int lengths[][2] = {{{lengths}}};
  for (const auto& l : lengths) {{
    BwdParamsSm90 P{{}};
    P.seqlen_q = l[0];
    P.seqlen_k = l[1];
    P.m_blocks = (l[0] + Cfg::kBlockM - 1) / Cfg::kBlockM;
    P.group = 1;
    P.dq_in_visit_order = 1;
    const int n_blocks = (l[1] + Cfg::kBlockN - 1) / Cfg::kBlockN;
    for (int x = 0; x < n_blocks; ++x) {{
      const BwdBlock b = bwd_block_at<Cfg>(P, x, 0, 0, n_blocks, 1, 1);
      printf("%s %d %d %d %d", name, l[0], l[1], x, b.n_block);
      for (int i = 0; i < b.m_count; ++i) {{
        const int m = b.m_begin + i;
        printf(" %d:%d", m, causal_visit_place(b.n_block, m, Cfg::kBlockM, Cfg::kBlockN, l[1] - l[0], n_blocks));
      }}
      printf("\n");
    }}
  }}
}}
int main() {{
{runs}
}}
"""


def _config(name: str, head_dim: int, block_m: int) -> str:
    base = f"BwdConfig<__nv_bfloat16, {head_dim}, {block_m}, 128, 2, 2, true, true>"
    return f"struct {name} : {base} {{}};"


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """(config, seqlen_q, seqlen_k) -> the launch: [(n_block, [(m, place), ...]) per x]."""
    program = PROGRAM.format(
        configs="\n".join(_config(*c) for c in CONFIGS),
        lengths=", ".join(f"{{{sq}, {sk}}}" for sq, sk in LENGTHS),
        runs="\n".join(f'  run<{c[0]}>("{c[0]}");' for c in CONFIGS),
    )
    stdout = run_host_program(tmp_path_factory.mktemp("launch_order"), "order", program)
    found = defaultdict(list)
    for line in stdout.splitlines():
        name, sq, sk, x, n, *visits = line.split()
        key = (name, int(sq), int(sk))
        assert int(x) == len(found[key])
        found[key].append((int(n), [tuple(map(int, v.split(":"))) for v in visits]))
    assert set(found) == {(c[0], sq, sk) for c in CONFIGS for sq, sk in LENGTHS}
    return dict(found)


def simulate(launch, heads: int, sms: int) -> int | None:
    """Steps until every CTA of ``heads`` (batch, head)s ends, their CTAs placed on free SMs in
    launch order (x fastest, then the head); each CTA adds into one m-block a step, once the
    m-block's adds of every smaller place are done. None: no CTA can move (a deadlock)."""
    order = [(h, n, visits) for h in range(heads) for n, visits in launch]
    done = defaultdict(int)  # (head, m) -> places added
    running, next_cta, t = [], 0, 0
    while next_cta < len(order) or running:
        while len(running) < sms and next_cta < len(order):
            running.append([order[next_cta], 0])
            next_cta += 1
        ready = [
            r
            for r in running
            if r[1] < len(r[0][2]) and done[(r[0][0], r[0][2][r[1]][0])] == r[0][2][r[1]][1]
        ]
        finished = [r for r in running if r[1] == len(r[0][2])]
        if not ready and not finished:
            return None
        for r in ready:
            done[(r[0][0], r[0][2][r[1]][0])] += 1
            r[1] += 1
        running = [r for r in running if r not in finished]
        t += 1
    return t


def test_the_launch_is_a_permutation_and_every_wait_is_on_an_earlier_launch(launches):
    for key, launch in launches.items():
        assert sorted(n for n, _ in launch) == list(range(len(launch))), key
        launched = {n: x for x, (n, _) in enumerate(launch)}
        holder = {(m, place): n for n, visits in launch for m, place in visits}
        for (m, place), n in holder.items():
            assert place == 0 or (m, place - 1) in holder, (key, m, place)  # no gap
            if place:
                assert launched[holder[(m, place - 1)]] < launched[n], (key, m, place)


@pytest.mark.parametrize("sms", [1, 2, 5, 16, 132])
def test_the_grid_finishes_on_any_number_of_sms(launches, sms):
    for key, launch in launches.items():
        assert simulate(launch, heads=3, sms=sms) is not None, (key, sms)


def test_the_n_block_launch_order_waits_where_the_last_first_does_not(launches):
    """With a (batch, head)'s n-blocks on the GPU at once, the order before (n-block 0 first)
    stalls the next (batch, head) behind its last launch; last first, no CTA of it waits
    longer than its own work plus one step a (batch, head) ahead of it."""
    launch = launches[("c128", 2048, 2048)]
    ascending = sorted(launch, key=lambda item: item[0])
    blocks, heads = len(launch), 4
    last_first = simulate(launch, heads, sms=blocks)
    n_first = simulate(ascending, heads, sms=blocks)
    assert n_first is not None and last_first is not None
    longest = max(len(visits) for _, visits in launch)
    assert last_first <= heads * longest  # each head's longest n-block, back to back at worst
    assert n_first > 1.3 * last_first  # (the order before: each head behind its last launch)
