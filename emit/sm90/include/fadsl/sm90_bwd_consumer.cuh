// fadsl/sm90_bwd_consumer.cuh -- sections 5-6 of fadsl/sm90_bwd.cuh (which includes it after
// the producer, section 4, dS^T's stores, 5a, and dQ's adds, 5b): a consumer warpgroup's
// steps and its body, bwd_consumer.  Not a header of its own: include fadsl/sm90_bwd.cuh.
#pragma once

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 5. Consumer steps (one warpgroup, 64 keys)
// ---------------------------------------------------------------------------

// X^T = rows x_wg (64 keys, K-major, one panel per 64 head_dim columns, B_c-row panels) times
// tile^T (B_r rows, K-major, B_r-row panels): S^T = K Q^T or dP^T = V dO^T.
template <class Cfg>
__device__ __forceinline__ void issue_keys_by_rows(float (&acc)[Cfg::kSRegs], uint32_t keys_wg, uint32_t rows_slot) {
  if constexpr (bwd_lean_path<Cfg>()) {  // descriptors built once, moved per k16 step
    const uint64_t a0 = make_desc_kmajor_sw128(keys_wg), b0 = make_desc_kmajor_sw128(rows_slot);
#pragma unroll
    for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
      const uint32_t panel = kk / 4, k_bytes = (kk % 4) * 32;
      const uint64_t desc_a = desc_advance(a0, panel * Cfg::kBlockN * Cfg::kRowBytes + k_bytes);
      const uint64_t desc_b = desc_advance(b0, panel * Cfg::kBlockM * Cfg::kRowBytes + k_bytes);
      Wgmma<Cfg::kBlockM>::template ss<typename Cfg::T, 0, 0>(acc, desc_a, desc_b, kk > 0 ? 1u : 0u);
    }
  } else {  // (bwd_lean_path says why)
#pragma unroll
    for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
      const uint32_t panel = kk / 4, k_bytes = (kk % 4) * 32;
      const uint64_t desc_a = make_desc_kmajor_sw128(keys_wg + panel * Cfg::kBlockN * Cfg::kRowBytes + k_bytes);
      const uint64_t desc_b = make_desc_kmajor_sw128(rows_slot + panel * Cfg::kBlockM * Cfg::kRowBytes + k_bytes);
      Wgmma<Cfg::kBlockM>::template ss<typename Cfg::T, 0, 0>(acc, desc_a, desc_b, kk > 0 ? 1u : 0u);
    }
  }
}

// acc += X^T Y: X^T (64 keys x B_r, 16-bit pairs from registers), Y a slot of Q or dO
// (B_r rows, head_dim contiguous: MN-major B).
template <class Cfg>
__device__ __forceinline__ void issue_grad_kv(float (&acc)[Cfg::kAccRegs], const uint32_t (&x)[Cfg::kPRegs],
                                              uint32_t rows_slot) {
  const uint64_t y0 = make_desc_mnmajor_sw128(rows_slot, Cfg::kBlockM * Cfg::kRowBytes);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockM / 16; ++kk) {
    const uint32_t a[4] = {x[4 * kk], x[4 * kk + 1], x[4 * kk + 2], x[4 * kk + 3]};
    Wgmma<Cfg::kHeadDim>::template rs<typename Cfg::T, 1>(acc, a, desc_advance(y0, kk * 16 * Cfg::kRowBytes), 1u);
  }
}

