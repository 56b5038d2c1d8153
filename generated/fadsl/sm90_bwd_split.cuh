// fadsl/sm90_bwd_split.cuh -- the sm_90a backward's main kernel at head_dim 256
// (docs/backward.md, research/backward-hdim256.md): the consumer warpgroups split head_dim.
//
// dK and dV of 64 keys over all 256 columns would take 2 x 64 x 256 / 128 = 256 fp32
// registers a thread, over setmaxnreg's 240.  So, as FlashAttention-3 does at head_dim 256
// (B_r 64 x B_c 80), consumer warpgroup w of 2, per m-block of 64 queries:
//   S = Q K_w^T, dP = dO V_w^T     its kKeysPerWG keys (B_c / 2 from key 40w at B_c 80), the
//                                   queries on wgmma's M (SS, m64n40)
//   P, dS                           16-bit, into SMEM: rows = the B_c keys, the 64 queries one
//                                   128-byte swizzled row (stmatrix .trans), double-buffered
//   dV^T += dO^T P, dK^T += Q^T dS  head_dim panels 2w and 2w + 1 on M, all B_c keys on N
//                                   (SS, m64n80: 2 x 40 registers each)
//   dQ^T = K^T dS^T                 panel 2w, then panel 2w + 1 into the same 32 registers
//                                   (SS, m64n64), each added into dQ's fp32 accumulator by
//                                   red.global.add before the next is issued
// Each warpgroup needs every key's P and dS for its half of head_dim but computes only its
// own keys', hence SMEM and one meeting of both warpgroups per m-block.  One register array
// for both dQ^T slices keeps ptxas from issuing the second before the first's adds (its
// "+f" operands depend on their reads): both live at once would spill.
//
// dO and D have a ring of their own of kDoStages (1) slots, with barriers do_full/do_empty:
// a second dO slot, or one ring of two Q/dO slots, does not fit beside K, V, Q's two slots
// and the two P and dS buffers.  The dO slot is released as soon as dP and dV^T retired, so
// the next m-block's dO loads under this one's dK^T and dQ^T.
//
// No dQ staging (its 64 KB do not fit), so `deterministic on` is refused at head_dim 256, as
// FlashAttention-3 refuses it.  dK^T and dV^T leave registers transposed: a shuffle with the
// lane holding the neighbouring column gives each lane two adjacent columns of one key.
//
// GQA's dK^T and dV^T leave as sm90_bwd.cuh's do (BwdParamsSm90::dkv_store, DkvStore): added
// into fp32 accumulators per K/V head by red.add (`deterministic on`, whose per-query-head
// store would apply, is refused here).  The m-blocks are visited by bwd_m_block, as the
// other consumer does (in n-block order here: visit order is `deterministic on`'s).
//
// A FADSL_BWD_TRACE build stamps the m-block timeline of sm90_bwd_trace.cuh at the same ten
// marks as bwd_consumer (fadsl/tools/bwdtrace.py names them), placed at this consumer's
// nearest points: 1 once Q and LSE landed (dO and D are waited for after S is issued), 5 once
// P and dS are stored, 6 after the meeting with dV^T and dQ^T's first panel issued, 7 that
// panel in registers, 8 both panels added (the second's issue and wait included), 9 the
// slots released.  The producer's 1 follows both rings' waits (Q's loads are issued between
// them).  Without FADSL_BWD_TRACE the marks are empty.
//
// Numerics as sm90_bwd.cuh's (P from the forward's LSE, rows without a key LSE +inf: P = 0).
// Every wait, arrive, barrier and fence says what it orders.
#pragma once

#include "sm90_bwd.cuh"

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 1. Producer (one elected thread of warp 0)
// ---------------------------------------------------------------------------

