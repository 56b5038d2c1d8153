// fadsl/sm90.cuh -- tile operations of the fadsl sm_90a path (FlashAttention-3's kernel:
// TMA, wgmma, an mbarrier K/V ring, warp specialisation), one device function per step so
// that a generated kernel body is a short list of steps and syncs.
//
// None of these functions waits, arrives or fences: every mbarrier wait/arrive/expect_tx,
// wgmma commit/wait, named barrier and proxy fence is a separate call in the kernel body
// (fadsl/sm90_ptx.cuh), where the compiler's sync plan places it and names its hazard.
// (The one exception is the compiler-only register fence fence_regs(), which is not a
// hardware sync.)
//
// Contents:
//   1. runtime parameters (FwdParamsSm90: 4 tensor maps + the sm80 path's FwdParams)
//   2. the configuration: tile shape, warpgroups, registers, SMEM plan
//   2b. the tile scheduler: which (q block, head, batch) tiles a CTA runs, in which order
//       (fadsl/sm90_tiles.cuh)
//   3. producer steps: TMA loads of the Q tile and of one K or V tile into a ring slot
//   4. consumer steps: S = Q K^T, masking, online softmax, P to 16 bits, O += P V,
//      rescale
//   5. epilogue steps: row sums, normalise, LSE, O into SMEM (stmatrix), TMA store; a tile
//      with no key (fadsl/sm90_epilogue.cuh)
#pragma once

#include <cuda/std/cmath>
#include <cuda/std/cstdint>

#include "params.cuh"  // FwdParams (every target's; next to this file)
#include "sm90_ptx.cuh"  // (next to this file)
#include "sm90_trace.cuh"  // FADSL_TILE_MARK: empty unless FADSL_TILE_TRACE (development builds)

