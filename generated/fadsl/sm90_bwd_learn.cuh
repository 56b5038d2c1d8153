// fadsl/sm90_bwd_learn.cuh -- the gradients of a score's learnable inputs (issue 41) in the
// sm_90a backward (docs/backward.md, "Score and mask modifiers"): ALiBi's slopes, a bias
// table, any f32 input the score reads where it requires grad.
//
// Included by fadsl/sm90_bwd.cuh before its parameters and blocks are declared, so the
// functions take them as template parameters.  Each body is under `if constexpr` on the
// Cfg's kLearn, false unless the runtime's learnable variant of a backward sets it
// (fadsl/targets/sm90/learn.py): in every other kernel BwdLearnSums is empty and the
// functions are nothing, so its SASS is unchanged.
//
// The math: with s' = score(s, ...) and P = softmax(s'), the loss's gradient by the modified
// score is dS' = P (dP - D), and by an input read x[idx] of the score it is the sum over
// every score of dS' f (f = d s' / d x[idx], differentiate_inputs's derivative), at idx.
// bwd_grad_scores computes dS' on the way to dS (dS' times d score / d s); bwd_learn adds
// it up, score by score, after P^T is packed.  Masked scores have P = 0, and so do query rows
// past seqlen_q (LSE +inf) and keys past seqlen_k (masked): they add nothing.  Indices are
// the clamped ones (bwd_q_idx, bwd_kv_idx) wherever a read or a function's domain needs
// them (kLearnClamped), so no element outside an input is addressed.
//
// D's rounding (docs/numerics.md, "Learnable inputs"): D_i = rowsum(dO_i O_i) - dLSE_i comes
// from the 16-bit O, so each row's dS' carries eps_i = sum_j dS'_ij - dLSE_i (0 in exact
// math; relative 2^-9).  dQ, dK, dV take it as FlashAttention does, but an input's sum
// multiplies it by the row's factors: ALiBi's kv_idx - q_idx is hundreds where seqlen_q and
// seqlen_k differ (2 % of dslopes, 3-20 x PyTorch's own bf16 error; H200, 2026-11-30).  The
// exact sum is sum_ij (dS'_ij - P_ij eps_i) f_ij (sum_j P_ij = 1 in a row that sees a key).
// So per query row the kernel also adds up, into P.learn_rows (kLearnRow floats a row,
// the host's: R starts at -dLSE_i):
//   R_i   = sum_j dS'_ij, which ends as eps_i;
//   W_x,i = sum_j P_ij f_ij over the scores whose read x is at the row's reference element
//           idx(i, ref_i), ref_i = clamp(i + seqlen_k - seqlen_q, 0, seqlen_k - 1) (the
//           diagonal key): every score for a uniform read (slopes[h]).
// and bwd_learn_fix (the `_learn` kernel, after the main one) adds -eps_i W_x,i at
// idx(i, ref_i): exact for uniform reads, and for scattered ones (a table by q_idx - kv_idx)
// exact for the scores at the reference element, the rest keeping their eps_i term, as
// before (sum_ij P_ij eps_i f_ij [idx_ij != idx(i, ref_i)]).  P for W: bwd_learn_p32.
//
// The adds are red.global.add.f32 in no fixed order: not with `deterministic on` (the
// runtime refuses that combination; static_assert below).
#pragma once

namespace fadsl::sm90 {

// The reference key of query row q_idx: its diagonal key (bottom-right aligned), clamped
// into the keys (bwd_learn and bwd_learn_fix agree on it).
__device__ __forceinline__ int bwd_learn_ref(int q_idx, int seqlen_q, int seqlen_k) {
  return imin(imax(q_idx + seqlen_k - seqlen_q, 0), seqlen_k - 1);
}

// Two adjacent query rows' K floats each (row[e][k]: column q + e), summed over the 8 lanes
// that hold the column's keys (lanes t, t + 4, ..., t + 28: shuffles over lane bits 2-4),
// added at `at` (rows q, q + 1: 2K contiguous floats, q even) by lane t, one vector add
// where K is 1 or 2, none where all are 0 (a masked or padding column).
template <int K>
__device__ __forceinline__ void bwd_learn_add_rows(float* at, float (&row)[2][K], int lane) {
#pragma unroll
  for (int offset = 4; offset < 32; offset <<= 1) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int k = 0; k < K; ++k) row[e][k] += __shfl_xor_sync(0xffffffffu, row[e][k], offset);
    }
  }
  if (lane >= 4) return;
  bool any = false;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
