"""`varlen on`'s padded chunks (emit/sm90/include/fadsl/sm90_bwd.cuh): the header's own
functions, compiled for the host with nvcc and run here. The preprocess and convert_dq skip a
chunk of B_r padded rows that holds no query (bwd_chunk_holds_query: a sequence's padding
slot, or any chunk of a malformed sequence), leaving its LSE, D and dQ accumulator unwritten.
That is safe only if the main kernel never visits such a chunk: sequence s visits chunks
first_slot(s) + [0, cdiv(len, B_r)) (bwd_block's chunk0 and m_end), and each must hold a
query of s at the rows bwd_query_rows gives; and every query row of every sequence must lie
in a chunk that is kept, so that convert_dq writes it."""

from __future__ import annotations

import random
import shutil

import pytest

from host_program import run_host_program

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

PROGRAM = r"""
#include "fadsl/sm90_bwd.cuh"
#include <cstdio>
using namespace fadsl::sm90;
template <int B> struct Cfg { static constexpr bool kVarlen = true; static constexpr int kBlockM = B; };
template <int B> void chunks(const int* cu, int sequences, int tokens) {
  const int slots = (tokens + sequences * B + B - 1) / B;
  for (int c = 0; c < slots; ++c) {
    const BwdQueryRows rows = bwd_query_rows<Cfg<B>>(cu, sequences, tokens, c);
    printf("%d %d %d %d %d %d\n", B, c, bwd_varlen_sequence(cu, sequences, B, c),
           bwd_chunk_holds_query<Cfg<B>>(rows, c) ? 1 : 0, rows.begin, rows.shift);
  }
}
int main() {
  int sequences, tokens;
  while (scanf("%d %d", &sequences, &tokens) == 2) {
    static int cu[4096];
    for (int i = 0; i <= sequences; ++i) scanf("%d", &cu[i]);
    printf("case\n");
    chunks<64>(cu, sequences, tokens);
    chunks<80>(cu, sequences, tokens);
    chunks<128>(cu, sequences, tokens);
  }
}
"""


def _cases() -> list[tuple[list[int], int]]:
    rng = random.Random(20261130)
    cases = [([0, 1024, 2048], 2048), ([0, 0, 1, 64, 64, 200], 200), ([5, 70, 71], 90)]
    cases.append(([0, 300, 100, 400], 400))  # malformed: decreasing
    cases.append(([0, 50, 900], 600))  # malformed: past the tokens
    for _ in range(60):
        lengths = [
            rng.choice([0, 1, rng.randint(1, 300), rng.randint(1, 2000)])
            for _ in range(rng.randint(1, 12))
        ]
        start = rng.choice([0, 0, rng.randint(1, 100)])
        cu = [start]
        for n in lengths:
            cu.append(cu[-1] + n)
        cases.append((cu, cu[-1] + rng.choice([0, 0, rng.randint(1, 100)])))
    return cases


@pytest.fixture(scope="module")
def found(tmp_path_factory):
    stdin = "".join(f"{len(cu) - 1} {tokens} {' '.join(map(str, cu))}\n" for cu, tokens in _cases())
    stdout = run_host_program(tmp_path_factory.mktemp("chunks"), "chunks", PROGRAM, stdin)
    results = []
    for line in stdout.splitlines():
        if line == "case":
            results.append({})
            continue
        block, chunk, seq, holds, begin, shift = map(int, line.split())
        results[-1][(block, chunk)] = (seq, bool(holds), begin, shift)
    return results


def test_every_chunk_the_main_kernel_visits_is_kept_and_every_query_row_lies_in_one(found):
    assert len(found) == len(_cases())
    for (cu, tokens), got in zip(_cases(), found):
        if not all(0 <= a <= b <= tokens for a, b in zip(cu, cu[1:])):
            # malformed (the forward's output is NaN, and so are the gradients): only the
            # sequence found for each chunk is in range
            assert all(0 <= seq < len(cu) - 1 for seq, _, _, _ in got.values())
            continue
        for block in (64, 80, 128):
            kept = {c for (b, c), (_, holds, _, _) in got.items() if b == block and holds}
            visited, rows_of_queries = set(), set()
            for s in range(len(cu) - 1):
                q0, q1 = cu[s], cu[s + 1]
                first = (q0 + s * block) // block
                for j in range(-(-(q1 - q0) // block)):  # bwd_block's m-blocks
                    visited.add(first + j)
                    seq, holds, begin, shift = got[(block, first + j)]
                    assert (seq, holds, begin, shift) == (
                        s,
                        True,
                        first * block,
                        q0 - first * block,
                    )
                rows_of_queries |= {(first * block + i) // block for i in range(q1 - q0)}
            assert visited <= kept, (cu, tokens, block)
            assert rows_of_queries == kept, (cu, tokens, block)


def test_padding_slots_are_skipped(found):
    # sixteen chunks of 64 rows per 1024-token sequence and one padding slot after each
    got = found[0]
    assert [got[(64, c)][1] for c in range(34)] == ([True] * 16 + [False]) * 2
