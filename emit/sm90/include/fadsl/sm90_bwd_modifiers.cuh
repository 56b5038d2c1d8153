// fadsl/sm90_bwd_modifiers.cuh -- score and mask modifiers (issue 41) in the sm_90a backward
// (docs/backward.md, "Score and mask modifiers"): a spec's `score EXPR` and `keep EXPR`,
// rendered by fadsl/targets/cuda_expr.py into the generated backward's SpecModifiers
// (Cfg::Modifiers, emit/sm90/bwd_modifiers.cu.j2), applied to a consumer's S^T in registers.
//
// Included by fadsl/sm90_bwd.cuh before its parameters and blocks are declared, so the
// functions take them as template parameters (Params: BwdParamsSm90, Block: BwdBlock).
// Each one's body is under `if constexpr` on the Cfg's kScore, kScoreGrad or kKeep, all false
// in a kernel without modifiers: there each is nothing, or the identity (bwd_score_at,
// bwd_probs_scale: the raw score, softmax_scale log2 e), and the kernel's SASS is unchanged.
//
// What they do, per m-block of the n-block (bwd_consumer), in bwd_probs:
//   bwd_score      a score whose derivative is the constant 1: S^T -> the modified score
//                  s' = score(S softmax_scale, b, h, q_idx, kv_idx), natural units, in place;
//   bwd_score_at   a score whose derivative is not 1 (kScoreGrad): s' score by score inside
//                  bwd_probs' loop; bwd_probs takes P = 2^(s' log2 e - LSE log2 e) (the
//                  forward's LSE being of the modified scores);
//   bwd_dscore_at  d score / d s (differentiate_score's derivative, where it is not the
//                  constant 1): bwd_probs keeps P times it, which bwd_grad_scores multiplies
//                  by (dP - D) for dS (one fp32 factor a score from P to dS, as the built-in
//                  softcap's 1 - tanh^2; P itself then only goes to 16 bits for dV);
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

// The clamped indices of a score: query q (a query row past seqlen_q read as the last row),
// key `key` (past seqlen_k: the last key).
template <class Block>
__device__ __forceinline__ int bwd_q_idx(const Block& b, int q) {
  return imin(q, b.seqlen_q - 1);
}
template <class Block>
__device__ __forceinline__ int bwd_kv_idx(const Block& b, int key) {
  return imin(key, b.seqlen_k - 1);
}

// `score` whose derivative is the constant 1 (ALiBi, any bias added to s) on this thread's
// S^T, in place, before bwd_probs' loop: the modified score in natural units, score(S
// softmax_scale, b, h, q_idx, kv_idx), as the forward's apply_score takes it.  (Evaluated
// score by score inside the loop instead, ALiBi spilled 4 bytes at B_r 80 beside keep's
// predicate; NVRTC 13.5, 2026-11-30.)
template <class Cfg, class Params, class Block>
__device__ __forceinline__ void bwd_score(float (&s)[Cfg::kSRegs], const Params& P, const Block& b, int key0, int q0,
                                          int lane) {
  if constexpr (Cfg::kScoreByDistance) {
    // s + f(q_idx - kv_idx), f once a distance the warp meets (DistanceTable): the score (r, 8j +
    // e) is key key0 + 8r against query q0 + 8j + 2t + e, so d = (q0 - key0 + g) + (2t - g) + 8j +
    // e - 8r with g = lane / 4 (key0 - g the warp's first key)
    using M = typename Cfg::Modifiers;
    const typename M::Uniforms u = M::uniforms(P, b.batch, b.head);
    const int spread = 2 * (lane % 4) - lane / 4;
    DistanceTable<-8, Cfg::kBlockM - 7> table;
    table.fill(q0 - key0 + lane / 4, lane, b.seqlen_q, b.seqlen_k,
               [&](int d) { return M::score_term(P, u, b.batch, b.head, d); });
#pragma unroll
    for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float& x = s[4 * j + 2 * r + e];
          x = x * P.softmax_scale + table.at(8 * j + e - 8 * r, spread);
        }
      }
    }
  } else if constexpr (Cfg::kScore && !Cfg::kScoreGrad) {
    using M = typename Cfg::Modifiers;
    const typename M::Uniforms u = M::uniforms(P, b.batch, b.head);  // a few __ldg per m-block
    const int t = lane % 4;
#pragma unroll
    for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q_idx = bwd_q_idx(b, q0 + 8 * j + 2 * t + e);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float& x = s[4 * j + 2 * r + e];
          x = M::score(P, u, x * P.softmax_scale, b.batch, b.head, q_idx, bwd_kv_idx(b, key0 + 8 * r));
        }
      }
    }
  }
}

// What a score with a derivative other than 1 reads once per (batch, head), or nothing.
struct BwdNoUniforms {};
template <class Cfg, class Params, class Block>
__device__ __forceinline__ auto bwd_score_uniforms(const Params& P, const Block& b) {
  if constexpr (Cfg::kScoreGrad) {
    return Cfg::Modifiers::uniforms(P, b.batch, b.head);  // a few __ldg per m-block
  } else {
    return BwdNoUniforms{};
  }
}