namespace fadsl::sm90 {

// Tags for a loop body instantiated with and without masking (no <type_traits> needed).
struct true_type {
  static constexpr bool value = true;
};
struct false_type {
  static constexpr bool value = false;
};

__host__ __device__ __forceinline__ constexpr int imin(int a, int b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ constexpr int imax(int a, int b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------
// 1. Runtime parameters
// ---------------------------------------------------------------------------

// Passed by value as `const __grid_constant__`, so that TMA reads the tensor maps straight
// from the kernel's parameter space.  Each map is 4-D (head_dim, seqlen, heads, batch)
// with the tensor's strides; boxes are 64 head_dim elements (128 bytes, the 128-byte
// swizzle's width) by a tile's rows, one head, one batch:
//   q: box rows = kBlockM    k, v: box rows = kBlockN    o: box rows = 64 (one warpgroup)
// n / d for the scheduler's runtime divisors (query blocks per head, heads, the GQA group,
// the split count), by a multiply and a shift that the host computed (fadsl/targets/sm90/host/launch.py,
// fast_div): exact for 0 <= n < 2^31, and a few instructions where a division is a long
// dependent chain (the tile boundary computes a tile's coordinates twice per warpgroup).
struct FastDiv {
  uint32_t mul;    // ceil(2^shift / d)
  uint32_t shift;  // 31 + ceil(log2 d)
};

__device__ __forceinline__ int fast_div(int n, FastDiv d) {
  return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * d.mul) >> d.shift);
}

struct FwdParamsSm90 {
  CUtensorMap tma_q;
  CUtensorMap tma_k;
  CUtensorMap tma_v;
  CUtensorMap tma_o;
  FwdParams base;  // pointers, strides, sizes, softmax_scale, LSE (see sm80_ptx.cuh)
  // `tail split_kv` (zeros otherwise): tiles split_start .. tiles - 1 run as `splits` pieces
  // each (split_tile_index); the pieces hand their partial results over in global memory.
  float* split_partials;   // per piece, warpgroup and thread: O's registers, m[2], l[2]
  uint32_t* split_counts;  // per split tile and warpgroup: its pieces done so far (wraps to 0)
  int split_start;
  int splits;
  FastDiv div_m_blocks;  // num_m_blocks
  FastDiv div_heads;     // heads_q
  FastDiv div_group;     // heads_q / heads_kv (query heads per K/V head)
  FastDiv div_splits;    // splits
  // `varlen on` (nullptr otherwise): q, k, v and o packed as (tokens, heads, head_dim), the
  // batch's sequence b at rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1; varlen_tiles
  // (sm90_varlen.cuh) lists the launch's (sequence, q block) tiles, longest K/V loop first.
  const int* cu_seqlens_q;      // batch + 1 prefix sums of the sequences' query rows
  const int* cu_seqlens_k;      // and of their keys
  int4* varlen_tiles;           // two int4 per (sequence, q block): VarlenTile
  int* varlen_tile_count;       // how many varlen_tiles wrote
  // `kv_cache` (nullptr otherwise): K and V from a cache, batch b's first cache_seqlens[b]
  // keys; paged: key j of batch b in page page_table[b * page_table_stride + j / kPageSize]
  // of the (pages, kPageSize, heads_kv, head_dim) cache (fadsl/sm90_kvcache.cuh)
  const int* cache_seqlens;
  const int* page_table;
  int page_table_stride;
  int num_pages;  // pages in the cache (paged; kv_input_bad flags an entry outside them)
  // score and mask modifiers (issue 41; nullptr otherwise): the spec's `input` tensors in
  // their declared order, contiguous, read-only (fadsl/sm90_modifiers.cuh)
  const void* inputs[8];
};

// ---------------------------------------------------------------------------
// 2. Configuration
// ---------------------------------------------------------------------------

template <class T_, int kHeadDim_, int kConsumerWGs_, int kBlockN_, int kStages_, bool kCausal_,
          bool kPersistent_ = true, bool kLazyRescale_ = false, int kInBytes_ = 2>
struct FwdConfig {
  using T = T_;
  // Bytes of a Q, K or V element: 2, or 1 for the FP8 forward (Fp8FwdConfig, fadsl/sm90_fp8.cuh,
  // where T is O's type)
  static constexpr int kInBytes = kInBytes_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWGs = kConsumerWGs_;  // each owns 64 query rows
  static constexpr int kBlockM = 64 * kConsumerWGs;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kPersistent = kPersistent_;  // grid = min(tiles, SMs), or one CTA per tile
  // A row's reference max moves only when the max grows past 2^kRescaleSlack of it (P <= 2^8
  // then: far inside 16-bit and fp32 range), so most blocks skip O's rescale (online_softmax).
  // Generated kernels pass the spec's `rescale` (lazy by default); the default here is
  // FlashAttention-3's rescale after every block.
  static constexpr bool kLazyRescale = kLazyRescale_;
  static constexpr float kRescaleSlack = 8.f;
  // `softcap N`: the scores capped by N tanh(s softmax_scale / N) before the softmax (0: off)
  static constexpr float kSoftcap = 0.f;
  // CTAs per cluster (`cluster 2`: a generated Cfg sets 2). The cluster's CTAs run q-tiles of
  // one (batch, head) and share every K/V block: load_kv_multicast.
  static constexpr int kClusterSize = 1;
  // A sliding window (`mask window(LEFT, RIGHT)`, `mask causal, window(LEFT)`: a generated Cfg
  // sets both, right 0 with the causal mask): query i sees key j iff i + d - kWindowLeft <= j
  // <= i + d + kWindowRight, d = seqlen_k - seqlen_q. -1: no window.
  static constexpr int kWindowLeft = -1;
  static constexpr int kWindowRight = -1;
  // `varlen on` (a generated Cfg sets it): packed sequences of any lengths (FwdParamsSm90's
  // cu_seqlens); each tile's rows and keys are its sequence's (TileWork's q_start, seqlen_q, ...).
  static constexpr bool kVarlen = false;
  // `kv_cache` (a generated Cfg sets these): K/V from a cache of per-batch lengths, in pages
  // of kPageSize rows (0: one contiguous cache per batch); `pack_gqa on`: a tile's rows are
  // (query row, query head of its K/V head) pairs (fadsl/sm90_kvcache.cuh).
  static constexpr bool kKvCache = false;
  static constexpr int kPageSize = 0;
  static constexpr bool kPackGQA = false;
  // Q's wgmma descriptors built again each block (issue_qk) instead of kept in registers
  // across the mainloop: a few integer instructions a block for 8 registers (a generated Cfg
  // sets it where ptxas would otherwise spill them: varlen at head_dim 64, rescale guarded).
  static constexpr bool kQDescPerBlock = false;
  // Score and mask modifiers (issue 41; a generated Cfg sets them and `using Modifiers` to its
  // SpecModifiers): kScore, `score EXPR` applied to S (natural units after it); kKeep, `keep
  // EXPR` as -inf in the blocks its tile rule classes PARTIAL (fadsl/sm90_modifiers.cuh);
  // kScoreByDistance, a score s + f(q_idx - kv_idx) whose f is evaluated once a distance.
  static constexpr bool kScore = false;
  static constexpr bool kScoreByDistance = false;
  static constexpr bool kKeep = false;

  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head_dim 64, 128 or 256");
  static_assert(kConsumerWGs >= 1 && kConsumerWGs <= 3, "1 to 3 consumer warpgroups");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16 && kBlockN <= 256, "B_c: a multiple of 16 up to 256 (wgmma N, TMA box)");
  static_assert(kStages >= 1, "at least one ring slot");