// dQ (B_r x kDqCols) = dS K over kDqKeys keys: A = dS^T in SMEM (rows = keys, the B_r
// queries contiguous: MN-major A), B = K (rows = keys, head_dim contiguous: MN-major B).
template <class Cfg>
__device__ __forceinline__ void issue_dq(float (&dq)[Cfg::kDqRegs], uint32_t ds_keys, uint32_t k_keys) {
  constexpr uint32_t kPanel = Cfg::kBlockN * Cfg::kRowBytes;
  if constexpr (bwd_lean_path<Cfg>()) {  // (as issue_keys_by_rows)
    const uint64_t a0 = make_desc_mnmajor_sw128(ds_keys, kPanel), b0 = make_desc_mnmajor_sw128(k_keys, kPanel);
#pragma unroll
    for (int kk = 0; kk < Cfg::kDqKeys / 16; ++kk) {
      const uint32_t step = kk * 16 * Cfg::kRowBytes;
      Wgmma<Cfg::kDqCols>::template ss<typename Cfg::T, 1, 1>(dq, desc_advance(a0, step), desc_advance(b0, step),
                                                               kk > 0 ? 1u : 0u);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < Cfg::kDqKeys / 16; ++kk) {
      const uint32_t step = kk * 16 * Cfg::kRowBytes;
      const uint64_t desc_a = make_desc_mnmajor_sw128(ds_keys + step, kPanel);
      const uint64_t desc_b = make_desc_mnmajor_sw128(k_keys + step, kPanel);
      Wgmma<Cfg::kDqCols>::template ss<typename Cfg::T, 1, 1>(dq, desc_a, desc_b, kk > 0 ? 1u : 0u);
    }
  }
}

// dQ^T (this warpgroup's 64 head_dim columns x B_r queries) = K^T dS^T over all B_c keys:
// A = K^T (K's panel wg: rows = keys, the 64 columns contiguous: MN-major A), B = dS (the
// B_r query rows of each 64-key panel, keys contiguous: K-major B).
template <class Cfg>
__device__ __forceinline__ void issue_dq_t(float (&dq)[Cfg::kDqRegs], uint32_t ds_buf, uint32_t k_panel) {
  constexpr uint32_t kPanel = Cfg::kBlockN * Cfg::kRowBytes;
  if constexpr (bwd_lean_path<Cfg>()) {  // (as issue_keys_by_rows)
    const uint64_t a0 = make_desc_mnmajor_sw128(k_panel, kPanel), b0 = make_desc_kmajor_sw128(ds_buf);
#pragma unroll
    for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
      const uint64_t desc_a = desc_advance(a0, kk * 16 * Cfg::kRowBytes);
      const uint64_t desc_b = desc_advance(b0, (kk / 4) * Cfg::kDSPanelBytes + (kk % 4) * 32);
      Wgmma<Cfg::kBlockM>::template ss<typename Cfg::T, 1, 0>(dq, desc_a, desc_b, kk > 0 ? 1u : 0u);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
      const uint64_t desc_a = make_desc_mnmajor_sw128(k_panel + kk * 16 * Cfg::kRowBytes, kPanel);
      const uint64_t desc_b = make_desc_kmajor_sw128(ds_buf + (kk / 4) * Cfg::kDSPanelBytes + (kk % 4) * 32);
      Wgmma<Cfg::kBlockM>::template ss<typename Cfg::T, 1, 0>(dq, desc_a, desc_b, kk > 0 ? 1u : 0u);
    }
  }
}

// `softcap N`: S <- (N log2 e / c) tanh(S c / (N log2 e)) as the forward's apply_softcap
// computes it (capped_score, so that P matches the forward's LSE), and the cap's
// derivative 1 - tanh^2 into `dtanh`.  With r = 1 / (2^(2x log2 e) + 1), tanh = 1 - 2r and
// 1 - tanh^2 = 4 r (1 - r) = 4 e r^2 (e = 2^(..)): the first where e >= 1 (r <= 1/2: 1 - r
// without cancellation; e = inf gives r = 0, so 0), the second where e < 1 (e r^2 without
// cancellation; e = 0 gives 0).  Either is exactly 0 or a normal fp32 up to 1 + 2^-21 (its
// rounding near s = 0): docs/numerics.md, tests/test_softcap.py.
template <class Cfg>
__device__ __forceinline__ void bwd_softcap(float (&s)[Cfg::kSRegs], float (&dtanh)[Cfg::kSRegs], float scale_log2) {
  if constexpr (Cfg::kSoftcap > 0.f) {
    const SoftcapMap map = softcap_map(Cfg::kSoftcap, scale_log2);
#pragma unroll
    for (int i = 0; i < Cfg::kSRegs; ++i) {
      float e, r;
      s[i] = capped_score(s[i], map, e, r);  // the forward's apply_softcap, score by score
      dtanh[i] = e >= 1.f ? 4.f * r * (1.f - r) : 4.f * e * r * r;
    }
  }
}

