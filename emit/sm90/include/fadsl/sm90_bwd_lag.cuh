// fadsl/sm90_bwd_lag.cuh -- section 6c of fadsl/sm90_bwd.cuh (which includes it after the
// consumer, sections 5-6): `dq_lag on`'s consumer warpgroup, bwd_consumer_lagged, whose dQ
// runs one m-block behind so that the warpgroups never meet.  Not a header of its own:
// include fadsl/sm90_bwd.cuh.
#pragma once

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 6c. `dq_lag on`: dQ one m-block behind, no meeting
// ---------------------------------------------------------------------------
//
// dQ = dS K reads both warpgroups' halves of dS^T, so bwd_consumer makes the warpgroups meet
// (bar.sync of every consumer thread) between the dS^T store and dQ's wgmma, every
// m-block: the faster one waits there for the slower, about 8 % of the head_dim 128
// backward on an H200 (the meeting left out, results wrong: 1.05-1.10x, 2026-11-30).  Here
// warpgroup w issues dQ(i - 1) in m-block i, after dS^T(i) is stored and dV(i) issued, by
// when the other half of dS^T(i - 1) was stored long before unless the other warpgroup lags
// a whole m-block.  Per dS^T buffer (m-block i's is i % 2, i the running index over tiles)
// two mbarriers of every consumer thread's arrival replace the meeting:
//   ds_full(buf):  each thread arrives after its st.shared of dS^T(i) and its
//                  fence.proxy.async; dQ(i)'s issuer waits for the phase (RAW);
//   ds_empty(buf): each thread arrives once its dQ(i) wgmma retired; the store of dS^T(i + 2)
//                  into the same buffer waits for the phase (WAR, from i + 2 >= 2 on).
// A warpgroup waits only for what the other did an m-block or more earlier, so they drift
// apart freely up to a buffer's reuse.  After the loop the last dQ is issued and added
// before K is freed (persistent) or dK and dV are stored.

// ds_full, then ds_empty, per dS^T buffer, after the plan's other mbarriers (kv_full, the
// ring's, `scheduler persistent`'s kv_empty): BwdConfig's kNumBars is 4 more with kDqLag.
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_ds_full(uint32_t smem, int buf) {
  return smem + Cfg::kOffBar + 8 * (1 + 2 * Cfg::kStages + Cfg::kDoBars + (Cfg::kPersistent ? 1 : 0) + buf);
}
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_ds_empty(uint32_t smem, int buf) {
  return bwd_bar_ds_full<Cfg>(smem, 2 + buf);
}

// `peel_dead on` (Cfg::kPeelDead): whether every key of warpgroup wg's 64 is masked for every
// query of the tile's first m-block: past the keys, or past the right edge of that m-block's
// last query (causal at B_r 64, B_c 128: the diagonal n-block's second warpgroup).  Its P and
// dS are zeros there, so its S^T, dP^T, dV and dK products of the m-block add nothing (nor
// do a learnable input's gradient adds: masked scores add none).  A keep modifier only
// narrows the mask: its first kept m-block (bwd_m_block's 0) is tested the same way.
// (bwd_keys_dead: the test's arithmetic, on the host too: tests/test_backward_peel_dead.py.)
template <class Cfg>
__host__ __device__ constexpr bool bwd_keys_dead(int wg_key0, int keys, int first_m, int diagonal) {
  if (wg_key0 >= keys) return true;
  if constexpr (bwd_has_right_edge<Cfg>()) {
    const int last_query = (first_m + 1) * Cfg::kBlockM - 1;
    return wg_key0 > last_query + diagonal + bwd_right_edge<Cfg>();
  }
  return false;
}
template <class Cfg>
__device__ __forceinline__ bool bwd_first_block_dead(const BwdParamsSm90& P, const BwdBlock& b, int wg) {
  if (b.m_count == 0) return false;
  return bwd_keys_dead<Cfg>(b.n0 + 64 * wg, bwd_keys<Cfg>(P, b), bwd_m_block<Cfg>(P, b, 0), bwd_diagonal<Cfg>(P, b));
}