  static constexpr int kThreads = 128 * (1 + kConsumerWGs);  // warpgroup 0 produces
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kConsumerWarps = 4 * kConsumerWGs;
  // setmaxnreg budgets (FlashAttention-3's): producer + consumers fit 64K registers.
  static constexpr int kProducerRegs = kConsumerWGs == 1 ? 56 : (kConsumerWGs == 2 ? 24 : 32);
  static constexpr int kConsumerRegs = kConsumerWGs == 1 ? 256 : (kConsumerWGs == 2 ? 240 : 160);
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= 65536, "register budget");

  // Per-thread register tiles of a consumer (wgmma accumulator layout, sm90_wgmma.cuh).
  static constexpr int kSRegs = kBlockN / 2;   // S = Q K^T, fp32, 64 x B_c per warpgroup
  static constexpr int kPRegs = kBlockN / 4;   // P, 16-bit pairs
  static constexpr int kORegs = kHeadDim / 2;  // O, fp32, 64 x head_dim per warpgroup

  // SMEM plan: tiles are column panels of 64 elements (128-byte rows, 128-byte swizzle).
  static constexpr int kPanels = kHeadDim / 64;
  static constexpr int kRowBytes = 128;
  // Q, K and V as TMA loads them: panels of kInPanelCols elements, rows of kInRowBytes (the
  // 8-bit Fp8FwdConfig's: 128 one-byte columns, or at head_dim 64 one panel of 64)
  static constexpr int kInPanelCols = 64;
  static constexpr int kInRowBytes = kRowBytes;
  static constexpr int kInPanels = kPanels;
  static constexpr int kQBytes = kBlockM * kHeadDim * kInBytes;
  static constexpr int kKVBytes = kBlockN * kHeadDim * kInBytes;  // one ring slot of K or of V
  static constexpr int kOBytes = kBlockM * kHeadDim * 2;
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKVBytes;
  static constexpr int kRingsEnd = kOffV + kStages * kKVBytes;
  // Defaults (a generated kernel's Cfg sets the offsets from plan_smem, which gives O bytes
  // of its own where they fit): O is written after the last wgmma of every consumer, when
  // the K/V rings are dead: it starts at the V ring, or ends where the V ring ends when
  // larger (running into the dead K ring), or takes bytes of its own after the rings when
  // larger than both (8-bit rings of few keys beside a 16-bit O of many rows).
  static constexpr bool kOOverRings = kOBytes <= 2 * kStages * kKVBytes;
  static constexpr int kOffO = kOBytes <= kStages * kKVBytes ? kOffV : (kOOverRings ? kRingsEnd - kOBytes : kRingsEnd);
  static constexpr int kOffBar = kOOverRings ? kRingsEnd : kRingsEnd + kOBytes;
  static_assert(kOffO >= kOffK, "O over the dead K/V rings or after them");
  static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0 && kOffO % 1024 == 0, "1024-byte aligned tiles");
  // mbarriers: q_full, q_empty, o_free, then per slot k_full, k_empty, v_full, v_empty.
  static constexpr int kNumBars = 3 + 4 * kStages;
  static constexpr int kSmemBytes = kOffBar + 8 * kNumBars + 1024;  // + slack to align the base to 1024
  static_assert(kSmemBytes <= 227 * 1024, "SMEM over the sm_90 limit of 227 KB per block");

  // Named barrier ids (0 is __syncthreads).
  static constexpr int kBarRingDead = 1;  // all consumer threads: K/V rings no longer read
  static constexpr int kBarOStore = 2;    // + wg: one warpgroup's O rows are in SMEM
  static constexpr int kBarSched = 5;     // + wg: this warpgroup's turn to issue wgmma
  static constexpr int kSchedThreads = 256;  // the waiting warpgroup + the one handing over
  static constexpr int kBarSplit = 8;        // + wg: a split piece's hand-over (global memory)
};

