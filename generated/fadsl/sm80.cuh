// fadsl/sm80.cuh -- device helpers for the fadsl FlashAttention-2 forward kernels,
// sm_80 code path (mma.sync / ldmatrix / cp.async; also runs on sm_86..sm_90).
//
// Contents, bottom-up (sections 1-3 are in fadsl/sm80_ptx.cuh):
//   4. warp-level tile copies (GMEM->SMEM, SMEM->RF, RF->SMEM, SMEM->GMEM)
//   5. warp-level GEMM on register fragments or SMEM tiles read slice by slice
//   6. online-softmax helpers on register fragments (masking, LSE)
//
// Register fragment conventions (used by every helper below):
//   * A 16-bit tile of R x C elements lives in `uint32_t frag[R/8][C/8]`:
//     frag[i][j] is this lane's slice of the 8x8 block at rows 8i.., cols 8j..,
//     i.e. the two elements (row 8i + lane/4, cols 8j + 2*(lane%4) + {0,1}),
//     lower column in the low half.  This is exactly what ldmatrix (non-trans)
//     returns per 8x8 matrix, and what mma.m16n8k16 wants for A, and for B
//     when the tile is stored "n-major" (B^T row-major, e.g. K for Q K^T).
//   * A transposed tile `uint32_t frag_t[C/8][R/8]` of a row-major R x C SMEM tile
//     holds in frag_t[j][i] the two elements (rows 8i + 2*(lane%4) + {0,1},
//     col 8j + lane/4): ldmatrix.trans output, the B operand of P V.
//   * An fp32 accumulator of R x C lives in `float acc[R/8][C/8][2]`:
//     acc[i][j][e] is element (row 8i + lane/4, col 8j + 2*(lane%4) + e), the
//     mma.m16n8k16 C/D layout.  Packing acc[i][j][0..1] to 16 bits yields frag[i][j]
//     in the A-operand layout above, so P = softmax(S) feeds P V without SMEM.
//   * Per-row statistics `float m[R/8]`: m[i] belongs to row 8i + lane/4; the four
//     lanes of a quad (same lane/4) share a row.
#pragma once

#include "sm80_ptx.cuh"  // (next to this file)

