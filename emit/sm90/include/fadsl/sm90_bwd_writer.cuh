// fadsl/sm90_bwd_writer.cuh -- section 6b of fadsl/sm90_bwd.cuh (which includes it after the
// producer and the consumers, sections 4-6): `dq_writer on`'s writer warps
// (research/backward-dq-writer.md).  Not a header of its own: include fadsl/sm90_bwd.cuh.
//
// Writer w is warp 1 + w of the producer warpgroup (warps 1..3 idle after setmaxnreg.dec
// otherwise; the producer's elected thread stays in warp 0).  Per m-block it takes consumer
// w's staged dQ share (reduce_dq's writer branch) and reduce-adds it into the accumulator
// from lane 0, so that the consumer waits neither for the add's read nor, with `deterministic
// on`, for its ticket or the release's wait_group 0: FlashAttention-3's dQ writer
// (hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp), a warp per consumer share.
//
// Deadlock-free: the consumer waits on its writer only at the empty barrier, for the read of
// m-block i - 1; the writer on its consumer only at the full barrier of the same m-block; the
// ring is the producer's alone, so the consumer runs at most one m-block ahead.  Across CTAs
// (deterministic) writer w at m-block m waits for the place before it in its chain (p - 1;
// `dq_chains N`: p - N), whose writer releases it before it waits on anything again (the
// next full barrier): an induction on (place, m-block), with bwd_dq_place's argument that
// every earlier place launched earlier or (without a mask, in visit order) is resident.
// fadsl/targets/sm90/backward/verify.py and verify_writer.py prove the plan it runs.
#pragma once

