// fadsl/sm80_ptx.cuh -- the lowest layer of the fadsl sm_80 code path (mma.sync /
// ldmatrix / cp.async; also runs on sm_86..sm_90): what the kernel and
// the tile operations of fadsl/sm80.cuh build on.
//
// Contents (the runtime parameters, FwdParams, are every target's: fadsl/params.cuh):
//   1. shared-memory layouts: row pitch + XOR swizzle (Swizzle, SmemLayout)
//   2. thin PTX wrappers (cp.async, ldmatrix, st/ld.shared, mma, cvt, ex2)
//
#pragma once

// Device code only, so that NVRTC builds it with no host toolkit: libcu++'s <cuda/std/...>
// forms of the standard headers, and no <cuda_runtime.h>.
#include <cuda/std/cmath>
#include <cuda/std/cstdint>
#include <cuda/std/type_traits>

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include "params.cuh"  // (next to this file)

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
// 1. Shared-memory layouts
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
// 2. PTX wrappers
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
  static_assert(cuda::std::is_same_v<T, __nv_bfloat16> || cuda::std::is_same_v<T, half>, "bf16 or fp16 only");
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
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
  static_assert(cuda::std::is_same_v<T, __nv_bfloat16> || cuda::std::is_same_v<T, half>, "bf16 or fp16 only");
  uint32_t packed;
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

// 2^x with one MUFU.EX2 (ex2.approx.ftz: about 2 ulp, subnormal results flushed to 0,
// 2^-inf = 0).  exp2f() adds range handling around the same instruction.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace fadsl
