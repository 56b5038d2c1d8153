// fadsl/sm80.cuh -- device helpers for the fadsl FlashAttention-2 forward kernels,
// sm_80 code path (mma.sync / ldmatrix / cp.async; also runs on sm_86..sm_90).
//
// Contents, bottom-up:
//   1. runtime parameters shared by kernel, launcher and bindings (FwdParams)
//   2. shared-memory layouts: row pitch + XOR swizzle (Swizzle, SmemLayout)
//   3. thin PTX wrappers (cp.async, ldmatrix, st/ld.shared, mma, cvt)
//   4. warp-level tile copies (GMEM->SMEM, SMEM->RF, RF->SMEM, SMEM->GMEM)
//   5. warp-level GEMM on register fragments
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

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace fadsl {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarpMask = 0xffffffffu;
// Every tensor element handled here is 16 bits wide (bf16 or fp16).
constexpr int kElemBytes = 2;
// One 16-byte vector (cp.async, ld.shared.v4, one ldmatrix row) holds 8 elements.
constexpr int kChunkElems = 8;

// int min/max usable in device and host code alike (the host emulator compiles the header too).
__host__ __device__ __forceinline__ constexpr int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ constexpr int imax(int a, int b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------
// 1. Runtime parameters
// ---------------------------------------------------------------------------

// Tensors are (batch, seqlen, heads, head_dim); strides are in elements and the
// head_dim stride is 1.  GQA: query head h reads KV head h / (heads_q / heads_kv).
// Any seqlen_q, seqlen_k >= 0 (a seqlen_k of 0 gives O = 0, LSE = -inf).
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  // Optional log-sum-exp of each row's scaled scores (natural log), fp32, shape
  // (batch, heads_q, seqlen_q) with seq stride 1; -inf for a row that sees no key.
  // nullptr: not written.
  float* lse;
  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t k_batch_stride, k_seq_stride, k_head_stride;
  int64_t v_batch_stride, v_seq_stride, v_head_stride;
  int64_t o_batch_stride, o_seq_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;
  int batch, heads_q, heads_kv, seqlen_q, seqlen_k;
  float softmax_scale;  // e.g. 1/sqrt(head_dim)
};

// ---------------------------------------------------------------------------
// 2. Shared-memory layouts
// ---------------------------------------------------------------------------

// XOR swizzle on element offsets: bits [M, M+B) are XORed with bits [M+S, M+S+B)
// (the seed's swizzle<B,M,S>).  S >= B keeps the bits read apart from the bits
// written, so the map is its own inverse and only permutes elements within
// aligned blocks of 2^(M+B) elements.  Swizzle<0, 0, 0> is the identity.
template <int B, int M, int S>
struct Swizzle {
  static_assert(B >= 0 && M >= 0 && S >= B, "Swizzle<B,M,S> needs S >= B >= 0, M >= 0");
  static constexpr int kBits = B;
  static constexpr int kBase = M;
  static constexpr int kShift = S;
  static constexpr uint32_t kMask = ((1u << B) - 1u) << M;

  __host__ __device__ static constexpr uint32_t apply(uint32_t elem_offset) {
    return elem_offset ^ ((elem_offset >> S) & kMask);
  }
};

using NoSwizzle = Swizzle<0, 0, 0>;

// A row-major SMEM tile: PITCH elements per row, optionally swizzled.  The
// swizzle is applied to the element offset measured from the start of the
// buffer, so every writer and reader of a buffer agrees on where (row, col) is.
template <int PITCH, class Swz>
struct SmemLayout {
  static constexpr int kPitch = PITCH;
  using swizzle = Swz;
  static constexpr bool kSwizzled = Swz::kBits != 0;
  static_assert(PITCH % kChunkElems == 0, "SMEM rows must be 16-byte aligned");
  // 16-byte accesses (cp.async, ldmatrix rows, ld.shared.v4) stay contiguous only
  // if the swizzle leaves the low 3 element bits alone.
  static_assert(Swz::kBits == 0 || Swz::kBase >= 3, "swizzle must move whole 8-element chunks (M >= 3)");
  // The swizzle only permutes elements inside aligned blocks of this many
  // elements: a buffer (or a warp's private slice of one) that is a whole
  // number of such blocks is mapped onto itself.
  static constexpr int kSwizzleBlockElems = 1 << (Swz::kBase + Swz::kBits);
  // The swizzle reads and writes only bits below log2(kPeriodElems), so adding a
  // multiple of kPeriodElems to an offset adds the same to its swizzled value.
  // kRowPeriod rows span a whole number of periods.
  static constexpr int kPeriodElems = Swz::kBits == 0 ? 1 : 1 << (Swz::kBase + Swz::kShift + Swz::kBits);
  // = kPeriodElems / gcd(PITCH, kPeriodElems); the gcd with a power of two is
  // the lowest set bit of PITCH, capped at kPeriodElems.
  static constexpr int kPitchLowBit = PITCH & -PITCH;
  static constexpr int kRowPeriod = kPeriodElems / (kPitchLowBit < kPeriodElems ? kPitchLowBit : kPeriodElems);

  // Byte offset of logical element (row, col) from the start of the buffer.
  __device__ __forceinline__ static uint32_t byte_offset(int row, int col) {
    return kElemBytes * Swz::apply(static_cast<uint32_t>(row * PITCH + col));
  }

  // Byte offset of element (row + d_row, col), where d_row is a compile-time
  // constant after unrolling.  Whole row periods of d_row are added after the
  // swizzle, where they fold into the immediate offset of the load/store: a
  // loop over d_row evaluates the swizzle once per distinct remainder only.
  __device__ __forceinline__ static uint32_t byte_offset(int row, int d_row, int col) {
    const int whole_periods = d_row - d_row % kRowPeriod;
    return byte_offset(row + (d_row - whole_periods), col) + whole_periods * PITCH * kElemBytes;
  }
};

// ---------------------------------------------------------------------------
// 3. PTX wrappers
// ---------------------------------------------------------------------------

// 32-bit .shared address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// cp.async 16 bytes GMEM -> SMEM, cached at L2 only (.cg): K/V tiles are re-read
// by other CTAs from L2, never by this SM from L1.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
               :
               : "r"(smem_dst), "l"(__cvta_generic_to_global(gmem_src))
               : "memory");
}

