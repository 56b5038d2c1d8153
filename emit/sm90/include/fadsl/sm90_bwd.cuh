// fadsl/sm90_bwd.cuh -- the sm_90a backward pass (docs/backward.md): three kernels per spec.
//
//   preprocess   head_dim / 8 threads per query row: D = rowsum(dO * O) (FlashAttention's dPsum), the
//                forward's LSE in log2 units (+inf for a row that saw no key, so that its
//                P is exp2(-inf) = 0, not NaN), and the row's share of dQ's fp32
//                accumulator zeroed.  Rows up to seqlen_q rounded to B_r get D = 0, LSE +inf.
//   main         one CTA per (n-block of B_c keys, query head, batch): a producer warp
//                loads K and V once and streams Q, dO, LSE and D through a ring of m-blocks
//                (B_r queries); each consumer warpgroup owns 64 keys of the n-block and, per
//                m-block, computes (keys on wgmma's M, so that P^T and dS^T come out in the
//                layout of the next GEMMs' A operand, registers):
//                  S^T = K Q^T,  dP^T = V dO^T                      (SS wgmma)
//                  P^T = exp2(S^T c log2e - LSE log2e),  dS^T = P^T (dP^T - D)
//                  dV += P^T dO,  dK += dS^T Q                      (RS wgmma)
//                  dQ = dS K  (dS^T through SMEM; SS wgmma)          -> reduce-added in fp32
//                dK (times softmax_scale) and dV are stored at the end from registers.
//   convert_dq   dQ's accumulator (fp32, the consumers' fragment order) times softmax_scale
//                -> dQ in the input dtype, a warp per pair of rows 8 apart.
//
// dQ's split between the consumer warpgroups, each computing 64 queries (wgmma's M): by
// queries where B_r is 64 per warpgroup (head_dim 64, B_r 128: warpgroup w computes queries
// 64w..64w+63, every column, over all B_c keys); else by head_dim panels where each
// warpgroup's share is whole 64-column panels (head_dim 128, B_r 64: warpgroup w computes
// columns 64w..64w+63 over all B_c keys); else by keys (head_dim 64, B_r 64: each warpgroup
// computes all columns over its own 64 keys, and both reduce-add into the same
// accumulator; no cross-warpgroup barrier).  Split by queries or panels, both warpgroups
// meet on dS^T first, and each warpgroup's reduce-add covers its own part of the m-block:
// half the bytes of the split by keys.  The reduce-add is one bulk
// cp.reduce.async.bulk .add.f32 per warpgroup and m-block, issued by the warpgroup's first
// thread from a staging buffer (SMEM -> global, atomic per element, in the L2).
//
// dS^T in SMEM: rows = the n-block's B_c keys, the B_r queries in 64-query panels of one
// 128-byte swizzled row each (panel p of kDSPanelBytes holds queries 64p..64p+63).
//
// Numerics: LSE >= every score of its row (it is their log-sum-exp), so S c - LSE <= 0
// up to rounding and P = 2^(S c log2e - LSE log2e) lies in [0, 1 + a few ulp]: no rescale,
// no factor that can leave fp32's normal range; 2^x of x below -126 is flushed to 0 (a true
// value under 2^-126 of a probability).  Keys past seqlen_k read zero rows of K and V but
// are masked anyway: their P = 2^(-LSE log2e) could be inf for a row of very negative
// scores.  Queries past seqlen_q have LSE = +inf (P = 0) and D = 0.
//
// Every wait, arrive, barrier and fence below says what it orders.
#pragma once

#include "sm90.cuh"  // FastDiv, the PTX wrappers, wgmma (next to this file)
#include "sm90_bwd_trace.cuh"  // FADSL_BWD_MARK: empty unless FADSL_BWD_TRACE (development builds)
#include "sm90_bwd_modifiers.cuh"  // score and mask modifiers (issue 41): under if constexpr only
#include "sm90_bwd_learn.cuh"  // the learnable inputs' gradients (issue 41): under if constexpr only

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 1. Parameters
// ---------------------------------------------------------------------------