// K and V once; per m-block Q and LSE into the Q ring (q_full), dO and D into the dO ring
// (do_full), each after its slot's previous round was released.
template <class Cfg>
__device__ __forceinline__ void bwd_producer_split(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b) {
  static_assert(Cfg::kSplitHeadDim, "the head_dim 256 producer");
  if (b.m_count == 0) return;  // the consumers store zeros without waiting
  bwd_load_kv<Cfg>(P, smem, b);
  const int64_t rows = bwd_stat_rows<Cfg>(P, b);
  for (int i = 0; i < b.m_count; ++i) {
    const int slot = i % Cfg::kStages;
    const int do_slot = i % Cfg::kDoStages;
    const int m = bwd_m_block<Cfg>(P, b, i);
    const int q_row = b.q_row0 + m * Cfg::kBlockM;
    const int64_t row0 = rows + static_cast<int64_t>(m) * Cfg::kBlockM;
    FADSL_BWD_MARK(Cfg::kConsumerWGs, i, 0);
    // WAR: every consumer thread has retired its wgmma reading the slot's Q (and read its
    // LSE) for m-block i - kStages; a fresh barrier passes parity 1 at once
    mbar_wait_parity(bwd_bar_q_empty<Cfg>(smem, slot), ((i / Cfg::kStages) & 1u) ^ 1u);
    const uint32_t q_full = bwd_bar_q_full<Cfg>(smem, slot);
    mbar_arrive_expect_tx(q_full, Cfg::kQBytes + Cfg::kRowFloatsBytes);  // Q's panels and the LSE complete it
#pragma unroll
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      const uint32_t at = slot * Cfg::kQBytes + panel * Cfg::kBlockM * Cfg::kRowBytes;
      tma_load_4d(smem + Cfg::kOffQ + at, &P.tma_q, q_full, 64 * panel, q_row, b.head, b.batch);
    }
    bulk_load(smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes, P.lse_log2 + row0, Cfg::kRowFloatsBytes, q_full);
    // WAR: every consumer thread has retired its dP and dV^T reading the dO slot (and read
    // its D) for m-block i - kDoStages
    mbar_wait_parity(bwd_bar_do_empty<Cfg>(smem, do_slot), ((i / Cfg::kDoStages) & 1u) ^ 1u);
    FADSL_BWD_MARK(Cfg::kConsumerWGs, i, 1);  // (both rings' slots free)
    const uint32_t do_full = bwd_bar_do_full<Cfg>(smem, do_slot);
    mbar_arrive_expect_tx(do_full, Cfg::kQBytes + Cfg::kRowFloatsBytes);  // dO's panels and D complete it
#pragma unroll
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      const uint32_t at = do_slot * Cfg::kQBytes + panel * Cfg::kBlockM * Cfg::kRowBytes;
      tma_load_4d(smem + Cfg::kOffDO + at, &P.tma_do, do_full, 64 * panel, q_row, b.head, b.batch);
    }
    bulk_load(smem + Cfg::kOffD + do_slot * Cfg::kRowFloatsBytes, P.dpsum + row0, Cfg::kRowFloatsBytes, do_full);
    FADSL_BWD_MARK(Cfg::kConsumerWGs, i, 2);
  }
  if constexpr (Cfg::kPrefetchKv) bwd_prefetch_later_kv<Cfg>(P);  // (right after this CTA's last loads)
}

// ---------------------------------------------------------------------------
// 2. Consumer steps (one warpgroup: kKeysPerWG keys for S and dP, head_dim panels 2 wg and
//    2 wg + 1 for dK^T, dV^T and dQ^T)
// ---------------------------------------------------------------------------

// X = tile keys_wg^T: a slot of Q or dO (the 64 queries, K-major, 64-row panels) times the
// warpgroup's kKeysPerWG rows of K or V (K-major, B_c-row panels): S = Q K_w^T or dP = dO V_w^T.
template <class Cfg>
__device__ __forceinline__ void issue_rows_by_keys(float (&acc)[Cfg::kSRegs], uint32_t rows_slot, uint32_t keys_wg) {
  // descriptors built once, moved per k16 step (desc_advance: one add where a rebuild masks
  // and shifts the address, and ptxas keeps them in uniform registers)
  const uint64_t a0 = make_desc_kmajor_sw128(rows_slot), b0 = make_desc_kmajor_sw128(keys_wg);
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    const uint32_t panel = kk / 4, k_bytes = (kk % 4) * 32;
    const uint64_t desc_a = desc_advance(a0, panel * Cfg::kBlockM * Cfg::kRowBytes + k_bytes);
    const uint64_t desc_b = desc_advance(b0, panel * Cfg::kBlockN * Cfg::kRowBytes + k_bytes);
    Wgmma<Cfg::kKeysPerWG>::template ss<typename Cfg::T, 0, 0>(acc, desc_a, desc_b, kk > 0 ? 1u : 0u);
  }
}