// LSE or D of the two query columns 8j + 2t + e (e = 0, 1) a thread's S^T holds, per j: read
// from the ring slot where the loop uses them (SlotRows), or loaded ahead into registers
// (RowPairs) so that no ld.shared waits behind the wgmmas' operand reads (the lagged
// consumer: the first exponential's LSE wait was 6 % of its stall samples; H200,
// 2026-12-01, docs/backward.md "Loads ahead of the wgmmas").
struct SlotRows {
  uint32_t slot;
  int t;  // lane % 4
  __device__ __forceinline__ float2 pair(int j) const { return ld_shared_v2_f32(slot + 4 * (8 * j + 2 * t)); }
};
// (bwd_consumer builds its SlotRows in place: its SASS stays byte-identical to the loads it
// made inside the loops before, nvdisasm, 2026-12-01; the lagged consumer calls slot_rows)
__device__ __forceinline__ SlotRows slot_rows(uint32_t slot, int lane) { return SlotRows{slot, lane % 4}; }
template <class Cfg>
struct RowPairs {
  float2 v[Cfg::kBlockM / 8];
  __device__ __forceinline__ float2 pair(int j) const { return v[j]; }
};
template <class Cfg>
__device__ __forceinline__ RowPairs<Cfg> load_row_pairs(const SlotRows& from) {
  RowPairs<Cfg> rows;
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j) rows.v[j] = from.pair(j);
  return rows;
}
// bwd_probs' work after column pair j's exponentials: nothing, or the next product's row
// values loaded pair by pair as the LSE's registers free (LSE and D both whole spill at B_r 80)
struct NoPrefetch {
  __device__ __forceinline__ void operator()(int) const {}
};
template <class Cfg>
struct PrefetchPairs {
  RowPairs<Cfg>& into;
  SlotRows from;
  __device__ __forceinline__ void operator()(int j) const { into.v[j] = from.pair(j); }
};
template <class Cfg>
__device__ __forceinline__ PrefetchPairs<Cfg> prefetch_pairs(RowPairs<Cfg>& into, const SlotRows& from) {
  return PrefetchPairs<Cfg>{into, from};
}

