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
  int* dq_semaphore;  // `deterministic on`: per (batch, head, m-block, share), the reduce-adds done
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;  // elements
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int seqlen_q, seqlen_k, seqlen_q_rounded, m_blocks;
  int heads_q, group;  // query heads, query heads per K/V head
  int dkv_store;       // DkvStore: how dK and dV leave the CTA
  float scale_log2;    // softmax_scale log2 e
  float softmax_scale;
  // `deterministic on`: 1 where the host found every n-block of a (batch, head) able to run
  // at once (bwd_in_visit_order), so that an m-block's tickets follow the order in which
  // the n-blocks reach it rather than the n-block order
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
  int* dq_semaphore;  // zeroed here (null unless `deterministic on`)
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

static_assert(sizeof(BwdParamsSm90) == 768, "BwdParamsSm90's layout is fadsl/targets/sm90/backward/host.py's");
// (NVRTC 13.0 has no __builtin_offsetof; nvcc's host compile of this header checks it:
// tests/test_varlen_backward_chunks.py)
#if !defined(__CUDACC_RTC__)
static_assert(__builtin_offsetof(BwdParamsSm90, sequences) == 664 && __builtin_offsetof(BwdParamsSm90, inputs) == 672 &&
                  __builtin_offsetof(BwdParamsSm90, batch) == 736,
              "the modifiers' fields where fadsl/targets/sm90/backward/host.py packs them (MODIFIERS_OFFSET)");
#endif

struct BwdConvertParams {
  const float* dq_accum;
  void* dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;  // elements
  int seqlen_q, m_blocks, heads_q;
  float softmax_scale;
  const int* cu_seqlens_q;  // `varlen on` (null otherwise): BwdParamsSm90's
  int sequences;
};
static_assert(sizeof(BwdPrepParams) == 208 && sizeof(BwdConvertParams) == 72,
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
  // release_dq_ticket's deferral is deadlock-free with a ring of 2 or more (its comment)
  static_assert(!kDeterministic || kStages >= 2, "the deferred ticket release needs 2 stages");
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
  // `varlen on` (a generated Cfg sets it): packed sequences, cu_seqlens in the params; a CTA
  // per (n-block slot, query head) over the packed keys (bwd_block)
  static constexpr bool kVarlen = false;
  // Score and mask modifiers (issue 41; a generated Cfg sets them and `using Modifiers` to its
  // SpecModifiers, fadsl/sm90_bwd_modifiers.cuh): kScore, P from the modified score; kScoreGrad,
  // dS times d score / d s (not the constant 1); kKeep, keep's -inf in the m-blocks its tile
  // rule does not class FULL, the EMPTY ones off both ends of the range (bwd_keep_trim)
  static constexpr bool kScore = false;
  static constexpr bool kScoreGrad = false;
  static constexpr bool kKeep = false;

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
  static constexpr int kBarDQ = 2;  // + wg: the warpgroup's dQ staging (128 threads)
};

// ---------------------------------------------------------------------------
// 3. The CTA's work: an n-block of keys and the m-blocks that see it
// ---------------------------------------------------------------------------

struct BwdBlock {
  int n_block, head, head_kv, batch;
  int n0;       // first key
  int m_begin;  // first m-block that sees a key of the n-block (causal: the diagonal's)
  int m_count;  // m-blocks to visit (0: dK = dV = 0)
  // the block's sequence: its queries and keys, its first row in the tensors (0 padded) and
  // (varlen) its first m-block's index among the head's chunks of dQ's accumulator, of B_r
  // rows each (the LSE's and D's rows / B_r); padded calls compute it from batch and head
  int seqlen_q, seqlen_k;
  int q_row0, k_row0;
  int chunk0;
};

// `varlen on`: sequence s's first padded slot is (cu[s] + s block) / block, in units of
// `block` rows (FlashAttention-3's padding: an extra block per sequence, so that each starts a
// block of its own).  With cu non-decreasing, sequence s owns the slots from its first to
// the next sequence's, at least cdiv(its rows, block) of them (research/backward-varlen.md
// §3).  Returns the last s < sequences whose first slot is at or before `slot`; malformed cu
// still give some s in range, which the callers check (bwd_sequence_ok).
__host__ __device__ __forceinline__ int bwd_first_slot(const int* cu, int s, int block) {
  return (cu[s] + s * block) / block;
}
__host__ __device__ __forceinline__ int bwd_varlen_sequence(const int* cu, int sequences, int block, int slot) {
  int lo = 0, hi = imin(slot, sequences - 1);  // a sequence's first slot is s or later
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (bwd_first_slot(cu, mid, block) <= slot) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}
// Whether rows [r0, r1) lie within a tensor of `rows` rows in order (else the sequence is
// treated as empty: nothing read or written for it; the forward made O and the LSE NaN).
__host__ __device__ __forceinline__ bool bwd_sequence_ok(int r0, int r1, int rows) {
  return 0 <= r0 && r0 <= r1 && r1 <= rows;
}

// The query rows behind padded rows (of the LSE, D and dQ's accumulator) of one chunk:
// padded row r holds query row r + shift of the tensors if begin <= r < end, else none.
struct BwdQueryRows {
  int shift, begin, end;
};
// Padded calls: rows [0, seqlen_q) as they are (none read from cu_seqlens).  The
// preprocess and convert_dq take a CTA's rows from one chunk (their rows per CTA divide B_r).
template <class Cfg>
__host__ __device__ __forceinline__ BwdQueryRows bwd_query_rows(const int* cu_q, int sequences, int tokens_q, int chunk) {
  if constexpr (!Cfg::kVarlen) return {0, 0, tokens_q};
  const int s = bwd_varlen_sequence(cu_q, sequences, Cfg::kBlockM, chunk);
  const int q0 = cu_q[s], q1 = cu_q[s + 1];
  const int first = bwd_first_slot(cu_q, s, Cfg::kBlockM) * Cfg::kBlockM;
  if (!bwd_sequence_ok(q0, q1, tokens_q)) return {0, 0, 0};
  return {q0 - first, first, first + q1 - q0};
}
// Whether padded row `row` holds a query, and the tensors' row of it (padded calls test the
// params' seqlen_q where they use it: a copy held in a local moved ptxas's allocation).
template <class Cfg>
__host__ __device__ __forceinline__ bool bwd_holds_query(const BwdQueryRows& rows, int seqlen_q, int row) {
  if constexpr (Cfg::kVarlen) return rows.begin <= row && row < rows.end;
  return row < seqlen_q;
}
// Whether m-block `chunk` (varlen: a chunk of B_r padded rows) holds a query; padded calls
// have none without one (their m-blocks cover [0, seqlen_q)).  Uniform over a CTA of the
// preprocess or convert_dq, whose rows lie in one chunk.
template <class Cfg>
__host__ __device__ __forceinline__ bool bwd_chunk_holds_query(const BwdQueryRows& rows, int chunk) {
  if constexpr (!Cfg::kVarlen) return true;
  return rows.begin < (chunk + 1) * Cfg::kBlockM && chunk * Cfg::kBlockM < rows.end;
}
template <class Cfg>
__host__ __device__ __forceinline__ int bwd_query_of(const BwdQueryRows& rows, int row) {
  if constexpr (Cfg::kVarlen) return row + rows.shift;
  return row;
}