// acc (one head_dim panel x the B_c keys) += Y^T X over the 64 queries: Y a panel of a Q or
// dO slot (query rows, the 64 columns contiguous: MN-major A), X the P or dS buffer (B_c key
// rows, the 64 queries contiguous: K-major B).  dV^T += dO^T P, dK^T += Q^T dS.
template <class Cfg>
__device__ __forceinline__ void issue_grad_panel_t(float (&acc)[Cfg::kAccPanelRegs], uint32_t rows_panel,
                                                   uint32_t keys_buf) {
  const uint64_t a0 = make_desc_mnmajor_sw128(rows_panel, Cfg::kBlockM * Cfg::kRowBytes);
  const uint64_t b0 = make_desc_kmajor_sw128(keys_buf);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockM / 16; ++kk) {
    const uint32_t step = kk * 16 * Cfg::kRowBytes;  // 16 query rows
    Wgmma<Cfg::kBlockN>::template ss<typename Cfg::T, 1, 0>(acc, desc_advance(a0, step), desc_advance(b0, kk * 32), 1u);
  }
}

// dQ^T (one 64-column panel of head_dim x the 64 queries) = K^T dS^T over the B_c keys: A =
// K's panel (key rows, the columns contiguous: MN-major A), B = the dS buffer (key rows, the
// queries contiguous: MN-major B).
template <class Cfg>
__device__ __forceinline__ void issue_dq_panel_t(float (&dq)[Cfg::kDqRegs], uint32_t k_panel, uint32_t ds_buf) {
  const uint64_t a0 = make_desc_mnmajor_sw128(k_panel, Cfg::kBlockN * Cfg::kRowBytes);
  const uint64_t b0 = make_desc_mnmajor_sw128(ds_buf, Cfg::kBlockN * Cfg::kRowBytes);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    const uint32_t step = kk * 16 * Cfg::kRowBytes;
    Wgmma<Cfg::kBlockM>::template ss<typename Cfg::T, 1, 1>(dq, desc_advance(a0, step), desc_advance(b0, step),
                                                           kk > 0 ? 1u : 0u);
  }
}

// P in place of S: element (query row0 + 8r of the m-block, key key0 + 8j + e) is
// 2^(S c log2e - LSE log2e), 0 where masked.  row0 = 16 warp + lane / 4, key0 = the
// warpgroup's first key + 2 (lane % 4); two LSE values a thread, one per row.
template <class Cfg, bool kMask>
__device__ __forceinline__ void bwd_probs_rows(float (&s)[Cfg::kSRegs], float (&dtanh)[Cfg::kSRegs],
                                               const BwdParamsSm90& P, uint32_t lse_slot, int row0, int q0, int key0,
                                               const BwdBlock& b) {
  bwd_softcap<Cfg>(s, dtanh, P.scale_log2);
  const int d = bwd_diagonal<Cfg>(P, b);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float lse = ld_shared_f32(lse_slot + 4 * (row0 + 8 * r));
    const int query = q0 + row0 + 8 * r;
#pragma unroll
    for (int j = 0; j < Cfg::kKeysPerWG / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * r + e];
        float p = fast_exp2(fmaf(x, P.scale_log2, -lse));
        if constexpr (kMask) {
          const int key = key0 + 8 * j + e;
          bool masked = key >= bwd_keys<Cfg>(P, b);
          if constexpr (bwd_has_right_edge<Cfg>()) masked = masked || key > query + d + bwd_right_edge<Cfg>();
          if constexpr (has_window<Cfg>()) masked = masked || key < query + d - Cfg::kWindowLeft;
          if (masked) p = 0.f;
        }
        x = p;
      }
    }
  }
}

// dS = P (dP - D) in place of dP (D of the element's query row), times the cap's derivative
// with `softcap N`.
template <class Cfg>
__device__ __forceinline__ void bwd_grad_scores_rows(const float (&p)[Cfg::kSRegs], float (&dp)[Cfg::kSRegs],
                                                     const float (&dtanh)[Cfg::kSRegs], uint32_t d_slot, int row0) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float d = ld_shared_f32(d_slot + 4 * (row0 + 8 * r));
#pragma unroll
    for (int j = 0; j < Cfg::kKeysPerWG / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 4 * j + 2 * r + e;
        dp[i] = p[i] * (dp[i] - d);
        if constexpr (Cfg::kSoftcap > 0.f) dp[i] *= dtanh[i];
      }
    }
  }
}