// P^T in place of S^T: element (key row 16 warp + g + 8r of the warpgroup, query column
// 8j + 2t + e of the m-block) is 2^(S c log2e - LSE log2e), 0 where masked.  With a `score`
// modifier, 2^(s' log2e - LSE log2e) of the modified score s' (bwd_score, or where its
// derivative is not 1 bwd_score_at, and `dtanh` then holds P times the derivative,
// bwd_dscore_at: one factor a score from P to dS); with `keep`, masked where it does not
// hold too (bwd_keeps).
template <class Cfg, bool kMask, class Rows, class Then = NoPrefetch>
__device__ __forceinline__ void bwd_probs(float (&s)[Cfg::kSRegs], float (&dtanh)[Cfg::kSRegs],
                                          const BwdParamsSm90& P, const Rows& lse_rows, int key0, int q0, int lane,
                                          const BwdBlock& b, const Then& then = {}) {
  bwd_softcap<Cfg>(s, dtanh, P.scale_log2);
  bwd_score<Cfg>(s, P, b, key0, q0, lane);  // `score` whose derivative is 1: S^T modified in place
  const auto u = bwd_score_uniforms<Cfg>(P, b);  // kScoreGrad's loads per (batch, head); else none
  const int t = lane % 4;
  const int d = bwd_diagonal<Cfg>(P, b);
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
    const float2 lse_pair = lse_rows.pair(j);  // columns 8j + 2t + e
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * t + e;
      const float lse = e == 0 ? lse_pair.x : lse_pair.y;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float& x = s[4 * j + 2 * r + e];
        float p = fast_exp2(fmaf(bwd_score_at<Cfg>(x, P, u, b, key0 + 8 * r, q0 + col), bwd_probs_scale<Cfg>(P), -lse));
        if constexpr (kMask) {
          const int key = key0 + 8 * r;
          bool masked = key >= bwd_keys<Cfg>(P, b);
          if constexpr (bwd_has_right_edge<Cfg>()) masked = masked || key > q0 + col + d + bwd_right_edge<Cfg>();
          if constexpr (has_window<Cfg>()) masked = masked || key < q0 + col + d - Cfg::kWindowLeft;
          if constexpr (Cfg::kKeep) masked = masked || !bwd_keeps<Cfg>(P, b, key, q0 + col);
          if (masked) p = 0.f;
        }
        if constexpr (Cfg::kScoreGrad) dtanh[4 * j + 2 * r + e] = p * bwd_dscore_at<Cfg>(x, P, u, b, key0 + 8 * r, q0 + col);
        x = p;
      }
    }
    then(j);
  }
}

// dS^T = P^T (dP^T - D) in place of dP^T (D of the element's query column), times the
// cap's derivative with `softcap N`; with a score whose derivative is not 1, (P d score / d s)
// (dP^T - D) from the product bwd_probs left in `dtanh`.
template <class Cfg, class Rows>
__device__ __forceinline__ void bwd_grad_scores(const float (&p)[Cfg::kSRegs], float (&dp)[Cfg::kSRegs],
                                                float (&dtanh)[Cfg::kSRegs], const Rows& d_rows) {
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
    const float2 d_pair = d_rows.pair(j);  // columns 8j + 2t + e
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float d = e == 0 ? d_pair.x : d_pair.y;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 4 * j + 2 * r + e;
        if constexpr (Cfg::kScoreGrad) {  // dtanh holds P times the score's derivative (bwd_probs)
          const float ds = dtanh[i] * (dp[i] - d);
          if constexpr (Cfg::kLearn) dtanh[i] = p[i] * (dp[i] - d);  // dS' for bwd_learn
          dp[i] = ds;
        } else {
          dp[i] = p[i] * (dp[i] - d);
          if constexpr (Cfg::kSoftcap > 0.f) dp[i] *= dtanh[i];
        }
      }
    }
  }
}

// 16-bit pairs in the RS A-operand layout: x[i] = (f[2i], f[2i + 1]).
template <class Cfg>
__device__ __forceinline__ void pack_pairs(const float (&f)[Cfg::kSRegs], uint32_t (&x)[Cfg::kPRegs]) {
#pragma unroll
  for (int i = 0; i < Cfg::kPRegs; ++i) x[i] = pack_f32x2<typename Cfg::T>(f[2 * i], f[2 * i + 1]);
}

// The 4 x 4 transpose of 32-bit words across the 4 lanes of a quad: lane t holds w[s] = M[t][s]
// on entry and M[s][t] on exit.  Two butterfly steps (lane distance 1, then 2), each moving
// the words whose row and column differ in that bit to the partner lane: 4 shuffles.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int t) {
#pragma unroll
  for (int bit = 1; bit <= 2; bit *= 2) {
    const bool high = (t & bit) != 0;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      if (s & bit) continue;  // the pair (s, s | bit): the lane keeps the word whose bit matches its own
      const uint32_t got = __shfl_xor_sync(0xffffffffu, high ? w[s] : w[s | bit], bit);
      if (high) {
        w[s] = got;
      } else {
        w[s | bit] = got;
      }
    }
  }
}