#pragma unroll
    for (int k = 0; k < K; ++k) any = any || row[e][k] != 0.f;
  }
  if (!any) return;
  if constexpr (K == 1) {
    red_add_v2_f32(at, row[0][0], row[1][0]);
  } else if constexpr (K == 2) {
    red_add_v4_f32(at, row[0][0], row[0][1], row[1][0], row[1][1]);
  } else {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
      for (int k = 0; k < K; ++k) atomicAdd(at + K * e + k, row[e][k]);
    }
  }
}

// Whether W takes P in fp32 (`p`, live through bwd_learn) rather than from its 16-bit pairs
// (`p16`): with scattered reads, whose rows' terms at the reference element may sum to 0
// exactly (t5_bias_causal at seqlen_q > seqlen_k: every score in the last bucket), where the
// 16-bit P's sum 1 + 2^-9 x would leave eps_i 2^-9 x of error against a truth of 0 (half
// the GPU test's 1e-4 budget in tests/test_modifiers_learnable_numerics.py's model); and
// with kEarlyDv, whose dV wgmma may still read p16 (its A registers are not to be accessed
// until it is waited for).  Else 16 bits: fp32 P live here spilled 4 bytes at
// prefix_lm_alibi's B_r 64 (NVRTC 13.0 and 13.5, 2026-11-30), and the rounding is
// multiplied by eps_i.
template <class Cfg>
__host__ __device__ constexpr bool bwd_learn_p32() {
  if constexpr (Cfg::kLearn) {
    return Cfg::Modifiers::kLearnScatter > 0 || Cfg::kEarlyDv;
  } else {
    return false;
  }
}

// dS' of each score this thread holds into the learnable inputs' gradients
// (SpecModifiers::learn), after bwd_grad_scores: dS' is dS there (`ds`), or with a score
// whose derivative is not 1 (kScoreGrad) what bwd_grad_scores left in `dtanh` (dS being dS'
// times the derivative); and each query column's R and W into P.learn_rows (the header),
// W's P from `p` or `p16` (bwd_learn_p32).
template <class Cfg, class Params, class Block>
__device__ __forceinline__ void bwd_learn(const float (&ds)[Cfg::kSRegs], const float (&dtanh)[Cfg::kSRegs],
                                          const float (&p)[Cfg::kSRegs], const uint32_t (&p16)[Cfg::kPRegs],
                                          const Params& P, const Block& b, int key0, int q0, int lane) {
  if constexpr (Cfg::kLearn) {
    static_assert(!Cfg::kDeterministic, "the learnable inputs' adds are in no fixed order");
    using M = typename Cfg::Modifiers;
    constexpr int K = M::kLearnRow;
    const typename M::Uniforms u = M::uniforms(P, b.batch, b.head);
    float sums[M::kLearnUniform + 1] = {};
    const int t = lane % 4;
    float* rows = P.learn_rows + (static_cast<int64_t>(b.batch) * P.heads_q + b.head) * P.seqlen_q_rounded * K;
#pragma unroll
    for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
      float row[2][K];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = q0 + 8 * j + 2 * t + e;
        const int q_idx = M::kLearnClamped ? bwd_q_idx(b, q) : q;
        int ref[M::kLearnScatter + 1];  // the scattered reads' offsets at the reference key
        if constexpr (M::kLearnScatter > 0) {
          M::learn_refs(P, u, ref, b.batch, b.head, q_idx, bwd_learn_ref(q_idx, b.seqlen_q, b.seqlen_k));
        }
#pragma unroll
        for (int k = 0; k < K; ++k) row[e][k] = 0.f;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = 4 * j + 2 * r + e;
          const float g = Cfg::kScoreGrad ? dtanh[i] : ds[i];
          float pi;
          if constexpr (bwd_learn_p32<Cfg>()) {
            pi = p[i];
          } else {
            const float2 pair = unpack_f32x2<typename Cfg::T>(p16[2 * j + r]);
            pi = e == 0 ? pair.x : pair.y;
          }
          const int key = key0 + 8 * r;
          row[e][0] += g;
          M::learn(P, u, sums, row[e], ref, g, pi, b.batch, b.head, q_idx, M::kLearnClamped ? bwd_kv_idx(b, key) : key);
        }
      }
      bwd_learn_add_rows<K>(rows + static_cast<int64_t>(q0 + 8 * j + 2 * t) * K, row, lane);
    }
    // The uniform reads' sums, over the warp, one add each per m-block (held across the
    // m-blocks instead, the one register spilled 12 bytes at ALiBi's B_r 64: NVRTC 13.5)
    M::learn_flush(P, sums, b.batch, b.head, lane);
  }
}