namespace fadsl {

// ---------------------------------------------------------------------------
// 4. Warp-level tile copies
// ---------------------------------------------------------------------------

// Per-lane SMEM addresses of a swizzled layout cost a few integer ops each and
// are loop-invariant, so the compiler hoists all of them out of the mainloop,
// where each then holds a register for the whole loop.  Passing the lane id
// through an empty asm makes it opaque, so the addresses are recomputed (cheaply)
// by each tile copy instead.  Unswizzled addresses are base + immediate anyway.
template <class Layout>
__device__ __forceinline__ int lane_for_addressing(int lane) {
  if constexpr (Layout::kSwizzled) {
    asm volatile("" : "+r"(lane));
  }
  return lane;
}

// How one warp walks a ROWS x COLS row-major tile in 16-byte chunks, for
// GMEM<->SMEM copies: kThreadsPerRow consecutive lanes cover one row (largest
// power of two dividing the chunks per row, at most 32), so every pass moves
// kRowsPerPass full rows and each lane keeps the same columns in every pass.
template <int ROWS, int COLS>
struct WarpChunkWalk {
  static_assert(COLS % kChunkElems == 0, "tile width must be a multiple of 8 elements");
  static constexpr int kChunksPerRow = COLS / kChunkElems;
  static constexpr int kLowBit = kChunksPerRow & (-kChunksPerRow);
  static constexpr int kThreadsPerRow = kLowBit < kWarpSize ? kLowBit : kWarpSize;
  static constexpr int kRowsPerPass = kWarpSize / kThreadsPerRow;
  static constexpr int kChunksPerLane = kChunksPerRow / kThreadsPerRow;  // per row
  static constexpr int kPasses = (ROWS + kRowsPerPass - 1) / kRowsPerPass;
  // False only for tiles with fewer rows than a pass covers evenly: the extra
  // lanes then skip the last pass (the check folds away when true).
  static constexpr bool kEvenPasses = ROWS % kRowsPerPass == 0;
};

// GMEM -> SMEM, asynchronous: one warp copies ROWS x COLS elements starting at
// `gmem` (row stride `gmem_row_stride` elements, unit column stride) into rows
// [row0, row0 + ROWS) of the SMEM buffer at `smem_buf`.  The caller commits.
// kZeroFill: tile rows >= rows_valid (any int; <= 0 means none) are not read but
// zero-filled (cp.async with src-size 0).  Their source address is clamped to row
// rows_valid - 1 of `gmem`, which the caller guarantees is a row of the tensor
// (the last one, in practice), so no out-of-bounds address is ever formed.
template <class Layout, int ROWS, int COLS, bool kZeroFill, typename T>
__device__ __forceinline__ void copy_tile_g2s_async_impl(uint32_t smem_buf, int row0, const T* gmem,
                                                         int64_t gmem_row_stride, int lane, int rows_valid) {
  lane = lane_for_addressing<Layout>(lane);
  if constexpr (kZeroFill) {
    // The zero-filling copy sits in a rarely taken branch of the mainloop.  An opaque
    // rows_valid keeps the clamp arithmetic in that branch: hoisted out of the loop,
    // its invariant parts would hold registers through every iteration.
    asm volatile("" : "+r"(rows_valid));
  }
  using Walk = WarpChunkWalk<ROWS, COLS>;
  const int lane_row = lane / Walk::kThreadsPerRow;
  const int lane_chunk = lane % Walk::kThreadsPerRow;
  // Step the source pointer pass by pass: precomputed per-pass offsets would be
  // loop-invariant in the mainloop and each pin two registers there.
  const int64_t pass_stride = Walk::kRowsPerPass * gmem_row_stride;
  const T* src = gmem + lane_row * gmem_row_stride + lane_chunk * kChunkElems;
  // kZeroFill: where the rows past rows_valid point instead (the last valid row).
  const T* clamped = kZeroFill ? gmem + (rows_valid - 1) * gmem_row_stride + lane_chunk * kChunkElems : nullptr;
#pragma unroll
  for (int pass = 0; pass < Walk::kPasses; ++pass, src += pass_stride) {
    const int row = pass * Walk::kRowsPerPass + lane_row;
    if (Walk::kEvenPasses || row < ROWS) {
#pragma unroll
      for (int i = 0; i < Walk::kChunksPerLane; ++i) {
        const int col = (i * Walk::kThreadsPerRow + lane_chunk) * kChunkElems;
        const uint32_t dst = smem_buf + Layout::byte_offset(row0 + lane_row, pass * Walk::kRowsPerPass, col);
        if constexpr (kZeroFill) {
          const bool valid = row < rows_valid;
          cp_async_16_zfill(dst, (valid ? src : clamped) + i * Walk::kThreadsPerRow * kChunkElems, valid ? 16u : 0u);
        } else {
          cp_async_16(dst, src + i * Walk::kThreadsPerRow * kChunkElems);
        }
      }
    }
  }
}

// Full tile: every row exists.
template <class Layout, int ROWS, int COLS, typename T>
__device__ __forceinline__ void copy_tile_g2s_async(uint32_t smem_buf, int row0, const T* gmem,
                                                    int64_t gmem_row_stride, int lane) {
  copy_tile_g2s_async_impl<Layout, ROWS, COLS, false>(smem_buf, row0, gmem, gmem_row_stride, lane, ROWS);
}

// Sequence tail: rows >= rows_valid are zero-filled (see copy_tile_g2s_async_impl;
// the row rows_valid - 1 of `gmem` must exist).
template <class Layout, int ROWS, int COLS, typename T>
__device__ __forceinline__ void copy_tile_g2s_async_zfill(uint32_t smem_buf, int row0, const T* gmem,
                                                          int64_t gmem_row_stride, int lane, int rows_valid) {
  copy_tile_g2s_async_impl<Layout, ROWS, COLS, true>(smem_buf, row0, gmem, gmem_row_stride, lane, rows_valid);
}

// SMEM -> GMEM with 16-byte loads and stores: rows [row0, row0 + ROWS) of the
// SMEM buffer go to `gmem` (row stride `gmem_row_stride` elements); only tile rows
// < rows_valid are written (no address is formed for the others).
template <class Layout, int ROWS, int COLS, typename T>
__device__ __forceinline__ void copy_tile_s2g(uint32_t smem_buf, int row0, T* gmem, int64_t gmem_row_stride,
                                              int lane, int rows_valid) {
  lane = lane_for_addressing<Layout>(lane);
  using Walk = WarpChunkWalk<ROWS, COLS>;
  const int lane_row = lane / Walk::kThreadsPerRow;
  const int lane_chunk = lane % Walk::kThreadsPerRow;
#pragma unroll
  for (int pass = 0; pass < Walk::kPasses; ++pass) {
    const int row = pass * Walk::kRowsPerPass + lane_row;
    if ((Walk::kEvenPasses || row < ROWS) && row < rows_valid) {
      T* dst = gmem + row * gmem_row_stride + lane_chunk * kChunkElems;
#pragma unroll
      for (int i = 0; i < Walk::kChunksPerLane; ++i) {
        const int col = (i * Walk::kThreadsPerRow + lane_chunk) * kChunkElems;
        const uint32_t src = smem_buf + Layout::byte_offset(row0 + lane_row, pass * Walk::kRowsPerPass, col);
        const uint4 chunk = ld_shared_v4(src);
        st_global_v4(dst + i * Walk::kThreadsPerRow * kChunkElems, chunk);
      }
    }
  }
}

// SMEM -> RF: the ROWS x COLS tile at buffer rows [row0, row0 + ROWS) into
// frag[ROWS/8][COLS/8] (A-operand layout, or B for an n-major tile such as K).
// Each ldmatrix.x4 fetches four 8x8 matrices side by side, (r, c) .. (r, c+3):
// lane L addresses tile row 8r + L%8, chunk c + L/8.  (Tiles whose width is not
// a multiple of 32 use 2x2 groups {(r,c), (r+1,c), (r,c+1), (r+1,c+1)} instead:
// lane L addresses row 8r + L%16, chunk c + L/16.)  Column groups are the outer
// loop: they are the reduction dim of Q K^T, which gemm walks outermost.
template <class Layout, int ROWS, int COLS>
__device__ __forceinline__ void ldmatrix_tile(uint32_t (&frag)[ROWS / 8][COLS / 8], uint32_t smem_buf, int row0,
                                              int lane) {
  lane = lane_for_addressing<Layout>(lane);
  static_assert(ROWS % 8 == 0 && COLS % 16 == 0, "ldmatrix tiles are 8 x 8");
  if constexpr (COLS % 32 == 0) {
    const int lane_row = lane % 8;
    const int lane_chunk = lane / 8;
#pragma unroll
    for (int c = 0; c < COLS / 8; c += 4) {
#pragma unroll
      for (int r = 0; r < ROWS / 8; ++r) {
        const uint32_t src = smem_buf + Layout::byte_offset(row0 + lane_row, r * 8, (c + lane_chunk) * kChunkElems);
        ldmatrix_x4(frag[r][c], frag[r][c + 1], frag[r][c + 2], frag[r][c + 3], src);
      }
    }
  } else {
    static_assert(ROWS % 16 == 0, "2x2 ldmatrix groups need a multiple of 16 rows");
    const int lane_row = lane % 16;
    const int lane_chunk = lane / 16;
#pragma unroll
    for (int c = 0; c < COLS / 8; c += 2) {
#pragma unroll
      for (int r = 0; r < ROWS / 8; r += 2) {
        const uint32_t src = smem_buf + Layout::byte_offset(row0 + lane_row, r * 8, (c + lane_chunk) * kChunkElems);
        ldmatrix_x4(frag[r][c], frag[r + 1][c], frag[r][c + 1], frag[r + 1][c + 1], src);
      }
    }
  }
}

// SMEM -> RF, transposed: the row-major ROWS x COLS tile (rows = reduction dim k,
// cols = output dim n, e.g. V) into frag_t[COLS/8][ROWS/8], the B operand of
// mma.row.col.  Same matrix groups and lane addresses as ldmatrix_tile; matrix
// (r, c) lands in frag_t[c][r].  Row groups are the outer loop: rows are the
// reduction dim of P V, which gemm walks outermost.
template <class Layout, int ROWS, int COLS>
__device__ __forceinline__ void ldmatrix_tile_trans(uint32_t (&frag_t)[COLS / 8][ROWS / 8], uint32_t smem_buf,
                                                    int row0, int lane) {
  lane = lane_for_addressing<Layout>(lane);
  static_assert(ROWS % 16 == 0 && COLS % 16 == 0, "ldmatrix tiles are 8 x 8; mma k16 needs 16 rows");
  if constexpr (COLS % 32 == 0) {
    const int lane_row = lane % 8;
    const int lane_chunk = lane / 8;
#pragma unroll
    for (int r = 0; r < ROWS / 8; ++r) {
#pragma unroll
      for (int c = 0; c < COLS / 8; c += 4) {
        const uint32_t src = smem_buf + Layout::byte_offset(row0 + lane_row, r * 8, (c + lane_chunk) * kChunkElems);
        ldmatrix_x4_trans(frag_t[c][r], frag_t[c + 1][r], frag_t[c + 2][r], frag_t[c + 3][r], src);
      }
    }
  } else {
    const int lane_row = lane % 16;
    const int lane_chunk = lane / 16;
#pragma unroll
    for (int r = 0; r < ROWS / 8; r += 2) {
#pragma unroll
      for (int c = 0; c < COLS / 8; c += 2) {
        const uint32_t src = smem_buf + Layout::byte_offset(row0 + lane_row, r * 8, (c + lane_chunk) * kChunkElems);
        ldmatrix_x4_trans(frag_t[c][r], frag_t[c][r + 1], frag_t[c + 1][r], frag_t[c + 1][r + 1], src);
      }
    }
  }
}

// RF -> SMEM: frag[ROWS/8][COLS/8] (accumulator layout packed to 16 bits) into
// buffer rows [row0, row0 + ROWS), one 4-byte st.shared per element pair.
template <class Layout, int ROWS, int COLS>
__device__ __forceinline__ void store_frag_tile_r2s(const uint32_t (&frag)[ROWS / 8][COLS / 8], uint32_t smem_buf,
                                                    int row0, int lane) {
  lane = lane_for_addressing<Layout>(lane);
  static_assert(ROWS % 8 == 0 && COLS % 8 == 0, "fragments are 8 x 8");
  const int lane_row = lane / 4;
  const int lane_col = (lane % 4) * 2;
#pragma unroll
  for (int r = 0; r < ROWS / 8; ++r) {
#pragma unroll
    for (int c = 0; c < COLS / 8; ++c) {
      st_shared_b32(smem_buf + Layout::byte_offset(row0 + lane_row, r * 8, c * 8 + lane_col), frag[r][c]);
    }
  }
}

// ---------------------------------------------------------------------------
// 5. Warp-level GEMM
// ---------------------------------------------------------------------------

// The operands of gemm below.  Each hands out, for a k16 step k (k even, in 8-element
// blocks of the reduction dim) and a pair of 8-blocks i, i+1 of its other dim (i even),
// the four 8x8 fragments out[a][b] = block (i + a, k + b) in the A/B register layout
// (see the conventions at the top).  Where they come from is the operand's business:

// A tile already in registers, frag[I8][K8] (ldmatrix_tile / ldmatrix_tile_trans / pack_acc).
template <int I8, int K8>
struct RegTile {
  const uint32_t (&frag)[I8][K8];
  __device__ __forceinline__ void load(int k, int i, uint32_t (&out)[2][2]) const {
    out[0][0] = frag[i][k];
    out[0][1] = frag[i][k + 1];
    out[1][0] = frag[i + 1][k];
    out[1][1] = frag[i + 1][k + 1];
  }
};

// A row-major SMEM tile whose rows are the operand's other dim and whose columns are the
// reduction dim (Q for the A side of Q K^T, K for its B side), read one ldmatrix.x4 per
// call: lane L addresses row 8i + L%16, chunk k + L/16, so matrices 0..3 are blocks
// (i, k), (i+1, k), (i, k+1), (i+1, k+1).
template <class Layout>
struct SmemRowsK {
  uint32_t smem_buf;
  int row0;
  int lane;
  __device__ __forceinline__ SmemRowsK(uint32_t buf, int first_row, int lane_id)
      : smem_buf(buf), row0(first_row), lane(lane_for_addressing<Layout>(lane_id)) {}
  __device__ __forceinline__ void load(int k, int i, uint32_t (&out)[2][2]) const {
    const uint32_t src = smem_buf + Layout::byte_offset(row0 + lane % 16, 8 * i, (k + lane / 16) * kChunkElems);
    ldmatrix_x4(out[0][0], out[1][0], out[0][1], out[1][1], src);
  }
};

// A row-major SMEM tile whose rows are the reduction dim (V for O += P V), transposed by
// ldmatrix.trans: lane L addresses row 8k + L%16, chunk i + L/16, so matrices 0..3 are
// blocks (i, k), (i, k+1), (i+1, k), (i+1, k+1) of the transposed tile.
template <class Layout>
struct SmemRowsKTrans {
  uint32_t smem_buf;
  int lane;
  __device__ __forceinline__ SmemRowsKTrans(uint32_t buf, int lane_id)
      : smem_buf(buf), lane(lane_for_addressing<Layout>(lane_id)) {}
  __device__ __forceinline__ void load(int k, int i, uint32_t (&out)[2][2]) const {
    const uint32_t src = smem_buf + Layout::byte_offset(lane % 16, 8 * k, (i + lane / 16) * kChunkElems);
    ldmatrix_x4_trans(out[0][0], out[0][1], out[1][0], out[1][1], src);
  }
};

// acc[M8][N8] += A[M8 x K8] * B[K8 x N8], all dims counted in 8x8 blocks (each even: m16,
// n8 pairs, k16).  a and b are operands as above; B's "other dim" is n.  Loop order
// k -> n -> m: A's slice for step k is fetched once, each B pair right before its mma
// (an SMEM operand costs registers for one pair, not the whole tile), and consecutive
// mma write different accumulators, so they do not wait on each other.
template <typename T, int M8, int N8, int K8, class A, class B>
__device__ __forceinline__ void gemm(float (&acc)[M8][N8][2], const A& a, const B& b) {
  static_assert(M8 % 2 == 0 && N8 % 2 == 0 && K8 % 2 == 0, "mma.m16n8k16 tiles, B in pairs of n8");
#pragma unroll
  for (int k = 0; k < K8; k += 2) {
    uint32_t a_k[M8][2][2];
#pragma unroll
    for (int m = 0; m < M8; m += 2) {
      a.load(k, m, a_k[m]);
    }
#pragma unroll
    for (int n = 0; n < N8; n += 2) {
      uint32_t b_k[2][2];
      b.load(k, n, b_k);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int m = 0; m < M8; m += 2) {
          mma_m16n8k16_f32<T>(acc[m][n + e][0], acc[m][n + e][1], acc[m + 1][n + e][0], acc[m + 1][n + e][1],
                              a_k[m][0][0], a_k[m][1][0], a_k[m][0][1], a_k[m][1][1], b_k[e][0], b_k[e][1]);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// 6. Online softmax on accumulator fragments
// ---------------------------------------------------------------------------

template <int R8, int C8>
__device__ __forceinline__ void fill_acc(float (&acc)[R8][C8][2], float value) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
#pragma unroll
    for (int j = 0; j < C8; ++j) {
      acc[i][j][0] = value;
      acc[i][j][1] = value;
    }
  }
}

template <int R8>
__device__ __forceinline__ void fill_rows(float (&stat)[R8], float value) {
#pragma unroll
  for (int i = 0; i < R8; ++i) stat[i] = value;
}

// The running max is kept in raw score units; exponentials take scores to log2
// units with the same FFMA that subtracts the max: 2^(s * scale_log2 - m * scale_log2).
// A row whose max is still -inf has seen no unmasked score: its reference is 0, so that
// 2^(-inf - ref) = 0 rather than NaN (-inf - -inf).
__device__ __forceinline__ float scaled_max(float row_max, float scale_log2) {
  return row_max == -INFINITY ? 0.f : row_max * scale_log2;
}

// Mask one score tile: s[i][j][e] = -inf where its column c = 8j + 2*(lane%4) + e
// (relative to the tile) is at or past its row's end.  Row 8i + lane/4 ends at
//   col_end                            (kCausal false: keys past seqlen_k),
//   min(col_end, diag_end + 8i)        (kCausal true: also keys past the diagonal),
// diag_end being the end for row lane/4 (i = 0); either may be <= 0 (all masked)
// or past the tile (none).  The lane's column offset moves into the bound, so each
// element costs one compare with an immediate and one select.
template <bool kCausal, int R8, int C8>
__device__ __forceinline__ void mask_scores(float (&s)[R8][C8][2], int col_end, int diag_end, int lane) {
  const int lane_col = 2 * (lane % 4);
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    int end = col_end;
    if constexpr (kCausal) {
      end = imin(end, diag_end + 8 * i);
    }
    end -= lane_col;
#pragma unroll
    for (int j = 0; j < C8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (8 * j + e >= end) {
          s[i][j][e] = -INFINITY;
        }
      }
    }
  }
}