// Whether the kernel has a sliding window (its Cfg's, not FwdConfig's default).
template <class Cfg>
__host__ __device__ constexpr bool has_window() {
  return Cfg::kWindowLeft >= 0;
}

// Whether a tile's work grows with its query block, so that the scheduler deals the longest
// first (persistent: in pairs of a long and a short one): the causal mask, and a `keep`
// without a mask (prefix-LM: each q block keeps its causal keys or the prefix; measured
// H200, 2026-12-01: the plain order ran prefix_lm at 16k 1.4x slower than ALiBi's causal
// kernel with no prefix at all). Not a sliding window: its tiles run about the same count.
template <class Cfg>
__host__ __device__ constexpr bool longest_tiles_first() {
  return (Cfg::kCausal || Cfg::kKeep) && !has_window<Cfg>();
}

// Position in a ring of kStages slots: the slot, and the phase parity of its barriers in
// the current round (flips each time the ring wraps).
template <int kStages>
struct RingPos {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kStages) {
      slot = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace fadsl::sm90

#include "sm90_tiles.cuh"  // 2b. the tile scheduler (next to this file)

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 3. Producer steps (one elected thread of the producer warpgroup)
// ---------------------------------------------------------------------------

// The CTA's Q tile (kBlockM rows, all head_dim panels: Cfg::kInPanels of kInPanelCols
// elements, 16- or 8-bit) into smem_q; its kQBytes land as complete_tx on `bar`.
template <class Cfg>
__device__ __forceinline__ void load_q(const FwdParamsSm90& P, uint32_t smem_q, uint32_t bar, const TileWork& w) {
#pragma unroll
  for (int panel = 0; panel < Cfg::kInPanels; ++panel) {
    const uint32_t dst = smem_q + panel * Cfg::kBlockM * Cfg::kInRowBytes;
    if constexpr (Cfg::kPackGQA) {  // rows (query row, query head): a (head_dim, G, rows, ...) box
      tma_load_5d(dst, &P.tma_q, bar, Cfg::kInPanelCols * panel, 0, fast_div(w.m0, P.div_group), w.head, w.batch);
    } else {
      tma_load_4d(dst, &P.tma_q, bar, Cfg::kInPanelCols * panel, q_row<Cfg>(w, w.m0), w.head, w.batch);
    }
  }
}

// A paged kv_cache's block n: its keys' pages, one TMA box of min(kBlockN, kPageSize) rows
// each (the cache's map: (head_dim, kPageSize, heads_kv, pages)), at their rows of the slot;
// 8-row multiples keep the swizzle's pattern (1,024 bytes of 128-byte rows, 512 of 64-byte
// ones). Keys past the sequence's last page read that page again (masked, and no page-table
// entry past the sequence's is read); kKVBytes land on `bar` as for a contiguous block.
template <class Cfg>
__device__ __forceinline__ void load_kv_paged(const CUtensorMap* tmap, uint32_t smem_slot, uint32_t bar, int n_block,
                                              const TileWork& w) {
  constexpr int kRows = imin(Cfg::kBlockN, Cfg::kPageSize);
  static_assert(Cfg::kBlockN % kRows == 0 && kRows % 8 == 0, "pages of whole blocks or blocks of whole pages");
  const int last_page = (w.seqlen_k - 1) / Cfg::kPageSize;
#pragma unroll
  for (int part = 0; part < Cfg::kBlockN / kRows; ++part) {
    const int key = n_block * Cfg::kBlockN + part * kRows;
    const int page = w.pages[imin(key / Cfg::kPageSize, last_page)];
#pragma unroll
    for (int panel = 0; panel < Cfg::kInPanels; ++panel) {
      tma_load_4d(smem_slot + (panel * Cfg::kBlockN + part * kRows) * Cfg::kInRowBytes, tmap, bar,
                  Cfg::kInPanelCols * panel, key % Cfg::kPageSize, w.head_kv, page);
    }
  }
}

// K or V block n (kBlockN rows) into one ring slot (with 8-bit inputs V's is the raw slot
// the producer warps transpose into Vt); kKVBytes land on `bar`.
template <class Cfg>
__device__ __forceinline__ void load_kv(const CUtensorMap* tmap, uint32_t smem_slot, uint32_t bar, int n_block,
                                        const TileWork& w) {
  if constexpr (Cfg::kPageSize > 0) {
    load_kv_paged<Cfg>(tmap, smem_slot, bar, n_block, w);
  } else {
#pragma unroll
    for (int panel = 0; panel < Cfg::kInPanels; ++panel) {
      tma_load_4d(smem_slot + panel * Cfg::kBlockN * Cfg::kInRowBytes, tmap, bar, Cfg::kInPanelCols * panel,
                  kv_row<Cfg>(w, n_block * Cfg::kBlockN), w.head_kv, w.batch);
    }
  }
}

// `cluster 2`: this CTA's share of K or V block n, the panels p with p % ctas == rank,
// multicast into the same slot of every CTA of the cluster; each CTA's `bar` receives all
// kKVBytes, its own panels' and its peers'.  A CTA launched alone (`ctas` 1) loads them all.
template <class Cfg>
__device__ __forceinline__ void load_kv_multicast(const CUtensorMap* tmap, uint32_t smem_slot, uint32_t bar,
                                                  int n_block, const TileWork& w, uint32_t rank,
                                                  uint32_t ctas) {
  static_assert(Cfg::kClusterSize == 2 && Cfg::kPanels % 2 == 0, "pairs, each loading half the panels");
  constexpr uint16_t kAllCtas = (1u << Cfg::kClusterSize) - 1u;
  if (ctas == 1u) {  // launched alone (the producer's one thread: a uniform branch)
    load_kv<Cfg>(tmap, smem_slot, bar, n_block, w);
    return;
  }
#pragma unroll
  for (int i = 0; i < Cfg::kPanels / Cfg::kClusterSize; ++i) {
    const int panel = i * Cfg::kClusterSize + static_cast<int>(rank);
    tma_load_4d_multicast(smem_slot + panel * Cfg::kBlockN * Cfg::kRowBytes, tmap, bar, kAllCtas, 64 * panel,
                          n_block * Cfg::kBlockN, w.head_kv, w.batch);
  }
}

// ---------------------------------------------------------------------------
// 4. Consumer steps (one warpgroup, 64 query rows)
// ---------------------------------------------------------------------------
// Register tiles use the wgmma accumulator layout: d[4j + 2r + e] is (row 16 * warp + g +
// 8r, col 8j + 2t + e) of the warpgroup's tile, g = lane / 4, t = lane % 4.  Each thread
// owns two rows (r = 0, 1); a row's values are spread over the 4 threads of a quad.

// Issue S = Q K^T (64 x kBlockN) over one K slot: head_dim / 16 wgmma, both operands
// K-major in SMEM.  smem_q_wg: the warpgroup's first Q row in panel 0.  K's descriptors
// move from the slot's (desc_advance); Q's, the same every block, ptxas keeps out of the loop.
template <class Cfg>
__device__ __forceinline__ void issue_qk(float (&s)[Cfg::kSRegs], uint32_t smem_q_wg, uint32_t smem_k_slot) {
  // the address hidden from ptxas, so that it cannot hoist Q's descriptors out of the loop
  if constexpr (Cfg::kQDescPerBlock) asm volatile("" : "+r"(smem_q_wg));
  const uint64_t k0 = make_desc_kmajor_sw128(smem_k_slot);
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    const uint32_t panel = kk / 4, k_bytes = (kk % 4) * 32;
    const uint64_t desc_q = make_desc_kmajor_sw128(smem_q_wg + panel * Cfg::kBlockM * Cfg::kRowBytes + k_bytes);
    const uint64_t desc_k = desc_advance(k0, panel * Cfg::kBlockN * Cfg::kRowBytes + k_bytes);
    Wgmma<Cfg::kBlockN>::template ss<typename Cfg::T, 0, 0>(s, desc_q, desc_k, kk > 0 ? 1u : 0u);
  }
}

