// fadsl/sm90_bwd_convert.cuh -- section 7b of fadsl/sm90_bwd.cuh (which includes it after the
// preprocess's section): `fused_convert on`, dQ converted to the input dtype by the main
// kernel, so that no convert_dq kernel runs after it (research/backward-fused-convert.md).
// Not a header of its own: include fadsl/sm90_bwd.cuh.
//
// Each (batch, head, m-block) has an int counter (P.dq_semaphore, zeroed by the preprocess).
// After its m-block loop and its dK / dV stores, every consumer thread of a CTA fences its
// dQ red.adds (fence.acq_rel.gpu: performed at GPU scope before anything after it), the
// consumers meet, and then each m-block the CTA visited gets one increment (acq_rel, by one
// consumer thread; consecutive m-blocks on consecutive warps).  The increment that makes a
// counter equal the m-block's contributors (bwd_dq_contributors: the n-blocks that visit
// it) comes last: its acquire orders every contributor's adds (each CTA's release, after
// its fences and meeting) before that thread's later reads, and its warp's __syncwarp
// passes that on to the warp's lanes, which then convert the m-block (bwd_convert_m_block,
// reading through L2).  An m-block that no n-block visits (causal, or a window, where some
// queries see no key) has no counter that completes: the host zeroes those rows of dQ
// (fadsl/targets/sm90/backward/host.py), or with `varlen on`, where the host does not know
// the sequences, the preprocess (bwd_preprocess_row).
#pragma once

namespace fadsl::sm90 {

// The convert kernel's view of the main kernel's params (P.dq set: `fused_convert on`).
__device__ __forceinline__ BwdConvertParams bwd_convert_view(const BwdParamsSm90& P) {
  BwdConvertParams c;
  c.dq_accum = P.dq_accum;
  c.dq = P.dq;
  c.dq_semaphore = nullptr;  // (fused_convert: no deterministic writer, every chain zeroed)
  c.dq_batch_stride = P.dq_batch_stride;
  c.dq_row_stride = P.dq_row_stride;
  c.dq_head_stride = P.dq_head_stride;
  c.seqlen_q = P.seqlen_q;
  c.m_blocks = P.m_blocks;
  c.heads_q = P.heads_q;
  c.softmax_scale = P.softmax_scale;
  c.cu_seqlens_q = P.cu_seqlens_q;
  c.sequences = P.sequences;
  return c;
}

// Run by every consumer thread after its warpgroup's consumer function (the kernel body).
template <class Cfg>
__device__ __forceinline__ void bwd_finish_dq(const BwdParamsSm90& P, const BwdBlock& b) {
  if constexpr (Cfg::kFusedConvert) {
    // the host launches convert_dq instead (P.dq null), or the CTA added nothing (uniform)
    if (P.dq == nullptr || b.m_count == 0) return;
    fence_acq_rel_gpu();  // RAW across CTAs: this thread's dQ red.adds performed before the counts below
    named_bar_sync(Cfg::kBarFinish, Cfg::kConsumerThreads);  // every consumer thread's fence before any count
    constexpr int kWarps = Cfg::kConsumerThreads / 32;
    const int thread = threadIdx.x - 128, warp = thread / 32, lane = thread % 32;
    // the block's first m-block among the counters and the accumulator's (varlen: its sequence's first chunk)
    const int64_t accum_head = bwd_accum_head<Cfg>(P, b);
    const int chunk0 = Cfg::kVarlen ? b.chunk0 : 0;
    int* counts = P.dq_semaphore + accum_head * Cfg::kDqSemaphores;
    const BwdConvertParams view = bwd_convert_view(P);
    for (int first = 0; first < b.m_count; first += Cfg::kConsumerThreads) {
      const int i = first + lane * kWarps + warp;  // the CTA's i-th m-block: consecutive ones on consecutive warps
      bool completes = false;
      if (i < b.m_count) {
        const int m = bwd_m_block<Cfg>(P, b, i);
        // release: the CTA's adds into m (the fences and the meeting above); acquire: the
        // other contributors' adds, where this count is the last
        completes = atomic_add_acq_rel_gpu(counts + m * Cfg::kDqSemaphores, 1) + 1 == bwd_dq_contributors<Cfg>(b, m);
      }
      unsigned owned = __ballot_sync(0xffffffffu, completes);
      __syncwarp();  // RAW: the completing lanes' acquires before every lane's reads of the sums
      while (owned != 0u) {
        const int lane_of = __ffs(owned) - 1;
        owned &= owned - 1u;
        const int m = bwd_m_block<Cfg>(P, b, first + lane_of * kWarps + warp);
        bwd_convert_m_block<Cfg>(view, b.head, b.batch, chunk0 + m, lane);
      }
    }
  }
}

}  // namespace fadsl::sm90
