// fadsl/sm90_bwd_modifiers.cuh -- score and mask modifiers (issue 41) in the sm_90a backward
// (docs/backward.md, "Score and mask modifiers"): a spec's `score EXPR` and `keep EXPR`,
// rendered by fadsl/targets/cuda_expr.py into the generated backward's SpecModifiers
// (Cfg::Modifiers, emit/sm90/bwd_modifiers.cu.j2), applied to a consumer's S^T in registers.
//
// Included by fadsl/sm90_bwd.cuh before its parameters and blocks are declared, so the
// functions take them as template parameters (Params: BwdParamsSm90, Block: BwdBlock).
// Every call of them in sm90_bwd.cuh is under `if constexpr` on the Cfg's kScore, kScoreGrad
// or kKeep, all false in a kernel without modifiers: their code is not instantiated there.
//
// What they do, per m-block of the n-block (bwd_consumer):
//   bwd_score      S^T -> the modified score s' = score(S softmax_scale, b, h, q_idx, kv_idx)
//                  in natural units (bwd_probs then takes P = 2^(s' log2 e - LSE log2 e),
//                  the forward's LSE being of the modified scores), and d score / d s
//                  (differentiate_score's derivative, where it is not the constant 1) into
//                  `dscore`, which dS = P (dP - D) is multiplied by (bwd_grad_scores);
//   bwd_keeps      `keep` of one score (bwd_probs' masked path: -inf, so P = 0);
//   bwd_keep_partial  whether an m-block is not FULL by keep's tile rule (bwd_needs_mask);
//   bwd_keep_trim  per n-block, the m-blocks keep's tile rule classes EMPTY at both ends of
//                  bwd_block's range not visited (the built-in window's rule is the special
//                  case); not with `deterministic on`, whose ordered dQ adds need every
//                  n-block of an m-block's range to visit it (bwd_dq_place): there an EMPTY
//                  m-block runs masked (P = 0, dS = 0, an add of zeros).
//
// Indices as the forward's (fadsl/sm90_modifiers.cuh): a query row past seqlen_q (padding:
// LSE +inf, so P = 0) is read as the last row, a key past seqlen_k (masked) as the last key,
// so that an input indexed by q_idx or kv_idx is never read outside the rows check_modifiers
// proved its indices in.  Numerics (docs/numerics.md, "The backward of score and keep"): the
// LSE is the log-sum-exp of the modified scores of its row, so s' - LSE <= 0 up to rounding
// and P is in [0, 1 + a few ulp]; d score / d s is finite for finite scores (every function
// check_modifiers admits has a finite derivative where it is admitted), and P = 0 wherever
// masked, so dS is 0 or a product of finite fp32 factors.
#pragma once

#include "sm90_modifiers.cuh"  // fadsl/modifiers.cuh's functions (next to this file)

namespace fadsl::sm90 {

// The clamped indices of this thread's score s[4j + 2r + e] of S^T: key row key0 + 8r,
// query column q0 + 8j + 2 (lane % 4) + e (the layout bwd_probs reads).
template <class Block>
__device__ __forceinline__ int bwd_q_idx(const Block& b, int q0, int col) {
  return imin(q0 + col, b.seqlen_q - 1);
}
template <class Block>
__device__ __forceinline__ int bwd_kv_idx(const Block& b, int key) {
  return imin(key, b.seqlen_k - 1);
}

// `score` on this thread's S^T (raw q.k), in place: the modified score in natural units, and
// with kScoreGrad its derivative by s into dscore.
template <class Cfg, class Params, class Block>
__device__ __forceinline__ void bwd_score(float (&s)[Cfg::kSRegs], float (&dscore)[Cfg::kSRegs], const Params& P,
                                          const Block& b, int key0, int q0, int lane) {
  if constexpr (Cfg::kScore) {
    using M = typename Cfg::Modifiers;
    const typename M::Uniforms u = M::uniforms(P, b.batch, b.head);  // per m-block: a few __ldg
    const int t = lane % 4;
#pragma unroll
    for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q_idx = bwd_q_idx(b, q0, 8 * j + 2 * t + e);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int kv_idx = bwd_kv_idx(b, key0 + 8 * r);
          float& x = s[4 * j + 2 * r + e];
          const float scaled = x * P.softmax_scale;  // s, as the forward's apply_score takes it
          if constexpr (Cfg::kScoreGrad) dscore[4 * j + 2 * r + e] = M::dscore(P, u, scaled, b.batch, b.head, q_idx, kv_idx);
          x = M::score(P, u, scaled, b.batch, b.head, q_idx, kv_idx);
        }
      }
    }
  }
}