namespace fadsl::sm90 {

// `dq_chains N`: place p adds into chain p mod N as its ticket p / N (with N = 1, chain 0 and
// ticket p); unsigned, as places are never negative, for a multiply-shift.
template <class Cfg>
__device__ __forceinline__ int bwd_dq_chain(int place) {
  return static_cast<int>(static_cast<unsigned>(place) % Cfg::kDqChains);
}
template <class Cfg>
__device__ __forceinline__ int bwd_dq_ticket(int place) {
  return static_cast<int>(static_cast<unsigned>(place) / Cfg::kDqChains);
}

// Writer w's loop over the block's m-blocks, in the consumers' order (bwd_m_block); its
// place, counter and destination are the consumer's (bwd_dq_place, dq_semaphore_share,
// dq_accum_share).
template <class Cfg>
__device__ __forceinline__ void bwd_dq_writer(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b, int w) {
  static_assert(!Cfg::kDqRed && !Cfg::kDqByKeys && !Cfg::kSplitHeadDim,
                "a writer reduce-adds a staged share of its own consumer");
  const int lane = threadIdx.x % 32;
  const uint32_t stage = bwd_dq_stage<Cfg>(smem, w);
  const int64_t accum_head = bwd_accum_head<Cfg>(P, b);
  // m-block i's index and place (the counter is found where it is used: held across the
  // barriers it spilled 40 bytes at head_dim 64, B_r 128, deterministic, setmaxnreg 32/232,
  // NVRTC 13.5, 2026-11-30)
  int m = b.m_count > 0 ? bwd_m_block<Cfg>(P, b, 0) : 0;
  int place = Cfg::kDeterministic && b.m_count > 0 ? bwd_dq_place<Cfg>(P, b, m) : 0;
  for (int i = 0; i < b.m_count; ++i) {
    // RAW: consumer w's staging written and fenced (its fence.proxy.async, then bar.arrive)
    named_bar_sync(Cfg::kBarDqFull + w, 160);
    if (lane == 0) {
      const int chain = bwd_dq_chain<Cfg>(place), ticket = bwd_dq_ticket<Cfg>(place);
      if constexpr (Cfg::kDeterministic) {
        // WAW on the chain's accumulator: the adds of its tickets before this one done (the
        // places p - N, p - 2N, ...)
        while (ld_acquire_gpu(dq_semaphore_share<Cfg>(P, accum_head, m, w, chain)) != ticket) __nanosleep(32);
        fence_proxy_async_global();  // the ticket's acquire (generic) before the adds (async proxy)
      }
      // (a chain's ticket 0 stores: nothing zeroed it, bwd_dq_stored_first)
      bulk_store_or_add_f32(dq_accum_share<Cfg>(P, accum_head, m, w, chain), stage, Cfg::kDqFloats * 4,
                            bwd_dq_stored_first<Cfg>() && ticket == 0);
      tma_store_commit();         // the add's bulk group, which the waits below name
    }
    // m-block i + 1's index and place, found while the add reads the staging: off the chain of
    // waits a writer runs per m-block (the ticket's acquire, the add's read and completion, the
    // release), where the visit order's divisions took 0.98 us of 2.8 at head_dim 64 without
    // a mask and paced the consumers (H200, 2026-12-03, docs/backward.md)
    // (only the place is held over the waits: holding the index as well spilled 4 bytes at
    // fa3_hopper's 24/240; the index is found again after them, one division)
    const int next_place =
        Cfg::kDeterministic && i + 1 < b.m_count ? bwd_dq_place<Cfg>(P, b, bwd_m_block<Cfg>(P, b, i + 1)) : 0;
    if (lane == 0) tma_store_wait_read<0>();  // WAR: the add has read the staging
    __syncwarp();  // lane 0's wait before the other lanes' arrivals
    // WAR: the staging read, consumer w may write it again (it syncs from m-block 1 on, so
    // none after the last)
    if (i + 1 < b.m_count) named_bar_arrive(Cfg::kBarDqEmpty + w, 160);
    if constexpr (Cfg::kDeterministic) {
      if (lane == 0) {
        // (chain and ticket found again, not held over the waits: held, they spilled 8 bytes
        // at fa3_hopper's 24/240 with dq_chains 2, NVRTC 13.5, 2026-12-06)
        const int chain = bwd_dq_chain<Cfg>(place), ticket = bwd_dq_ticket<Cfg>(place);
        bulk_wait_all();  // the writer's adds performed in global memory
        fence_proxy_async_global();  // the async proxy's adds before the release
        // WAW: the chain's next ticket (place p + N) may add
        st_release_gpu(dq_semaphore_share<Cfg>(P, accum_head, m, w, chain), ticket + 1);
      }
      // the warp converged after lane 0's release, before the next m-block's bar.sync: bar.sync
      // is .aligned (every lane executes it together), which the compiler's reconvergence after
      // the divergent block above does not promise (cutlass's GenericBarrier<SyncwarpSync> syncs
      // the warp around its lane-0 semaphore operations too)
      __syncwarp();
    }
    m = i + 1 < b.m_count ? bwd_m_block<Cfg>(P, b, i + 1) : m;
    place = next_place;
  }
  // The last add performed, not only its read of the staging, before the warp exits: PTX says
  // nothing of a bulk group's global writes still in flight when its thread exits (the consumer
  // without a writer waits the same way).  With `deterministic on` each release's wait_group 0
  // has done it already.
  if constexpr (!Cfg::kDeterministic) {
    if (lane == 0) bulk_wait_all();
  }
}

// The producer warpgroup's warps 1..consumers, after setmaxnreg.dec: writer warp - 1 on the
// block of its role (bwd_role_block).  Nothing without `dq_writer on`.
template <class Cfg>
__device__ __forceinline__ void bwd_dq_writers(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& shared) {
  if constexpr (Cfg::kDqWriter) {
    const int warp = threadIdx.x / 32;
    if (warp >= 1 && warp <= Cfg::kConsumerWGs) bwd_dq_writer<Cfg>(P, smem, bwd_role_block<Cfg>(P, shared), warp - 1);
  }
}

}  // namespace fadsl::sm90