struct BwdParamsSm90 {
  CUtensorMap tma_q;   // box 64 x B_r
  CUtensorMap tma_k;   // box 64 x B_c
  CUtensorMap tma_v;   // box 64 x B_c
  CUtensorMap tma_do;  // box 64 x B_r
  const float* lse_log2;  // (batch, heads_q, seqlen_q_rounded): LSE log2 e, +inf for no key
  const float* dpsum;     // (batch, heads_q, seqlen_q_rounded): D = rowsum(dO * O)
  float* dq_accum;        // (batch, heads_q, m_blocks, B_r x head_dim), fragment order
  void* dk;               // (batch, seqlen_k, heads, head_dim): T, or fp32 (dkv_store)
  void* dv;
  int* dq_semaphore;  // `deterministic on`: per (batch, head, m-block, share), the reduce-adds done;
                     // `fused_convert on`: share 0's, the n-blocks done (sm90_bwd_convert.cuh)
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;  // elements
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int seqlen_q, seqlen_k, seqlen_q_rounded, m_blocks;
  int heads_q, group;  // query heads, query heads per K/V head
  int dkv_store;       // DkvStore: how dK and dV leave the CTA
  float scale_log2;    // softmax_scale log2 e
  float softmax_scale;
  // `deterministic on`: 1 where an m-block's tickets follow the order in which the n-blocks
  // reach it rather than the n-block order (bwd_in_visit_order): causal at any length (its
  // n-blocks launched last first), without a mask where the host found every n-block of a
  // (batch, head) able to run at once
  int dq_in_visit_order;
  // `varlen on` (null otherwise): batch 1 of packed rows; seqlen_q / seqlen_k are the
  // tokens, and (lse_log2, dpsum, dq_accum, dq_semaphore) hold each sequence's queries from
  // its own padded row (bwd_first_slot), m_blocks per head counting the padding
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int sequences;
  // score and mask modifiers (issue 41; zeros otherwise): the spec's `input` tensors in their
  // declared order, contiguous, read-only (fadsl/sm90_bwd_modifiers.cuh), and the batch
  // size, which an expression may read (`batch`)
  const void* inputs[8];
  int batch;
  // kLearn: the learnable inputs' gradients, fp32, zeroed (fadsl/targets/sm90/learn.py's order),
  // and per (batch, head, padded query row) Modifiers::kLearnRow floats for D's rounding's
  // correction (fadsl/sm90_bwd_learn.cuh: sum dS' from -dLSE, then each read's W), the host's
  float* input_grads;
  float* learn_rows;
  // `fused_convert on` (0 otherwise, and where the host launches convert_dq): dQ in the input
  // dtype, written by the CTA whose adds complete an m-block (fadsl/sm90_bwd_convert.cuh),
  // and its strides in elements; dq_semaphore then counts each m-block's n-blocks done
  void* dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  // dK and dV stored by TMA from the dead K and V tiles (16-bit, one K/V head per query
  // head; zeros otherwise): boxes of 64 columns x 64 key rows, a consumer warpgroup's
  CUtensorMap tma_dk;
  CUtensorMap tma_dv;
};

// BwdParamsSm90::dkv_store.  GQA's query heads of one K/V head each hold part of its dK and
// dV: added into fp32 accumulators per K/V head (red.add: the order of the group's adds
// varies), or with `deterministic on` stored in fp32 per query head and summed over the
// group after the kernel in a fixed order (the host's).
enum DkvStore : int {
  kDkvStoreT = 0,        // T per K/V head (no GQA)
  kDkvStorePartial = 1,  // fp32 per query head
  kDkvAddFp32 = 2,       // fp32 per K/V head, red.add (zeroed by the host)
};

