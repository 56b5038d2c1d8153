// fadsl/sm90_bwd_dq_reduce.cuh -- section 5b of fadsl/sm90_bwd.cuh (which includes it before
// the consumers, sections 5-6): an m-block's dQ added into its fp32 accumulator, staged and
// reduce-added in bulk, by red.add, or in ticket order (`deterministic on`).  A file of its
// own because the writer warps (6b) and head_dim 256's consumer (fadsl/sm90_bwd_split.cuh)
// add into the same accumulator.  Not a header of its own: include fadsl/sm90_bwd.cuh.
#pragma once

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 5b. dQ into its fp32 accumulator
// ---------------------------------------------------------------------------

// The warpgroup's dQ registers into its staging buffer: float4 q of thread `tid` at
// (q * 128 + tid) * 4 floats (convert_dq reads the same order back).
template <class Cfg>
__device__ __forceinline__ void stage_dq(uint32_t stage, const float (&dq)[Cfg::kDqRegs], int tid) {
#pragma unroll
  for (int q = 0; q < Cfg::kDqRegs / 4; ++q) {
    st_shared_v4(stage + 16 * (q * 128 + tid), dq[4 * q], dq[4 * q + 1], dq[4 * q + 2], dq[4 * q + 3]);
  }
}

// Share `share`'s dQ staging buffer (dQ staged: `rf -st.shared-> smem[warpgroup] -reduce.add->
// gmem`), kDqFloats fp32 each: consumer warpgroup `share` stores it, its leader or its writer
// warp reduce-adds it (tests/backward_walk.py inlines this body to read the plan's operands).
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_dq_stage(uint32_t smem, int share) {
  return smem + Cfg::kOffDQ + share * Cfg::kDqFloats * 4;
}

// The first m-block of the block's (batch, head) in dQ's accumulator (and its semaphores).
template <class Cfg>
__device__ __forceinline__ int64_t bwd_accum_head(const BwdParamsSm90& P, const BwdBlock& b) {
  return Cfg::kVarlen ? static_cast<int64_t>(b.head) * P.m_blocks + b.chunk0
                      : (static_cast<int64_t>(b.batch) * P.heads_q + b.head) * P.m_blocks;
}

// An m-block's floats in dQ's accumulator: B_r x head_dim per chain (`dq_chains N`: chain c's
// at c B_r head_dim), and its ints among the counters: kDqSemaphores per chain.  Functions,
// not Cfg members: a generated Cfg sets kDqChains after the base's members are fixed.
template <class Cfg>
__host__ __device__ constexpr int bwd_dq_block_floats() {
  static_assert(Cfg::kDqChains >= 1 && Cfg::kDqChains <= 4, "dq_chains 1 to 4 (knobs.py)");
  static_assert(Cfg::kDqChains == 1 || (Cfg::kDeterministic && Cfg::kDqWriter && !Cfg::kFusedConvert),
                "dq_chains splits the writer warps' tickets: deterministic on, dq_writer on, no fused_convert");
  return Cfg::kBlockM * Cfg::kHeadDim * Cfg::kDqChains;
}
template <class Cfg>
__host__ __device__ constexpr int bwd_dq_counters() {
  return Cfg::kDqSemaphores * Cfg::kDqChains;
}

// The deterministic writer warps' chains start in memory nobody zeroed: each chain's ticket 0
// stores its share (bulk_store_or_add_f32), the later tickets add onto it, the preprocess
// zeroes only the counters, and the conversion reads a chain whose counter is still 0 (no
// n-block reached the m-block: rows no key reaches, a keep's empty m-blocks) as zeros.  The
// stores save the accumulator's zeroing, half of the preprocess's bytes (about 45 us of 16k
// tokens x 16 heads at head_dim 128 on an H100, per chain).  The sum is the zeroed one's
// bit for bit but for a first share's -0 (stored, 0 + -0 = +0 added: equal values) and its
// subnormals (stored, flushed by an add into 0: the store is the exact one).
template <class Cfg>
__host__ __device__ constexpr bool bwd_dq_stored_first() {
  return Cfg::kDeterministic && Cfg::kDqWriter;
}

// The writer's add of its staged share into the accumulator: a bulk store where `store` (its
// chain's first ticket, bwd_dq_stored_first), else a bulk reduce-add; the same bulk group
// either way (the waits after it name both).
__device__ __forceinline__ void bulk_store_or_add_f32(float* dst, uint32_t smem_src, uint32_t bytes, bool store) {
  if (store) {
    bulk_store_f32(dst, smem_src, bytes);
  } else {
    bulk_reduce_add_f32(dst, smem_src, bytes);
  }
}