// Issue O += P V over one V slot: kBlockN / 16 wgmma, P from registers (A), V MN-major
// in SMEM (head_dim contiguous: transposed B).
template <class Cfg>
__device__ __forceinline__ void issue_pv(float (&o)[Cfg::kORegs], const uint32_t (&p)[Cfg::kPRegs],
                                         uint32_t smem_v_slot) {
  constexpr uint32_t kPanelBytes = Cfg::kBlockN * Cfg::kRowBytes;
  const uint64_t v0 = make_desc_mnmajor_sw128(smem_v_slot, kPanelBytes);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
    const uint64_t desc_v = desc_advance(v0, kk * 16 * Cfg::kRowBytes);
    Wgmma<Cfg::kHeadDim>::template rs<typename Cfg::T, 1>(o, a, desc_v, 1u);
  }
}

// Per-thread row bounds for masking: key column c (relative to the block) of row r is
// kept iff c < limit[r] - 2t.  Rows end at seqlen_k and, causal, after their diagonal.
struct RowLimits {
  int row0;  // index in its sequence of this thread's row r = 0 (row 1 is row0 + 8)
  int seqlen_q, seqlen_k;  // the sequence's (read with varlen; a padded batch's are FwdParams')
};

template <class Cfg>
__device__ __forceinline__ RowLimits row_limits(const TileWork& w, int wg, int warp, int lane) {
  return RowLimits{w.m0 + 64 * wg + 16 * warp + lane / 4, w.seqlen_q, w.seqlen_k};
}