struct BwdPrepParams {
  const void* o;
  const void* dout;
  const float* lse;   // the forward's, natural log
  const float* dlse;  // the LSE's own gradient (same strides as lse), or null
  float* lse_log2;
  float* dpsum;
  float* dq_accum;
  int* dq_semaphore;  // zeroed here (null unless `deterministic on` or a fused conversion)
  int64_t o_batch_stride, o_row_stride, o_head_stride;  // elements
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t lse_batch_stride, lse_head_stride;
  int seqlen_q, seqlen_q_rounded, heads_q;
  const int* cu_seqlens_q;  // `varlen on` (null otherwise): BwdParamsSm90's
  int sequences;
  // `varlen on`: the gradients the later kernels write in place, rows of q_row_bytes (dq) and
  // k_row_bytes (dk, dv; null where the main kernel adds into fp32 accumulators instead),
  // zeroed here outside every sequence (bwd_zero_outside)
  void* dq;
  void* dk;
  void* dv;
  const int* cu_seqlens_k;
  int tokens_k, q_row_bytes, k_row_bytes;
};

static_assert(sizeof(BwdParamsSm90) == 1152, "BwdParamsSm90's layout is fadsl/targets/sm90/backward/host.py's");
// (NVRTC 13.0 has no __builtin_offsetof; nvcc's host compile of this header checks it:
// tests/test_varlen_backward_chunks.py)
#if !defined(__CUDACC_RTC__)
static_assert(__builtin_offsetof(BwdParamsSm90, sequences) == 664 && __builtin_offsetof(BwdParamsSm90, inputs) == 672 &&
                  __builtin_offsetof(BwdParamsSm90, batch) == 736 && __builtin_offsetof(BwdParamsSm90, input_grads) == 744 &&
                  __builtin_offsetof(BwdParamsSm90, learn_rows) == 752,
              "the modifiers' fields where fadsl/targets/sm90/backward/host.py packs them (MODIFIERS_OFFSET)");
static_assert(__builtin_offsetof(BwdParamsSm90, dq) == 760 && __builtin_offsetof(BwdParamsSm90, dq_head_stride) == 784,
              "fused_convert's fields where fadsl/targets/sm90/backward/host.py packs them (FUSED_OFFSET)");
#endif

struct BwdConvertParams {
  const float* dq_accum;
  void* dq;
  // the deterministic writer's counters (bwd_dq_stored_first: a chain whose count is 0 was
  // never stored into, bwd_dq_written); null otherwise
  const int* dq_semaphore;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;  // elements
  int seqlen_q, m_blocks, heads_q;
  float softmax_scale;
  const int* cu_seqlens_q;  // `varlen on` (null otherwise): BwdParamsSm90's
  int sequences;
};
static_assert(sizeof(BwdPrepParams) == 208 && sizeof(BwdConvertParams) == 80,
              "the host's layouts (fadsl/targets/sm90/backward/host.py)");

// ---------------------------------------------------------------------------
// 2. Configuration
// ---------------------------------------------------------------------------

template <class T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kConsumerWGs_, int kStages_, bool kCausal_,
          bool kDeterministic_ = false, bool kOverlap_ = false, bool kEarlyDv_ = false, bool kDqRed_ = false>
