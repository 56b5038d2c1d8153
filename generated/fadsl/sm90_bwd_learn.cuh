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
// every score of dS' d s' / d x[idx] (differentiate_inputs's derivative), at idx.
// bwd_grad_scores computes dS' on the way to dS (dS' times d score / d s); bwd_learn adds
// it up, score by score, after P^T is packed.  Masked scores have P = 0, and so do query rows past seqlen_q (LSE +inf)
// and keys past seqlen_k (masked): they add nothing.  Indices are the clamped ones
// (bwd_q_idx, bwd_kv_idx) wherever a read or a function's domain needs them
// (kLearnClamped), so no element outside an input is addressed.
//
// The adds are red.global.add.f32 in no fixed order: not with `deterministic on` (the
// runtime refuses that combination; static_assert below).
#pragma once

namespace fadsl::sm90 {

// dS' of each score this thread holds into the learnable inputs' gradients
// (SpecModifiers::learn), after bwd_grad_scores: dS' is dS there (`ds`), or with a score
// whose derivative is not 1 (kScoreGrad) what bwd_grad_scores left in `dtanh` (dS being dS'
// times the derivative).  After P^T is packed, so that only its 16-bit pairs are live.
template <class Cfg, class Params, class Block>
__device__ __forceinline__ void bwd_learn(const float (&ds)[Cfg::kSRegs], const float (&dtanh)[Cfg::kSRegs],
                                          const Params& P, const Block& b, int key0, int q0, int lane) {
  if constexpr (Cfg::kLearn) {
    static_assert(!Cfg::kDeterministic, "the learnable inputs' adds are in no fixed order");
    using M = typename Cfg::Modifiers;
    const typename M::Uniforms u = M::uniforms(P, b.batch, b.head);
    float sums[M::kLearnUniform + 1] = {};
    const int t = lane % 4;
#pragma unroll
    for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int q = q0 + 8 * j + 2 * t + e;
        const int q_idx = M::kLearnClamped ? bwd_q_idx(b, q) : q;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = 4 * j + 2 * r + e;
          const float g = Cfg::kScoreGrad ? dtanh[i] : ds[i];
          const int key = key0 + 8 * r;
          M::learn(P, u, sums, g, b.batch, b.head, q_idx, M::kLearnClamped ? bwd_kv_idx(b, key) : key);
        }
      }
    }
    // The uniform reads' sums, over the warp, one add each per m-block (held across the
    // m-blocks instead, the one register spilled 12 bytes at ALiBi's B_r 64: NVRTC 13.5)
    M::learn_flush(P, sums, b.batch, b.head, lane);
  }
}

// A uniform read's sum over the warp, one add by lane 0 (none where it is 0: a CTA whose
// scores are all masked adds nothing).
__device__ __forceinline__ void bwd_learn_add_warp(float* dst, float x, int lane) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  if (lane == 0 && x != 0.f) atomicAdd(dst, x);
}

}  // namespace fadsl::sm90
