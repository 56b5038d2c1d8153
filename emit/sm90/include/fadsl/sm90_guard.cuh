// fadsl/sm90_guard.cuh -- `rescale guarded`: the online softmax of a block without its row max.
//
// Included at the end of fadsl/sm90.cuh (it uses FwdConfig and online_softmax).
//
// The row max costs a chain of B_c / 4 FMNMX per row and thread, plus two shuffles, in every
// block; at head_dim 64 that is about a sixth of a consumer warp's instructions. After the
// first block, a row's reference m (the max it keeps, `rescale lazy`) almost always still
// bounds the block's scores, so guarded blocks skip the max: P = 2^(S c - m c) against the
// kept reference, and a thread checks the partial row sums it adds up anyway. A sum within
// (B_c / 4) 2^8 bounds every P of it by that (16-bit and fp32 safe, as the lazy slack's 2^8
// is). Past it, the rare paths:
//   - the sums finite: a row whose largest P passed 2^8 moves its reference up to that P (P,
//     its sum and O's scale divided by it), in the warp, as online_softmax would have;
//   - a sum not finite (a jump past 2^128, a reference still -inf): P is lost, and once the
//     P V in flight has read P (its registers free then), the warp recomputes its S from
//     the Q and K tiles in SMEM and runs the full online_softmax (softmax_redo). The K slot
//     must still hold the block then: the sync plan releases it after P is converted.
#pragma once

namespace fadsl::sm90 {

// The 128-byte swizzle TMA writes (CU_TENSOR_MAP_SWIZZLE_128B): within each 1024-byte atom
// the 16-byte chunk of byte-address bits 4-6 is XORed with the 128-byte row, bits 7-9. The
// tiles start 1024-byte aligned, so the absolute SMEM address gives the row.
__device__ __forceinline__ uint32_t swizzle_128b(uint32_t addr) { return addr ^ (((addr >> 7) & 7u) << 4); }

// q . k over head_dim from two 128-byte-swizzled rows (16 bytes at a time), fp32 sums.
template <class Cfg>
__device__ __forceinline__ float dot_rows(uint32_t q_row, uint32_t k_row) {
  float acc = 0.f;
#pragma unroll 1  // the rarest path: small code, few registers
  for (int c = 0; c < Cfg::kHeadDim / 8; ++c) {
    const uint32_t panel = c / 8, chunk = 16 * (c % 8);
    uint32_t q[4], k[4];
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(q[0]), "=r"(q[1]), "=r"(q[2]), "=r"(q[3])
                 : "r"(swizzle_128b(q_row + panel * Cfg::kBlockM * Cfg::kRowBytes + chunk)));
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(k[0]), "=r"(k[1]), "=r"(k[2]), "=r"(k[3])
                 : "r"(swizzle_128b(k_row + panel * Cfg::kBlockN * Cfg::kRowBytes + chunk)));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 qf, kf;
      if constexpr (cuda::std::is_same_v<typename Cfg::T, __nv_bfloat16>) {
        qf = make_float2(__uint_as_float(q[i] << 16), __uint_as_float(q[i] & 0xffff0000u));
        kf = make_float2(__uint_as_float(k[i] << 16), __uint_as_float(k[i] & 0xffff0000u));
      } else {
        qf = __half22float2(*reinterpret_cast<const __half2*>(&q[i]));
        kf = __half22float2(*reinterpret_cast<const __half2*>(&k[i]));
      }
      acc = fmaf(qf.x, kf.x, acc);
      acc = fmaf(qf.y, kf.y, acc);
    }
  }
  return acc;
}

// This warp's S entries again, one dot product each, from the Q and K tiles in SMEM, in
// the wgmma accumulator layout: s[4j + 2r + e] is row 16 warp + lane / 4 + 8r, key
// 8j + 2 (lane % 4) + e. Tiles are 64-column panels of 128-byte rows: Q [panel][B_r rows]
// from the warpgroup's first row, K [panel][B_c rows]. Slow (each lane reads its rows and
// keys whole) and register-light, for it runs beside O, P and S in registers; it is for
// inputs whose scores jump past 2^128 between blocks.
template <class Cfg>
__device__ __forceinline__ void recompute_s_warp(float (&s)[Cfg::kSRegs], uint32_t smem_q_wg, uint32_t smem_k,
                                                 int warp, int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t q_row = smem_q_wg + (16 * warp + lane / 4 + 8 * r) * Cfg::kRowBytes;
#pragma unroll
    for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t k_row = smem_k + (8 * j + 2 * (lane % 4) + e) * Cfg::kRowBytes;
        s[4 * j + 2 * r + e] = dot_rows<Cfg>(q_row, k_row);
      }
    }
  }
}

// The largest partial row sum (B_c / 4 values of P) a guarded block accepts: (B_c / 4) 2^8.
// A sum within it bounds every P by it (at most 2^14 at B_c 256: 16-bit and fp32 safe); a
// sum past it has a P past the lazy slack 2^8, so online_softmax then moves the reference
// and the next block is guarded against the new one.
template <class Cfg>
constexpr float kGuardedSum = Cfg::kBlockN / 4 * 256.f;

// online_softmax for a block after the first, without the row max (see the top of this
// file). scale is 1 (O keeps its reference) unless the warp took the rare path. True when
// P is lost (a jump past 2^128, a reference still -inf): then m and l are untouched and
// softmax_redo must run once the P V in flight has read P (its registers are free then).
template <class Cfg>
__device__ __forceinline__ bool online_softmax_guarded(float (&s)[Cfg::kSRegs], float (&m)[2], float (&l)[2],
                                                       float (&scale)[2], float scale_log2) {
  float sum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // m = -inf: every P is inf or NaN, the rarest path
    sum[r] = exp2_row<Cfg>(s, r, m[r] * scale_log2, scale_log2);
  }
  scale[0] = scale[1] = 1.f;
  // Warp-uniform branches: no lane diverges around the P V wgmma still in flight.
  if (__any_sync(0xffffffffu, !(sum[0] <= kGuardedSum<Cfg> && sum[1] <= kGuardedSum<Cfg>))) {
    if (__any_sync(0xffffffffu, !(isfinite(sum[0]) && isfinite(sum[1])))) return true;
    // P finite but past the slack somewhere: a row whose largest P passed 2^8 moves its
    // reference up to that P (P /= it, O's scale too), as online_softmax would have.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float top = 0.f;
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) top = fmaxf(top, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const bool moves = top > exp2f(Cfg::kRescaleSlack);  // no branch: rows differ by quad
      const float inv = moves ? fast_rcp(top) : 1.f;
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
        s[4 * j + 2 * r] *= inv;
        s[4 * j + 2 * r + 1] *= inv;
      }
      sum[r] *= inv;
      scale[r] = inv;
      m[r] += moves ? fast_log2(top) * fast_rcp(scale_log2) : 0.f;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = l[r] * scale[r] + sum[r];
  return false;
}

// The rarest case of a guarded block: S again from SMEM, and the full online_softmax.
template <class Cfg>
__device__ __forceinline__ void softmax_redo(float (&s)[Cfg::kSRegs], float (&m)[2], float (&l)[2], float (&scale)[2],
                                             float scale_log2, uint32_t smem_q_wg, uint32_t smem_k, int warp, int lane) {
  recompute_s_warp<Cfg>(s, smem_q_wg, smem_k, warp, lane);
  online_softmax<Cfg>(s, m, l, scale, scale_log2);
}

}  // namespace fadsl::sm90