// The score bwd_probs takes P of, for the raw q.k `x` of key `key` and query `q`: where the
// score's derivative is not 1 (kScoreGrad), score(x softmax_scale, b, h, q_idx, kv_idx) in
// natural units, evaluated score by score inside bwd_probs' loop beside its derivative
// (bwd_dscore_at), so that neither is held beside S^T (a pre-pass holding the derivatives
// spilled 56-88 bytes at head_dim 128, B_r 64; NVRTC 13.5, 2026-11-30); else x as it is
// (bwd_score modified it already, or there is no score).
template <class Cfg, class Params, class U, class Block>
__device__ __forceinline__ float bwd_score_at(float x, const Params& P, const U& u, const Block& b, int key, int q) {
  if constexpr (Cfg::kScoreGrad) {
    return Cfg::Modifiers::score(P, u, x * P.softmax_scale, b.batch, b.head, bwd_q_idx(b, q), bwd_kv_idx(b, key));
  } else {
    return x;
  }
}

// d score / d s of the same score (kScoreGrad: the derivative is not the constant 1).
template <class Cfg, class Params, class U, class Block>
__device__ __forceinline__ float bwd_dscore_at(float x, const Params& P, const U& u, const Block& b, int key, int q) {
  if constexpr (Cfg::kScoreGrad) {
    return Cfg::Modifiers::dscore(P, u, x * P.softmax_scale, b.batch, b.head, bwd_q_idx(b, q), bwd_kv_idx(b, key));
  } else {
    return 1.f;
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

// `keep` of the score of key `key` and query `q` (its loads per call: the compiler keeps
// them out of the loop, or not, as registers allow).
template <class Cfg, class Params, class Block>
__device__ __forceinline__ bool bwd_keeps(const Params& P, const Block& b, int key, int q) {
  if constexpr (Cfg::kKeep) {
    using M = typename Cfg::Modifiers;
    const typename M::Uniforms u = M::uniforms(P, b.batch, b.head);
    return M::keep(P, u, b.batch, b.head, bwd_q_idx(b, q), bwd_kv_idx(b, key));
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

// A keep that reads inputs per token (TileRule.by_pass): the n-block's row of tiles in the
// classes <kernel>_keep_classes wrote before the kernel (bwd_keep_classes): per (batch[,
// head], n-block) a class byte per m-block at P.inputs[kClassesInput] and the list of the
// m-blocks kept at P.inputs[kClassesInput + 1] (keep_kept_list: [1] their count, [2 ..] the
// m-blocks, the last first).
template <class Cfg, class Params, class Block>
__device__ __forceinline__ long long bwd_class_row(const Params& P, const Block& b) {
  const int row = Cfg::Modifiers::kClassesPerHead ? b.batch * P.heads_q + b.head : b.batch;
  const int n_blocks = (P.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  return static_cast<long long>(row) * n_blocks + b.n0 / Cfg::kBlockN;
}

template <class Cfg, class Params, class Block>
__device__ __forceinline__ const int* bwd_kept_list(const Params& P, const Block& b) {
  const int* lists = static_cast<const int*>(P.inputs[Cfg::Modifiers::kClassesInput + 1]);
  return lists + bwd_class_row<Cfg>(P, b) * (2 + P.m_blocks);
}

// Whether m-block m needs keep's predicate: not FULL by the tile rule, nor by its class where
// the classes were made per call (CTA-uniform).
template <class Cfg, class Params, class Block>
__device__ __forceinline__ bool bwd_keep_partial(const Params& P, const Block& b, int m) {
  if constexpr (Cfg::kKeep) {
    const BwdTile x = bwd_tile<Cfg>(b, m);
    if (Cfg::Modifiers::full(P, b.batch, b.head, x.q_lo, x.q_hi, x.kv_lo, x.kv_hi)) return false;
    if constexpr (Cfg::Modifiers::kClassesInput >= 0) {
      const uint8_t* classes = static_cast<const uint8_t*>(P.inputs[Cfg::Modifiers::kClassesInput]);
      return __ldg(classes + bwd_class_row<Cfg>(P, b) * P.m_blocks + m) != kTileFull;
    }
    return true;
  } else {
    return false;
  }
}

// bwd_block's m range without the m-blocks keep's tile rule classes EMPTY at either end (no
// score of the n-block kept by any of their queries: P = 0, nothing to add); an EMPTY m-block
// between two visited ones is visited, masked. With classes made by a pass, the n-block's
// list of kept m-blocks instead (bwd_m_block reads it), every EMPTY one left out; not with
// `deterministic on`, whose tickets count every m-block of the range. The producer and the
// consumers find the same m-blocks (bwd_block runs once before the roles split, or per role
// on the same params).
template <class Cfg, class Params, class Block>
__device__ __forceinline__ void bwd_keep_trim(const Params& P, Block& b) {
  if constexpr (Cfg::kKeep && !Cfg::kDeterministic) {
    if constexpr (Cfg::Modifiers::kClassesInput >= 0) {
      // (the list lies in the causal range: the pass classes the tiles above the diagonal EMPTY)
      b.m_count = b.m_count > 0 ? __ldg(bwd_kept_list<Cfg>(P, b) + 1) : 0;
      return;
    }
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

// <kernel>_keep_classes of the backward (a keep that reads inputs per token), before each
// launch of the main kernel, with its params: tile (m-block blockIdx.x, n-block blockIdx.y)
// at the backward's B_r x B_c (keep_classes_cta), each n-block's list of kept m-blocks.
template <class Cfg, class Params>
__device__ __forceinline__ void bwd_keep_classes(const Params& P) {
  keep_classes_cta<Cfg, Cfg::kBlockM, Cfg::kBlockN, true>(P, P.heads_q, P.seqlen_q, P.seqlen_k);
}

}  // namespace fadsl::sm90