// s = -inf in this thread's row r where the key's column in the block (8j + 2t + e) is below
// `begin`, relative to this thread's first column (a sliding window's left edge).
template <class Cfg>
__device__ __forceinline__ void mask_before(float (&s)[Cfg::kSRegs], int r, int begin) {
#pragma unroll
  for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (8 * j + e < begin) s[4 * j + 2 * r + e] = -INFINITY;
    }
  }
}

// s = -inf where key n_block * kBlockN + col is at or past seqlen_k or (causal) past the
// row's diagonal, or outside the row's sliding window.
template <class Cfg>
__device__ __forceinline__ void mask_scores(float (&s)[Cfg::kSRegs], const FwdParams& p, const RowLimits& rows,
                                            int n_block, int lane) {
  const int col0 = n_block * Cfg::kBlockN + 2 * (lane % 4);
  const int len_q = Cfg::kVarlen ? rows.seqlen_q : p.seqlen_q;
  const int len_k = Cfg::kVarlen || Cfg::kKvCache ? rows.seqlen_k : p.seqlen_k;
  const int group = Cfg::kPackGQA ? p.heads_q / p.heads_kv : 1;  // packed rows per query row
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    int end = len_k;
    if constexpr (has_window<Cfg>()) {
      // the padding rows past seqlen_q as its last row (window_work counts on it)
      const int on_diagonal = imin(rows.row0 + 8 * r, len_q - 1) + len_k - len_q;
      end = imin(end, on_diagonal + Cfg::kWindowRight + 1);
      mask_before<Cfg>(s, r, on_diagonal - Cfg::kWindowLeft - col0);
    } else if constexpr (Cfg::kCausal) {
      const int query = Cfg::kPackGQA ? (rows.row0 + 8 * r) / group : rows.row0 + 8 * r;
      end = imin(end, query + len_k - len_q + 1);
    }
    end -= col0;
#pragma unroll
    for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (8 * j + e >= end) s[4 * j + 2 * r + e] = -INFINITY;
      }
    }
  }
}