// Share `share` of m-block m in dQ's fp32 accumulator, kDqFloats each (the consumers'
// fragment order: bwd_convert_dq_row reads it back): warpgroup wg's, or at head_dim 256
// head_dim panel `share` (warpgroup share / 2's slice share % 2); in chain `chain`'s copy of
// the m-block (`dq_chains N`; 0 otherwise).
template <class Cfg>
__device__ __forceinline__ float* dq_accum_share(const BwdParamsSm90& P, int64_t accum_head, int m, int share,
                                                 int chain = 0) {
  return P.dq_accum + (accum_head + m) * bwd_dq_block_floats<Cfg>() + chain * (Cfg::kBlockM * Cfg::kHeadDim) +
         (Cfg::kDqByKeys ? 0 : share * Cfg::kDqFloats);
}

// `dQ: rf -red.add-> gmem`: the thread's dQ registers added into the accumulator, float4 q
// at (q * 128 + tid) * 4 floats as stage_dq would have staged it (each add atomic, in the L2;
// red.global.add rounds to nearest and flushes fp32 subnormals, as the bulk reduce-add).
template <class Cfg>
__device__ __forceinline__ void red_add_dq(float* dst, const float (&dq)[Cfg::kDqRegs], int tid) {
  // the thread's first float4 once, opaque to the compiler (the empty asm), then constant
  // steps that ptxas folds into each add's immediate offset: otherwise the index arithmetic
  // is reassociated and the 64-bit address rebuilt for every add, about 5 instructions each
  // (SASS, NVRTC 13.5, 2026-11-30); where bwd_pinned_dq is off the pinned pointer
  // spilled (16 bytes, fa3_hopper's windowed and capped variant), so the index stays there
  if constexpr (bwd_pinned_dq<Cfg>()) {
    float* mine = dst + 4 * tid;
    asm("" : "+l"(mine));
#pragma unroll
    for (int q = 0; q < Cfg::kDqRegs / 4; ++q) {
      red_add_v4_f32(mine + 4 * 128 * q, dq[4 * q], dq[4 * q + 1], dq[4 * q + 2], dq[4 * q + 3]);
    }
  } else {
#pragma unroll
    for (int q = 0; q < Cfg::kDqRegs / 4; ++q) {
      red_add_v4_f32(dst + 4 * (q * 128 + tid), dq[4 * q], dq[4 * q + 1], dq[4 * q + 2], dq[4 * q + 3]);
    }
  }
}

// `deterministic on`: the reduce-adds into each warpgroup's share of the m-block's
// accumulator in ticket order place (bwd_dq_place: the n-block's place among those that add
// into the m-block, in n-block or in visit order), one counter per share; where the shares
// are one (kDqByKeys), ticket place * consumers + wg on one counter.  An order per disjoint
// share is all that bitwise-stable sums need; one order over both warpgroups made warpgroup
// 1 wait for warpgroup 0's release, a whole m-block later (0.58-0.68x the default's speed
// on an H200, 2026-11-30; per share 0.69-0.77x).  The leader waits for its ticket, issues
// and commits the add, and owes the release of ticket + 1 (release_dq_ticket): waiting here
// for the add to complete (an L2 round trip and 40 KB at head_dim 128) held the whole
// warpgroup, as its next wgmma needs every warp.
struct DqTicket {
  int* semaphore;
  int ticket;
};

template <class Cfg>
__device__ __forceinline__ void ordered_reduce_add(float* dst, uint32_t stage, int* semaphore, int ticket) {
  while (ld_acquire_gpu(semaphore) != ticket) __nanosleep(32);
  fence_proxy_async_global();  // the acquire before the async proxy's adds
  bulk_reduce_add_f32(dst, stage, Cfg::kDqFloats * 4);
  tma_store_commit();
}