// The factor bwd_probs takes S^T by before 2^(. - LSE log2 e): softmax_scale log2 e of the
// raw score, or log2 e where bwd_score left it modified, in natural units.
template <class Cfg, class Params>
__device__ __forceinline__ float bwd_probs_scale(const Params& P) {
  if constexpr (Cfg::kScore) {
    return 1.4426950408889634f;
  } else {
    return P.scale_log2;
  }
}

// Whether dS is multiplied by a per-score factor: the built-in softcap's 1 - tanh^2, or the
// score's derivative (kScoreGrad: not the constant 1).
template <class Cfg>
__host__ __device__ constexpr bool bwd_scales_ds() {
  return Cfg::kSoftcap > 0.f || Cfg::kScoreGrad;
}

// `keep` of the score of key `key` and query column `col` of m-block q0.
template <class Cfg, class Params, class Block>
__device__ __forceinline__ bool bwd_keeps(const Params& P, const Block& b, int key, int q0, int col) {
  if constexpr (Cfg::kKeep) {
    using M = typename Cfg::Modifiers;
    const typename M::Uniforms u = M::uniforms(P, b.batch, b.head);
    return M::keep(P, u, b.batch, b.head, bwd_q_idx(b, q0, col), bwd_kv_idx(b, key));
  } else {
    return true;
  }
}

// The bounds keep's tile rule reads for m-block m of the block's n-block: its queries and the
// n-block's keys, clamped to the sequences as bwd_q_idx and bwd_kv_idx clamp them.
struct BwdTile {
  int q_lo, q_hi, kv_lo, kv_hi;
};
template <class Cfg, class Block>
__device__ __forceinline__ BwdTile bwd_tile(const Block& b, int m) {
  const int q_last = b.seqlen_q - 1;
  return {imin(m * Cfg::kBlockM, q_last), imin(m * Cfg::kBlockM + Cfg::kBlockM - 1, q_last), b.n0,
          imin(b.n0 + Cfg::kBlockN, b.seqlen_k) - 1};
}

// Whether m-block m needs keep's predicate: not FULL by the tile rule (CTA-uniform).
template <class Cfg, class Params, class Block>
__device__ __forceinline__ bool bwd_keep_partial(const Params& P, const Block& b, int m) {
  if constexpr (Cfg::kKeep) {
    const BwdTile x = bwd_tile<Cfg>(b, m);
    return !Cfg::Modifiers::full(P, b.batch, b.head, x.q_lo, x.q_hi, x.kv_lo, x.kv_hi);
  } else {
    return false;
  }
}

// bwd_block's m range without the m-blocks keep's tile rule classes EMPTY at either end (no
// score of the n-block kept by any of their queries: P = 0, nothing to add).  An EMPTY
// m-block between two visited ones is visited, masked.  The producer and the consumers find
// the same range (bwd_block runs once before the roles split, or per role on the same
// params).
template <class Cfg, class Params, class Block>
__device__ __forceinline__ void bwd_keep_trim(const Params& P, Block& b) {
  if constexpr (Cfg::kKeep && !Cfg::kDeterministic) {
    int lo = b.m_begin, hi = b.m_begin + b.m_count;
    for (; lo < hi; ++lo) {
      const BwdTile x = bwd_tile<Cfg>(b, lo);
      if (!Cfg::Modifiers::empty(P, b.batch, b.head, x.q_lo, x.q_hi, x.kv_lo, x.kv_hi)) break;
    }
    for (; hi > lo; --hi) {
      const BwdTile x = bwd_tile<Cfg>(b, hi - 1);
      if (!Cfg::Modifiers::empty(P, b.batch, b.head, x.q_lo, x.q_hi, x.kv_lo, x.kv_hi)) break;
    }
    b.m_begin = lo;
    b.m_count = hi - lo;
  }
}

}  // namespace fadsl::sm90