// `softcap N`: S <- (N log2 e / c) tanh(S c / (N log2 e)), so that S c, the score in log2
// units the softmax takes, is N log2(e) tanh(s softmax_scale / N): capped at N log2 e, and
// every later factor bounded with it. Before the mask (a masked -inf stays -inf). tanh(x) =
// 1 - 2 / (2^(2x log2 e) + 1) with one ex2 and one rcp: an absolute error of about 2^-21
// (tanh.approx.f32's 2^-11 relative would move a score capped at 30 by 0.015); 2^(..) = inf
// gives 1, 0 gives -1.
struct SoftcapMap {
  float into;  // 2 c / N: a score times it is 2 s softmax_scale log2(e) / N
  float out;   // N log2(e) / c: tanh times it is the capped score in S's units
};
__device__ __forceinline__ SoftcapMap softcap_map(float cap, float scale_log2) {
  return {scale_log2 * (2.f / cap), cap * 1.4426950408889634f * fast_rcp(scale_log2)};
}
// One score capped; e = 2^(S into) and r = 1 / (e + 1) for the backward's derivative
// (bwd_softcap; unused, and so not kept, in the forward).
__device__ __forceinline__ float capped_score(float s, SoftcapMap map, float& e, float& r) {
  e = fast_exp2(s * map.into);
  r = fast_rcp(e + 1.f);
  return map.out * (1.f - 2.f * r);
}

template <class Cfg>
__device__ __forceinline__ void apply_softcap(float (&s)[Cfg::kSRegs], float scale_log2) {
  if constexpr (Cfg::kSoftcap > 0.f) {
    const SoftcapMap map = softcap_map(Cfg::kSoftcap, scale_log2);
#pragma unroll
    for (int i = 0; i < Cfg::kSRegs; ++i) {
      float e, r;
      s[i] = capped_score(s[i], map, e, r);
    }
  }
}

// A row whose max is still -inf has seen no key: use 0 as its reference so that
// 2^(-inf - ref) = 0 rather than NaN.
__device__ __forceinline__ float scaled_max(float row_max, float scale_log2) {
  return row_max == -INFINITY ? 0.f : row_max * scale_log2;
}

