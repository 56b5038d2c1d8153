// fadsl/sm90_guard.cuh -- `rescale guarded`: the online softmax of a block without its row max,
// and the numerics of every sm_90a rescale mode.
//
// Included at the end of fadsl/sm90.cuh (it uses FwdConfig and online_softmax).
//
// The row max costs a chain of B_c / 4 FMNMX per row and thread, plus two shuffles, in every
// block; at head_dim 64 that is about a sixth of a consumer warp's instructions. After the
// first block, a row's reference m (the max it keeps, `rescale lazy`) almost always still
// bounds the block's scores, so guarded blocks skip the max: P = 2^(S c - m c) against the
// kept reference, and a thread checks the partial row sums it adds up anyway. A sum within
// K = (B_c / 4) 2^8 bounds every P of it by K. Past it, the rare paths:
//   - every sum of the warp finite and within 2^120: a row whose largest P passed 2^8 moves
//     its reference up to that P (P, its sum and O's scale multiplied by 2^(m c - m' c)), in
//     the warp, as online_softmax would have;
//   - a sum past 2^120, inf or NaN (a jump of 120 or more, a reference still -inf): P is not
//     used; once the P V in flight has read P (its registers free then), the warp recomputes
//     its S from the Q and K tiles in SMEM and runs the full online_softmax (softmax_redo).
//     The K slot must still hold the block then: the sync plan releases it after P is
//     converted.
//
// Why every path is exact up to the 16-bit rounding of P (docs/numerics.md says it at length;
// tests/softmax_model.py models it in float32 and tests/test_softmax_model.py drives the model
// with adversarial scores at each threshold below, on both sides):
// c = softmax_scale log2(e) > 0 (the host refuses other scales); x = s c, a score in log2
// units; R = m c, the reference (online_softmax: 0 for m = -inf). Domain: finite scores with
// |x| < 2^16 (past that fp32 cannot move m by 8 / c; the weights' relative error from R's
// rounding, |x| 2^-24, is the fp32 reference's own). fast_exp2 flushes results below 2^-126
// to 0 and gives inf from 128 up. Once a row has seen a finite score, between blocks:
//   (I1) R never exceeds the largest x seen (it is a seen max, or moved to a seen P);
//   (I2) every P held, 2^(x - R), is at most 2^14: 1 (every), 2^8 (lazy: the slack), K <= 2^14
//        (guarded: each P is at most its thread's sum, B_c <= 256);
//   (I3) the row's total L = sum of its 4 threads' l is at least 1: the P of the score that
//        set R was 1, and each later move adds the new max's P = 1 after scaling the rest.
// Every move's factor is 2^(R - R') from the rounded references themselves (R as exp2_row
// used it, __fmul_rn(m, c); never an fma with the exact m c), so the factors of successive
// moves compose to 2^(R_first - R_last), one rounding each, instead of leaving half an ulp of
// |R| per move to add up (tests/test_softmax_model.py: 0.6 % after 1024 moves at 2^15).
// The factors, each normal or a flush whose true value is below 2^-126:
//   P (every mode, every path that keeps it): in [0, 2^14] by I2, so it fits fp16 (65504) and
//       bf16; a P below 2^-126 flushes to 0, at most n 2^-126 of mass against L >= 1.
//   P (guarded, before the check): unbounded, possibly inf or NaN; used only when every sum of
//       the warp is within K (then each P <= K), else divided down or recomputed (below).
//   scale (online_softmax; every, lazy's move, the first and masked blocks of guarded, redo):
//       2^(R - R') with R' >= R, in (0, 1]: normal when R' - R <= 126; past that the true
//       factor is below 2^-126 and the 0 it flushes to drops at most L 2^-126 <= n 2^-112
//       against the new total >= 1 (I3). m = -inf: exactly 0 (l and O are 0). lazy's keep:
//       exactly 1, not applied.
//   inv (guarded's move): 2^(R - R') with R' - R = log2(top), top <= 2^120 because every sum
//       is within 2^120: inv in [2^-120, 2^-8), normal. P inv <= 1; l inv and O inv are
//       products with a normal factor (a product below 2^-126 is below 2^-126 of L >= 1).
//       The old move took inv = rcp.approx.ftz(top) for any finite sum: for top in
//       (2^126, 2^128) it flushed to 0 and zeroed the row's P, l and O while m moved.
//   redo: P is discarded; S again in fp32 from the same 16-bit Q and K; then online_softmax.
//   normalize: 1 / L with L >= 1 (IEEE division), or 0 for L = 0 (a row that saw no key).
//   LSE: (R + log2 L) ln 2, L in [1, n 2^14].
//   split_kv's combine: 2^(R_i - max R) in [0, 1], as scale; a piece with m = -inf gets
//       exactly 0 (its l and O are 0); the piece holding the max has L >= 1.
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
// inputs whose scores jump by 120 or more (log2 units) between blocks.
// `each(x, r, c)`: what becomes of a score of this thread's row r, column c of the block,
// as it is computed (a score modifier's ScoreOf: applied one score at a time, so that the
// rare path holds no more than one of them beside the others).
struct Unchanged {
  __device__ __forceinline__ float operator()(float x, int, int) const { return x; }
};