// The owed release: the add completes (wait_group 0: its writes performed, not only its
// SMEM read) before the next ticket is released.  bwd_consumer calls it in the next m-block
// once S^T and dP^T are issued (the wait runs under them), or after the loop.
// Deadlock-free: a warpgroup never waits on another warpgroup or CTA while it owes a
// release.  Between the add and the release it waits only for q_full of m-block i + 1,
// whose slot was freed by the q_empty arrivals of m-block i + 1 - kStages <= i - 1: every
// warpgroup of the CTA arrives there after its own add of i - 1 at the latest (the
// overlapped order; the default arrives before its add), and every add of i - 1 was
// granted, its releases done before any warpgroup of the CTA could get the ticket of i
// (tickets rise with wg, and a warpgroup releases i - 1 before its meeting of i).  The
// release comes before the meeting at dS^T of i + 1 and before the ticket wait of i + 1,
// so warpgroup wg + 1, waiting at i for wg's release, is never waited for by wg; with one
// stage q_full of i + 1 would need the q_empty of i of warpgroup wg + 1, after its ticket:
// a cycle (hence kStages >= 2).  fadsl/targets/sm90/backward/verify.py proves it.
template <class Cfg>
__device__ __forceinline__ void release_dq_ticket(const DqTicket& owed) {
  bulk_wait_all();             // the adds performed in global memory
  fence_proxy_async_global();  // the async proxy's adds before the release
  st_release_gpu(owed.semaphore, owed.ticket + 1);
}

// The counter of share `share` of m-block m (`deterministic on`; one per m-block where the
// shares are one, kDqByKeys: the caller adds no share then), of chain `chain` (`dq_chains N`).
template <class Cfg>
__device__ __forceinline__ int* dq_semaphore_share(const BwdParamsSm90& P, int64_t accum_head, int m, int share,
                                                   int chain = 0) {
  return P.dq_semaphore + (accum_head + m) * bwd_dq_counters<Cfg>() + chain * Cfg::kDqSemaphores + share;
}

// The warpgroup's dQ of m-block m (the CTA's i-th) added into the accumulator: from registers
// (`dQ: rf -red.add-> gmem`), or stored into its staging buffer and reduce-added in bulk by
// the warpgroup's first thread (ordered by ticket with `deterministic on`: the leader then
// owes the ticket's release, `owed`), or with `dq_writer on` by its writer warp
// (bwd_dq_writer).  Both consumers'.  WAR on the staging: the previous add has read it (its
// issuer's wait_read, then the warpgroup's barrier; in deterministic mode the owed
// release's wait_group 0 came earlier in this m-block anyway; the writer's empty barrier).
template <class Cfg>
__device__ __forceinline__ void reduce_dq(const BwdParamsSm90& P, const BwdBlock& b, uint32_t stage,
                                          const float (&dq)[Cfg::kDqRegs], int64_t accum_head, int m, int wg,
                                          int tid, DqTicket& owed, int i) {
  float* dst = dq_accum_share<Cfg>(P, accum_head, m, wg);
  if constexpr (Cfg::kDqRed) {
    red_add_dq<Cfg>(dst, dq, tid);
  } else if constexpr (Cfg::kDqWriter) {
    // WAR: writer wg's reduce-add of m-block i - 1 has read the staging (its lane 0's
    // wait_group.read, __syncwarp, then its bar.arrive)
    if (i > 0) named_bar_sync(Cfg::kBarDqEmpty + wg, 160);
    stage_dq<Cfg>(stage, dq, tid);
    // RAW: the staging's st.shared (generic proxy) before the writer's bulk reduce reads it (async proxy)
    fence_proxy_async_smem();
    named_bar_arrive(Cfg::kBarDqFull + wg, 160);  // RAW: the staging handed to writer wg, which syncs on it
  } else {
    // WAR: the previous reduce-add has read the staging buffer (its issuing thread waits,
    // then the warpgroup meets)
    if (tid == 0) tma_store_wait_read<0>();
    named_bar_sync(Cfg::kBarDQ + wg, 128);
    stage_dq<Cfg>(stage, dq, tid);
    // RAW: the staging's st.shared (generic proxy) before the bulk reduce reads it (async proxy)
    fence_proxy_async_smem();
    named_bar_sync(Cfg::kBarDQ + wg, 128);
    if (tid == 0) {
      if constexpr (Cfg::kDeterministic) {
        const int place = bwd_dq_place<Cfg>(P, b, m);
        if constexpr (Cfg::kDqByKeys) {  // one counter: the warpgroups in turn
          owed.semaphore = dq_semaphore_share<Cfg>(P, accum_head, m, 0);
          owed.ticket = place * Cfg::kConsumerWGs + wg;
        } else {
          owed.semaphore = dq_semaphore_share<Cfg>(P, accum_head, m, wg);
          owed.ticket = place;
        }
        ordered_reduce_add<Cfg>(dst, stage, owed.semaphore, owed.ticket);
      } else {
        bulk_reduce_add_f32(dst, stage, Cfg::kDqFloats * 4);
        tma_store_commit();
      }
    }
  }
}

}  // namespace fadsl::sm90