// x summed over the warp (every lane gets the sum).
__device__ __forceinline__ float bwd_warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// A uniform read's sum over the warp, one add by lane 0 (none where it is 0: a CTA whose
// scores are all masked adds nothing).
__device__ __forceinline__ void bwd_learn_add_warp(float* dst, float x, int lane) {
  x = bwd_warp_sum(x);
  if (lane == 0 && x != 0.f) atomicAdd(dst, x);
}

// The `_learn` kernel's body, after the main kernel (stream order): per query row of
// (blockIdx.z, blockIdx.y), 256 rows a CTA from row 256 blockIdx.x, -eps_i W_x,i into each
// read's gradient at idx(i, ref_i) (the header).  Rows that see no key (LSE +inf: P = 0, so
// W = 0 and sum_j P_ij = 0, not 1) and rows past seqlen_q take no part.  A uniform read's
// terms are summed over the CTA first (one add each), a scattered read's added row by row.
template <class Cfg, class Params>
__device__ __forceinline__ void bwd_learn_fix(const Params& P) {
  if constexpr (Cfg::kLearn) {
    using M = typename Cfg::Modifiers;
    constexpr int K = M::kLearnRow;
    const int h = blockIdx.y, b = blockIdx.z, row = blockIdx.x * 256 + threadIdx.x;
    const int64_t at = (static_cast<int64_t>(b) * P.heads_q + h) * P.seqlen_q_rounded + row;
    const bool seen = row < P.seqlen_q && P.lse_log2[at] != INFINITY;
    float fix[K] = {};  // fix[1 + x] = -eps_i W_x,i
    if (seen) {
      const float eps = P.learn_rows[at * K];
#pragma unroll
      for (int k = 1; k < K; ++k) fix[k] = -eps * P.learn_rows[at * K + k];
    }
    const typename M::Uniforms u = M::uniforms(P, b, h);
    if constexpr (M::kLearnScatter > 0) {
      if (seen) M::learn_fix_scatter(P, u, fix, b, h, row, bwd_learn_ref(row, P.seqlen_q, P.seqlen_k));
    }
    if constexpr (M::kLearnUniform > 0) {
      __shared__ float warps[8][M::kLearnUniform];
      const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
      for (int x = 0; x < M::kLearnUniform; ++x) {
        const float v = bwd_warp_sum(fix[1 + x]);
        if (lane == 0) warps[warp][x] = v;
      }
      __syncthreads();  // RAW: every warp's sums in SMEM before thread 0 adds them
      if (threadIdx.x == 0) {
#pragma unroll
        for (int x = 0; x < M::kLearnUniform; ++x) {
          float v = 0.f;
#pragma unroll
          for (int w = 0; w < 8; ++w) v += warps[w][x];
          fix[1 + x] = v;
        }
        M::learn_fix_uniform(P, u, fix, b, h);
      }
    }
  }
}

}  // namespace fadsl::sm90