template <class Cfg, class F = Unchanged>
__device__ __forceinline__ void recompute_s_warp(float (&s)[Cfg::kSRegs], uint32_t smem_q_wg, uint32_t smem_k,
                                                 int warp, int lane, F each = {}) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint32_t q_row = smem_q_wg + (16 * warp + lane / 4 + 8 * r) * Cfg::kRowBytes;
#pragma unroll
    for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t k_row = smem_k + (8 * j + 2 * (lane % 4) + e) * Cfg::kRowBytes;
        const float x = dot_rows<Cfg>(q_row, k_row);
        int c = 8 * j + e;
        // (a modifier's work on this score waits for it: hoisted above the dot products, the
        // 64 scores' index terms were live at once, and ptxas spilled 100 bytes for ALiBi)
        if constexpr (!cuda::std::is_same_v<F, Unchanged>) asm volatile("" : "+r"(c) : "f"(x));
        s[4 * j + 2 * r + e] = each(x, r, c);
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

// The largest partial row sum the rare path divides down: its largest P is then at most
// 2^120, so the factor 2^-log2(P) stays a normal fp32 number (rcp or exp2 of a P past 2^126
// flushes to 0). Past it, and for inf and NaN, the warp recomputes S (softmax_redo).
constexpr float kGuardedMoveSum = 0x1p120f;

// online_softmax for a block after the first, without the row max (see the top of this
// file). scale is 1 (O keeps its reference) unless the warp took the rare path. True when
// P is not used (a sum past 2^120, inf or NaN: a jump of 120 or more, a reference still
// -inf): then m and l are untouched and softmax_redo must run once the P V in flight has
// read P (its registers are free then).
template <class Cfg>
__device__ __forceinline__ bool online_softmax_guarded(float (&s)[Cfg::kSRegs], float (&m)[2], float (&l)[2],
                                                       float (&scale)[2], float scale_log2) {
  float sum[2], ref[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    ref[r] = __fmul_rn(m[r], scale_log2);  // m = -inf: every P is inf or NaN, the rarest path
    sum[r] = exp2_row<Cfg>(s, r, ref[r], scale_log2);
  }
  scale[0] = scale[1] = 1.f;
  // Warp-uniform branches: no lane diverges around the P V wgmma still in flight.
  if (__any_sync(0xffffffffu, !(sum[0] <= kGuardedSum<Cfg> && sum[1] <= kGuardedSum<Cfg>))) {
    // A sum past 2^120 (inf and NaN too): P is lost, or too large to divide out with a
    // normal factor. Recompute.
    if (__any_sync(0xffffffffu, !(sum[0] <= kGuardedMoveSum && sum[1] <= kGuardedMoveSum))) return true;
    // Every P within 2^120, some past the slack: a row whose largest P passed 2^8 moves its
    // reference up to that P (P and O's scale multiplied by 2^(m c - m' c) >= 2^-120), as
    // online_softmax would have.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float top = 0.f;
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) top = fmaxf(top, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      const bool moves = top > exp2f(Cfg::kRescaleSlack);  // no branch: rows differ by quad
      const float m_new = moves ? m[r] + fast_log2(top) * fast_rcp(scale_log2) : m[r];
      // From the rounded references, this block's (m c) and the next blocks' (m' c), not
      // from 1 / top: P, l and O then refer to m' c exactly as the next blocks' P do.
      const float inv = moves ? fast_exp2(ref[r] - __fmul_rn(m_new, scale_log2)) : 1.f;
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
        s[4 * j + 2 * r] *= inv;
        s[4 * j + 2 * r + 1] *= inv;
      }
      sum[r] *= inv;
      scale[r] = inv;
      m[r] = m_new;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) l[r] = l[r] * scale[r] + sum[r];
  return false;
}

// The rarest case of a guarded block: S again from SMEM, and the full online_softmax.
// `each`: a score modifier's (score_of, where the kernel has one), applied as S is computed.
template <class Cfg, class F = Unchanged>
__device__ __forceinline__ void softmax_redo(float (&s)[Cfg::kSRegs], float (&m)[2], float (&l)[2], float (&scale)[2],
                                             float scale_log2, uint32_t smem_q_wg, uint32_t smem_k, int warp, int lane,
                                             F each = {}) {
  recompute_s_warp<Cfg>(s, smem_q_wg, smem_k, warp, lane, each);
  apply_softcap<Cfg>(s, scale_log2);  // a guarded block is unmasked: nothing else to redo
  online_softmax<Cfg>(s, m, l, scale, scale_log2);
}

}  // namespace fadsl::sm90