struct BwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // queries per m-block
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  // dQ's reduce-adds of an m-block in a fixed order (n-block, then warpgroup): bitwise-
  // identical gradients from run to run (ordered_reduce_add)
  static constexpr bool kDeterministic = kDeterministic_;
  // dQ issued before dV and dK and staged while they run (bwd_consumer's overlapped order)
  static constexpr bool kOverlap = kOverlap_;
  // dV += P^T dO issued as soon as P^T is packed, before dP^T is waited for (the overlapped
  // order): its wgmma runs under the softmax gradient, the dS^T stores and the meeting
  static constexpr bool kEarlyDv = kEarlyDv_;
  // `dQ: rf -red.add-> gmem`: each thread adds its dQ share into the accumulator from its
  // registers (red_add_dq), no staging; else staged in SMEM for one bulk reduce-add
  static constexpr bool kDqRed = kDqRed_;
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");
  // head_dim 256: dK and dV of 64 keys over every column would take 256 fp32 registers a
  // thread, so the consumer warpgroups split head_dim instead of the keys (FlashAttention-3's
  // 64 x 80 tile): warpgroup w holds dK^T and dV^T of all B_c keys for head_dim panels 2w
  // and 2w + 1, S and dP of its B_c / 2 keys, P and dS go through SMEM (sm90_bwd_split.cuh)
  static constexpr bool kSplitHeadDim = kHeadDim == 256;
  // B_r 128: 64 queries of dQ per consumer warpgroup; S^T and dP^T of 128 queries (64 + 64
  // fp32 registers) fit beside dK and dV at head_dim 64 only.  B_r 80: dQ computed
  // transposed (kDqTransposed), one 64-column panel of head_dim per consumer warpgroup.
  static_assert(kBlockM == 64 || (kBlockM == 128 && kConsumerWGs == 2 && kHeadDim == 64) ||
                    (kBlockM == 80 && kConsumerWGs == 2 && kHeadDim == 128),
                "B_r 64, 128 with 2 consumer warpgroups at head_dim 64, or 80 with 2 at head_dim 128");
  static_assert(kSplitHeadDim ? kConsumerWGs == 2 && (kBlockN == 64 || kBlockN == 80) : kBlockN == 64 * kConsumerWGs,
                "each consumer warpgroup owns 64 keys; at head_dim 256 two own B_c 64 or 80 between them");
  static_assert(!kSplitHeadDim || (kBlockM == 64 && kDqRed && !kOverlap && !kDeterministic),
                "head_dim 256: B_r 64, dQ added from registers (no room for its staging), the plain order");
  static_assert(kStages >= 1, "at least one ring slot");
  static_assert(!kEarlyDv || kOverlap, "the early dV is the overlapped consumer's");
  static_assert(!kDqRed || !kDeterministic, "the ordered adds go through the staging");
  // release_dq_ticket's deferral is deadlock-free with a ring of 2 or more (its comment); the
  // writer warps release in the same m-block, but the proof has not been run with 1 stage
  static_assert(!kDeterministic || kStages >= 2, "deterministic on is proven with 2 stages or more");
  // A sliding window (a generated Cfg sets both; right 0 with the causal mask): query i sees
  // key j iff i + d - kWindowLeft <= j <= i + d + kWindowRight, d = seqlen_k - seqlen_q. -1:
  // no window.  `softcap N` (a generated Cfg sets it): the forward's scores were capped by
  // N tanh(s softmax_scale / N), so P is recomputed from the capped scores and dS carries
  // the cap's derivative 1 - tanh^2.  0: off.
  static constexpr int kWindowLeft = -1;
  static constexpr int kWindowRight = -1;
  static constexpr float kSoftcap = 0.f;
  // `longest_first on` (a generated Cfg sets it; the causal mask only): CTAs launch by L2
  // sections (bwd_block): a section's (head, batch) pairs share the L2 for their Q, dO and dQ
  // accumulator, and inside a section the n-block is slowest, so its n-block 0 (the most
  // m-blocks) starts first and the shortest come last; off: blockIdx as is (n fastest, head
  // by head).
  static constexpr bool kLongestFirst = false;
  // `dv_before_meeting on` (a generated Cfg sets it; with kOverlap, not with kEarlyDv): dV
  // issued once dS^T is stored (FlashAttention-3's order), in a wgmma group of its own, so
  // that it runs under the warpgroups' meeting, where no product is queued otherwise
  static constexpr bool kDvBeforeMeeting = false;
  // `dq_lag on` (a generated Cfg sets it, with kNumBars 4 more for ds_full and ds_empty per
  // dS^T buffer; with kOverlap and dQ by red.add only): dQ(i - 1) issued in m-block i, after
  // dV(i), so that the warpgroups never meet (bwd_consumer_lagged, fadsl/sm90_bwd_lag.cuh)
  static constexpr bool kDqLag = false;
  // `dq_first on` (a generated Cfg sets it, with kDqLag): dQ(i - 1) issued before dV(i), in a
  // group of its own, so that its adds run under dV(i) and dK(i)
  static constexpr bool kDqFirst = false;
  // `dq_writer on` (a generated Cfg sets it; dQ staged in shares of its own, not kDqByKeys):
  // warp 1 + w of the producer warpgroup reduce-adds consumer w's staging (bwd_dq_writer),
  // with the ticket's acquire and release in deterministic mode, so that the consumer
  // waits for neither (research/backward-dq-writer.md)
  static constexpr bool kDqWriter = false;
  // `dq_chains N` (a generated Cfg sets it; with kDeterministic and kDqWriter): each (m-block,
  // share) accumulator and counter N times, place p adding into chain p mod N after place
  // p - N, so that a writer waits for the add N places back rather than the one before; the
  // conversion sums the chains in chain order (bwd_dq_writer, load_dq_chains)
  static constexpr int kDqChains = 1;
  // `dS: rf -stmatrix-> smem[cta]` (a generated Cfg sets it; not where dQ is transposed or
  // head_dim split, whose dS stores are stmatrix .trans already): dS^T's 8 x 8 blocks stored
  // by stmatrix, four an instruction (store_ds_stmatrix), the bytes store_ds's st.shared write
  static constexpr bool kDsStmatrix = false;
  // `dK: rf -stmatrix-> smem[warpgroup] -tma-> gmem` and dV's alike (a generated Cfg sets it;
  // with kDqLag, one tile per CTA): each consumer warpgroup stages its rows in the dead V,
  // then K tile and its thread 0 stores them by TMA (bwd_consumer_lagged's epilogue)
  static constexpr bool kDkvTma = false;
  // `prefetch_kv on` (a generated Cfg sets it; one tile per CTA): the producer fetches the K
  // and V tiles of the CTA launched a wave after this one into the L2 (bwd_prefetch_later_kv)
  static constexpr bool kPrefetchKv = false;
  // `dv_out_first on` (a generated Cfg sets it, with kDkvTma): dV staged in its dead V rows
  // and stored by TMA before the last m-block's dQ, its store under that dQ's wgmma and adds
  static constexpr bool kDvOutFirst = false;
  // `peel_dead on` (a generated Cfg sets it, with kDqLag): a warpgroup whose keys are all
  // masked in the tile's first m-block peels it (bwd_first_block_dead): no product, its dS^T
  // rows handed over as zeros
  static constexpr bool kPeelDead = false;
  // `late_v on` (a generated Cfg sets it, with kDqLag and kNumBars one more, one tile per
  // CTA): V loaded after the first m-block's ring slot, on a barrier of its own
  // (bwd_load_v_late), waited before each warpgroup's first dP^T and after its loop
  static constexpr bool kLateV = false;
  // `varlen on` (a generated Cfg sets it): packed sequences, cu_seqlens in the params; a CTA
  // per (n-block slot, query head) over the packed keys (bwd_block)
  static constexpr bool kVarlen = false;
  // Score and mask modifiers (issue 41; a generated Cfg sets them and `using Modifiers` to its
  // SpecModifiers, fadsl/sm90_bwd_modifiers.cuh): kScore, P from the modified score; kScoreGrad,
  // dS times d score / d s (not the constant 1); kKeep, keep's -inf in the m-blocks its tile
  // rule does not class FULL, the EMPTY ones off both ends of the range (bwd_keep_trim)
  static constexpr bool kScore = false;
  static constexpr bool kScoreByDistance = false;  // s + f(q_idx - kv_idx): f once a distance a warp meets
  static constexpr bool kScoreGrad = false;
  static constexpr bool kKeep = false;
  // `scheduler persistent` (a generated Cfg sets it, with kNumBars one more for kv_empty):
  // about one CTA per SM, each running the roles once per tile (sm90_bwd_persistent.cuh)
  static constexpr bool kPersistent = false;
  // kLearn: the gradients of the score's learnable inputs into P.input_grads (the runtime's
  // variant of a spec's backward for inputs that require grad; fadsl/sm90_bwd_learn.cuh)
  static constexpr bool kLearn = false;
  // `fused_convert on` (a generated Cfg sets it; dQ by red.add, not deterministic, persistent,
  // packed or with keep): after its dK and dV stores the CTA counts itself done for each
  // m-block it visited, and the CTA that completes an m-block converts its dQ (no convert_dq
  // kernel where the host passes P.dq; fadsl/sm90_bwd_convert.cuh)
  static constexpr bool kFusedConvert = false;

  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  // dQ = dS K by queries where B_r has 64 per warpgroup, else by whole head_dim panels per
  // warpgroup, else by keys (see the header).  A warpgroup's dQ is 64 queries (wgmma's M).
  // Where B_r is not a multiple of 64 (wgmma's M), dQ^T = K^T dS^T instead: head_dim panel
  // wg on M, the B_r queries on N, over all B_c keys; dS then lies with the queries as rows
  // (keys contiguous, one 64-key panel per warpgroup), stored transposed by stmatrix.
  static constexpr bool kDqTransposed = kBlockM % 64 != 0;
  static constexpr bool kDqByQueries = kBlockM == 128;
  static constexpr bool kDqByKeys = !kDqByQueries && !kDqTransposed && (kHeadDim / kConsumerWGs) % 64 != 0;
  static constexpr bool kDqAllCols = kDqByKeys || kDqByQueries;
  // `deterministic on`: one ticket counter per (m-block, warpgroup share) where the shares
  // are disjoint (each warpgroup's adds ordered only among the n-blocks'), one per m-block
  // where every warpgroup adds into all of it (kDqByKeys: ordered by n-block, then wg)
  static constexpr int kDqSemaphores = kDqByKeys ? 1 : kConsumerWGs;
  static constexpr int kDqCols = kDqAllCols ? kHeadDim : kHeadDim / kConsumerWGs;  // wgmma N (transposed: M)
  static constexpr int kDqKeys = kDqByKeys ? 64 : kBlockN;                         // wgmma K
  // one warpgroup's share of an m-block (staged or added): 64 queries x kDqCols, or
  // (transposed) 64 head_dim columns x B_r queries
  static constexpr int kDqFloats = kDqTransposed || kSplitHeadDim ? 64 * kBlockM : 64 * kDqCols;
  static_assert(!kDqTransposed || kHeadDim == 64 * kConsumerWGs, "a 64-column panel of dQ^T per warpgroup");

  static constexpr int kKeysPerWG = kBlockN / kConsumerWGs;     // 64 (head_dim 256: 40 or 32)
  static constexpr int kSRegs = kKeysPerWG * kBlockM / 128;      // S^T, dP^T: the warpgroup's keys x B_r, fp32
  static constexpr int kPRegs = kSRegs / 2;                      // P^T, dS^T: 16-bit pairs
  static constexpr int kAccRegs = kKeysPerWG * kHeadDim / 128;   // dK, dV: 64 keys x head_dim (or B_c x 128), fp32
  static constexpr int kAccPanelRegs = 64 * kBlockN / 128;       // head_dim 256: one panel of dK^T or dV^T
  static constexpr int kDqRegs = kDqFloats / 128;

  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kRowBytes = 128;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;  // one ring slot of Q or of dO
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
  static constexpr int kDSBytes = kBlockN * kBlockM * 2;  // rows = keys, B_r queries each
  // a panel: 64 queries of every key row (transposed: 64 keys of every query row)
  static constexpr int kDSPanelBytes = kDqTransposed ? kBlockM * kRowBytes : kBlockN * kRowBytes;
  static constexpr int kRowFloatsBytes = kBlockM * 4;     // one slot of LSE or of D
  // head_dim 256: dO and D in a ring of their own of one slot, with barriers of their own (a
  // second slot, or a Q/dO ring of two, does not fit beside K, V, Q's two slots, P and dS);
  // P in SMEM too, rows = the B_c keys (as dS), double-buffered
  static constexpr int kDoStages = kSplitHeadDim ? 1 : kStages;
  static constexpr int kPBytes = kSplitHeadDim ? kDSBytes : 0;

  // SMEM plan (a generated Cfg sets these from fadsl/targets/sm90/backward/plan_smem.py)
  static constexpr int kOffK = 0;
  static constexpr int kOffV = kOffK + kKVBytes;
  static constexpr int kOffQ = kOffV + kKVBytes;
  static constexpr int kOffDO = kOffQ + kStages * kQBytes;
  static constexpr int kOffP = kOffDO + kDoStages * kQBytes;
  static constexpr int kOffDS = kOffP + 2 * kPBytes;
  static constexpr int kOffDQ = kOffDS + 2 * kDSBytes;
  static constexpr int kDqStageBytes = kDqRed ? 0 : kConsumerWGs * kDqFloats * 4;  // none with red.add
  static constexpr int kOffLSE = kOffDQ + kDqStageBytes;
  static constexpr int kOffD = kOffLSE + kStages * kRowFloatsBytes;
  static constexpr int kOffBar = kOffD + kDoStages * kRowFloatsBytes;
  // mbarriers: kv_full, then q_full and q_empty per slot (head_dim 256: then do_full and
  // do_empty per slot of the dO ring)
  static constexpr int kDoBars = kSplitHeadDim ? 2 * kDoStages : 0;
  static constexpr int kNumBars = 1 + 2 * kStages + kDoBars;
  static constexpr int kSmemBytes = kOffBar + 8 * kNumBars + 1024;

  // Named barrier ids (0 is __syncthreads)
  static constexpr int kBarDS = 1;  // all consumer threads: both halves of dS^T in SMEM
  static constexpr int kBarDQ = 2;  // + wg: the warpgroup's dQ staging, or its dK / dV rows staged for TMA (128 threads)
  // `dq_writer on`, + wg: consumer wg and its writer warp (160 threads): the staging written
  // (full: the consumer arrives, the writer syncs) and read by the writer's add (empty)
  static constexpr int kBarDqFull = 5;
  static constexpr int kBarDqEmpty = 8;
  // `fused_convert on`: every consumer thread, its dQ adds fenced before the CTA's counts
  static constexpr int kBarFinish = 11;
};

}  // namespace fadsl::sm90

// The rest of the backward, sections of this header kept in files of their own (each
// included here, after what it uses):
#include "sm90_bwd_block.cuh"  // 3: the CTA's n-block, the m-blocks it visits, their masks and counts
#include "sm90_bwd_ds.cuh"     // 5a: dS^T into SMEM (st.shared, stmatrix, stmatrix .trans)
#include "sm90_bwd_persistent.cuh"  // 3b: `scheduler persistent`'s tiles and K/V's empty barrier
#include "sm90_bwd_producer.cuh"   // 4: the producer's loads, the rings' barriers
#include "sm90_bwd_dq_reduce.cuh"  // 5b: dQ into its fp32 accumulator (staged, red.add, in ticket order)
#include "sm90_bwd_consumer.cuh"   // 5-6: a consumer warpgroup's steps and body
#include "sm90_bwd_writer.cuh"  // 6b: `dq_writer on`'s writer warps
#include "sm90_bwd_lag.cuh"     // 6c: `dq_lag on`'s consumer (dQ one m-block behind, no meeting)
#include "sm90_bwd_prep.cuh"   // 7: the preprocess and dQ's conversion
#include "sm90_bwd_convert.cuh"  // 7b: `fused_convert on`: dQ converted by the CTA that completes an m-block