// m_new[i] = max(m_run[i], max of row i of s): first over this lane's elements,
// then across the quad of lanes sharing the row (xor 2, then xor 1).
template <int R8, int C8>
__device__ __forceinline__ void row_max_quad(const float (&s)[R8][C8][2], const float (&m_run)[R8],
                                             float (&m_new)[R8]) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    float m = m_run[i];
#pragma unroll
    for (int j = 0; j < C8; ++j) {
      m = fmaxf(m, fmaxf(s[i][j][0], s[i][j][1]));
    }
    m = fmaxf(m, __shfl_xor_sync(kFullWarpMask, m, 2));
    m = fmaxf(m, __shfl_xor_sync(kFullWarpMask, m, 1));
    m_new[i] = m;
  }
}

// The running max moves from m_run to m_new: rescale the unnormalised output and the
// partial row sum by 2^((m_run - m_new) * scale_log2), then adopt m_new.  On the first
// block m_run = -inf, so the factor is 0.
template <int R8, int D8>
__device__ __forceinline__ void rescale_running_stats(float (&m_run)[R8], const float (&m_new)[R8],
                                                      float (&l_part)[R8], float (&o_acc)[R8][D8][2],
                                                      float scale_log2) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    // the rounded references the P were taken against (an fma with the exact m c would
    // leave half an ulp of |m c| per move, adding up over the moves)
    const float factor = fast_exp2(__fmul_rn(m_run[i], scale_log2) - scaled_max(m_new[i], scale_log2));
    l_part[i] *= factor;
