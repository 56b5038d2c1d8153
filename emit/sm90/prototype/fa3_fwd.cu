// fa3_fwd.cu -- prototype of the kernel that fadsl's sm_90a target will generate: written
// as the generator will emit it, a list of tile steps (fadsl/sm90.cuh) and syncs
// (fadsl/sm90_ptx.cuh), each sync annotated with the hazard it orders.
//
// o = softmax(q k^T * softmax_scale [+ causal mask]) v, FlashAttention-3's structure:
//   warpgroup 0        producer: setmaxnreg.dec; one elected thread issues every TMA load
//   warpgroups 1..W    consumers: setmaxnreg.inc; 64 query rows each; wgmma; softmax
//   K/V ring           kStages slots, each with a full (TMA complete_tx) and an empty
//                      (consumer arrivals) mbarrier for K and for V, parity tracked per
//                      round; Q on a one-shot barrier
//   consumer schedule  FA3's intra-warpgroup overlap (S(j+1) = Q K(j+1)^T and O += P(j) V(j)
//                      in flight while softmax(j+1) runs) and inter-warpgroup ping-pong
//                      (named barriers hand the tensor cores from one warpgroup to the next)
//   epilogue           O -> 16 bits -> SMEM over the dead V ring (stmatrix) -> TMA store;
//                      LSE from registers
//
// Compile-time configuration (from -D, as the harness builds one cubin per config):
//   FA3_DTYPE  bf16 | fp16        FA3_HEAD_DIM  64 | 128 | 256
//   FA3_WGS    consumer warpgroups (1..3; B_r = 64 * FA3_WGS)
//   FA3_BLOCK_N  B_c              FA3_STAGES  ring slots      FA3_CAUSAL  0 | 1
// Launch: grid (cdiv(seqlen_q, B_r), heads_q, batch), block Cfg::kThreads, dynamic SMEM
// Cfg::kSmemBytes; any seqlen_q, seqlen_k >= 1.
#include "fadsl/sm90.cuh"

#ifndef FA3_DTYPE
#define FA3_DTYPE bf16
#endif
#ifndef FA3_HEAD_DIM
#define FA3_HEAD_DIM 128
#endif
#ifndef FA3_WGS
#define FA3_WGS 2
#endif
#ifndef FA3_BLOCK_N
#define FA3_BLOCK_N 128
#endif
#ifndef FA3_STAGES
#define FA3_STAGES 2
#endif
#ifndef FA3_CAUSAL
#define FA3_CAUSAL 0
#endif

#define FA3_TYPE_bf16 __nv_bfloat16
#define FA3_TYPE_fp16 half
#define FA3_CAT(a, b) a##b
#define FA3_TYPE(name) FA3_CAT(FA3_TYPE_, name)

using namespace fadsl::sm90;
using Cfg = FwdConfig<FA3_TYPE(FA3_DTYPE), FA3_HEAD_DIM, FA3_WGS, FA3_BLOCK_N, FA3_STAGES, FA3_CAUSAL != 0>;

// Read by the harness (cuModuleGetGlobal) so that host and device agree on the launch.
extern "C" __device__ const int fa3_launch_info[4] = {Cfg::kThreads, Cfg::kSmemBytes, Cfg::kBlockM, Cfg::kBlockN};

static_assert(sizeof(FwdParamsSm90) == 768 && alignof(CUtensorMap) == 128 && sizeof(fadsl::FwdParams) == 176,
              "host mirror of FwdParamsSm90 (scripts/sm90_proto.py)");

