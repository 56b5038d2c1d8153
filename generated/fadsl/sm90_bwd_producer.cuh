// fadsl/sm90_bwd_producer.cuh -- section 4 of fadsl/sm90_bwd.cuh (which includes it after its
// parameters, configuration and blocks, sections 1-3): the producer's loads, and the rings'
// barrier addresses, which the consumers (and head_dim 256's, fadsl/sm90_bwd_split.cuh) wait
// on too.  Not a header of its own: include fadsl/sm90_bwd.cuh.
#pragma once

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 4. Producer (one elected thread of warp 0)
// ---------------------------------------------------------------------------

template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_kv(uint32_t smem) {
  return smem + Cfg::kOffBar;
}
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_q_full(uint32_t smem, int slot) {
  return smem + Cfg::kOffBar + 8 * (1 + slot);
}
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_q_empty(uint32_t smem, int slot) {
  return smem + Cfg::kOffBar + 8 * (1 + Cfg::kStages + slot);
}
// head_dim 256: the dO ring's own (kDoStages slots), after Q's
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_do_full(uint32_t smem, int slot) {
  return smem + Cfg::kOffBar + 8 * (1 + 2 * Cfg::kStages + slot);
}
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_do_empty(uint32_t smem, int slot) {
  return smem + Cfg::kOffBar + 8 * (1 + 2 * Cfg::kStages + Cfg::kDoStages + slot);
}

// `late_v on` (Cfg::kLateV, with kDqLag, one tile per CTA): V's own barrier, the word after
// dS^T's four (the template's kNumBars one more)
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_v_late(uint32_t smem) {
  return smem + Cfg::kOffBar + 8 * (1 + 2 * Cfg::kStages + Cfg::kDoBars + 4);
}

// K and V of the n-block, once: 2 kKVBytes complete on kv_full (phase 0; `scheduler
// persistent`: the tile's round, run.kv); with kLateV K alone (V: bwd_load_v_late).
template <class Cfg>
__device__ __forceinline__ void bwd_load_kv(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b,
                                            const BwdRun& run = {}) {
  const uint32_t bar_kv = bwd_bar_kv<Cfg>(smem);
  if constexpr (Cfg::kPersistent) {
    // WAR: every consumer thread retired its wgmmas reading the previous tile's K and V (a
    // fresh barrier passes parity 1 at once)
    mbar_wait_parity(bwd_bar_kv_empty<Cfg>(smem), (static_cast<uint32_t>(run.kv) & 1u) ^ 1u);
  }
  if constexpr (Cfg::kLateV) {
    mbar_arrive_expect_tx(bar_kv, Cfg::kKVBytes);
  } else {
    mbar_arrive_expect_tx(bar_kv, 2 * Cfg::kKVBytes);
  }
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    const uint32_t at = panel * Cfg::kBlockN * Cfg::kRowBytes;
    tma_load_4d(smem + Cfg::kOffK + at, &P.tma_k, bar_kv, 64 * panel, b.k_row0 + b.n0, b.head_kv, b.batch);
    if constexpr (!Cfg::kLateV) tma_load_4d(smem + Cfg::kOffV + at, &P.tma_v, bar_kv, 64 * panel, b.k_row0 + b.n0, b.head_kv, b.batch);
  }
}

// `late_v on`: V of the n-block, issued after m-block 0's Q, dO, LSE and D, so that S^T's
// first wgmma waits for K's and the slot's bytes only (its kKVBytes complete on v_full,
// phase 0; the consumers wait before their first dP^T and after the loop)
template <class Cfg>
__device__ __forceinline__ void bwd_load_v_late(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b) {
  const uint32_t bar_v = bwd_bar_v_late<Cfg>(smem);
  mbar_arrive_expect_tx(bar_v, Cfg::kKVBytes);
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    const uint32_t at = panel * Cfg::kBlockN * Cfg::kRowBytes;
    tma_load_4d(smem + Cfg::kOffV + at, &P.tma_v, bar_v, 64 * panel, b.k_row0 + b.n0, b.head_kv, b.batch);
  }
}