// dK or dV rows of this warpgroup (times `scale`) to global memory.  16-bit: the accumulator
// gives lane t of a quad columns 8j + 2t, 8j + 2t + 1 of its two rows; a quad transpose per 4
// column groups gives lane t all 8 columns of group 4g + t, stored as one 16-byte word, so a
// warp's store writes 64 contiguous bytes of each of 8 rows (4-byte stores of column pairs
// cost 4-7 % of a call at 1k: research/performance-history.md, 2026-11-29).  The host
// allocates dK and dV with rows of head_dim elements, 16-byte aligned.  fp32 (a GQA group's
// per-head partials): column pairs, 8 bytes a lane, 32 contiguous bytes a quad.
template <class Cfg>
__device__ __forceinline__ void store_grad_kv(const float (&acc)[Cfg::kAccRegs], void* base, int64_t batch_stride,
                                              int64_t row_stride, int64_t head_stride, const BwdParamsSm90& P,
                                              const BwdBlock& b, int key0, float scale) {
  static_assert(Cfg::kHeadDim % 32 == 0, "whole quads of 8-column groups");
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key0 + 8 * r;
    const bool stored = key < bwd_keys<Cfg>(P, b);  // the quad's row: its 4 lanes agree
    const int64_t row = b.batch * batch_stride + (b.k_row0 + key) * row_stride + b.head * head_stride;
    if (P.dkv_store != kDkvStoreT) {  // fp32 column pairs 8j + 2t, stored or added
      if (!stored) continue;
      const bool add = P.dkv_store == kDkvAddFp32;
#pragma unroll
      for (int j = 0; j < Cfg::kHeadDim / 8; ++j) {
        float* at = static_cast<float*>(base) + row + 8 * j + 2 * t;
        const float x = acc[4 * j + 2 * r] * scale, y = acc[4 * j + 2 * r + 1] * scale;
        if (add) {
          red_add_v2_f32(at, x, y);
        } else {
          *reinterpret_cast<float2*>(at) = make_float2(x, y);
        }
      }
      continue;
    }
#pragma unroll
    for (int g = 0; g < Cfg::kHeadDim / 32; ++g) {
      uint32_t w[4];  // column pairs 32g + 8s + 2t of this lane's row, s = 0..3
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int j = 4 * g + s;
        w[s] = pack_f32x2<typename Cfg::T>(acc[4 * j + 2 * r] * scale, acc[4 * j + 2 * r + 1] * scale);
      }
      quad_transpose(w, t);  // every lane of the warp, whether its row is stored or not
      if (stored) {
        *reinterpret_cast<uint4*>(static_cast<typename Cfg::T*>(base) + row + 32 * g + 8 * t) =
            make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// 6. A consumer warpgroup's body
// ---------------------------------------------------------------------------

// Issue dQ = dS K of the m-block whose dS^T is in `ds_buf`, after the warpgroups that wrote
// it meet (all consumers when dQ is split by queries or head_dim panels; this one's 128
// threads when split by keys).
template <class Cfg>
__device__ __forceinline__ void meet_and_issue_dq(float (&dq)[Cfg::kDqRegs], uint32_t smem, uint32_t ds_buf, int wg) {
  if constexpr (Cfg::kDqByKeys) {
    named_bar_sync(Cfg::kBarDQ + wg, 128);  // RAW: the warpgroup's 64 rows of dS^T written and fenced
    issue_dq<Cfg>(dq, ds_buf + 64 * wg * Cfg::kRowBytes, smem + Cfg::kOffK + 64 * wg * Cfg::kRowBytes);
  } else {
    named_bar_sync(Cfg::kBarDS, Cfg::kConsumerThreads);  // RAW: all B_c rows of dS^T written and fenced
    if constexpr (Cfg::kDqTransposed) {  // dQ^T: K's panel wg (as M), every query, all of dS
      issue_dq_t<Cfg>(dq, ds_buf, smem + Cfg::kOffK + wg * Cfg::kBlockN * Cfg::kRowBytes);
    } else if constexpr (Cfg::kDqByQueries) {  // the warpgroup's 64 queries (dS^T panel wg), all of K
      issue_dq<Cfg>(dq, ds_buf + wg * Cfg::kDSPanelBytes, smem + Cfg::kOffK);
    } else {  // every query, the warpgroup's panel of K
      issue_dq<Cfg>(dq, ds_buf, smem + Cfg::kOffK + wg * Cfg::kBlockN * Cfg::kRowBytes);
    }
  }
  wgmma_commit();
}

// A consumer warpgroup: per m-block S^T and dP^T, P and dS, then dV, dK and dQ.
//
// In wgmma commit order, per m-block: S^T, dP^T, then
// - by default: dV and dK, then dQ, all three waited for before dQ is staged for the
//   reduce-add (the tensor cores idle while the warpgroup stages);
// - with `overlap on` (Cfg::kOverlap): dQ first, waited for alone (wgmma_wait<1>), so that
//   its staging and reduce-add run while dV and dK do; with `early_dv on` (Cfg::kEarlyDv)
//   dV is issued as soon as P^T is packed, before dP^T is waited for, so that the tensor
//   cores have it while the warpgroup computes dS^T, stores it and meets the others: S^T,
//   dP^T, dV, dQ, then dK.
// (Issuing m-block i's dQ in m-block i + 1, after its S^T and dP^T, would take the
// warpgroups' meeting off the critical path too, but keeps dQ's registers live over S^T and
// dP^T: at head_dim 128 that spills about 400 bytes at 240 registers.)
template <class Cfg>
__device__ __forceinline__ void bwd_consumer(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b, int wg,
                                             const BwdRun& run = {}) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int key0 = b.n0 + 64 * wg + 16 * warp + lane / 4;  // this thread's key row r = 0
  float dk[Cfg::kAccRegs], dv[Cfg::kAccRegs];
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) dk[i] = dv[i] = 0.f;

  const uint32_t k_wg = smem + Cfg::kOffK + 64 * wg * Cfg::kRowBytes;  // the warpgroup's 64 key rows
  const uint32_t v_wg = smem + Cfg::kOffV + 64 * wg * Cfg::kRowBytes;
  const uint32_t stage = bwd_dq_stage<Cfg>(smem, wg);
  const int64_t accum_head = bwd_accum_head<Cfg>(P, b);
  // RAW: K and V landed (TMA complete_tx on kv_full, phase 0; persistent: the tile's round)
  if constexpr (Cfg::kPersistent) {
    if (b.m_count > 0) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), static_cast<uint32_t>(run.kv) & 1u);
  } else {
    if (b.m_count > 0) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), 0u);
  }
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(2);
  DqTicket owed{nullptr, 0};  // `deterministic on`: the leader's unreleased ticket

  for (int i = 0; i < b.m_count; ++i) {
    FADSL_BWD_MARK(wg, i, 0);
    const int run_i = run.m0 + i;  // ring slot, parity and dS^T buffer run on over tiles (persistent)
    const int slot = run_i % Cfg::kStages;
    const int m = bwd_m_block<Cfg>(P, b, i);
    const uint32_t q_slot = smem + Cfg::kOffQ + slot * Cfg::kQBytes;
    const uint32_t do_slot = smem + Cfg::kOffDO + slot * Cfg::kQBytes;
    // RAW: the slot's Q, dO, LSE and D landed (TMA and bulk complete_tx on q_full)
    mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(run_i / Cfg::kStages) & 1u);
    FADSL_BWD_MARK(wg, i, 1);

    float s[Cfg::kSRegs], dp[Cfg::kSRegs];
    wgmma_fence();  // s and dp were read by ordinary instructions in the previous m-block
    issue_keys_by_rows<Cfg>(s, k_wg, q_slot);
    wgmma_commit();
    issue_keys_by_rows<Cfg>(dp, v_wg, do_slot);
    wgmma_commit();
    // `deterministic on`: m-block i - 1's ticket, released while S^T and dP^T run, before
    // anything that waits on another warpgroup or CTA (release_dq_ticket; the writer's own
    // with `dq_writer on`)
    if constexpr (Cfg::kDeterministic && !Cfg::kDqWriter) {
      if (tid == 0 && i > 0) release_dq_ticket<Cfg>(owed);
    }
    wgmma_wait<1>();  // S^T in registers (dP^T's group may still run)
    fence_regs(s);
    FADSL_BWD_MARK(wg, i, 2);

    float dtanh[Cfg::kSRegs];  // softcap's 1 - tanh^2, or P times the score's derivative (unused without either)
    const uint32_t lse_slot = smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes;
    const uint32_t d_slot = smem + Cfg::kOffD + slot * Cfg::kRowFloatsBytes;
    if (bwd_needs_mask<Cfg>(P, b, m)) {
      bwd_probs<Cfg, true>(s, dtanh, P, SlotRows{lse_slot, lane % 4}, key0, m * Cfg::kBlockM, lane, b);
    } else {
      bwd_probs<Cfg, false>(s, dtanh, P, SlotRows{lse_slot, lane % 4}, key0, m * Cfg::kBlockM, lane, b);
    }
    FADSL_BWD_MARK(wg, i, 3);
    uint32_t p16[Cfg::kPRegs], ds16[Cfg::kPRegs];
    if constexpr (Cfg::kEarlyDv) {  // (only with kOverlap: the static_assert in BwdConfig)
      pack_pairs<Cfg>(s, p16);
      wgmma_fence();  // the A registers p16 were written by ordinary instructions
      issue_grad_kv<Cfg>(dv, p16, do_slot);
      wgmma_commit();
      wgmma_wait<1>();  // dP^T in registers (dV's group may still run)
      fence_regs(dp);
      bwd_grad_scores<Cfg>(s, dp, dtanh, SlotRows{d_slot, lane % 4});
    } else {
      wgmma_wait<0>();  // dP^T in registers
      fence_regs(dp);
      bwd_grad_scores<Cfg>(s, dp, dtanh, SlotRows{d_slot, lane % 4});
      pack_pairs<Cfg>(s, p16);
    }
    bwd_learn<Cfg>(dp, dtanh, s, p16, P, b, key0, m * Cfg::kBlockM, lane);  // kLearn: dS' into the inputs' gradients
    pack_pairs<Cfg>(dp, ds16);
    FADSL_BWD_MARK(wg, i, 4);

    // dS^T into buffer i % 2: the other warpgroup's dQ of m-block i - 1 may still read the
    // other buffer (its reads of this one retired before it met at dS^T(i - 1))
    const uint32_t ds_buf = smem + Cfg::kOffDS + (run_i % 2) * Cfg::kDSBytes;
    if constexpr (Cfg::kDqTransposed) {
      store_ds_t<Cfg>(ds_buf, ds16, wg, warp, lane);
    } else if constexpr (Cfg::kDsStmatrix) {
      store_ds_stmatrix<Cfg>(ds_buf, ds16, wg, warp, lane);
    } else {
      store_ds<Cfg>(ds_buf, ds16, wg, warp, lane);
    }
    FADSL_BWD_MARK(wg, i, 5);
    float dq[Cfg::kDqRegs];
    if constexpr (Cfg::kOverlap) {
      // `dv_before_meeting on` (only without kEarlyDv): dV after the dS^T store, as
      // FlashAttention-3 issues it; with any of the store after the issue, ptxas (NVRTC 13.0)
      // serializes every wgmma (C7512) at head_dim 128 B_r 80 and head_dim 64 B_r 128
      if constexpr (Cfg::kDvBeforeMeeting) {
        wgmma_fence();  // p16 (its A operand) and dv written by ordinary instructions
        issue_grad_kv<Cfg>(dv, p16, do_slot);
        wgmma_commit();
      }
      // RAW: dS^T's st.shared (generic proxy) before the dQ wgmma reads it (async proxy)
      fence_proxy_async_smem();
      // dq was read by ordinary instructions (the previous m-block's adds); dk (and dv, p16
      // unless dV is issued already) and the A registers ds16 written (with kDvBeforeMeeting
      // all before dV's wgmma_fence above, and none since)
      if constexpr (!Cfg::kDvBeforeMeeting) wgmma_fence();
      meet_and_issue_dq<Cfg>(dq, smem, ds_buf, wg);
      FADSL_BWD_MARK(wg, i, 6);
      if constexpr (!Cfg::kEarlyDv && !Cfg::kDvBeforeMeeting) issue_grad_kv<Cfg>(dv, p16, do_slot);
      issue_grad_kv<Cfg>(dk, ds16, q_slot);
      wgmma_commit();
      wgmma_wait<1>();  // dQ in registers (dK, and dV unless issued early, still run)
      fence_regs(dq);
      FADSL_BWD_MARK(wg, i, 7);
      reduce_dq<Cfg>(P, b, stage, dq, accum_head, m, wg, tid, owed, i);
      FADSL_BWD_MARK(wg, i, 8);
      wgmma_wait<0>();  // dV and dK retired: Q, dO read; p16 and ds16 free
      // WAR: the slot's Q, dO (wgmma, retired above), LSE and D (read above) are free
      mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));
    } else {
      wgmma_fence();  // dk, dv and the A registers p16, ds16 were written by ordinary instructions
      issue_grad_kv<Cfg>(dv, p16, do_slot);
      issue_grad_kv<Cfg>(dk, ds16, q_slot);
      wgmma_commit();
      // RAW: dS^T's st.shared (generic proxy) before the dQ wgmma reads it (async proxy)
      fence_proxy_async_smem();
      meet_and_issue_dq<Cfg>(dq, smem, ds_buf, wg);
      FADSL_BWD_MARK(wg, i, 6);
      wgmma_wait<0>();  // dV, dK and dQ retired: Q, dO and dS^T read, dq in registers
      fence_regs(dq);
      FADSL_BWD_MARK(wg, i, 7);
      // WAR: the slot's Q, dO (wgmma, retired above), LSE and D (read above) are free
      mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));
      reduce_dq<Cfg>(P, b, stage, dq, accum_head, m, wg, tid, owed, i);
      FADSL_BWD_MARK(wg, i, 8);
    }
    FADSL_BWD_MARK(wg, i, 9);
  }
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(3);
  if constexpr (Cfg::kPersistent) {
    // WAR: every wgmma reading K and V retired (wait_group 0 ends each m-block): the producer
    // loads the next tile's while this one's dK and dV are stored
    if (b.m_count > 0) mbar_arrive(bwd_bar_kv_empty<Cfg>(smem));
  }
  // `deterministic on`: the last m-block's ticket, before the CTA exits
  if constexpr (Cfg::kDeterministic && !Cfg::kDqWriter) {
    if (tid == 0 && b.m_count > 0) release_dq_ticket<Cfg>(owed);
  }
  // The last reduce-add has read the staging buffer before the CTA's SMEM goes away (the
  // writer's own wait with `dq_writer on`)
  if constexpr (!Cfg::kDqRed && !Cfg::kDqWriter) {
    if (tid == 0) bulk_wait_all();
  }

  // dK, dV per K/V head, or with deterministic GQA per query head (summed over the group after)
  BwdBlock out = b;
  out.head = P.dkv_store == kDkvStorePartial ? b.head : b.head_kv;
  store_grad_kv<Cfg>(dk, P.dk, P.dk_batch_stride, P.dk_row_stride, P.dk_head_stride, P, out, key0, P.softmax_scale);
  store_grad_kv<Cfg>(dv, P.dv, P.dv_batch_stride, P.dv_row_stride, P.dv_head_stride, P, out, key0, 1.f);
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(4);
}

}  // namespace fadsl::sm90
