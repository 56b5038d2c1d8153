"""The head_dim 256 backward's host side and dQ's accumulator layout, without a GPU.

- host.run on CPU tensors with the driver's TMA encoder replaced by one that records its
  arguments and a launch that records each kernel: the grids (n-blocks of B_c 80 keys,
  m-blocks of 64 queries), the maps' boxes, dQ's accumulator (64 x 256 floats per m-block),
  GQA's dK and dV added in fp32 per K/V head (DkvStore kDkvAddFp32: the split consumer's
  red.add), then cast to K's dtype.
- the accumulator's fragment order: what bwd_consumer_split's red.adds write (share p =
  head_dim panel p, each thread's dQ^T registers in wgmma's accumulator layout) decoded the
  way bwd_convert_dq_t reads it (2 warpgroups of a CTA, each 2 shares, a shuffle with the
  lane 4 away) gives dQ back, every element once; modelled in plain Python from the header's
  formulas."""

from __future__ import annotations

import struct

import torch

from fadsl.pipeline import compile_file
from fadsl.targets.sm90.backward import host
from fadsl.targets.sm90.host import tma

HDIM256 = "examples/fa3_hdim256.fa"


def test_the_host_launches_the_split_kernels(monkeypatch):
    calls = []

    def fake_encode(ptr, dtype, shape, strides, element_size, box_cols, box_rows, streamed=False):
        calls.append((tuple(shape), box_cols, box_rows))
        return bytes(tma.MAP_BYTES)

    monkeypatch.setattr(tma, "_encode", fake_encode)
    monkeypatch.setattr(tma, "_encoded", {})
    kernel = compile_file(HDIM256).kernel
    batch, sq, sk, hq, hkv, d = 2, 100, 170, 8, 2, 256
    q = torch.randn(batch, sq, hq, d, dtype=torch.bfloat16)
    k = torch.randn(batch, sk, hkv, d, dtype=torch.bfloat16)
    v = torch.randn(batch, sk, hkv, d, dtype=torch.bfloat16)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(batch, hq, sq)
    launches = []
    dq, dk, dv = host.run(kernel, launches.append, q, k, v, out, lse, dout, None, 0.0625)
    prep, main, convert = launches
    rows = 128  # seqlen_q rounded to B_r 64
    assert [x.suffix for x in launches] == ["_preprocess", "", "_convert_dq"]
    assert prep.grid == (rows // 8, hq, batch)  # 8 rows of 256 per CTA (32 threads a row)
    assert main.grid == (3, hq, batch) and main.block == (384, 1, 1)  # cdiv(170, 80) n-blocks
    assert convert.grid == (rows // 16, hq, batch)  # 16 queries per CTA
    # Q and dO boxes of 64 columns x B_r 64 rows, K and V of 64 x B_c 80
    assert [c[1:] for c in calls] == [(64, 64), (64, 80), (64, 80), (64, 64)]
    fields = host.MAIN_FIELDS.unpack_from(main.params, 4 * tma.MAP_BYTES)
    ints = fields[12:19]  # seqlen_q, seqlen_k, rows, m_blocks, heads_q, group, dkv_store
    # GQA without `deterministic on` (refused at head_dim 256): added per K/V head in fp32
    assert ints == (sq, sk, rows, rows // 64, hq, hq // hkv, host.DKV_ADD_FP32)
    scales = struct.unpack("<2f", struct.pack("<2f", 0.0625 * host.LOG2E, 0.0625))
    assert fields[19:21] == scales  # softmax_scale log2 e, softmax_scale
    assert fields[21] == 0  # dq_in_visit_order: `deterministic on`'s only
    # GQA's fp32 accumulators per K/V head, cast to K's shape and dtype (the kernels did not
    # run: whatever the zeroed buffers held)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dk.dtype == dv.dtype == torch.bfloat16


# --- the accumulator's fragment order --------------------------------------------------

BLOCK_M, HEAD_DIM, THREADS = 64, 256, 128
FLOATS = 64 * BLOCK_M  # one share (kDqFloats): a head_dim panel of every query


def _written(dq: list[list[float]]) -> list[float]:
    """One m-block's accumulator as bwd_consumer_split's red_add_dq writes it: for share p
    (head_dim panel p) thread tid's dQ^T registers, m64n64 accumulator layout (register
    4j + 2r + e holds row 16 warp + g + 8r = column c of the panel, column 8j + 2t + e = the
    query), float4 q = registers 4q..4q + 3 at (q * 128 + tid) * 4."""
    acc = [float("nan")] * (HEAD_DIM // 64 * FLOATS)
    for share in range(HEAD_DIM // 64):
        for tid in range(THREADS):
            warp, lane = tid // 32, tid % 32
            g, t = lane // 4, lane % 4
            for reg in range(FLOATS // THREADS):
                j, r, e = reg // 4, reg % 4 // 2, reg % 2
                col = 64 * share + 16 * warp + g + 8 * r
                query = 8 * j + 2 * t + e
                q, within = reg // 4, reg % 4
                acc[share * FLOATS + (q * THREADS + tid) * 4 + within] = dq[query][col]
    return acc


def _converted(acc: list[float]) -> list[list[float | None]]:
    """The m-block's dQ as bwd_convert_dq_t reads it back: 4 CTAs of 16 queries, each thread
    of 256 two shares (threadIdx / 128 and + 2), a float4 per half and a shuffle with the
    lane 4 away (column d ^ 1)."""
    out: list[list[float | None]] = [[None] * HEAD_DIM for _ in range(BLOCK_M)]
    for cta in range(BLOCK_M // 16):
        row0 = cta * 16
        for rnd in range(HEAD_DIM // 128):
            for half in range(2):
                q = (row0 % BLOCK_M) // 8 + half
                loaded = {}
                for thread in range(256):
                    share, tid = thread // 128 + 2 * rnd, thread % 128
                    base = share * FLOATS + (q * THREADS + tid) * 4
                    loaded[thread] = acc[base : base + 4]
                for thread in range(256):
                    share, tid = thread // 128 + 2 * rnd, thread % 128
                    lane = tid % 32
                    odd = (lane // 4) % 2 == 1
                    col = 64 * share + 16 * (tid // 32) + lane // 4 - (1 if odd else 0)
                    v, partner = loaded[thread], loaded[thread ^ 4]  # __shfl_xor_sync(.., 4)
                    # each lane sends (odd ? v.x : v.y) and (odd ? v.z : v.w): what it gets
                    # is of its partner, whose column has the other parity
                    sent0 = partner[1] if odd else partner[0]
                    sent1 = partner[3] if odd else partner[2]
                    lo = (sent0, v[1]) if odd else (v[0], sent0)
                    hi = (sent1, v[3]) if odd else (v[2], sent1)
                    row = 8 * q + 2 * (lane % 4) + (1 if odd else 0)
                    for c, x in zip((col, col + 1, col + 8, col + 9), (*lo, *hi)):
                        assert out[row][c] is None, (row, c)
                        out[row][c] = x
    return out


def test_the_accumulator_round_trips_through_the_conversion():
    dq = [[float(1000 * query + col) for col in range(HEAD_DIM)] for query in range(BLOCK_M)]
    acc = _written(dq)
    assert not any(x != x for x in acc)  # every float of the m-block's chunk written once
    assert len(acc) == BLOCK_M * HEAD_DIM
    assert _converted(acc) == dq