// Online softmax on S (in place, S becomes the unnormalised P in fp32):
//   m_new = max(m, rowmax(S));  scale = 2^((m - m_new) * c);  S = 2^(S * c - m_new * c);
//   l = l * scale + rowsum(S) (this thread's partial sum);  m = m_new,
// with c = softmax_scale * log2(e).  O is rescaled by `scale` separately (rescale_o),
// when no wgmma is using it.  kLazyRescale: m_new stays m (scale = 1) unless the row's max
// grew past 2^kRescaleSlack of it; the result is the same (P, l and O all refer to m), only
// the reference moves less often (FlashAttention-4's conditional rescale).
// Row r of this thread's S (in place): P = 2^(S c - ref); returns their sum.
template <class Cfg>
__device__ __forceinline__ float exp2_row(float (&s)[Cfg::kSRegs], int r, float ref, float scale_log2) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x = s[4 * j + 2 * r + e];
      x = fast_exp2(fmaf(x, scale_log2, -ref));
      sum += x;
    }
  }
  return sum;
}

template <class Cfg>
__device__ __forceinline__ void online_softmax(float (&s)[Cfg::kSRegs], float (&m)[2], float (&l)[2],
                                               float (&scale)[2], float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m[r];
#pragma unroll
    for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
      mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // Lazy: m = -inf and a finite max give inf > slack, so a row's first key always sets
    // m; a row that still has no key (both -inf) gives NaN, false, and keeps m = -inf.
    const bool keep = Cfg::kLazyRescale && !((mx - m[r]) * scale_log2 > Cfg::kRescaleSlack);
    if (keep) mx = m[r];
    const float ref = scaled_max(mx, scale_log2);
    // 1 exactly when m is kept (rescale_o tests for it); m = -inf (nothing seen yet): 0.
    // From the rounded references the P were taken against, m c as exp2_row rounded it and
    // ref (an fma with the exact m c would leave half an ulp of |m c| per move, and the
    // moves' errors would add up: 3.5 % over 256 moves at |S c| = 2^12)
    scale[r] = keep ? 1.f : fast_exp2(__fmul_rn(m[r], scale_log2) - ref);
    const float sum = exp2_row<Cfg>(s, r, ref, scale_log2);
    l[r] = l[r] * scale[r] + sum;
    m[r] = mx;
  }
}

// P (fp32, accumulator layout) -> 16-bit pairs, which is the RS A-operand layout:
// p[i] = (s[2i], s[2i + 1]).
template <class Cfg>
__device__ __forceinline__ void convert_p(const float (&s)[Cfg::kSRegs], uint32_t (&p)[Cfg::kPRegs]) {
#pragma unroll
  for (int i = 0; i < Cfg::kPRegs; ++i) p[i] = pack_f32x2<typename Cfg::T>(s[2 * i], s[2 * i + 1]);
}

template <class Cfg>
__device__ __forceinline__ void rescale_o(float (&o)[Cfg::kORegs], const float (&scale)[2]) {
  if constexpr (Cfg::kLazyRescale) {
    // Most blocks keep every row's reference (scale exactly 1): then the warp skips the
    // multiplies.  A warp-uniform branch, so no lane diverges around the wgmma code.
    if (!__any_sync(0xffffffffu, scale[0] != 1.f || scale[1] != 1.f)) return;
  }
#pragma unroll
  for (int j = 0; j < Cfg::kHeadDim / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      o[4 * j + 2 * r] *= scale[r];
      o[4 * j + 2 * r + 1] *= scale[r];
    }
  }
}

}  // namespace fadsl::sm90

#include "sm90_epilogue.cuh"  // 5. the epilogue steps (next to this file)
#include "sm90_modifiers.cuh"  // score and mask modifiers (next to this file)
#include "sm90_guard.cuh"  // rescale guarded: the softmax without its row max (next to this file)
#include "sm90_varlen.cuh"  // varlen on: the packed sequences' tile list and scheduler (next to this file)
#include "sm90_kvcache.cuh"  // kv_cache, pack_gqa, splits auto: the combine kernel (next to this file)