// P or dS (this warpgroup's keys, 16-bit pairs) into a buffer of B_c key rows x the 64
// queries (one 128-byte swizzled row per key): each 8 x 8 block stored transposed by
// stmatrix .trans.  x[2j + r] holds queries 16 warp + lane / 4 + 8r, keys 8j + 2 (lane % 4)
// + {0, 1}; an x4 stores blocks (j, r) = (2n + I / 2, I % 2), I < 4, whose key row lane % 8
// lane L / 8 addresses (16 bytes of 8 queries), an x2 the last key group when there are an
// odd number (B_c 80: 5 groups of 8 keys a warpgroup).
template <class Cfg>
__device__ __forceinline__ void store_keys_t(uint32_t buf, const uint32_t (&x)[Cfg::kPRegs], int wg, int warp,
                                             int lane) {
  constexpr int kGroups = Cfg::kKeysPerWG / 8;
  const int block = lane / 8;
  const uint32_t query_bytes = (16 * warp + 8 * (block % 2)) * 2;
  const int key = Cfg::kKeysPerWG * wg + lane % 8;
#pragma unroll
  for (int n = 0; n < kGroups / 2; ++n) {
    const uint32_t byte = (key + 8 * (2 * n + block / 2)) * Cfg::kRowBytes + query_bytes;
    stmatrix_x4_trans(buf + swizzle128(byte), x[4 * n], x[4 * n + 1], x[4 * n + 2], x[4 * n + 3]);
  }
  if constexpr (kGroups % 2 == 1) {
    const uint32_t byte = (key + 8 * (kGroups - 1)) * Cfg::kRowBytes + query_bytes;
    stmatrix_x2_trans(buf + swizzle128(byte), x[2 * (kGroups - 1)], x[2 * (kGroups - 1) + 1]);
  }
}