// dQ of one m-block from dS^T buffer `ds_buf` (both warpgroups' halves): the warpgroup's
// share as meet_and_issue_dq issues it, without the meeting, in a wgmma group of its own.
template <class Cfg>
__device__ __forceinline__ void issue_dq_lagged(float (&dq)[Cfg::kDqRegs], uint32_t smem, uint32_t ds_buf, int wg) {
  if constexpr (Cfg::kDqTransposed) {  // dQ^T: K's panel wg (as M), every query, all of dS
    issue_dq_t<Cfg>(dq, ds_buf, smem + Cfg::kOffK + wg * Cfg::kBlockN * Cfg::kRowBytes);
  } else if constexpr (Cfg::kDqByQueries) {  // the warpgroup's 64 queries (dS^T panel wg), all of K
    issue_dq<Cfg>(dq, ds_buf + wg * Cfg::kDSPanelBytes, smem + Cfg::kOffK);
  } else {  // every query, the warpgroup's panel of K
    issue_dq<Cfg>(dq, ds_buf, smem + Cfg::kOffK + wg * Cfg::kBlockN * Cfg::kRowBytes);
  }
  wgmma_commit();
}

// dK or dV (the warpgroup's 64 key rows, times `scale`) into its rows of the K or V tile
// (`tile_wg`: the tile's address plus the warpgroup's first row), 16-bit in the tile's
// 128-byte swizzled 64-column panels, as the TMA store reads them: x4 n of warp w stores
// 8 x 8 blocks (j, r) = (2n + I / 2, I % 2), I = lane / 8, whose key row 16 w + 8r + lane % 8
// lane L addresses, columns 8j .. 8j + 7 (the accumulator's fragment is stmatrix's register
// layout, as store_ds_stmatrix's).  A generic-proxy store: fenced and met before the TMA
// store reads it.
template <class Cfg>
__device__ __forceinline__ void stage_grad_kv(uint32_t tile_wg, const float (&acc)[Cfg::kAccRegs], int warp, int lane,
                                              float scale) {
  const int block = lane / 8;
  const int key = 16 * warp + 8 * (block % 2) + lane % 8;
#pragma unroll
  for (int n = 0; n < Cfg::kHeadDim / 16; ++n) {
    const int j = 2 * n + block / 2;
    const uint32_t byte = (j / 8) * Cfg::kBlockN * Cfg::kRowBytes + key * Cfg::kRowBytes + (j % 8) * 16;
    uint32_t x[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int jj = 2 * n + i / 2, r = i % 2;
      x[i] = pack_f32x2<typename Cfg::T>(acc[4 * jj + 2 * r] * scale, acc[4 * jj + 2 * r + 1] * scale);
    }
    stmatrix_x4(tile_wg + swizzle128(byte), x[0], x[1], x[2], x[3]);
  }
}

// The warpgroup's 64 staged rows of dK or dV (`tile_wg` as stage_grad_kv's) to global memory
// by TMA, a box of 64 columns x 64 rows per panel (the host's tma_dk and tma_dv); rows past
// seqlen_k are not written.  By one thread, in the bulk group it commits after.
template <class Cfg>
__device__ __forceinline__ void store_grad_kv_tma(uint32_t tile_wg, const CUtensorMap* map, const BwdBlock& b,
                                                  int head, int wg) {
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    tma_store_4d(map, tile_wg + panel * Cfg::kBlockN * Cfg::kRowBytes, 64 * panel, b.k_row0 + b.n0 + 64 * wg, head,
                 b.batch);
  }
}