extern "C" __global__ void __launch_bounds__(Cfg::kThreads, 1) fa3_fwd(const __grid_constant__ FwdParamsSm90 P) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t smem = (smem_u32(smem_raw) + 1023u) & ~1023u;  // the 128-byte swizzle repeats every 1024 bytes
  const uint32_t smem_q = smem + Cfg::kOffQ;
  const uint32_t bar_q_full = smem + Cfg::kOffBar;
  auto k_slot = [&](int s) { return smem + Cfg::kOffK + s * Cfg::kKVBytes; };
  auto v_slot = [&](int s) { return smem + Cfg::kOffV + s * Cfg::kKVBytes; };
  auto bar_k_full = [&](int s) { return smem + Cfg::kOffBar + 8 * (1 + 4 * s); };
  auto bar_k_empty = [&](int s) { return smem + Cfg::kOffBar + 8 * (2 + 4 * s); };
  auto bar_v_full = [&](int s) { return smem + Cfg::kOffBar + 8 * (3 + 4 * s); };
  auto bar_v_empty = [&](int s) { return smem + Cfg::kOffBar + 8 * (4 + 4 * s); };

  const int warpgroup = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;  // within the warpgroup
  const int lane = threadIdx.x % 32;
  const TileCoord tile = {Cfg::kCausal ? static_cast<int>(gridDim.x - 1 - blockIdx.x) : static_cast<int>(blockIdx.x),
                          static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};  // one CTA per tile
  const TileWork w = tile_work<Cfg>(P, tile);

  if (threadIdx.x == 0) {
    tma_prefetch_desc(&P.tma_q);
    tma_prefetch_desc(&P.tma_k);
    tma_prefetch_desc(&P.tma_v);
    tma_prefetch_desc(&P.tma_o);
    mbar_init(bar_q_full, 1);  // the producer's arrive.expect_tx
    for (int s = 0; s < Cfg::kStages; ++s) {
      mbar_init(bar_k_full(s), 1);
      mbar_init(bar_v_full(s), 1);
      mbar_init(bar_k_empty(s), Cfg::kConsumerWarps);  // lane 0 of each consumer warp
      mbar_init(bar_v_empty(s), Cfg::kConsumerWarps);
    }
    // hazard: mbarrier.init before complete_tx from the async proxy
    fence_mbarrier_init();
  }
  // hazard: mbarrier.init (thread 0) before every arrive/wait of the other threads
  __syncthreads();

  if (warpgroup == 0) {
    // ===================== producer warpgroup =====================
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0 && elect_one() && w.n_blocks > 0) {
      RingPos<Cfg::kStages> kpos, vpos;
      // Q: its bytes complete q_full's phase 0.
      mbar_arrive_expect_tx(bar_q_full, Cfg::kQBytes);
      load_q<Cfg>(P, smem_q, bar_q_full, w);
      // K of the first block (n_blocks - 1).
      // hazard WAR: consumers' S wgmma of the slot's previous round done before TMA overwrites it
      mbar_wait_parity(bar_k_empty(kpos.slot), kpos.phase ^ 1u);
      mbar_arrive_expect_tx(bar_k_full(kpos.slot), Cfg::kKVBytes);
      load_kv<Cfg>(&P.tma_k, k_slot(kpos.slot), bar_k_full(kpos.slot), w.n_blocks - 1, w);
      kpos.advance();
      for (int it = 1; it < w.n_blocks; ++it) {
        // K(it) one block ahead of V(it - 1): the consumers' S(it) overlaps their P V(it - 1).
        // hazard WAR: S wgmma reading this K slot (previous round) complete
        mbar_wait_parity(bar_k_empty(kpos.slot), kpos.phase ^ 1u);
        mbar_arrive_expect_tx(bar_k_full(kpos.slot), Cfg::kKVBytes);
        load_kv<Cfg>(&P.tma_k, k_slot(kpos.slot), bar_k_full(kpos.slot), w.n_blocks - 1 - it, w);
        kpos.advance();
        // hazard WAR: P V wgmma reading this V slot (previous round) complete
        mbar_wait_parity(bar_v_empty(vpos.slot), vpos.phase ^ 1u);
        mbar_arrive_expect_tx(bar_v_full(vpos.slot), Cfg::kKVBytes);
        load_kv<Cfg>(&P.tma_v, v_slot(vpos.slot), bar_v_full(vpos.slot), w.n_blocks - it, w);
        vpos.advance();
      }
      // hazard WAR: P V wgmma reading this V slot (previous round) complete
      mbar_wait_parity(bar_v_empty(vpos.slot), vpos.phase ^ 1u);
      mbar_arrive_expect_tx(bar_v_full(vpos.slot), Cfg::kKVBytes);
      load_kv<Cfg>(&P.tma_v, v_slot(vpos.slot), bar_v_full(vpos.slot), 0, w);
    }
  } else {
    // ===================== consumer warpgroups =====================
    setmaxnreg_inc<Cfg::kConsumerRegs>();
    const int wg = warpgroup - 1;
    const uint32_t smem_q_wg = smem_q + wg * 64 * Cfg::kRowBytes;
    const RowLimits rows = row_limits<Cfg>(w, wg, warp, lane);
    const float scale_log2 = P.base.softmax_scale * 1.4426950408889634f;
    const uint32_t sched_bar = Cfg::kBarSched + wg;                           // my turn
    const uint32_t sched_bar_next = Cfg::kBarSched + (wg + 1) % Cfg::kConsumerWGs;  // hand over
    constexpr bool kPingPong = Cfg::kConsumerWGs > 1;

    float o[Cfg::kORegs];
    float s[Cfg::kSRegs];
    uint32_t p[Cfg::kPRegs];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, scale[2] = {1.f, 1.f};
#pragma unroll
    for (int i = 0; i < Cfg::kORegs; ++i) o[i] = 0.f;

    if (w.n_blocks > 0) {
      RingPos<Cfg::kStages> kpos, vpos;
      // The last warpgroup opens the first turn of warpgroup 0.
      if (kPingPong && wg == Cfg::kConsumerWGs - 1) named_bar_arrive(Cfg::kBarSched + 0, Cfg::kSchedThreads);

      // ---- first block: S = Q K^T, softmax (no P V yet) ----
      // hazard RAW: Q tile landed (TMA complete_tx)
      mbar_wait_parity(bar_q_full, 0);
      // hazard RAW: K(0) landed in its slot
      mbar_wait_parity(bar_k_full(kpos.slot), kpos.phase);
      // ping-pong: wait for this warpgroup's turn on the tensor cores
      if (kPingPong) named_bar_sync(sched_bar, Cfg::kSchedThreads);
      // wgmma fence: first wgmma of the warpgroup
      wgmma_fence();
      issue_qk<Cfg>(s, smem_q_wg, k_slot(kpos.slot));
      wgmma_commit();
      // ping-pong: hand the tensor cores to the next warpgroup
      if (kPingPong) named_bar_arrive(sched_bar_next, Cfg::kSchedThreads);
      // hazard RAW: S accumulators complete before softmax reads them
      wgmma_wait<0>();
      fence_regs(s);
      // hazard WAR: this warp's S wgmma has read the K slot; the producer may refill it
      if (lane == 0) mbar_arrive(bar_k_empty(kpos.slot));
      kpos.advance();
      if (w.n_masked > 0) mask_scores<Cfg>(s, P.base, rows, w.n_blocks - 1, lane);
      online_softmax<Cfg>(s, m, l, scale, scale_log2);
      convert_p<Cfg>(s, p);

      // ---- blocks it = 1 .. n_blocks-1: S(it) and P(it-1) V(it-1) in flight together ----
      auto iteration = [&](int it, auto mask_tag) {
        constexpr bool kMask = decltype(mask_tag)::value;
        // hazard RAW: K(it) landed in its slot
        mbar_wait_parity(bar_k_full(kpos.slot), kpos.phase);
        // ping-pong: this warpgroup's turn on the tensor cores
        if (kPingPong) named_bar_sync(sched_bar, Cfg::kSchedThreads);
        // wgmma fence: P registers written by convert_p since the last wgmma
        wgmma_fence();
        issue_qk<Cfg>(s, smem_q_wg, k_slot(kpos.slot));
        wgmma_commit();  // group: S(it)
        rescale_o<Cfg>(o, scale);  // O is in no wgmma now (the previous P V completed)
        // hazard RAW: V(it-1) landed in its slot
        mbar_wait_parity(bar_v_full(vpos.slot), vpos.phase);
        // wgmma fence: O registers rescaled since the last wgmma
        wgmma_fence();
        issue_pv<Cfg>(o, p, v_slot(vpos.slot));
        wgmma_commit();  // group: O += P(it-1) V(it-1)
        // ping-pong: hand the tensor cores to the next warpgroup
        if (kPingPong) named_bar_arrive(sched_bar_next, Cfg::kSchedThreads);
        // hazard RAW: S(it) complete (the P V group may still run)
        wgmma_wait<1>();
        fence_regs(s);
        // hazard WAR: this warp's S wgmma has read the K slot; the producer may refill it
        if (lane == 0) mbar_arrive(bar_k_empty(kpos.slot));
        kpos.advance();
        if constexpr (kMask) mask_scores<Cfg>(s, P.base, rows, w.n_blocks - 1 - it, lane);
        online_softmax<Cfg>(s, m, l, scale, scale_log2);
        // hazard RAW/WAR: P V complete: O readable, P registers and the V slot free
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(p);
        // hazard WAR: this warp's P V wgmma has read the V slot; the producer may refill it
        if (lane == 0) mbar_arrive(bar_v_empty(vpos.slot));
        vpos.advance();
        convert_p<Cfg>(s, p);
      };
      int it = 1;
      for (; it < w.n_masked; ++it) iteration(it, std::true_type{});
      for (; it < w.n_blocks; ++it) iteration(it, std::false_type{});

      // ---- last P V ----
      rescale_o<Cfg>(o, scale);
      // hazard RAW: V(n_blocks-1) landed in its slot
      mbar_wait_parity(bar_v_full(vpos.slot), vpos.phase);
      if (kPingPong) named_bar_sync(sched_bar, Cfg::kSchedThreads);
      // wgmma fence: O and P registers written since the last wgmma
      wgmma_fence();
      issue_pv<Cfg>(o, p, v_slot(vpos.slot));
      wgmma_commit();
      if (kPingPong) named_bar_arrive(sched_bar_next, Cfg::kSchedThreads);
      // hazard RAW: O complete before the epilogue reads it
      wgmma_wait<0>();
      fence_regs(o);
      // hazard WAR: V slot read (keeps the ring protocol whole; no further load waits on it)
      if (lane == 0) mbar_arrive(bar_v_empty(vpos.slot));
      // ping-pong: warpgroup 0 takes the last warpgroup's final hand-over, so that every
      // bar.arrive is matched by a bar.sync
      if (kPingPong && wg == 0) named_bar_sync(Cfg::kBarSched + 0, Cfg::kSchedThreads);
    }

    // ---- epilogue ----
    row_sum_quad(l);
    store_lse<Cfg>(P.base, w, rows, m, l, scale_log2, lane);
    normalize_o<Cfg>(o, l);
    const uint32_t smem_o_wg = smem + Cfg::kOffO + wg * 64 * Cfg::kRowBytes;
    // hazard WAR: every consumer warpgroup's last wgmma has read the K/V rings that O overwrites
    named_bar_sync(Cfg::kBarRingDead, Cfg::kConsumerThreads);
    store_o_smem<Cfg>(o, smem_o_wg, warp, lane);
    // hazard RAW across proxies: stmatrix (generic proxy) before the TMA store reads SMEM (async proxy)
    fence_proxy_async_smem();
    // hazard RAW: all 128 threads' O rows in SMEM before one thread issues the TMA store
    named_bar_sync(Cfg::kBarOStore + wg, 128);
    if (warp == 0 && elect_one()) {
      store_o_tma<Cfg>(P, smem_o_wg, w, wg);
      tma_store_commit();
      // hazard: SMEM stays allocated until the TMA store has read it (CTA exit)
      tma_store_wait_read<0>();
    }
  }
}