// Whether a query's keys end at a right edge (the causal mask's diagonal, or a window's), and
// that edge: query q sees no key past q + d + bwd_right_edge (d = seqlen_k - seqlen_q).
// (has_window: sm90.cuh's, on the Cfg's kWindowLeft.)
template <class Cfg>
__host__ __device__ constexpr bool bwd_has_right_edge() {
  return Cfg::kCausal || has_window<Cfg>();
}
template <class Cfg>
__host__ __device__ constexpr int bwd_right_edge() {
  return Cfg::kCausal ? 0 : Cfg::kWindowRight;
}

// The block's keys and its diagonal offset d = seqlen_k - seqlen_q (query q's diagonal key is
// q + d): the params' for padded calls (constants the compiler need not keep in registers),
// the sequence's with `varlen on`.
template <class Cfg>
__device__ __forceinline__ int bwd_keys(const BwdParamsSm90& P, const BwdBlock& b) {
  if constexpr (Cfg::kVarlen) return b.seqlen_k;
  return P.seqlen_k;
}
template <class Cfg>
__device__ __forceinline__ int bwd_diagonal(const BwdParamsSm90& P, const BwdBlock& b) {
  if constexpr (Cfg::kVarlen) return b.seqlen_k - b.seqlen_q;
  return P.seqlen_k - P.seqlen_q;
}