// Same, but copies only `src_bytes` (0 or 16) bytes and zero-fills the rest of the
// 16 destination bytes: src_bytes = 0 writes 16 zero bytes and reads nothing.  The
// source address must still be a valid global address (callers pass an in-bounds one).
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_dst, const void* gmem_src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :
               : "r"(smem_dst), "l"(__cvta_generic_to_global(gmem_src)), "r"(src_bytes)
               : "memory");
}

// %ctaid.x read through volatile asm: each call is a fresh S2R that the compiler can
// neither merge with an earlier read nor hoist out of a loop.  For a value that the
// mainloop needs once per iteration and that is cheaper to recompute than to hold
// in a register through the loop (register pressure there decides the occupancy).
__device__ __forceinline__ int ctaid_x_fresh() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.x;\n" : "=r"(v));
  return v;
}

// Close the group of cp.async issued by this thread since the previous commit.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most N committed groups of this thread are still in flight.
// Only makes this thread's copies visible to itself: a __syncwarp/__syncthreads
// must follow before other threads read the data.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix x4: lane L supplies the SMEM address of row L % 8 of matrix L / 8;
// register rI receives (row lane/4, cols 2*(lane%4) + {0,1}) of matrix I.
__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                            uint32_t smem_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_src)
               : "memory");
}

// Same addressing as ldmatrix_x4, but each 8x8 matrix is delivered transposed:
// register rI receives (rows 2*(lane%4) + {0,1}, col lane/4) of matrix I.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                                  uint32_t smem_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_src)
               : "memory");
}

__device__ __forceinline__ void st_shared_b32(uint32_t smem_dst, uint32_t value) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(smem_dst), "r"(value) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t smem_src) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_src)
               : "memory");
  return v;
}

// Plain global stores (st.global.v4 / st.global.f32), wrapped so that every global
// write of the kernel goes through this section.
__device__ __forceinline__ void st_global_v4(void* gmem_dst, uint4 value) {
  *reinterpret_cast<uint4*>(gmem_dst) = value;
}

__device__ __forceinline__ void st_global_f32(float* gmem_dst, float value) {
  *gmem_dst = value;
}

// D = A * B + D for one m16n8k16 tile, fp32 accumulators, T = __nv_bfloat16 or half.
// Fragment registers as laid out in the PTX ISA:
//   a0 = (row g, k 2t..2t+1)  a1 = (row g+8, k 2t..)  a2 = (row g, k 8+2t..)  a3 = (row g+8, k 8+2t..)
//   b0 = (k 2t..2t+1, col g)  b1 = (k 8+2t.., col g)
//   d0,d1 = (row g, cols 2t, 2t+1)  d2,d3 = (row g+8, cols 2t, 2t+1)
// with g = lane / 4, t = lane % 4.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16_f32(float& d0, float& d1, float& d2, float& d3,
                                                 uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                 uint32_t b0, uint32_t b1) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, half>, "bf16 or fp16 only");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// Round two fp32 values to 16 bits (round-to-nearest-even) with one paired cvt.