// `prefetch_kv on`: the K and V tiles of the CTA launched %nsmid CTAs after this one (with
// one CTA per SM, about the one that starts as this wave's CTAs end) fetched into the L2 as
// this CTA's producer issues its last loads, a few m-blocks before this CTA ends; without
// GQA no other CTA reads them, so that CTA's loads would go to DRAM.  bwd_block_at finds its
// block as that CTA will (longest_first's and the visit order's remapping included).  A
// hint: nothing to order, and a wrong guess costs L2 bandwidth only.
template <class Cfg>
__device__ __forceinline__ void bwd_prefetch_later_kv(const BwdParamsSm90& P) {
  static_assert(!Cfg::kPersistent, "prefetch_kv: one tile per CTA (a persistent CTA loads its next K and V early)");
  const int gx = gridDim.x, gy = gridDim.y, gz = gridDim.z;
  const BwdGridPos later = bwd_launched_after(blockIdx.x, blockIdx.y, blockIdx.z, gx, gy, gz, sm_id_count());
  if (!later.ok) return;
  const BwdBlock b = bwd_block_at<Cfg>(P, later.x, later.y, later.z, gx, gy, gz);
  if (b.m_count == 0) return;  // (that CTA loads nothing)
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    tma_prefetch_l2_4d(&P.tma_k, 64 * panel, b.k_row0 + b.n0, b.head_kv, b.batch);
    tma_prefetch_l2_4d(&P.tma_v, 64 * panel, b.k_row0 + b.n0, b.head_kv, b.batch);
  }
}

// The first row of the block's (batch, head) in the LSE and D (m-block m's B_r rows follow
// at m B_r).
template <class Cfg>
__device__ __forceinline__ int64_t bwd_stat_rows(const BwdParamsSm90& P, const BwdBlock& b) {
  return Cfg::kVarlen ? (static_cast<int64_t>(b.head) * P.m_blocks + b.chunk0) * Cfg::kBlockM
                      : (static_cast<int64_t>(b.batch) * P.heads_q + b.head) * P.seqlen_q_rounded;
}

template <class Cfg>
__device__ __forceinline__ void bwd_producer(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b,
                                             const BwdRun& run = {}) {
  if (b.m_count == 0) return;  // the consumers store zeros without waiting
  bwd_load_kv<Cfg>(P, smem, b, run);
  const int64_t rows = bwd_stat_rows<Cfg>(P, b);
  for (int i = 0; i < b.m_count; ++i) {
    const int run_i = run.m0 + i;  // the ring's running index (run.m0 = 0 with one tile per CTA)
    const int slot = run_i % Cfg::kStages;
    const uint32_t phase = static_cast<uint32_t>(run_i / Cfg::kStages) & 1u;
    const int m = bwd_m_block<Cfg>(P, b, i);
    FADSL_BWD_MARK(Cfg::kConsumerWGs, i, 0);
    // WAR: every consumer thread has retired its wgmma reading the slot's Q and dO (and read
    // its LSE and D) for m-block i - kStages; a fresh barrier passes parity 1 at once.
    mbar_wait_parity(bwd_bar_q_empty<Cfg>(smem, slot), phase ^ 1u);
    FADSL_BWD_MARK(Cfg::kConsumerWGs, i, 1);
    const uint32_t full = bwd_bar_q_full<Cfg>(smem, slot);
    mbar_arrive_expect_tx(full, 2 * Cfg::kQBytes + 2 * Cfg::kRowFloatsBytes);
#pragma unroll
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      const uint32_t at = slot * Cfg::kQBytes + panel * Cfg::kBlockM * Cfg::kRowBytes;
      tma_load_4d(smem + Cfg::kOffQ + at, &P.tma_q, full, 64 * panel, b.q_row0 + m * Cfg::kBlockM, b.head, b.batch);
      tma_load_4d(smem + Cfg::kOffDO + at, &P.tma_do, full, 64 * panel, b.q_row0 + m * Cfg::kBlockM, b.head, b.batch);
    }
    const int64_t row0 = rows + static_cast<int64_t>(m) * Cfg::kBlockM;
    bulk_load(smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes, P.lse_log2 + row0, Cfg::kRowFloatsBytes, full);
    bulk_load(smem + Cfg::kOffD + slot * Cfg::kRowFloatsBytes, P.dpsum + row0, Cfg::kRowFloatsBytes, full);
    if constexpr (Cfg::kLateV) {
      if (i == 0) bwd_load_v_late<Cfg>(P, smem, b);  // (after the first slot's loads)
    }
    FADSL_BWD_MARK(Cfg::kConsumerWGs, i, 2);
  }
  if constexpr (Cfg::kPrefetchKv) bwd_prefetch_later_kv<Cfg>(P);  // (right after this CTA's last loads)
}

}  // namespace fadsl::sm90