template <class Cfg>
__device__ __forceinline__ BwdBlock bwd_block(const BwdParamsSm90& P) {
  BwdBlock b;
  b.n_block = blockIdx.x;
  b.head = blockIdx.y;
  b.batch = blockIdx.z;
  b.seqlen_q = P.seqlen_q;
  b.seqlen_k = P.seqlen_k;
  b.q_row0 = b.k_row0 = 0;
  if constexpr (Cfg::kVarlen) {
    // slot blockIdx.x of the packed keys: its sequence and n-block (a gap slot past the
    // sequence's keys, or a malformed sequence, has no work and stores nothing)
    const int s = bwd_varlen_sequence(P.cu_seqlens_k, P.sequences, Cfg::kBlockN, blockIdx.x);
    const int q0 = P.cu_seqlens_q[s], q1 = P.cu_seqlens_q[s + 1];
    const int k0 = P.cu_seqlens_k[s], k1 = P.cu_seqlens_k[s + 1];
    const bool ok = bwd_sequence_ok(q0, q1, P.seqlen_q) && bwd_sequence_ok(k0, k1, P.seqlen_k);
    b.n_block = blockIdx.x - bwd_first_slot(P.cu_seqlens_k, s, Cfg::kBlockN);
    b.batch = 0;
    b.q_row0 = q0;
    b.k_row0 = k0;
    b.seqlen_q = q1 - q0;
    b.seqlen_k = k1 - k0;
    if (!ok || b.n_block < 0 || b.n_block * Cfg::kBlockN >= b.seqlen_k) {
      b.n_block = b.seqlen_q = b.seqlen_k = b.q_row0 = b.k_row0 = 0;  // no key stored, no m-block
    }
    b.chunk0 = bwd_first_slot(P.cu_seqlens_q, s, Cfg::kBlockM);
  }
  if constexpr (Cfg::kLongestFirst && !Cfg::kVarlen) {
    // Blocks launch x fastest, then y, then z.  The launch index runs over sections of
    // `section` (head, batch) pairs, the n-block slowest inside each.  `section` is the power
    // of 2 of pairs whose Q and dO (2 bytes) and dQ accumulator (4 bytes) fit 40 MB of the
    // L2 (50 MB on H100 and H200): with the n-block slowest over all pairs at once, every
    // running CTA reads its own head's Q and dO and the L2 thrashes (measured 2026-11-29,
    // H200: -27 % at causal 1k, head_dim 128).  The last section holds the remainder.
    const int pairs = gridDim.y * gridDim.z;
    const int launched = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const long long head_bytes = (long long)P.seqlen_q_rounded * Cfg::kHeadDim * (2 * 2 + 4);
    const long long fit = (40ll << 20) / head_bytes;
    const int section = fit < 1 ? 1 : 1 << (31 - __clz(fit > (1 << 30) ? 1 << 30 : (int)fit));
    const int section_ctas = section * gridDim.x;
    const int first_pair = launched / section_ctas * section;
    const int in_section = launched % section_ctas;
    const int pairs_here = imin(section, pairs - first_pair);
    const int hb = first_pair + in_section % pairs_here;
    b.n_block = in_section / pairs_here;
    b.head = hb % gridDim.y;
    b.batch = hb / gridDim.y;
  }
  b.head_kv = b.head / P.group;
  b.n0 = b.n_block * Cfg::kBlockN;
  b.m_begin = 0;
  const int d = b.seqlen_k - b.seqlen_q;  // query q's diagonal key is q + d (bottom-right aligned)
  int m_end = Cfg::kVarlen ? (b.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM : P.m_blocks;
  if constexpr (bwd_has_right_edge<Cfg>()) {
    // the first query that sees the n-block's first key: its right edge q + d + right
    const int first_q = b.n0 - d - bwd_right_edge<Cfg>();
    b.m_begin = first_q > 0 ? first_q / Cfg::kBlockM : 0;
  }
  if constexpr (has_window<Cfg>()) {
    // the last query that sees the n-block's last key: its left edge q + d - left
    const int last_q = b.n0 + Cfg::kBlockN - 1 - d + Cfg::kWindowLeft;
    m_end = last_q < 0 ? 0 : imin(m_end, last_q / Cfg::kBlockM + 1);
  }
  b.m_count = imax(m_end - b.m_begin, 0);
  if constexpr (Cfg::kKeep) bwd_keep_trim<Cfg>(P, b);  // keep's EMPTY m-blocks off both ends
  return b;
}

// Whether each role finds its block after its setmaxnreg (bwd_block reads only the params and
// cu_seqlens, which no thread writes) rather than once before the roles split: with `varlen
// on` the sequence's bounds come from memory, and held across the producer's setmaxnreg.dec
// they spilled 8 bytes at head_dim 64, B_r 128 (ptxas of NVRTC 13.5, 2026-11-29); with a
// softcap the block found once spills less (12 bytes against 24 at head_dim 128, causal).
template <class Cfg>
__host__ __device__ constexpr bool bwd_block_per_role() {
  return Cfg::kVarlen && !(Cfg::kSoftcap > 0.f);
}
// The block found before the roles split, and the one a role works on: the same, unless
// bwd_block_per_role, where nothing of it is live across the producer's setmaxnreg.dec.
template <class Cfg>
__device__ __forceinline__ BwdBlock bwd_shared_block(const BwdParamsSm90& P) {
  if constexpr (bwd_block_per_role<Cfg>()) return BwdBlock{};
  return bwd_block<Cfg>(P);
}
template <class Cfg>
__device__ __forceinline__ BwdBlock bwd_role_block(const BwdParamsSm90& P, const BwdBlock& shared) {
  if constexpr (bwd_block_per_role<Cfg>()) return bwd_block<Cfg>(P);
  return shared;
}

// The first n-block whose keys m-block m sees (0 without a window): with `deterministic on`
// the m-block's tickets start there.  Every n-block from it to the last that m sees visits
// m-block m (bwd_block's range is the same condition), so the tickets come without a gap.
template <class Cfg>
__device__ __forceinline__ int bwd_first_n_block(const BwdBlock& b, int m) {
  if constexpr (has_window<Cfg>()) {
    const int first_key = m * Cfg::kBlockM + (b.seqlen_k - b.seqlen_q) - Cfg::kWindowLeft;  // (padded only: see validate)
    return first_key > 0 ? first_key / Cfg::kBlockN : 0;
  }
  return 0;
}

// `deterministic on` in visit order (P.dq_in_visit_order, set by the host only without a
// window, packed sequences or longest_first, and with no more n-blocks per (batch, head) than
// the GPU runs CTAs at once): the n-blocks reach each m-block one after another instead of
// all at once, so an m-block's ordered adds (ordered_reduce_add) seldom wait.  Without a
// mask n-block n of N visits all M m-blocks from m-block visit_first = n M / N on,
// wrapping around, so that at any step the running n-blocks are spread over the m-blocks;
// with the causal mask it visits them upwards from its diagonal as always, which reaches an
// m-block from the last n-block that sees it down to n-block 0.
template <class Cfg>
__device__ __forceinline__ bool bwd_in_visit_order(const BwdParamsSm90& P) {
  if constexpr (!Cfg::kDeterministic || Cfg::kVarlen || Cfg::kLongestFirst || has_window<Cfg>()) return false;
  return P.dq_in_visit_order != 0;
}

template <class Cfg>
__device__ __forceinline__ int bwd_n_blocks(const BwdBlock& b) {
  return (b.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
}

// Without a mask, in visit order, of n_blocks n-blocks over m_count m-blocks (every n-block
// visits every one): n-block n's first m-block, n m_count / n_blocks, and how many n-blocks
// start at or before m-block x (n m_count / n_blocks <= x iff n < (x + 1) n_blocks / m_count).
__host__ __device__ __forceinline__ constexpr int visit_first(int n, int m_count, int n_blocks) {
  return n * m_count / n_blocks;
}
__host__ __device__ __forceinline__ constexpr int visit_starting_by(int x, int m_count, int n_blocks) {
  return x < 0 ? 0 : imin(n_blocks, ((x + 1) * n_blocks + m_count - 1) / m_count);
}

// Without a mask, in visit order: n-block n's place at m-block m, the n-blocks that reach m
// in fewer steps (n' reaches it at step (m - first(n')) mod m_count), then those that reach
// it at the same step with a smaller index (tests/test_backward_dq_places.py checks it
// against that definition).
__host__ __device__ __forceinline__ constexpr int visit_place(int n, int m, int m_count, int n_blocks) {
  const int first = visit_first(n, m_count, n_blocks);
  const int step = m >= first ? m - first : m - first + m_count;
  // fewer steps: first(n') in m - step + 1 .. m (mod m_count), i.e. [lo, m], and [lo + m_count, m_count) where lo < 0
  const int lo = m - step + 1;
  const int wrapped = lo < 0 ? visit_starting_by(m_count - 1, m_count, n_blocks) -
                                   visit_starting_by(m_count + lo - 1, m_count, n_blocks)
                             : 0;
  const int fewer = visit_starting_by(m, m_count, n_blocks) - visit_starting_by(imax(lo, 0) - 1, m_count, n_blocks);
  return fewer + wrapped + n - visit_starting_by(first - 1, m_count, n_blocks);
}

// Causal, in visit order: n-block n's place at m-block m, last - n, where `last` is the last
// n-block that sees m (n-block n visits m-blocks from m_begin = (n B_c - d) / B_r on, so it
// visits m iff n B_c - d < (m + 1) B_r, which holds for every smaller n too); d = seqlen_k -
// seqlen_q.  Only for an n that visits m.
__host__ __device__ __forceinline__ constexpr int causal_visit_place(int n, int m, int block_m, int block_n, int d,
                                                                      int n_blocks) {
  return imin(((m + 1) * block_m + d - 1) / block_n, n_blocks - 1) - n;
}

// The i-th m-block n-block b visits (producer and consumers alike).
template <class Cfg>
__device__ __forceinline__ int bwd_m_block(const BwdParamsSm90& P, const BwdBlock& b, int i) {
  if constexpr (!Cfg::kCausal) {
    if (bwd_in_visit_order<Cfg>(P)) {
      const int m = visit_first(b.n_block, b.m_count, bwd_n_blocks<Cfg>(b)) + i;  // (m_count > 0 where any i is asked)
      return m < b.m_count ? m : m - b.m_count;
    }
  }
  return b.m_begin + i;
}

// `deterministic on`: n-block b's place among the n-blocks that add into m-block m's dQ
// (ordered_reduce_add's ticket, before the warpgroups).  Each of 0 .. place - 1 belongs to an
// n-block that visits m too, so every ticket comes, and the places at m are distinct.
// - n-block order (the default): n_block - bwd_first_n_block.  Every n-block from the
//   m-block's first to this one visits it too (without a mask all of them; causal, a
//   smaller n-block's keys are seen by at least the same queries; with a window, those
//   between the m-block's first seen key and this n-block's).  A CTA waits only on smaller
//   n-blocks of its (batch, head), which launch before it in either order of bwd_block, so
//   a waited-for CTA has started: no deadlock whatever runs at once.
// - visit order (bwd_in_visit_order): causal_visit_place, visit_place without a mask.  Here
//   a CTA may wait on larger n-blocks, which launch after it: the host
//   asks for it only where every n-block of a (batch, head) fits on the GPU at once, so that
//   of the CTAs running only the last (batch, head) launched can be short of a CTA it waits
//   on, and the others, complete, finish and make room for it.
template <class Cfg>
__device__ __forceinline__ int bwd_dq_place(const BwdParamsSm90& P, const BwdBlock& b, int m) {
  if (bwd_in_visit_order<Cfg>(P)) {
    if constexpr (Cfg::kCausal) {
      return causal_visit_place(b.n_block, m, Cfg::kBlockM, Cfg::kBlockN, b.seqlen_k - b.seqlen_q,
                                bwd_n_blocks<Cfg>(b));
    } else {
      return visit_place(b.n_block, m, b.m_count, bwd_n_blocks<Cfg>(b));
    }
  }
  return b.n_block - bwd_first_n_block<Cfg>(b, m);
}

// Whether m-block m needs the mask: keys past seqlen_k in the n-block, or (causal) a key
// past some query's diagonal.
template <class Cfg>
__device__ __forceinline__ bool bwd_needs_mask(const BwdParamsSm90& P, const BwdBlock& b, int m) {
  bool mask = b.n0 + Cfg::kBlockN > bwd_keys<Cfg>(P, b);
  const int d = bwd_diagonal<Cfg>(P, b);
  if constexpr (bwd_has_right_edge<Cfg>()) {  // a key past the first row's right edge
    mask = mask || b.n0 + Cfg::kBlockN - 1 > m * Cfg::kBlockM + d + bwd_right_edge<Cfg>();
  }
  if constexpr (has_window<Cfg>()) {  // a key before the last row's left edge
    mask = mask || b.n0 < (m + 1) * Cfg::kBlockM - 1 + d - Cfg::kWindowLeft;
  }
  if constexpr (Cfg::kKeep) mask = mask || bwd_keep_partial<Cfg>(P, b, m);  // not FULL by keep's rule
  return mask;
}

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

// K and V of the n-block, once: 2 kKVBytes complete on kv_full (phase 0).
template <class Cfg>
__device__ __forceinline__ void bwd_load_kv(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b) {
  const uint32_t bar_kv = bwd_bar_kv<Cfg>(smem);
  mbar_arrive_expect_tx(bar_kv, 2 * Cfg::kKVBytes);
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    const uint32_t at = panel * Cfg::kBlockN * Cfg::kRowBytes;
    tma_load_4d(smem + Cfg::kOffK + at, &P.tma_k, bar_kv, 64 * panel, b.k_row0 + b.n0, b.head_kv, b.batch);
    tma_load_4d(smem + Cfg::kOffV + at, &P.tma_v, bar_kv, 64 * panel, b.k_row0 + b.n0, b.head_kv, b.batch);
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
__device__ __forceinline__ void bwd_producer(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b) {
  if (b.m_count == 0) return;  // the consumers store zeros without waiting
  bwd_load_kv<Cfg>(P, smem, b);
  const int64_t rows = bwd_stat_rows<Cfg>(P, b);
  for (int i = 0; i < b.m_count; ++i) {
    const int slot = i % Cfg::kStages;
    const uint32_t phase = static_cast<uint32_t>(i / Cfg::kStages) & 1u;
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
    FADSL_BWD_MARK(Cfg::kConsumerWGs, i, 2);
  }
}

// ---------------------------------------------------------------------------
// 5. Consumer steps (one warpgroup, 64 keys)
// ---------------------------------------------------------------------------

// X^T = rows x_wg (64 keys, K-major, one panel per 64 head_dim columns, B_c-row panels) times
// tile^T (B_r rows, K-major, B_r-row panels): S^T = K Q^T or dP^T = V dO^T.
template <class Cfg>
__device__ __forceinline__ void issue_keys_by_rows(float (&acc)[Cfg::kSRegs], uint32_t keys_wg, uint32_t rows_slot) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    const uint32_t panel = kk / 4, k_bytes = (kk % 4) * 32;
    const uint64_t desc_a = make_desc_kmajor_sw128(keys_wg + panel * Cfg::kBlockN * Cfg::kRowBytes + k_bytes);
    const uint64_t desc_b = make_desc_kmajor_sw128(rows_slot + panel * Cfg::kBlockM * Cfg::kRowBytes + k_bytes);
    Wgmma<Cfg::kBlockM>::template ss<typename Cfg::T, 0, 0>(acc, desc_a, desc_b, kk > 0 ? 1u : 0u);
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
#pragma unroll
  for (int kk = 0; kk < Cfg::kDqKeys / 16; ++kk) {
    const uint32_t step = kk * 16 * Cfg::kRowBytes;
    const uint64_t desc_a = make_desc_mnmajor_sw128(ds_keys + step, Cfg::kBlockN * Cfg::kRowBytes);
    const uint64_t desc_b = make_desc_mnmajor_sw128(k_keys + step, Cfg::kBlockN * Cfg::kRowBytes);
    Wgmma<Cfg::kDqCols>::template ss<typename Cfg::T, 1, 1>(dq, desc_a, desc_b, kk > 0 ? 1u : 0u);
  }
}

// dQ^T (this warpgroup's 64 head_dim columns x B_r queries) = K^T dS^T over all B_c keys:
// A = K^T (K's panel wg: rows = keys, the 64 columns contiguous: MN-major A), B = dS (the
// B_r query rows of each 64-key panel, keys contiguous: K-major B).
template <class Cfg>
__device__ __forceinline__ void issue_dq_t(float (&dq)[Cfg::kDqRegs], uint32_t ds_buf, uint32_t k_panel) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    const uint64_t desc_a = make_desc_mnmajor_sw128(k_panel + kk * 16 * Cfg::kRowBytes, Cfg::kBlockN * Cfg::kRowBytes);
    const uint64_t desc_b = make_desc_kmajor_sw128(ds_buf + (kk / 4) * Cfg::kDSPanelBytes + (kk % 4) * 32);
    Wgmma<Cfg::kBlockM>::template ss<typename Cfg::T, 1, 0>(dq, desc_a, desc_b, kk > 0 ? 1u : 0u);
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

// P^T in place of S^T: element (key row 16 warp + g + 8r of the warpgroup, query column
// 8j + 2t + e of the m-block) is 2^(S c log2e - LSE log2e), 0 where masked.  With a `score`
// modifier, 2^(s' log2e - LSE log2e) of the modified score s' (bwd_score, or where its
// derivative is not 1 bwd_score_at, and `dtanh` then holds P times the derivative,
// bwd_dscore_at: one factor a score from P to dS); with `keep`, masked where it does not
// hold too (bwd_keeps).
template <class Cfg, bool kMask>
__device__ __forceinline__ void bwd_probs(float (&s)[Cfg::kSRegs], float (&dtanh)[Cfg::kSRegs],
                                          const BwdParamsSm90& P, uint32_t lse_slot, int key0, int q0, int lane,
                                          const BwdBlock& b) {
  bwd_softcap<Cfg>(s, dtanh, P.scale_log2);
  bwd_score<Cfg>(s, P, b, key0, q0, lane);  // `score` whose derivative is 1: S^T modified in place
  const auto u = bwd_score_uniforms<Cfg>(P, b);  // kScoreGrad's loads per (batch, head); else none
  const int t = lane % 4;
  const int d = bwd_diagonal<Cfg>(P, b);
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
    const float2 lse_pair = ld_shared_v2_f32(lse_slot + 4 * (8 * j + 2 * t));  // columns 8j + 2t + e
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
  }
}

// dS^T = P^T (dP^T - D) in place of dP^T (D of the element's query column), times the
// cap's derivative with `softcap N`; with a score whose derivative is not 1, (P d score / d s)
// (dP^T - D) from the product bwd_probs left in `dtanh`.
template <class Cfg>
__device__ __forceinline__ void bwd_grad_scores(const float (&p)[Cfg::kSRegs], float (&dp)[Cfg::kSRegs],
                                                const float (&dtanh)[Cfg::kSRegs], uint32_t d_slot, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
    const float2 d_pair = ld_shared_v2_f32(d_slot + 4 * (8 * j + 2 * t));  // columns 8j + 2t + e
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float d = e == 0 ? d_pair.x : d_pair.y;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = 4 * j + 2 * r + e;
        if constexpr (Cfg::kScoreGrad) {  // dtanh holds P times the score's derivative (bwd_probs)
          dp[i] = dtanh[i] * (dp[i] - d);
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

// dS^T (this warpgroup's 64 key rows) into an SMEM buffer of B_c rows x B_r queries
// (per 64-query panel, one 128-byte swizzled row per key).
template <class Cfg>
__device__ __forceinline__ void store_ds(uint32_t ds_buf, const uint32_t (&x)[Cfg::kPRegs], int wg, int warp, int lane) {
  const int row = 64 * wg + 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t byte =
          (j / 8) * Cfg::kDSPanelBytes + (row + 8 * r) * Cfg::kRowBytes + (8 * (j % 8) + 2 * (lane % 4)) * 2;
      st_shared_b32(ds_buf + swizzle128(byte), x[2 * j + r]);
    }
  }
}

// dS^T (this warpgroup's 64 keys) into key panel wg of a buffer with the B_r queries as
// rows (128-byte swizzled rows of 64 keys): each 8 x 8 block of the registers stored
// transposed by stmatrix .trans.  x[2j + r] holds keys 16 warp + lane / 4 + 8r, queries
// 8j + 2 (lane % 4) + {0, 1}; an x4 stores blocks (j, r) = (2n + I / 2, I % 2), I < 4,
// whose query row lane % 8 lane L / 8 addresses.
template <class Cfg>
__device__ __forceinline__ void store_ds_t(uint32_t ds_buf, const uint32_t (&x)[Cfg::kPRegs], int wg, int warp,
                                           int lane) {
  const int block = lane / 8;
  const uint32_t key_bytes = (16 * warp + 8 * (block % 2)) * 2;
#pragma unroll
  for (int n = 0; n < Cfg::kBlockM / 16; ++n) {
    const int query = 8 * (2 * n + block / 2) + lane % 8;
    const uint32_t byte = wg * Cfg::kDSPanelBytes + query * Cfg::kRowBytes + key_bytes;
    stmatrix_x4_trans(ds_buf + swizzle128(byte), x[4 * n], x[4 * n + 1], x[4 * n + 2], x[4 * n + 3]);
  }
}

// The warpgroup's dQ registers into its staging buffer: float4 q of thread `tid` at
// (q * 128 + tid) * 4 floats (convert_dq reads the same order back).
template <class Cfg>
__device__ __forceinline__ void stage_dq(uint32_t stage, const float (&dq)[Cfg::kDqRegs], int tid) {
#pragma unroll
  for (int q = 0; q < Cfg::kDqRegs / 4; ++q) {
    st_shared_v4(stage + 16 * (q * 128 + tid), dq[4 * q], dq[4 * q + 1], dq[4 * q + 2], dq[4 * q + 3]);
  }
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

// Share `share` of m-block m in dQ's fp32 accumulator, kDqFloats each (the consumers'
// fragment order: bwd_convert_dq_row reads it back): warpgroup wg's, or at head_dim 256
// head_dim panel `share` (warpgroup share / 2's slice share % 2).
template <class Cfg>
__device__ __forceinline__ float* dq_accum_share(const BwdParamsSm90& P, int64_t accum_head, int m, int share) {
  return P.dq_accum + (accum_head + m) * (Cfg::kBlockM * Cfg::kHeadDim) + (Cfg::kDqByKeys ? 0 : share * Cfg::kDqFloats);
}

// `dQ: rf -red.add-> gmem`: the thread's dQ registers added into the accumulator, float4 q
// at (q * 128 + tid) * 4 floats as stage_dq would have staged it (each add atomic, in the L2;
// red.global.add rounds to nearest and flushes fp32 subnormals, as the bulk reduce-add).
template <class Cfg>
__device__ __forceinline__ void red_add_dq(float* dst, const float (&dq)[Cfg::kDqRegs], int tid) {
#pragma unroll
  for (int q = 0; q < Cfg::kDqRegs / 4; ++q) {
    red_add_v4_f32(dst + 4 * (q * 128 + tid), dq[4 * q], dq[4 * q + 1], dq[4 * q + 2], dq[4 * q + 3]);
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

// The warpgroup's dQ of m-block m added into the accumulator: from registers (`dQ: rf
// -red.add-> gmem`), or stored into its staging buffer and reduce-added in bulk by the
// warpgroup's first thread (ordered by ticket with `deterministic on`: the leader then owes
// the ticket's release, `owed`).  Both consumers'.  WAR on the staging: the previous add has
// read it (its issuer's wait_read, then the warpgroup's barrier; in deterministic mode the
// owed release's wait_group 0 came earlier in this m-block anyway).
template <class Cfg>
__device__ __forceinline__ void reduce_dq(const BwdParamsSm90& P, const BwdBlock& b, uint32_t stage,
                                          const float (&dq)[Cfg::kDqRegs], int64_t accum_head, int m, int wg,
                                          int tid, DqTicket& owed) {
  float* dst = dq_accum_share<Cfg>(P, accum_head, m, wg);
  if constexpr (Cfg::kDqRed) {
    red_add_dq<Cfg>(dst, dq, tid);
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
        owed.semaphore = P.dq_semaphore + (accum_head + m) * Cfg::kDqSemaphores;
        if constexpr (Cfg::kDqByKeys) {  // one counter: the warpgroups in turn
          owed.ticket = place * Cfg::kConsumerWGs + wg;
        } else {
          owed.semaphore += wg;
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

// ---------------------------------------------------------------------------
// 6. The main kernel's bodies
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
__device__ __forceinline__ void bwd_consumer(const BwdParamsSm90& P, uint32_t smem, const BwdBlock& b, int wg) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int key0 = b.n0 + 64 * wg + 16 * warp + lane / 4;  // this thread's key row r = 0
  float dk[Cfg::kAccRegs], dv[Cfg::kAccRegs];
#pragma unroll
  for (int i = 0; i < Cfg::kAccRegs; ++i) dk[i] = dv[i] = 0.f;

  const uint32_t k_wg = smem + Cfg::kOffK + 64 * wg * Cfg::kRowBytes;  // the warpgroup's 64 key rows
  const uint32_t v_wg = smem + Cfg::kOffV + 64 * wg * Cfg::kRowBytes;
  const uint32_t stage = smem + Cfg::kOffDQ + wg * Cfg::kDqFloats * 4;
  const int64_t accum_head = Cfg::kVarlen ? static_cast<int64_t>(b.head) * P.m_blocks + b.chunk0
                                          : (static_cast<int64_t>(b.batch) * P.heads_q + b.head) * P.m_blocks;
  // RAW: K and V landed (TMA complete_tx on kv_full, phase 0)
  if (b.m_count > 0) mbar_wait_parity(bwd_bar_kv<Cfg>(smem), 0u);
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(2);
  DqTicket owed{nullptr, 0};  // `deterministic on`: the leader's unreleased ticket

  for (int i = 0; i < b.m_count; ++i) {
    FADSL_BWD_MARK(wg, i, 0);
    const int slot = i % Cfg::kStages;
    const int m = bwd_m_block<Cfg>(P, b, i);
    const uint32_t q_slot = smem + Cfg::kOffQ + slot * Cfg::kQBytes;
    const uint32_t do_slot = smem + Cfg::kOffDO + slot * Cfg::kQBytes;
    // RAW: the slot's Q, dO, LSE and D landed (TMA and bulk complete_tx on q_full)
    mbar_wait_parity(bwd_bar_q_full<Cfg>(smem, slot), static_cast<uint32_t>(i / Cfg::kStages) & 1u);
    FADSL_BWD_MARK(wg, i, 1);

    float s[Cfg::kSRegs], dp[Cfg::kSRegs];
    wgmma_fence();  // s and dp were read by ordinary instructions in the previous m-block
    issue_keys_by_rows<Cfg>(s, k_wg, q_slot);
    wgmma_commit();
    issue_keys_by_rows<Cfg>(dp, v_wg, do_slot);
    wgmma_commit();
    // `deterministic on`: m-block i - 1's ticket, released while S^T and dP^T run, before
    // anything that waits on another warpgroup or CTA (release_dq_ticket)
    if constexpr (Cfg::kDeterministic) {
      if (tid == 0 && i > 0) release_dq_ticket<Cfg>(owed);
    }
    wgmma_wait<1>();  // S^T in registers (dP^T's group may still run)
    fence_regs(s);
    FADSL_BWD_MARK(wg, i, 2);

    float dtanh[Cfg::kSRegs];  // softcap's 1 - tanh^2, or P times the score's derivative (unused without either)
    const uint32_t lse_slot = smem + Cfg::kOffLSE + slot * Cfg::kRowFloatsBytes;
    const uint32_t d_slot = smem + Cfg::kOffD + slot * Cfg::kRowFloatsBytes;
    if (bwd_needs_mask<Cfg>(P, b, m)) {
      bwd_probs<Cfg, true>(s, dtanh, P, lse_slot, key0, m * Cfg::kBlockM, lane, b);
    } else {
      bwd_probs<Cfg, false>(s, dtanh, P, lse_slot, key0, m * Cfg::kBlockM, lane, b);
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
      bwd_grad_scores<Cfg>(s, dp, dtanh, d_slot, lane);
    } else {
      wgmma_wait<0>();  // dP^T in registers
      fence_regs(dp);
      bwd_grad_scores<Cfg>(s, dp, dtanh, d_slot, lane);
      pack_pairs<Cfg>(s, p16);
    }
    pack_pairs<Cfg>(dp, ds16);
    FADSL_BWD_MARK(wg, i, 4);

    // dS^T into buffer i % 2: the other warpgroup's dQ of m-block i - 1 may still read the
    // other buffer (its reads of this one retired before it met at dS^T(i - 1))
    const uint32_t ds_buf = smem + Cfg::kOffDS + (i % 2) * Cfg::kDSBytes;
    if constexpr (Cfg::kDqTransposed) {
      store_ds_t<Cfg>(ds_buf, ds16, wg, warp, lane);
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
      reduce_dq<Cfg>(P, b, stage, dq, accum_head, m, wg, tid, owed);
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
      reduce_dq<Cfg>(P, b, stage, dq, accum_head, m, wg, tid, owed);
      FADSL_BWD_MARK(wg, i, 8);
    }
    FADSL_BWD_MARK(wg, i, 9);
  }
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(3);
  // `deterministic on`: the last m-block's ticket, before the CTA exits
  if constexpr (Cfg::kDeterministic) {
    if (tid == 0 && b.m_count > 0) release_dq_ticket<Cfg>(owed);
  }
  // The last reduce-add has read the staging buffer before the CTA's SMEM goes away
  if constexpr (!Cfg::kDqRed) {
    if (tid == 0) bulk_wait_all();
  }

  // dK, dV per K/V head, or with deterministic GQA per query head (summed over the group after)
  BwdBlock out = b;
  out.head = P.dkv_store == kDkvStorePartial ? b.head : b.head_kv;
  store_grad_kv<Cfg>(dk, P.dk, P.dk_batch_stride, P.dk_row_stride, P.dk_head_stride, P, out, key0, P.softmax_scale);
  store_grad_kv<Cfg>(dv, P.dv, P.dv_batch_stride, P.dv_row_stride, P.dv_head_stride, P, out, key0, 1.f);
  if (wg == 0 && tid == 0) FADSL_BWD_CTA_MARK(4);
}

// ---------------------------------------------------------------------------
// 7. Preprocess and dQ's conversion (256 threads per CTA, 16-byte accesses)
// ---------------------------------------------------------------------------

// `varlen on`: rows [0, cu[0]) and [cu[sequences], tokens) of a gradient belong to no
// sequence; no later kernel writes them, so they are zeroed here (FlashAttention-3 leaves
// them unwritten).  With malformed cu_seqlens (a sequence before row 0, decreasing, past the
// tokens: a sequence bwd_sequence_ok refuses) every row is zeroed, and the main kernel and dQ's conversion
// then write the well-formed sequences' rows (stream order; the forward made O and the LSE
// NaN).  The preprocess's first kZeroCtas CTAs of head 0 (fewer where its grid has fewer)
// do it, 16 bytes a store.  Zeroing
// only these rows, not the whole tensors, saved 63 us of a 1k-token backward (16 x 1024,
// hidden 1024, H200, 2026-11-30: scripts/backward_budget.py).
constexpr int kZeroCtas = 16;

__device__ __forceinline__ void zero_bytes(void* base, int64_t begin, int64_t end) {
  const int64_t first = begin / 16, last = end / 16;  // (rows of 16-byte multiples)
  const int ctas = imin(kZeroCtas, static_cast<int>(gridDim.x));
  uint4* at = static_cast<uint4*>(base);
  for (int64_t i = first + blockIdx.x * 256 + threadIdx.x; i < last; i += ctas * 256) {
    at[i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

__device__ __forceinline__ void zero_outside(void* t, const int* cu, int sequences, int tokens, int row_bytes,
                                             bool valid) {
  if (t == nullptr) return;
  const int64_t bytes = static_cast<int64_t>(tokens) * row_bytes;
  const int64_t begin = valid ? static_cast<int64_t>(cu[0]) * row_bytes : bytes;
  const int64_t end = valid ? static_cast<int64_t>(cu[sequences]) * row_bytes : bytes;
  zero_bytes(t, 0, begin);
  zero_bytes(t, end, bytes);
}

__device__ __forceinline__ void bwd_zero_outside(const BwdPrepParams& P) {
  if (blockIdx.x >= kZeroCtas || blockIdx.y != 0) return;
  bool ok = true;  // every sequence as the main kernel takes it (bwd_sequence_ok)
  for (int b = threadIdx.x; b < P.sequences; b += 256) {
    ok = ok && bwd_sequence_ok(P.cu_seqlens_q[b], P.cu_seqlens_q[b + 1], P.seqlen_q) &&
         bwd_sequence_ok(P.cu_seqlens_k[b], P.cu_seqlens_k[b + 1], P.tokens_k);
  }
  const bool valid = __syncthreads_and(ok);
  zero_outside(P.dq, P.cu_seqlens_q, P.sequences, P.seqlen_q, P.q_row_bytes, valid);
  zero_outside(P.dk, P.cu_seqlens_k, P.sequences, P.tokens_k, P.k_row_bytes, valid);
  zero_outside(P.dv, P.cu_seqlens_k, P.sequences, P.tokens_k, P.k_row_bytes, valid);
}

// The preprocess: 8 elements of a row per thread (one 16-byte load of O and one of dO), so
// head_dim / 8 threads per row and 256 * 8 / head_dim rows per CTA (the host's grid:
// fadsl/targets/sm90/backward/host.py prep_rows_per_cta); the row's threads are adjacent
// lanes of one warp and sum their parts of D by shuffles.
template <class Cfg>
__device__ __forceinline__ void bwd_preprocess_row(const BwdPrepParams& P) {
  using T = typename Cfg::T;
  constexpr int kThreadsPerRow = Cfg::kHeadDim / 8;  // 8 or 16: within a warp
  constexpr int kRowsPerCta = 256 / kThreadsPerRow;
  const int part = threadIdx.x % kThreadsPerRow;
  const int row = blockIdx.x * kRowsPerCta + threadIdx.x / kThreadsPerRow, head = blockIdx.y, batch = blockIdx.z;
  // the query row of padded row `row` (varlen: the CTA's rows lie in one chunk, since
  // kRowsPerCta divides B_r, so in one sequence's padded rows)
  static_assert(Cfg::kBlockM % kRowsPerCta == 0, "a preprocess CTA within one chunk");
  const int chunk = blockIdx.x * kRowsPerCta / Cfg::kBlockM;
  const BwdQueryRows rows = bwd_query_rows<Cfg>(P.cu_seqlens_q, P.sequences, P.seqlen_q, chunk);
  // a chunk with no query (a sequence's padding slot) is never visited by the main kernel
  // nor written by convert_dq: its LSE, D, semaphores and accumulator stay unwritten
  if (!bwd_chunk_holds_query<Cfg>(rows, chunk)) return;
  const bool real = bwd_holds_query<Cfg>(rows, P.seqlen_q, row);
  const int query = bwd_query_of<Cfg>(rows, row);
  float d = 0.f;
  if (real) {
    const T* o = static_cast<const T*>(P.o) + batch * P.o_batch_stride + query * P.o_row_stride + head * P.o_head_stride;
    const T* g = static_cast<const T*>(P.dout) + batch * P.do_batch_stride + query * P.do_row_stride +
                 head * P.do_head_stride;
    // 16-byte aligned: O and dO are rows of head_dim 16-bit elements that TMA reads too
    const uint4 o8 = *reinterpret_cast<const uint4*>(o + 8 * part);
    const uint4 g8 = *reinterpret_cast<const uint4*>(g + 8 * part);
    const uint32_t os[4] = {o8.x, o8.y, o8.z, o8.w}, gs[4] = {g8.x, g8.y, g8.z, g8.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 a = unpack_f32x2<T>(os[e]), b = unpack_f32x2<T>(gs[e]);
      d = fmaf(a.x, b.x, fmaf(a.y, b.y, d));
    }
  }
  // every lane of the warp takes part (rows past the end add zeros)
#pragma unroll
  for (int width = kThreadsPerRow / 2; width > 0; width /= 2) d += __shfl_xor_sync(0xffffffffu, d, width);
  if (row >= P.seqlen_q_rounded) return;
  const int64_t at = (static_cast<int64_t>(batch) * P.heads_q + head) * P.seqlen_q_rounded + row;
  if (part == 0) {
    float lse = -INFINITY;
    if (real) {
      const int64_t at_lse = batch * P.lse_batch_stride + head * P.lse_head_stride + query;
      lse = P.lse[at_lse];
      // dLSE_i / dS_ij = P_ij, so a gradient on the LSE adds P dLSE to dS = P (dP - D):
      // the same as D - dLSE in place of D
      if (P.dlse != nullptr) d -= P.dlse[at_lse];
    }
    P.dpsum[at] = d;
    // a row that saw no key (LSE -inf), or a padding row: P = 2^(S c - inf) = 0
    P.lse_log2[at] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
    // the m-block's semaphores (rows are m-blocks of B_r: seqlen_q_rounded / B_r per head)
    if (P.dq_semaphore != nullptr && row % Cfg::kBlockM == 0) {
#pragma unroll
      for (int share = 0; share < Cfg::kDqSemaphores; ++share) {
        P.dq_semaphore[at / Cfg::kBlockM * Cfg::kDqSemaphores + share] = 0;
      }
    }
  }
  // the row's head_dim floats of dQ's accumulator zeroed: 2 float4 per thread
  float4* zero = reinterpret_cast<float4*>(P.dq_accum + at * Cfg::kHeadDim) + 2 * part;
  zero[0] = zero[1] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// The preprocess kernel's body: with `varlen on` first the gradients' rows outside every
// sequence (bwd_zero_outside), then the CTA's rows.
template <class Cfg>
__device__ __forceinline__ void bwd_preprocess(const BwdPrepParams& P) {
  if constexpr (Cfg::kVarlen) bwd_zero_outside(P);
  bwd_preprocess_row<Cfg>(P);
}

// dQ from the accumulator, one warp per pair of rows (u, u + 8) of a 16-row group, 8 warps
// per CTA (the host's grid: m_blocks B_r / 16 CTAs per (head, batch)): lane L converts
// columns c = 2L (+ 64 j) of both rows. In a warpgroup share's staging order (stage_dq),
// float4 q of thread tid holds, of the share's 64 queries and kDqCols columns, row
// u' = 16 (tid / 32) + (tid % 32) / 4 and u' + 8, columns 8q + 2 (tid % 4) + {0, 1}
// (registers 4q + 2r + e: row u' + 8r, column + e). So the lane reads one whole float4
// (both rows) and the warp's reads are runs of 64 bytes, its writes whole rows. Share s
// covers queries 64s.. (split by queries), columns s kDqCols.. (by panels), or all of
// the m-block (by keys: one share).
//
// Transposed (kDqTransposed: B_r 80; and head_dim 256: share s = head_dim panel s): float4
// q of thread tid holds columns d = 64 s + 16 (tid / 32) + (tid % 32) / 4 and d + 8 of
// queries u = 8q + 2 (tid % 4) and u + 1 (registers 4q + 2r + e: column d + 8r, query
// u + e).  A CTA takes 16 queries (q-groups 2c and 2c + 1 of its m-block); thread (tid) of
// share s = threadIdx.x / 128 (and s + 2 at head_dim 256) reads one float4 of each and
// swaps two values with its partner lane (tid ^ 4: column d ^ 1) so that each holds two
// adjacent columns of one query.
template <class Cfg>
__device__ __forceinline__ void bwd_convert_dq_t(const BwdConvertParams& P) {
  const int row0 = blockIdx.x * 16, head = blockIdx.y, batch = blockIdx.z;
  const int m_block = row0 / Cfg::kBlockM;
  if (m_block >= P.m_blocks) return;
  const BwdQueryRows rows = bwd_query_rows<Cfg>(P.cu_seqlens_q, P.sequences, P.seqlen_q, m_block);
  if (!bwd_chunk_holds_query<Cfg>(rows, m_block)) return;  // a padding slot: nothing to write
#pragma unroll
  for (int round = 0; round < Cfg::kHeadDim / 128; ++round) {  // the CTA's 2 warpgroups take shares 2 round + 0, 1
    const int share = threadIdx.x / 128 + 2 * round, tid = threadIdx.x % 128, lane = tid % 32;
    const bool odd = (lane / 4) % 2 == 1;  // column d odd: takes query u + 1
    const int col = 64 * share + 16 * (tid / 32) + (lane / 4) - (odd ? 1 : 0);  // the pair's first column
    const float* chunk = P.dq_accum + ((static_cast<int64_t>(batch) * P.heads_q + head) * P.m_blocks + m_block) *
                                          (Cfg::kBlockM * Cfg::kHeadDim) + share * Cfg::kDqFloats;
    typename Cfg::T* dq = static_cast<typename Cfg::T*>(P.dq) + batch * P.dq_batch_stride + head * P.dq_head_stride;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int q = (row0 % Cfg::kBlockM) / 8 + half;
      const float4 v = *reinterpret_cast<const float4*>(chunk + (q * 128 + tid) * 4);
      // even d sends its query u + 1 values (v.y, v.w), odd d its query u values (v.x, v.z)
      const float got0 = __shfl_xor_sync(0xffffffffu, odd ? v.x : v.y, 4);
      const float got1 = __shfl_xor_sync(0xffffffffu, odd ? v.z : v.w, 4);
      const float2 lo = odd ? make_float2(got0, v.y) : make_float2(v.x, got0);  // columns col, col + 1
      const float2 hi = odd ? make_float2(got1, v.w) : make_float2(v.z, got1);  // columns col + 8, col + 9
      const int row = m_block * Cfg::kBlockM + 8 * q + 2 * (lane % 4) + (odd ? 1 : 0);
      if (bwd_holds_query<Cfg>(rows, P.seqlen_q, row)) {
        typename Cfg::T* out = dq + bwd_query_of<Cfg>(rows, row) * P.dq_row_stride + col;
        *reinterpret_cast<uint32_t*>(out) =
            pack_f32x2<typename Cfg::T>(lo.x * P.softmax_scale, lo.y * P.softmax_scale);
        *reinterpret_cast<uint32_t*>(out + 8) =
            pack_f32x2<typename Cfg::T>(hi.x * P.softmax_scale, hi.y * P.softmax_scale);
      }
    }
  }
}

template <class Cfg>
__device__ __forceinline__ void bwd_convert_dq_row(const BwdConvertParams& P) {
  if constexpr (Cfg::kDqTransposed || Cfg::kSplitHeadDim) {
    bwd_convert_dq_t<Cfg>(P);
    return;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x * 16 + warp, head = blockIdx.y, batch = blockIdx.z;  // and row + 8
  const int m_block = row / Cfg::kBlockM, q = row % Cfg::kBlockM, u = q % 64;
  if (m_block >= P.m_blocks) return;
  const BwdQueryRows rows = bwd_query_rows<Cfg>(P.cu_seqlens_q, P.sequences, P.seqlen_q, m_block);
  if (!bwd_chunk_holds_query<Cfg>(rows, m_block)) return;  // a padding slot: nothing to write
  const float* chunk = P.dq_accum + ((static_cast<int64_t>(batch) * P.heads_q + head) * P.m_blocks + m_block) *
                                        (Cfg::kBlockM * Cfg::kHeadDim);
  typename Cfg::T* dq = static_cast<typename Cfg::T*>(P.dq) + batch * P.dq_batch_stride + head * P.dq_head_stride;
#pragma unroll
  for (int col = 2 * lane; col < Cfg::kHeadDim; col += 64) {
    const int share = Cfg::kDqByQueries ? q / 64 : col / Cfg::kDqCols, c = col % Cfg::kDqCols;
    const int tid = 32 * (u / 16) + 4 * (u % 8) + (c % 8) / 2;
    const float4 v = *reinterpret_cast<const float4*>(chunk + share * Cfg::kDqFloats + ((c / 8) * 128 + tid) * 4);
    if (bwd_holds_query<Cfg>(rows, P.seqlen_q, row)) {
      *reinterpret_cast<uint32_t*>(dq + bwd_query_of<Cfg>(rows, row) * P.dq_row_stride + col) =
          pack_f32x2<typename Cfg::T>(v.x * P.softmax_scale, v.y * P.softmax_scale);
    }
    if (bwd_holds_query<Cfg>(rows, P.seqlen_q, row + 8)) {
      *reinterpret_cast<uint32_t*>(dq + bwd_query_of<Cfg>(rows, row + 8) * P.dq_row_stride + col) =
          pack_f32x2<typename Cfg::T>(v.z * P.softmax_scale, v.w * P.softmax_scale);
    }
  }
}

}  // namespace fadsl::sm90