// `lo` lands in the low half (the lower column index), as mma expects.
// Note the PTX operand order: cvt.rn.{bf16x2,f16x2}.f32 d, hi, lo.
template <typename T>
__device__ __forceinline__ uint32_t pack_f32x2(float lo, float hi) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, half>, "bf16 or fp16 only");
  uint32_t packed;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

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
// loop: they are the reduction dim of Q K^T, which gemm_frag walks outermost.
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
// reduction dim of P V, which gemm_frag walks outermost.
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

// acc[M8][N8] += A[M8 x K8] * B, with B given n-major as b[N8][K8] (see the
// fragment conventions at the top).  All three dims count 8x8 blocks; M8 and K8
// must be even (m16, k16).  Loop order k -> m -> n: consecutive mma write
// different accumulators, so they do not wait on each other.
template <typename T, int M8, int N8, int K8>
__device__ __forceinline__ void gemm_frag(float (&acc)[M8][N8][2], const uint32_t (&a)[M8][K8],
                                          const uint32_t (&b)[N8][K8]) {
  static_assert(M8 % 2 == 0 && K8 % 2 == 0, "mma.m16n8k16 needs M and K multiples of 16");
#pragma unroll
  for (int k = 0; k < K8; k += 2) {
#pragma unroll
    for (int m = 0; m < M8; m += 2) {
#pragma unroll
      for (int n = 0; n < N8; ++n) {
        mma_m16n8k16_f32<T>(acc[m][n][0], acc[m][n][1], acc[m + 1][n][0], acc[m + 1][n][1],
                            a[m][k], a[m + 1][k], a[m][k + 1], a[m + 1][k + 1], b[n][k], b[n][k + 1]);
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

template <int R8, int C8>
__device__ __forceinline__ void scale_acc(float (&acc)[R8][C8][2], float factor) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
#pragma unroll
    for (int j = 0; j < C8; ++j) {
      acc[i][j][0] *= factor;
      acc[i][j][1] *= factor;
    }
  }
}

// A row whose max is still -inf has seen no unmasked score.  Exponentiating
// against 0 instead keeps exp2(-inf - m) = 0 rather than NaN (-inf - -inf).
__device__ __forceinline__ float exp_reference(float row_max) {
  return row_max == -INFINITY ? 0.f : row_max;
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

// The running max moves from m_run to m_new: rescale the unnormalised output
// and the partial row sum by 2^(m_run - m_new) (scores are in log2 units), then
// adopt m_new.  On the first block m_run = -inf, so the factor is 0.
template <int R8, int D8>
__device__ __forceinline__ void rescale_running_stats(float (&m_run)[R8], const float (&m_new)[R8],
                                                      float (&l_part)[R8], float (&o_acc)[R8][D8][2]) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    const float factor = exp2f(m_run[i] - exp_reference(m_new[i]));
    l_part[i] *= factor;
#pragma unroll
    for (int j = 0; j < D8; ++j) {
      o_acc[i][j][0] *= factor;
      o_acc[i][j][1] *= factor;
    }
    m_run[i] = m_new[i];
  }
}

// s <- 2^(s - m) in place (s already in log2 units) and add each row's
// exponentials to this lane's partial row sum.  No shuffles: the quad-wide sum
// is only needed once, in the epilogue (row_sum_quad).
template <int R8, int C8>
__device__ __forceinline__ void exp2_rows_accumulate(float (&s)[R8][C8][2], const float (&m)[R8],
                                                     float (&l_part)[R8]) {
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    const float ref = exp_reference(m[i]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < C8; ++j) {
      s[i][j][0] = exp2f(s[i][j][0] - ref);
      s[i][j][1] = exp2f(s[i][j][1] - ref);
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

// Log-sum-exp of each row, natural log: sum_j exp(x_j) = 2^m * l with the row max m
// in log2 units and l the (quad-reduced) row sum, so lse = (m + log2 l) * ln 2;
// -inf for a row that saw no key (l == 0).  `lse_rows` points at the entry of the
// warp's first row (row 8i + lane/4 at lse_rows[8i + lane/4]); rows >= rows_valid
// are not written.  One lane per quad writes.
template <int R8>
__device__ __forceinline__ void store_row_lse(float* lse_rows, const float (&m)[R8], const float (&l)[R8],
                                              int rows_valid, int lane) {
  if (lane % 4 != 0) {
    return;
  }
#pragma unroll
  for (int i = 0; i < R8; ++i) {
    const int row = 8 * i + lane / 4;
    if (row < rows_valid) {
      const float lse = l[i] == 0.f ? -INFINITY : (m[i] + log2f(l[i])) * 0.6931471805599453f;
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