// A consumer warpgroup with `dq_lag on` (BwdConfig's static_assert: overlap on, dQ by
// red.add or staged for the writer warps, deterministic only with them, no early dV, dQ by
// keys or split head_dim).  With `dq_writer on` reduce_dq stages dQ(i - 1) in m-block i and
// hands it to writer wg, whose loop takes the m-blocks in the same order (sm90_bwd_writer.cuh):
// its empty barrier's wait runs from the second staging on (reduce_dq's i is the m-block the
// add is for), the ordered adds stay the writer's.
// In wgmma commit order, per m-block i: S^T(i), dP^T(i), then dV(i), dQ(i - 1) (from i = 1),
// dK(i); wait_group 1 retires dV and dQ(i - 1), whose adds run under dK(i).  With
// `dq_first on` (Cfg::kDqFirst): dQ(i - 1), then dV(i) and dK(i) in one group, so that
// wait_group 1 retires dQ(i - 1) alone and its adds run under both (at head_dim 64 1.01-1.05x
// on an H200, 2026-12-01; at B_r 80 ptxas spills there and serializes the wgmmas, NVRTC 13.5).
template <class Cfg>
__device__ __forceinline__ void bwd_consumer_lagged(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b, int wg,
                                                    const BwdRun& run = {}) {
  static_assert(Cfg::kDqLag && Cfg::kOverlap && (Cfg::kDqRed || Cfg::kDqWriter) && (!Cfg::kDeterministic || Cfg::kDqWriter) &&
                    !Cfg::kEarlyDv && !Cfg::kDvBeforeMeeting && !Cfg::kDqByKeys && !Cfg::kSplitHeadDim,
                "dq_lag: overlap on, dQ by red.add or by the writer warps (deterministic: the writer's), none of early_dv, dv_before_meeting");
  static_assert(!Cfg::kDkvTma || (!Cfg::kPersistent && !Cfg::kVarlen), "dK, dV by TMA: one tile per CTA, padded batches");
  static_assert(!Cfg::kDvOutFirst || Cfg::kDkvTma, "dv_out_first: it moves dV's TMA store");
  static_assert(!Cfg::kPeelDead || (!Cfg::kPersistent && !Cfg::kDqTransposed && !has_window<Cfg>()),
                "peel_dead: one tile per CTA, dS^T's rows keys, no window (knobs.py)");
  static_assert(!Cfg::kLateV || !Cfg::kPersistent, "late_v: V loaded once, for the CTA's one tile (knobs.py)");
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int key0 = b.n0 + 64 * wg + 16 * warp + lane / 4;  // this thread's key row r = 0
  float dk[Cfg::kAccRegs], dv[Cfg::kAccRegs];
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) dk[i] = dv[i] = 0.f;

  const uint32_t k_wg = smem + Cfg::kOffK + 64 * wg * Cfg::kRowBytes;  // the warpgroup's 64 key rows
  const uint32_t v_wg = smem + Cfg::kOffV + 64 * wg * Cfg::kRowBytes;
  const int64_t accum_head = bwd_accum_head<Cfg>(P, b);
  // RAW: K and V landed (TMA complete_tx on kv_full, phase 0; persistent: the tile's round)
  if constexpr (Cfg::kPersistent) {
    if (b.m_count > 0) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), static_cast<uint32_t>(run.kv) & 1u);
  } else {
    if (b.m_count > 0) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), 0u);
  }
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(2);
  DqTicket unused{nullptr, 0};  // (reduce_dq's ticket: deterministic mode without a writer only)
  // dq_writer on: the warpgroup's dQ staging, handed to its writer warp (reduce_dq's writer branch)
  const uint32_t dq_stage = Cfg::kDqWriter ? bwd_dq_stage<Cfg>(smem, wg) : 0u;
  // m-block i - 1's index, whose dQ m-block i issues.  With the peel it starts at m-block 0's
  // in every warpgroup, peeled or not (only m-block 1 on reads it): a start that depended on
  // the peel made ptxas re-derive it each m-block (4-13 more instructions there, NVRTC 13.5).
  int m_prev = Cfg::kPeelDead && b.m_count > 0 ? bwd_m_block<Cfg>(P, b, 0) : 0;
  int i_first = 0;              // 1 where the first m-block is peeled (peel_dead)
  if constexpr (Cfg::kPeelDead) {
    if (bwd_first_block_dead<Cfg>(P, b, wg)) {
      // The first m-block of a warpgroup whose keys it all masks: no product (P = dS = 0),
      // only its part of the m-block's hand-over, in the loop's order: its dS^T rows stored as
      // zeros for both warpgroups' dQ (issued lagged in m-block 1 or after the loop), and the
      // slot released.  (The plan's peel: fadsl/targets/sm90/backward/peel.py.)
      const int run_i = run.m0;  // one tile per CTA: 0
      const int slot = run_i % Cfg::kStages;
      // RAW: the slot's Q, dO, LSE and D landed (TMA and bulk complete_tx on q_full)
      mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(run_i / Cfg::kStages) & 1u);
      uint32_t zeros[Cfg::kPRegs];
#pragma unroll
      for (int r = 0; r < Cfg::kPRegs; ++r) zeros[r] = 0u;
      // (dS^T buffer 0's first use: no earlier dQ reads it, so no wait on its empty barrier)
      const uint32_t ds_buf = smem + Cfg::kOffDS + (run_i % 2) * Cfg::kDSBytes;
      if constexpr (Cfg::kDsStmatrix) {
        store_ds_stmatrix<Cfg>(ds_buf, zeros, wg, warp, lane);
      } else {
        store_ds<Cfg>(ds_buf, zeros, wg, warp, lane);
      }
      // RAW: the zeros' st.shared (generic proxy) before either warpgroup's dQ wgmma reads them (async proxy)
      fence_proxy_async_smem();
      mbar_arrive(bwd_bar_ds_full<Cfg>(smem, run_i % 2));  // RAW: this thread's part of dS^T(0) stored and fenced
      mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));  // WAR: the slot is read no more (nothing of it was)
      i_first = 1;
    }
  }

  for (int i = i_first; i < b.m_count; ++i) {
    FADSL_BWD_MARK(wg, i, 0);
    const int run_i = run.m0 + i;  // ring slot, parity and dS^T buffer run on over tiles (persistent)
    const int slot = run_i % Cfg::kStages;
    const int m = bwd_m_block<Cfg>(P, b, i);
    const uint32_t q_slot = smem + Cfg::kOffQ + slot * Cfg::kQBytes;
    const uint32_t do_slot = smem + Cfg::kOffDO + slot * Cfg::kQBytes;
    // RAW: the slot's Q, dO, LSE and D landed (TMA and bulk complete_tx on q_full)
    mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(run_i / Cfg::kStages) & 1u);
    FADSL_BWD_MARK(wg, i, 1);

    // LSE into registers before S^T's operands fill the SMEM pipe (q_full covered it above)
    const uint32_t lse_slot = smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes;
    const uint32_t d_slot = smem + Cfg::kOffD + slot * Cfg::kRowFloatsBytes;
    const RowPairs<Cfg> lse = load_row_pairs<Cfg>(slot_rows(lse_slot, lane));
    RowPairs<Cfg> d_sums;  // D, loaded pair by pair under P's exponentials
    float s[Cfg::kSRegs], dp[Cfg::kSRegs];
    wgmma_fence();  // s and dp were read by ordinary instructions in the previous m-block
    issue_keys_by_rows<Cfg>(s, k_wg, q_slot);
    wgmma_commit();
    if constexpr (Cfg::kLateV) {
      // RAW: V (loaded after m-block 0's slot) landed before this warpgroup's first dP^T reads it
      if (i == i_first) mbar_wait_parity(bwd_bar_v_late<Cfg>(smem), 0u);
    }
    issue_keys_by_rows<Cfg>(dp, v_wg, do_slot);
    wgmma_commit();
    wgmma_wait<1>();  // S^T in registers (dP^T's group may still run)
    fence_regs(s);
    FADSL_BWD_MARK(wg, i, 2);

    float dtanh[Cfg::kSRegs];  // softcap's 1 - tanh^2, or P times the score's derivative (unused without either)
    if (bwd_needs_mask<Cfg>(P, b, m)) {
      bwd_probs<Cfg, true>(s, dtanh, P, lse, key0, m * Cfg::kBlockM, lane, b, prefetch_pairs<Cfg>(d_sums, slot_rows(d_slot, lane)));
    } else {
      bwd_probs<Cfg, false>(s, dtanh, P, lse, key0, m * Cfg::kBlockM, lane, b, prefetch_pairs<Cfg>(d_sums, slot_rows(d_slot, lane)));
    }
    FADSL_BWD_MARK(wg, i, 3);
    uint32_t p16[Cfg::kPRegs], ds16[Cfg::kPRegs];
    wgmma_wait<0>();  // dP^T in registers
    fence_regs(dp);
    bwd_grad_scores<Cfg>(s, dp, dtanh, d_sums);
    pack_pairs<Cfg>(s, p16);
    bwd_learn<Cfg>(dp, dtanh, s, p16, P, b, key0, m * Cfg::kBlockM, lane);  // kLearn: dS' into the inputs' gradients
    pack_pairs<Cfg>(dp, ds16);
    FADSL_BWD_MARK(wg, i, 4);

    const int buf = run_i % 2;
    // WAR: both warpgroups' dQ(i - 2) wgmmas, which read this buffer, retired
    if (run_i >= 2) mbar_wait_parity(bwd_bar_ds_empty<Cfg>(smem, buf), static_cast<uint32_t>(run_i / 2 - 1) & 1u);
    const uint32_t ds_buf = smem + Cfg::kOffDS + buf * Cfg::kDSBytes;
    if constexpr (Cfg::kDqTransposed) {
      store_ds_t<Cfg>(ds_buf, ds16, wg, warp, lane);
    } else if constexpr (Cfg::kDsStmatrix) {
      store_ds_stmatrix<Cfg>(ds_buf, ds16, wg, warp, lane);
    } else {
      store_ds<Cfg>(ds_buf, ds16, wg, warp, lane);
    }
    if constexpr (!Cfg::kDqFirst) {  // dV(i) first, in a group of its own, under the fence below
      wgmma_fence();  // dv and its A registers p16, dk and ds16 written by ordinary instructions
      issue_grad_kv<Cfg>(dv, p16, do_slot);
      wgmma_commit();
    }
    // RAW: dS^T's st.shared (generic proxy) before either warpgroup's dQ wgmma reads it (async proxy)
    fence_proxy_async_smem();
    mbar_arrive(bwd_bar_ds_full<Cfg>(smem, buf));  // RAW: this thread's part of dS^T(i) stored and fenced
    FADSL_BWD_MARK(wg, i, 5);
    if (i > 0) {
      const int prev = run_i - 1;
      float dq[Cfg::kDqRegs];  // (scoped: live from its wgmma to its adds, not over S^T and dP^T)
      // RAW: both warpgroups' parts of dS^T(i - 1) stored and fenced
      mbar_wait_parity(bwd_bar_ds_full<Cfg>(smem, prev % 2), static_cast<uint32_t>(prev / 2) & 1u);
      if constexpr (Cfg::kDqFirst) {
        wgmma_fence();  // dv and its A registers p16, dk and ds16, dq written by ordinary instructions
      }
      issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (prev % 2) * Cfg::kDSBytes, wg);
      FADSL_BWD_MARK(wg, i, 6);
      if constexpr (Cfg::kDqFirst) {  // dV(i) after dQ(i - 1), in dK(i)'s group
        issue_grad_kv<Cfg>(dv, p16, do_slot);
      }
      issue_grad_kv<Cfg>(dk, ds16, q_slot);
      wgmma_commit();
      wgmma_wait<1>();  // dQ(i - 1) in registers, and dV(i) issued before it (the newest group still runs)
      fence_regs(dq);
      mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, prev % 2));  // WAR: this warpgroup's reads of dS^T(i - 1) retired
      FADSL_BWD_MARK(wg, i, 7);
      reduce_dq<Cfg>(P, b, dq_stage, dq, accum_head, m_prev, wg, tid, unused, i - 1);
      FADSL_BWD_MARK(wg, i, 8);
    } else {
      if constexpr (Cfg::kDqFirst) {
        wgmma_fence();  // dv and its A registers p16, dk and ds16 written by ordinary instructions
        issue_grad_kv<Cfg>(dv, p16, do_slot);
      }
      issue_grad_kv<Cfg>(dk, ds16, q_slot);
      wgmma_commit();
    }
    wgmma_wait<0>();  // dV and dK retired: Q, dO read; p16 and ds16 free
    // WAR: the slot's Q, dO (wgmma, retired above), LSE and D (read above) are free
    mbar_arrive(bwd_bar_q_empty<Cfg>(smem, slot));
    m_prev = m;
    FADSL_BWD_MARK(wg, i, 9);
  }
  if constexpr (Cfg::kLateV && Cfg::kPeelDead) {
    // RAW and WAW: V landed before dV is staged over it or the CTA ends (a peeled warpgroup
    // of a one-m-block tile runs no loop pass; elsewhere the phase is complete: no wait)
    if (b.m_count > 0) mbar_wait_parity(bwd_bar_v_late<Cfg>(smem), 0u);
  }
  if constexpr (Cfg::kDkvTma && Cfg::kDvOutFirst) {
    if (P.dkv_store == kDkvStoreT) {  // dV's store under the last dQ (GQA's fp32: from registers, below)
      // dV through the warpgroup's V rows, which only its dP^T read (retired in the loop)
      stage_grad_kv<Cfg>(v_wg, dv, warp, lane, 1.f);
      fence_proxy_async_smem();  // RAW: the stmatrix (generic proxy) before the TMA store reads it (async proxy)
      named_bar_sync(Cfg::kBarDQ + wg, 128);  // RAW: every thread's part of the rows staged and fenced
      if (tid == 0) {
        store_grad_kv_tma<Cfg>(v_wg, &P.tma_dv, b, b.head_kv, wg);  // (per K/V head: kDkvStoreT)
        tma_store_commit();  // dV's bulk group: the exit's wait names it
      }
    }
  }
  if (b.m_count > 0) {  // the last m-block's dQ, before K is freed or the CTA ends
    const int last = run.m0 + b.m_count - 1;
    float dq[Cfg::kDqRegs];
    // RAW: both warpgroups' parts of the last dS^T stored and fenced
    mbar_wait_parity(bwd_bar_ds_full<Cfg>(smem, last % 2), static_cast<uint32_t>(last / 2) & 1u);
    wgmma_fence();  // dq read by the previous adds
    issue_dq_lagged<Cfg>(dq, smem, smem + Cfg::kOffDS + (last % 2) * Cfg::kDSBytes, wg);
    wgmma_wait<0>();  // the last dQ in registers
    fence_regs(dq);
    mbar_arrive(bwd_bar_ds_empty<Cfg>(smem, last % 2));  // WAR: this warpgroup's reads of the last dS^T retired
    reduce_dq<Cfg>(P, b, dq_stage, dq, accum_head, m_prev, wg, tid, unused, b.m_count - 1);
  }
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(3);
  if constexpr (Cfg::kPersistent) {
    // WAR: every wgmma reading K and V retired (the last dQ's wait_group 0): the producer
    // loads the next tile's while this one's dK and dV are stored
    if (b.m_count > 0) mbar_arrive(bwd_bar_kv_empty<Cfg>(smem));
  }

  // dK, dV per K/V head, or with deterministic GQA per query head (summed over the group after)
  BwdBlock out = b;
  out.head = P.dkv_store == kDkvStorePartial ? b.head : b.head_kv;
  if constexpr (Cfg::kDkvTma) {
    if (P.dkv_store == kDkvStoreT) {  // (GQA's fp32 per K/V head: from registers, below)
      if constexpr (!Cfg::kDvOutFirst) {
        // dV through the warpgroup's V rows, which only its dP^T read (retired in the loop)
        stage_grad_kv<Cfg>(v_wg, dv, warp, lane, 1.f);
        fence_proxy_async_smem();  // RAW: the stmatrix (generic proxy) before the TMA store reads it (async proxy)
        named_bar_sync(Cfg::kBarDQ + wg, 128);  // RAW: every thread's part of the rows staged and fenced
        if (tid == 0) {
          store_grad_kv_tma<Cfg>(v_wg, &P.tma_dv, b, out.head, wg);
          tma_store_commit();  // dV's bulk group: the exit's wait names it
        }
      }
      if (b.m_count > 0) {
        const int last = run.m0 + b.m_count - 1;
        // WAR: every warpgroup's last dQ, which read K, retired (the last dS^T buffer's empty phase)
        mbar_wait_parity(bwd_bar_ds_empty<Cfg>(smem, last % 2), static_cast<uint32_t>(last / 2) & 1u);
      }
      stage_grad_kv<Cfg>(k_wg, dk, warp, lane, P.softmax_scale);
      fence_proxy_async_smem();  // RAW: the stmatrix (generic proxy) before the TMA store reads it (async proxy)
      named_bar_sync(Cfg::kBarDQ + wg, 128);  // RAW: every thread's part of the rows staged and fenced
      if (tid == 0) {
        store_grad_kv_tma<Cfg>(k_wg, &P.tma_dk, b, out.head, wg);
        tma_store_commit();  // dK's bulk group: the exit's wait names it
        tma_store_wait_read<0>();  // both stores read their tiles before the CTA exits
      }
      if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(4);
      return;
    }
  }
  store_grad_kv<Cfg>(dk, P.dk, P.dk_batch_stride, P.dk_row_stride, P.dk_head_stride, P, out, key0, P.softmax_scale);
  store_grad_kv<Cfg>(dv, P.dv, P.dv_batch_stride, P.dv_row_stride, P.dv_head_stride, P, out, key0, 1.f);
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(4);
}

}  // namespace fadsl::sm90
