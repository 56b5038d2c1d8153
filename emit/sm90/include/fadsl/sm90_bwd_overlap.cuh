// fadsl/sm90_bwd_overlap.cuh -- the backward's consumer with dQ's staging under dV and dK
// (`overlap on` in a spec's backward block), included by sm90_bwd.cuh.
//
// bwd_consumer issues dV, dK and then dQ, and waits for all three before it stages dQ for
// the reduce-add: the tensor cores idle while the warpgroup stages (two barriers, the
// stores, the bulk copy's issue).  Here dQ is issued first and waited for alone
// (wgmma_wait<1>): its staging and reduce-add run while dV and dK do.  Per m-block, in
// wgmma commit order: S^T, dP^T, dQ, then dV and dK.  With `early_dv on` (kEarlyDv), dV is
// issued as soon as P^T is packed, before dP^T is waited for, so that the tensor cores have
// it while the warpgroup computes dS^T, stores it and meets the others: S^T, dP^T, dV, dQ,
// then dK.
//
// (Issuing m-block i's dQ in m-block i + 1, after its S^T and dP^T, would take the
// warpgroups' meeting off the critical path too, but keeps dQ's registers live over S^T and
// dP^T: at head_dim 128 that spills about 400 bytes at 240 registers.)
#pragma once

namespace fadsl::sm90 {

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
    if constexpr (Cfg::kDqByQueries) {  // the warpgroup's 64 queries (dS^T panel wg), all of K
      issue_dq<Cfg>(dq, ds_buf + wg * Cfg::kDSPanelBytes, smem + Cfg::kOffK);
    } else {  // every query, the warpgroup's panel of K
      issue_dq<Cfg>(dq, ds_buf, smem + Cfg::kOffK + wg * Cfg::kBlockN * Cfg::kRowBytes);
    }
  }
  wgmma_commit();
}

template <class Cfg>
__device__ __forceinline__ void bwd_consumer_overlapped(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b,
                                                        int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int key0 = b.n0 + 64 * wg + 16 * warp + lane / 4;  // this thread's key row r = 0
  float dk[Cfg::kAccRegs], dv[Cfg::kAccRegs];
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) dk[i] = dv[i] = 0.f;

  const uint32_t k_wg = smem + Cfg::kOffK + 64 * wg * Cfg::kRowBytes;  // the warpgroup's 64 key rows
  const uint32_t v_wg = smem + Cfg::kOffV + 64 * wg * Cfg::kRowBytes;
  const uint32_t stage = smem + Cfg::kOffDQ + wg * Cfg::kDqFloats * 4;
  const int64_t accum_head = (static_cast<int64_t>(b.batch) * P.heads_q + b.head) * P.m_blocks;
  // RAW: K and V landed (TMA complete_tx on kv_full, phase 0)
  if (b.m_count > 0) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), 0u);

  for (int i = 0; i < b.m_count; ++i) {
    const int slot = i % Cfg::kStages;
    const int m = b.m_begin + i;
    const uint32_t q_slot = smem + Cfg::kOffQ + slot * Cfg::kQBytes;
    const uint32_t do_slot = smem + Cfg::kOffDO + slot * Cfg::kQBytes;
    // RAW: the slot's Q, dO, LSE and D landed (TMA and bulk complete_tx on q_full)
    mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(i / Cfg::kStages) & 1u);

    float s[Cfg::kSRegs], dp[Cfg::kSRegs];
    wgmma_fence();  // s and dp were read by ordinary instructions in the previous m-block
    issue_keys_by_rows<Cfg>(s, k_wg, q_slot);
    wgmma_commit();
    issue_keys_by_rows<Cfg>(dp, v_wg, do_slot);
    wgmma_commit();
    wgmma_wait<1>();  // S^T in registers (dP^T's group may still run)
    fence_regs(s);

    const uint32_t lse_slot = smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes;
    const uint32_t d_slot = smem + Cfg::kOffD + slot * Cfg::kRowFloatsBytes;
    if (bwd_needs_mask<Cfg>(P, b, m)) {
      bwd_probs<Cfg, true>(s, P, lse_slot, key0, m * Cfg::kBlockM, lane);
    } else {
      bwd_probs<Cfg, false>(s, P, lse_slot, key0, m * Cfg::kBlockM, lane);
    }
    uint32_t p16[Cfg::kPRegs], ds16[Cfg::kPRegs];
    if constexpr (Cfg::kEarlyDv) {
      pack_pairs<Cfg>(s, p16);
      wgmma_fence();  // the A registers p16 were written by ordinary instructions
      issue_grad_kv<Cfg>(dv, p16, do_slot);
      wgmma_commit();
      wgmma_wait<1>();  // dP^T in registers (dV's group may still run)
      fence_regs(dp);
      bwd_grad_scores<Cfg>(s, dp, d_slot, lane);
    } else {
      wgmma_wait<0>();  // dP^T in registers
      fence_regs(dp);
      bwd_grad_scores<Cfg>(s, dp, d_slot, lane);
      pack_pairs<Cfg>(s, p16);
    }
    pack_pairs<Cfg>(dp, ds16);

    // dS^T into buffer i % 2: the other warpgroup's dQ of m-block i - 1 may still read the
    // other buffer (its reads of this one retired before it met at dS^T(i - 1))
    const uint32_t ds_buf = smem + Cfg::kOffDS + (i % 2) * Cfg::kDSBytes;
    store_ds<Cfg>(ds_buf, ds16, wg, warp, lane);
    // RAW: dS^T's st.shared (generic proxy) before the dQ wgmma reads it (async proxy)
    fence_proxy_async_smem();

    // dq was read by ordinary instructions (the previous m-block's adds); dk (and dv, p16
    // unless dV is issued already) and the A registers ds16 written
    wgmma_fence();
    float dq[Cfg::kDqRegs];
    meet_and_issue_dq<Cfg>(dq, smem, ds_buf, wg);
    if constexpr (!Cfg::kEarlyDv) issue_grad_kv<Cfg>(dv, p16, do_slot);
    issue_grad_kv<Cfg>(dk, ds16, q_slot);
    wgmma_commit();
    wgmma_wait<1>();  // dQ in registers (dK, and dV unless issued early, still run)
    fence_regs(dq);
    reduce_dq<Cfg>(P, b, stage, dq, accum_head, m, wg, tid);
    wgmma_wait<0>();  // dV and dK retired: Q, dO read; p16 and ds16 free
    // WAR: the slot's Q, dO (wgmma, retired above), LSE and D (read above) are free
    mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));
  }
  // The last reduce-add has read the staging buffer before the CTA's SMEM goes away
  if constexpr (!Cfg::kDqRed) {
    if (tid == 0) bulk_wait_all();
  }

  BwdBlock out = b;  // dK, dV per K/V head; GQA's per query head (summed over the group after)
  out.head = P.dkv_fp32 ? b.head : b.head_kv;
  store_grad_kv<Cfg>(dk, P.dk, P.dk_batch_stride, P.dk_row_stride, P.dk_head_stride, P, out, key0, P.softmax_scale);
  store_grad_kv<Cfg>(dv, P.dv, P.dv_batch_stride, P.dv_row_stride, P.dv_head_stride, P, out, key0, 1.f);
}

}  // namespace fadsl::sm90