#pragma unroll
    for (int j = 0; j < D8; ++j) {
      o_acc[i][j][0] *= factor;
      o_acc[i][j][1] *= factor;
    }
    m_run[i] = m_new[i];
  }
}

// s <- 2^(s * scale_log2 - m * scale_log2) in place, one FFMA and one MUFU.EX2 per
// element, and add each row's exponentials to this lane's partial row sum.  No
// shuffles: the quad-wide sum is only needed once, in the epilogue (row_sum_quad).
template <int R8, int C8>
__device__ __forceinline__ void exp2_rows_accumulate(float (&s)[R8][C8][2], const float (&m)[R8],
                                                     float (&l_part)[R8], float scale_log2) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    const float ref = scaled_max(m[i], scale_log2);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < C8; ++j) {
      s[i][j][0] = fast_exp2(fmaf(s[i][j][0], scale_log2, -ref));
      s[i][j][1] = fast_exp2(fmaf(s[i][j][1], scale_log2, -ref));
      sum += s[i][j][0] + s[i][j][1];
    }
    l_part[i] += sum;
  }
}

// fp32 accumulator -> 16-bit fragments in the same positions (A-operand layout).
template <typename T, int R8, int C8>
__device__ __forceinline__ void pack_acc(const float (&acc)[R8][C8][2], uint32_t (&frag)[R8][C8]) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
#pragma unroll
    for (int j = 0; j < C8; ++j) {
      frag[i][j] = pack_f32x2<T>(acc[i][j][0], acc[i][j][1]);
    }
  }
}