// dK^T or dV^T of this warpgroup (times `scale`) to global memory.  The accumulator gives
// the thread head_dim column c = 64 (2 wg + a) + 16 warp + lane / 4 + 8r of keys 8j + 2t and
// 8j + 2t + 1 (t = lane % 4); the lane 4 away holds column c ^ 1 of the same keys, so one
// shuffle leaves each lane two adjacent columns of one key: even c key 8j + 2t, odd c key
// 8j + 2t + 1.  16-bit: 4 bytes a lane (8 key rows x 16 bytes a warp); fp32 under GQA
// (P.dkv_store: added per K/V head by red.add): 8 bytes.
template <class Cfg>
__device__ __forceinline__ void store_grad_kv_t(const float (&acc)[2][Cfg::kAccPanelRegs], void* base,
                                                int64_t batch_stride, int64_t row_stride, int64_t head_stride,
                                                const BwdParamsSm90& P, const BwdBlock& b, int wg, float scale) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32;
  const bool odd = (lane / 4) % 2 == 1;
  const int64_t head = b.batch * batch_stride + b.head * head_stride;
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int col = 64 * (2 * wg + a) + 16 * warp + lane / 4 + 8 * r - (odd ? 1 : 0);  // the pair's first
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
        const float v0 = acc[a][4 * j + 2 * r] * scale, v1 = acc[a][4 * j + 2 * r + 1] * scale;
        // even c sends its key + 1 value, odd c its key value
        const float got = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
        const float2 pair = odd ? make_float2(got, v1) : make_float2(v0, got);  // columns col, col + 1
        const int key = 8 * j + 2 * (lane % 4) + (odd ? 1 : 0);
        if (b.n0 + key >= bwd_keys<Cfg>(P, b)) continue;
        const int64_t at = head + (b.k_row0 + b.n0 + key) * row_stride + col;
        if (P.dkv_store != kDkvStoreT) {  // fp32 (col even: 8-byte aligned)
          float* dst = static_cast<float*>(base) + at;
          // the host's DkvStore follows `deterministic` (kDkvStorePartial with it, which is
          // refused at head_dim 256, else kDkvAddFp32); decided at compile time, since a third
          // runtime branch here costs registers (12 bytes spilled, causal softcap 30, NVRTC 13.5)
          if constexpr (Cfg::kDeterministic) {
            *reinterpret_cast<float2*>(dst) = pair;
          } else {
            red_add_v2_f32(dst, pair.x, pair.y);
          }
        } else {
          *reinterpret_cast<uint32_t*>(static_cast<typename Cfg::T*>(base) + at) =
              pack_f32x2<typename Cfg::T>(pair.x, pair.y);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// 3. The consumer's body
// ---------------------------------------------------------------------------

// A consumer warpgroup (wg of 2).  Per m-block, in wgmma commit order: S; dP; dV^T of both
// panels with dQ^T of panel 2 wg; dK^T of panel 2 wg; dQ^T of panel 2 wg + 1; dK^T of panel
// 2 wg + 1.  The first dQ^T's adds run under the first dK^T, the second's under the second.
template <class Cfg>
__device__ __forceinline__ void bwd_consumer_split(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b, int wg) {
  static_assert(Cfg::kSplitHeadDim && Cfg::kDqRed, "the head_dim 256 consumer adds dQ from registers");
  // its one order (validate refuses the others at head_dim 256, located): dV^T reads every
  // key's P from SMEM, so it is issued after the meeting, and dQ has no staging to order
  static_assert(!Cfg::kOverlap && !Cfg::kEarlyDv && !Cfg::kDvBeforeMeeting && !Cfg::kDeterministic,
                "head_dim 256: no overlap, early_dv, dv_before_meeting or deterministic");
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int row0 = 16 * warp + lane / 4;                                  // this thread's query row r = 0
  const int key0 = b.n0 + Cfg::kKeysPerWG * wg + 2 * (lane % 4);          // and its key column j = e = 0
  float dk[2][Cfg::kAccPanelRegs], dv[2][Cfg::kAccPanelRegs];             // head_dim panels 2 wg, 2 wg + 1
#pragma unroll
  for (int a = 0; a < 2; ++a) {
#pragma unroll
    for (int i = 0; i < Cfg::kAccPanelRegs; ++i) dk[a][i] = dv[a][i] = 0.f;
  }
  const uint32_t k_wg = smem + Cfg::kOffK + Cfg::kKeysPerWG * wg * Cfg::kRowBytes;  // the warpgroup's key rows
  const uint32_t v_wg = smem + Cfg::kOffV + Cfg::kKeysPerWG * wg * Cfg::kRowBytes;
  const uint32_t k_panels = smem + Cfg::kOffK + 2 * wg * Cfg::kBlockN * Cfg::kRowBytes;  // its head_dim panels of K
  const int64_t accum_head = Cfg::kVarlen ? static_cast<int64_t>(b.head) * P.m_blocks + b.chunk0
                                          : (static_cast<int64_t>(b.batch) * P.heads_q + b.head) * P.m_blocks;
  // RAW: K and V landed (TMA complete_tx on kv_full, phase 0)
  if (b.m_count > 0) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), 0u);
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(2);

  for (int i = 0; i < b.m_count; ++i) {
    FADSL_BWD_MARK(wg, i, 0);
    const int slot = i % Cfg::kStages;
    const int m = bwd_m_block<Cfg>(P, b, i);
    const uint32_t q_slot = smem + Cfg::kOffQ + slot * Cfg::kQBytes;
    const uint32_t do_slot = smem + Cfg::kOffDO + (i % Cfg::kDoStages) * Cfg::kQBytes;
    // RAW: the slot's Q and LSE landed (TMA and bulk complete_tx on q_full)
    mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(i / Cfg::kStages) & 1u);
    FADSL_BWD_MARK(wg, i, 1);

    float s[Cfg::kSRegs], dp[Cfg::kSRegs];
    wgmma_fence();  // s, dp (and dq, by the adds) were accessed by ordinary instructions before
    issue_rows_by_keys<Cfg>(s, q_slot, k_wg);
    wgmma_commit();  // group S: P needs it before dP
    // RAW: the dO slot and D landed (TMA and bulk complete_tx on do_full)
    mbar_wait_parity(bwd_bar_do_full<Cfg>(smem, i % Cfg::kDoStages), static_cast<uint32_t>(i / Cfg::kDoStages) & 1u);
    issue_rows_by_keys<Cfg>(dp, do_slot, v_wg);
    wgmma_commit();  // group dP
    wgmma_wait<1>();  // S in registers (dP's group may still run)
    fence_regs(s);
    FADSL_BWD_MARK(wg, i, 2);

    float dtanh[Cfg::kSRegs];  // softcap's 1 - tanh^2 (unused without it)
    const uint32_t lse_slot = smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes;
    const uint32_t d_slot = smem + Cfg::kOffD + (i % Cfg::kDoStages) * Cfg::kRowFloatsBytes;
    if (bwd_needs_mask<Cfg>(P, b, m)) {
      bwd_probs_rows<Cfg, true>(s, dtanh, P, lse_slot, row0, m * Cfg::kBlockM, key0, b);
    } else {
      bwd_probs_rows<Cfg, false>(s, dtanh, P, lse_slot, row0, m * Cfg::kBlockM, key0, b);
    }
    FADSL_BWD_MARK(wg, i, 3);
    wgmma_wait<0>();  // dP in registers
    fence_regs(dp);
    bwd_grad_scores_rows<Cfg>(s, dp, dtanh, d_slot, row0);
    uint32_t p16[Cfg::kPRegs], ds16[Cfg::kPRegs];
    pack_pairs<Cfg>(s, p16);
    pack_pairs<Cfg>(dp, ds16);
    FADSL_BWD_MARK(wg, i, 4);

    // P and dS into buffers i % 2: the other warpgroup's wgmmas of m-block i - 1 may still
    // read the other buffers (its reads of these retired before it met at m-block i - 1)
    const uint32_t p_buf = smem + Cfg::kOffP + (i % 2) * Cfg::kPBytes;
    const uint32_t ds_buf = smem + Cfg::kOffDS + (i % 2) * Cfg::kDSBytes;
    store_keys_t<Cfg>(p_buf, p16, wg, warp, lane);
    store_keys_t<Cfg>(ds_buf, ds16, wg, warp, lane);
    FADSL_BWD_MARK(wg, i, 5);
    // RAW: P's and dS's stmatrix (generic proxy) before the wgmmas read them (async proxy)
    fence_proxy_async_smem();
    // RAW: both warpgroups' keys of P and dS written and fenced
    named_bar_sync(Cfg::kBarDS, Cfg::kConsumerThreads);
    const uint32_t do_panels = do_slot + 2 * wg * Cfg::kBlockM * Cfg::kRowBytes;  // dO's panels 2 wg, 2 wg + 1
    const uint32_t q_panels = q_slot + 2 * wg * Cfg::kBlockM * Cfg::kRowBytes;
    issue_grad_panel_t<Cfg>(dv[0], do_panels, p_buf);
    issue_grad_panel_t<Cfg>(dv[1], do_panels + Cfg::kBlockM * Cfg::kRowBytes, p_buf);
    float dq[Cfg::kDqRegs];  // both slices: the second's wgmma waits for the first's adds
    issue_dq_panel_t<Cfg>(dq, k_panels, ds_buf);
    wgmma_commit();  // group dV^T, dQ^T slice 0: the adds need it before dK^T's
    FADSL_BWD_MARK(wg, i, 6);
    issue_grad_panel_t<Cfg>(dk[0], q_panels, ds_buf);
    wgmma_commit();  // group dK^T panel 0
    wgmma_wait<1>();  // dV^T and dQ^T slice 0 retired (dK^T's first panel may still run)
    fence_regs(dq);
    FADSL_BWD_MARK(wg, i, 7);
    // WAR: the dO slot (dP and dV^T retired) and D (read above) are free
    mbar_arrive(bwd_bar_do_empty<Cfg>(smem, i % Cfg::kDoStages));
    red_add_dq<Cfg>(dq_accum_share<Cfg>(P, accum_head, m, 2 * wg), dq, tid);
    wgmma_fence();  // dq was read by the adds above
    issue_dq_panel_t<Cfg>(dq, k_panels + Cfg::kBlockN * Cfg::kRowBytes, ds_buf);
    wgmma_commit();  // group dQ^T slice 1
    issue_grad_panel_t<Cfg>(dk[1], q_panels + Cfg::kBlockM * Cfg::kRowBytes, ds_buf);
    wgmma_commit();  // group dK^T panel 1
    wgmma_wait<1>();  // dQ^T slice 1 retired (dK^T's second panel may still run)
    fence_regs(dq);
    red_add_dq<Cfg>(dq_accum_share<Cfg>(P, accum_head, m, 2 * wg + 1), dq, tid);
    FADSL_BWD_MARK(wg, i, 8);
    wgmma_wait<0>();  // dK^T retired: Q read
    // WAR: the slot's Q (wgmma, retired above) and LSE (read above) are free
    mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));
    FADSL_BWD_MARK(wg, i, 9);
  }
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(3);

  // dK, dV per K/V head (GQA: added in fp32), or with deterministic GQA per query head (not
  // at head_dim 256: refused)
  BwdBlock out = b;
  out.head = P.dkv_store == kDkvStorePartial ? b.head : b.head_kv;
  store_grad_kv_t<Cfg>(dk, P.dk, P.dk_batch_stride, P.dk_row_stride, P.dk_head_stride, P, out, wg, P.softmax_scale);
  store_grad_kv_t<Cfg>(dv, P.dv, P.dv_batch_stride, P.dv_row_stride, P.dv_head_stride, P, out, wg, 1.f);
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(4);
}

}  // namespace fadsl::sm90
