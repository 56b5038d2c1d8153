"""`deterministic on` in visit order (emit/sm90/include/fadsl/sm90_bwd.cuh, bwd_dq_place):
the header's own place functions, compiled for the host with nvcc and run here, against
their definition: at each m-block the places of the n-blocks that visit it are 0, 1, ... in
the order the n-blocks reach it (without a mask n-block n starts at m-block n M / N and wraps
around, ties by index; causal, each visits upwards from its diagonal, so the last n-block
that sees an m-block reaches it first). A wrong place would make a CTA wait for a ticket that
never comes (a hang) or add out of order (dQ not bitwise stable)."""

from __future__ import annotations

import shutil

import pytest

from host_program import run_host_program

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

PROGRAM = r"""
#include "fadsl/sm90_bwd.cuh"
#include <cstdio>
using namespace fadsl::sm90;
int main() {
  for (int M = 1; M <= 24; ++M)
    for (int N = 1; N <= 30; ++N)
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) printf("none %d %d %d %d %d\n", M, N, m, n, visit_place(n, m, M, N));
  const int tiles[][2] = {{64, 128}, {80, 128}, {128, 128}};
  for (const auto& t : tiles)
    for (int sq = 1; sq <= 700; sq += 37)
      for (int sk = 1; sk <= 900; sk += 53) {
        const int M = (sq + t[0] - 1) / t[0], N = (sk + t[1] - 1) / t[1], d = sk - sq;
        for (int n = 0; n < N; ++n) {
          const int first_q = n * t[1] - d, m_begin = first_q > 0 ? first_q / t[0] : 0;  // bwd_block's
          for (int m = m_begin; m < M; ++m)
            printf("causal %d %d %d %d %d %d %d\n", t[0], t[1], sq, sk, m, n,
                   causal_visit_place(n, m, t[0], t[1], d, N));
        }
      }
}
"""


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    stdout = run_host_program(tmp_path_factory.mktemp("places"), "places", PROGRAM)
    found = {"none": {}, "causal": {}}
    for line in stdout.splitlines():
        kind, *values = line.split()
        *where, n, place = map(int, values)
        found[kind].setdefault(tuple(where), {})[n] = place
    return found


def test_without_a_mask_places_follow_the_steps_at_which_n_blocks_arrive(places):
    assert len(places["none"]) == sum(range(1, 25)) * 30
    for (m_count, n_blocks, m), got in places["none"].items():
        first = {n: n * m_count // n_blocks for n in range(n_blocks)}
        arrivals = sorted(range(n_blocks), key=lambda n: ((m - first[n]) % m_count, n))
        assert got == {n: i for i, n in enumerate(arrivals)}, (m_count, n_blocks, m)


def test_causal_places_run_from_the_last_n_block_that_sees_the_m_block_down(places):
    assert places["causal"]
    for (block_m, block_n, sq, sk, m), got in places["causal"].items():
        # every n-block that visits m (its m_begin <= m) and only those, each once
        visitors = sorted(got)
        assert visitors == list(range(len(visitors))), (block_m, block_n, sq, sk, m)
        # the later its diagonal, the sooner an n-block reaches m: the last first
        assert got == {n: visitors[-1] - n for n in visitors}