// Finish the deferred row sums: add up the four partial sums of each quad.
template <int R8>
__device__ __forceinline__ void row_sum_quad(float (&l)[R8]) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    l[i] += __shfl_xor_sync(kFullWarpMask, l[i], 2);
    l[i] += __shfl_xor_sync(kFullWarpMask, l[i], 1);
  }
}

// Log-sum-exp of each row, natural log: sum_j exp(x_j) = 2^(m * scale_log2) * l with
// the raw row max m and l the (quad-reduced) row sum, so lse = (m * scale_log2 + log2 l) * ln 2;
// -inf for a row that saw no key (l == 0).  `lse_rows` points at the entry of the
// warp's first row (row 8i + lane/4 at lse_rows[8i + lane/4]); rows >= rows_valid
// are not written.  One lane per quad writes.
template <int R8>
__device__ __forceinline__ void store_row_lse(float* lse_rows, const float (&m)[R8], const float (&l)[R8],
                                              float scale_log2, int rows_valid, int lane) {
  if (lane % 4 != 0) {
    return;
  }
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    const int row = 8 * i + lane / 4;
    if (row < rows_valid) {
      const float lse = l[i] == 0.f ? -INFINITY : (m[i] * scale_log2 + log2f(l[i])) * 0.6931471805599453f;
      st_global_f32(lse_rows + row, lse);
    }
  }
}

// o_acc /= l row-wise.  A row with l == 0 (nothing attended: seqlen_k == 0, or a
// causal row before every key) is written as 0 instead of 0/0 = NaN.
template <int R8, int D8>
__device__ __forceinline__ void normalize_rows(float (&o_acc)[R8][D8][2], const float (&l)[R8]) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    const float inv_l = l[i] == 0.f ? 0.f : 1.f / l[i];
#pragma unroll
    for (int j = 0; j < D8; ++j) {
      o_acc[i][j][0] *= inv_l;
      o_acc[i][j][1] *= inv_l;
    }
  }
}

}  // namespace fadsl
