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
//   3. producer steps: TMA loads of the Q tile and of one K or V tile into a ring slot
//   4. consumer steps: S = Q K^T, masking, online softmax, P to 16 bits, O += P V,
//      rescale
//   5. epilogue steps: row sums, normalise, LSE, O into SMEM (stmatrix), TMA store; a tile
//      with no key
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
};

// ---------------------------------------------------------------------------
// 2. Configuration
// ---------------------------------------------------------------------------

template <class T_, int kHeadDim_, int kConsumerWGs_, int kBlockN_, int kStages_, bool kCausal_,
          bool kPersistent_ = true, bool kLazyRescale_ = false>
struct FwdConfig {
  using T = T_;
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
  // (query row, query head of its K/V head) pairs; `splits auto`: every tile's K/V blocks
  // split into pieces whose partials <kernel>_combine adds up (fadsl/sm90_kvcache.cuh).
  static constexpr bool kKvCache = false;
  static constexpr int kPageSize = 0;
  static constexpr bool kPackGQA = false;
  static constexpr bool kSplitAll = false;

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
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one ring slot of K or of V
  static constexpr int kOBytes = kBlockM * kHeadDim * 2;
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKVBytes;
  static constexpr int kOffBar = kOffV + kStages * kKVBytes;
  // Defaults (a generated kernel's Cfg sets the offsets from plan_smem, which gives O bytes
  // of its own where they fit): O is written after the last wgmma of every consumer, when
  // the K/V rings are dead: it starts at the V ring, or ends where the V ring ends when
  // larger (running into the dead K ring).
  static constexpr int kOffO = kOBytes <= kStages * kKVBytes ? kOffV : kOffBar - kOBytes;
  static_assert(kOffO >= kOffK, "O must fit over the dead K/V rings");
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

// One tile of the launch: 128 (kBlockM) query rows of one (batch, head).
struct TileCoord {
  int m_block, head, batch;
};

// Which tiles this CTA runs, and in which order.  Tiles are numbered query block
// fastest, then head, then batch, so that the CTAs running at once work on few heads and
// share their K and V through L2.
//   kPersistent (`scheduler persistent`): grid = min(tiles, SMs); CTA c runs steps
//     s = 0, 1, ...  Without a mask, step s is tile c + s * gridDim.x.  Causal: tiles go
//     in pairs of a head's long and short query block (m = num_m - 1 - i, then i: the
//     pair's blocks add up to num_m + 1), the CTA running pairs c, c + gridDim.x, ..., so
//     that every CTA gets the same work however long each tile is.
//   grid (`scheduler grid`): one CTA per tile, the hardware handing out tiles as SMs
//     free up; causal puts the longest query blocks first.
//   A sliding window (causal or not) takes the plain order either way: its tiles run about
//     the same number of blocks (a few at the sequence's ends fewer), so pairs would not
//     balance anything.
// (Functions of the launch's parameters, read from the constant bank at each call:
// nothing of the scheduler stays in registers across a tile but the step.)
// Query blocks per (batch, head), rounded up to a multiple of the launch's CTAs per cluster,
// so that the CTAs of a cluster, which run consecutive tiles, stay on one head.  (The host
// launches pairs only for an even count; were it odd, the block past seqlen_q would run its
// K/V loop on zero-filled Q rows and store nothing: TMA clips its O rows, store_lse skips
// them.)  fadsl/targets/sm90/host/launch.py's m_blocks is the host's copy.
// `pack_gqa on`: the query heads of a K/V head share its tiles' rows (row r: query row r / G
// of query head r % G, G = heads_q / heads_kv), so a head's tiles cover seqlen_q x G rows.
template <class Cfg>
__device__ __forceinline__ int tile_rows(const FwdParams& p) {
  if constexpr (Cfg::kPackGQA) return p.seqlen_q * (p.heads_q / p.heads_kv);
  return p.seqlen_q;
}

template <class Cfg>
__device__ __forceinline__ int tile_heads(const FwdParams& p) {
  if constexpr (Cfg::kPackGQA) return p.heads_kv;
  return p.heads_q;
}

template <class Cfg>
__device__ __forceinline__ int num_m_blocks(const FwdParams& p) {
  const int blocks = (tile_rows<Cfg>(p) + Cfg::kBlockM - 1) / Cfg::kBlockM;
  if constexpr (Cfg::kClusterSize > 1) {
    const int round = static_cast<int>(cluster_nctarank()) - 1;  // 0 or 1: no division
    return (blocks + round) & ~round;
  }
  return blocks;
}

// The index of the CTA's tile at step `step`, or -1 when it has no more tiles (the host
// keeps the tile count under 2^30, so no index here overflows).
template <class Cfg>
__device__ __forceinline__ int tile_index(const FwdParams& p, int step) {
  const int ctas = gridDim.x, cta = blockIdx.x;
  int t = cta;  // one CTA per tile (the grid has exactly one per tile): step 0 only
  if constexpr (Cfg::kPersistent && Cfg::kCausal && !has_window<Cfg>()) {
    t = 2 * (cta + (step / 2) * ctas) + (step & 1);
  } else if constexpr (Cfg::kPersistent) {
    t = cta + step * ctas;
  } else if (step > 0) {
    return -1;
  }
  return t < num_m_blocks<Cfg>(p) * tile_heads<Cfg>(p) * p.batch ? t : -1;
}

template <class Cfg>
__device__ __forceinline__ TileCoord tile_coords(const FwdParamsSm90& P, int t) {
  const int m = num_m_blocks<Cfg>(P.base);
  const int bh = fast_div(t, P.div_m_blocks), j = t - bh * m;
  TileCoord c;
  if constexpr (Cfg::kCausal && Cfg::kPersistent && !has_window<Cfg>()) {
    c.m_block = (j & 1) ? j / 2 : m - 1 - j / 2;  // num_m - 1, 0, num_m - 2, 1, ...
  } else {
    c.m_block = Cfg::kCausal && !has_window<Cfg>() ? m - 1 - j : j;  // causal: long rows first
  }
  c.batch = fast_div(bh, P.div_heads);
  c.head = bh - c.batch * tile_heads<Cfg>(P.base);
  return c;
}

// A tile and its K/V range.  Blocks are visited from the last (n_blocks - 1) down to 0,
// so the ones that need masking (the seqlen_k tail, the causal diagonal) come first:
// iterations it < n_masked mask, the rest do not.  A sliding window's tile visits blocks
// block_end - 1 down to block_end - n_blocks, and its iterations from masked_from on (the
// window's left edge) mask too.
struct TileWork {
  int m_block, head, batch, head_kv;
  int m0;         // first query row of the tile
  int n_blocks;   // K/V blocks visited (0: the tile's rows see no key; store_empty_tile)
  int n_masked;   // leading iterations that need masking
  int masked_from;  // a window: the trailing iterations that mask start here (else n_blocks)
  // tail split_kv: a piece visits blocks block_end - 1 down to block_end - n_blocks
  int block_end;   // n_blocks for a whole tile
  int split;       // the piece's index among its tile's, -1 for a whole tile
  int split_tile;  // the tile's index among the launch's split tiles
  // varlen: the sequence's first query row and key in the packed tensors, and its lengths
  // (read through seqlen_q/seqlen_k/q_row/kv_row, which give FwdParams' for padded batches)
  int q_start, seqlen_q, k_start, seqlen_k;
  const int* pages;  // a paged kv_cache: the batch's row of the page table
};

// The tile's sequence lengths: FwdParams' for a padded batch, its own sequence's with varlen.
template <class Cfg>
__device__ __forceinline__ int seqlen_q(const FwdParams& p, const TileWork& w) {
  if constexpr (Cfg::kVarlen) return w.seqlen_q;
  return p.seqlen_q;
}

template <class Cfg>
__device__ __forceinline__ int seqlen_k(const FwdParams& p, const TileWork& w) {
  if constexpr (Cfg::kVarlen || Cfg::kKvCache) return w.seqlen_k;
  return p.seqlen_k;
}

// Row `row` of the tile's sequence as a row of the tensor (TMA's row coordinate): packed
// sequences start at q_start / k_start, a padded batch's at 0 of its own batch index.
template <class Cfg>
__device__ __forceinline__ int q_row(const TileWork& w, int row) {
  if constexpr (Cfg::kVarlen) return w.q_start + row;
  return row;
}

template <class Cfg>
__device__ __forceinline__ int kv_row(const TileWork& w, int row) {
  if constexpr (Cfg::kVarlen) return w.k_start + row;
  return row;
}

// A sliding window's K/V range (tile_work): row i sees keys [i + d - L, i + d + R] of
// [0, seqlen_k), d = seqlen_k - seqlen_q.  The tile's rows m0 .. last (its last row below
// seqlen_q: mask_scores masks the padding rows past it as that row, so that none of them has
// no key in a block that runs unmasked) see keys kv_begin .. kv_end - 1, the blocks of which
// the tile visits, from the last; every row sees all of [last + d - L, m0 + d + R].  Leading
// iterations mask (the right edge) down to the block of key m0 + d + R, row m0's last: so
// every row has a finite max before the first unmasked block, which `rescale guarded` runs
// without the row max.  Trailing ones mask from the first block with a key left of
// last + d - L (the left edge).  No key at all (kv_begin >= kv_end): n_blocks = 0.
template <class Cfg>
__device__ __forceinline__ void window_work(TileWork& w, int seqlen_q, int seqlen_k) {
  constexpr int kLeft = Cfg::kWindowLeft, kRight = Cfg::kWindowRight, kN = Cfg::kBlockN;
  const int diag = seqlen_k - seqlen_q;
  const int last = imin(w.m0 + Cfg::kBlockM, seqlen_q) - 1;
  const int kv_begin = imax(0, w.m0 + diag - kLeft);
  const int kv_end = imin(seqlen_k, last + diag + kRight + 1);
  const int first_block = kv_begin / kN;
  w.block_end = kv_end > kv_begin ? (kv_end + kN - 1) / kN : first_block;
  w.n_blocks = w.block_end - first_block;
  // blocks below this one need no right-edge mask (-1 when row m0 sees no key: all mask)
  const int right_full = imin(seqlen_k, w.m0 + diag + kRight + 1) - 1;
  const int unmasked_end = right_full < 0 ? first_block : imax(first_block, right_full / kN);
  w.n_masked = w.block_end - imin(w.block_end, unmasked_end);
  // blocks below this one need a left-edge mask
  const int left_full = imax(0, last + diag - kLeft);
  const int left_masked = imin(w.n_blocks, imax(0, (left_full + kN - 1) / kN - first_block));
  w.masked_from = imax(w.n_masked, w.n_blocks - left_masked);
}

// The tile's K/V blocks (w.m0 set): how many, which mask, for sequences of these lengths.
template <class Cfg>
__device__ __forceinline__ void kv_work(TileWork& w, int seqlen_q, int seqlen_k, int group = 1) {
  w.split = -1;
  w.split_tile = 0;
  if constexpr (has_window<Cfg>()) {
    window_work<Cfg>(w, seqlen_q, seqlen_k);
    return;
  }
  // Causal, aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q.
  const int diag = seqlen_k - seqlen_q;
  int kv_end = seqlen_k;
  int kv_full_end = seqlen_k;  // keys below this need no mask for any row of the tile
  if constexpr (Cfg::kCausal) {
    // the tile's query rows: m0 .. m0 + kBlockM - 1, or with pack_gqa those rows / group
    const int first = Cfg::kPackGQA ? w.m0 / group : w.m0;
    const int end = Cfg::kPackGQA ? (w.m0 + Cfg::kBlockM - 1) / group + 1 : w.m0 + Cfg::kBlockM;
    kv_end = imin(kv_end, imax(0, end + diag));
    kv_full_end = imin(kv_full_end, imax(0, first + 1 + diag));
  }
  w.n_blocks = (kv_end + Cfg::kBlockN - 1) / Cfg::kBlockN;
  w.n_masked = w.n_blocks - imin(w.n_blocks, kv_full_end / Cfg::kBlockN);
  w.masked_from = w.n_blocks;
  w.block_end = w.n_blocks;
}

template <class Cfg>
__device__ __forceinline__ TileWork tile_work(const FwdParamsSm90& P, const TileCoord& c) {
  TileWork w;
  w.m_block = c.m_block;
  w.head = c.head;
  w.batch = c.batch;
  w.head_kv = Cfg::kPackGQA ? w.head : fast_div(w.head, P.div_group);
  w.m0 = w.m_block * Cfg::kBlockM;
  w.q_start = w.k_start = 0;  // (read only with varlen)
  w.seqlen_q = P.base.seqlen_q;
  // a cache's length, clamped to its capacity (FwdParams' seqlen_k): no read past the cache
  w.seqlen_k = Cfg::kKvCache ? imin(imax(P.cache_seqlens[w.batch], 0), P.base.seqlen_k) : P.base.seqlen_k;
  if constexpr (Cfg::kPageSize > 0) w.pages = P.page_table + static_cast<int64_t>(w.batch) * P.page_table_stride;
  kv_work<Cfg>(w, P.base.seqlen_q, w.seqlen_k, Cfg::kPackGQA ? P.base.heads_q / P.base.heads_kv : 1);
  return w;
}

// tail split_kv (persistent, no mask): the host's split plan (fadsl/targets/sm90/host/launch.py, split_plan)
// leaves tiles 0 .. split_start - 1 whole, a multiple of the grid (whole rounds), and
// splits each of the others, the launch's last, part-full round, into `splits` pieces of
// the K/V blocks, so that the CTAs idle in that round share it.  Work item i < split_start
// is tile i; then piece p = i - split_start is piece p % splits of tile split_start +
// p / splits.  Each CTA runs items c, c + gridDim.x, ... as the plain scheduler does.
template <class Cfg>
__device__ __forceinline__ int split_tile_index(const FwdParamsSm90& P, int step) {
  const int tiles = num_m_blocks<Cfg>(P.base) * tile_heads<Cfg>(P.base) * P.base.batch;
  const int items = P.split_start + (tiles - P.split_start) * P.splits;
  const int i = blockIdx.x + step * gridDim.x;
  return i < items ? i : -1;
}

// The work of item i: a whole tile, or the piece's blocks [lo, hi) of its tile's n
// (balanced: lo = split * n / splits), visited from hi - 1 down; only the piece holding
// the tile's last blocks has masked iterations.
template <class Cfg>
__device__ __forceinline__ TileWork split_tile_work(const FwdParamsSm90& P, int i) {
  if (i < P.split_start) return tile_work<Cfg>(P, tile_coords<Cfg>(P, i));
  const int piece = i - P.split_start;
  const int split_tile = fast_div(piece, P.div_splits);
  TileWork w = tile_work<Cfg>(P, tile_coords<Cfg>(P, P.split_start + split_tile));
  const int n = w.n_blocks, masked_from = w.n_blocks - w.n_masked;
  w.split = piece - split_tile * P.splits;
  w.split_tile = split_tile;
  const int lo = fast_div(w.split * n, P.div_splits);
  w.block_end = fast_div((w.split + 1) * n, P.div_splits);
  w.n_blocks = w.block_end - lo;
  w.n_masked = imax(0, w.block_end - imax(lo, masked_from));
  w.masked_from = w.n_blocks;
  return w;
}

// Phase parity of the per-tile barriers (Q's, O's) in the CTA's tile number t.
__device__ __forceinline__ uint32_t tile_phase(int t) { return static_cast<uint32_t>(t) & 1u; }

// ---------------------------------------------------------------------------
// 3. Producer steps (one elected thread of the producer warpgroup)
// ---------------------------------------------------------------------------

// The CTA's Q tile (kBlockM rows, all head_dim panels) into smem_q; its kQBytes land as
// complete_tx on `bar`.
template <class Cfg>
__device__ __forceinline__ void load_q(const FwdParamsSm90& P, uint32_t smem_q, uint32_t bar, const TileWork& w) {
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    if constexpr (Cfg::kPackGQA) {  // rows (query row, query head): a (head_dim, G, rows, ...) box
      tma_load_5d(smem_q + panel * Cfg::kBlockM * Cfg::kRowBytes, &P.tma_q, bar, 64 * panel, 0,
                  fast_div(w.m0, P.div_group), w.head, w.batch);
    } else {
      tma_load_4d(smem_q + panel * Cfg::kBlockM * Cfg::kRowBytes, &P.tma_q, bar, 64 * panel, q_row<Cfg>(w, w.m0),
                  w.head, w.batch);
    }
  }
}

// A paged kv_cache's block n: its keys' pages, one TMA box of min(kBlockN, kPageSize) rows
// each (the cache's map: (head_dim, kPageSize, heads_kv, pages)), at their rows of the slot;
// 8-row multiples keep the 128-byte swizzle's 1024-byte pattern. Keys past the sequence's
// last page read that page again (masked, and no page-table entry past the sequence's is
// read); kKVBytes land on `bar` as for a contiguous block.
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
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      tma_load_4d(smem_slot + (panel * Cfg::kBlockN + part * kRows) * Cfg::kRowBytes, tmap, bar, 64 * panel,
                  key % Cfg::kPageSize, w.head_kv, page);
    }
  }
}

// K or V block n (kBlockN rows) into one ring slot; kKVBytes land on `bar`.
template <class Cfg>
__device__ __forceinline__ void load_kv(const CUtensorMap* tmap, uint32_t smem_slot, uint32_t bar, int n_block,
                                        const TileWork& w) {
  if constexpr (Cfg::kPageSize > 0) {
    load_kv_paged<Cfg>(tmap, smem_slot, bar, n_block, w);
    return;
  }
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    tma_load_4d(smem_slot + panel * Cfg::kBlockN * Cfg::kRowBytes, tmap, bar, 64 * panel,
                kv_row<Cfg>(w, n_block * Cfg::kBlockN), w.head_kv, w.batch);
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
template <class Cfg>
__device__ __forceinline__ void apply_softcap(float (&s)[Cfg::kSRegs], float scale_log2) {
  if constexpr (Cfg::kSoftcap > 0.f) {
    constexpr float kCapLog2 = Cfg::kSoftcap * 1.4426950408889634f;
    const float into = scale_log2 * (2.f / Cfg::kSoftcap), out = kCapLog2 * fast_rcp(scale_log2);
#pragma unroll
    for (int i = 0; i < Cfg::kSRegs; ++i) {
      const float e = fast_exp2(s[i] * into);
      s[i] = out * (1.f - 2.f * fast_rcp(e + 1.f));
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

// ---------------------------------------------------------------------------
// 5. Epilogue steps
// ---------------------------------------------------------------------------

// Add up the 4 partial row sums of each quad.
__device__ __forceinline__ void row_sum_quad(float (&l)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
}

// O /= l; a row with l == 0 (it saw no key) becomes 0.
template <class Cfg>
__device__ __forceinline__ void normalize_o(float (&o)[Cfg::kORegs], const float (&l)[2]) {
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = l[r] == 0.f ? 0.f : 1.f / l[r];
  rescale_o<Cfg>(o, inv);
}

// `pack_gqa on`: row r of the tile is query row r / G of query head head * G + r % G.
template <class Cfg>
__device__ __forceinline__ void store_lse_packed(const FwdParams& p, const TileWork& w, const RowLimits& rows,
                                                 const float (&m)[2], const float (&l)[2], float scale_log2) {
  const int group = p.heads_q / p.heads_kv;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = rows.row0 + 8 * r, query = row / group, head = w.head * group + row % group;
    if (query < p.seqlen_q) {
      p.lse[w.batch * p.lse_batch_stride + head * p.lse_head_stride + query] =
          l[r] == 0.f ? -INFINITY : (m[r] * scale_log2 + log2f(l[r])) * 0.6931471805599453f;
    }
  }
}

// LSE (natural log) of this thread's two rows: (m * c + log2 l) * ln 2, -inf when l == 0;
// written by lane t == 0 of each quad, for rows < seqlen_q, if p.lse is set.
template <class Cfg>
__device__ __forceinline__ void store_lse(const FwdParams& p, const TileWork& w, const RowLimits& rows,
                                          const float (&m)[2], const float (&l)[2], float scale_log2, int lane) {
  if (p.lse == nullptr || lane % 4 != 0) return;
  if constexpr (Cfg::kPackGQA) {
    store_lse_packed<Cfg>(p, w, rows, m, l, scale_log2);
    return;
  }
  // varlen: (heads, tokens), the sequence's rows from q_start
  float* lse = p.lse + w.batch * p.lse_batch_stride + w.head * p.lse_head_stride + q_row<Cfg>(w, 0);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = rows.row0 + 8 * r;
    if (row < seqlen_q<Cfg>(p, w)) {
      lse[row] = l[r] == 0.f ? -INFINITY : (m[r] * scale_log2 + log2f(l[r])) * 0.6931471805599453f;
    }
  }
}

// O (fp32 registers) -> 16 bits -> the warpgroup's 64 rows of the O tile in SMEM, in the
// TMA store's 128-byte-swizzled panel layout, one stmatrix.x4 per 16 x 16 piece.
// smem_o_wg: the warpgroup's first row in panel 0 (panels are kBlockM rows apart).
template <class Cfg>
__device__ __forceinline__ void store_o_smem(const float (&o)[Cfg::kORegs], uint32_t smem_o_wg, int warp, int lane) {
  using T = typename Cfg::T;
  const int mat = lane / 8;                                  // which of the 4 matrices this lane addresses
  const int row = 16 * warp + (lane % 8) + 8 * (mat & 1);    // row within the warpgroup's 64
  const int col_in16 = 8 * (mat >> 1);
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    const int col = 16 * kk + col_in16;
    const uint32_t addr = smem_o_wg + (col / 64) * Cfg::kBlockM * Cfg::kRowBytes +
                          swizzle128(row * Cfg::kRowBytes + (col % 64) * 2);
    stmatrix_x4(addr, pack_f32x2<T>(o[8 * kk], o[8 * kk + 1]), pack_f32x2<T>(o[8 * kk + 2], o[8 * kk + 3]),
                pack_f32x2<T>(o[8 * kk + 4], o[8 * kk + 5]), pack_f32x2<T>(o[8 * kk + 6], o[8 * kk + 7]));
  }
}

// The warpgroup's 64 O rows from SMEM to GMEM (rows past seqlen_q are clipped by TMA).
// varlen: rows past the sequence belong to the next one, so O's map is ragged (fadsl/targets/
// sm90/host/tma.py, ragged_rows_map): (head_dim, r < 64, heads, anchor) at o + (anchor + r - 64)
// rows. The box starts at r = 64 - rows (rows: the warpgroup's rows in its sequence, at most
// 64) and anchor = its first row + rows, so that TMA writes rows 0 .. rows - 1 and clips the
// rest at r = 64; a warpgroup with no row left stores nothing.
template <class Cfg>
__device__ __forceinline__ void store_o_tma(const FwdParamsSm90& P, uint32_t smem_o_wg, const TileWork& w, int wg) {
  const int first = w.m0 + 64 * wg;
  if constexpr (Cfg::kPackGQA) {  // (head_dim, G, rows, heads_kv, batch): rows past seqlen_q clipped
#pragma unroll
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      tma_store_5d(&P.tma_o, smem_o_wg + panel * Cfg::kBlockM * Cfg::kRowBytes, 64 * panel, 0,
                   fast_div(first, P.div_group), w.head, w.batch);
    }
    return;
  }
  if constexpr (Cfg::kVarlen) {
    const int rows = imin(64, w.seqlen_q - first);
    if (rows <= 0) return;
#pragma unroll
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      tma_store_4d(&P.tma_o, smem_o_wg + panel * Cfg::kBlockM * Cfg::kRowBytes, 64 * panel, 64 - rows, w.head,
                   q_row<Cfg>(w, first) + rows);
    }
    return;
  }
#pragma unroll
  for (int panel = 0; panel < Cfg::kPanels; ++panel) {
    tma_store_4d(&P.tma_o, smem_o_wg + panel * Cfg::kBlockM * Cfg::kRowBytes, 64 * panel, first, w.head, w.batch);
  }
}

// Piece `split` of split tile `split_tile`: its warpgroup's partial in the workspace.
template <class Cfg>
__device__ __forceinline__ float4* split_partial(const FwdParamsSm90& P, int split_tile, int split, int wg, int thread) {
  constexpr int kVecs = Cfg::kORegs / 4 + 1;  // float4s of O per thread, then one of m and l
  const size_t piece = static_cast<size_t>(split_tile) * P.splits + split;
  return reinterpret_cast<float4*>(P.split_partials) + (piece * Cfg::kConsumerWGs + wg) * 128 * kVecs + thread;
}

// This thread's O registers, m and l into its place of a piece's partial.
template <class Cfg>
__device__ __forceinline__ void write_split_partial(float4* mine, const float (&o)[Cfg::kORegs], const float (&m)[2],
                                                    const float (&l)[2]) {
  constexpr int kOVecs = Cfg::kORegs / 4;
  static_assert(Cfg::kORegs % 4 == 0, "O's registers in whole float4s");
#pragma unroll
  for (int k = 0; k < kOVecs; ++k) mine[128 * k] = make_float4(o[4 * k], o[4 * k + 1], o[4 * k + 2], o[4 * k + 3]);
  mine[128 * kOVecs] = make_float4(m[0], m[1], l[0], l[1]);
}

// Every piece's partial of a split tile (this thread's place in each), combined in piece
// order from piece 0, so that the result has the same bits whichever piece wrote last:
// m = max_i m_i, l = sum_i l_i 2^((m_i - m) c), O likewise (-inf maxima give factors of 0).
template <class Cfg>
__device__ __forceinline__ void merge_split_partials(const FwdParamsSm90& P, int split_tile, int wg, int thread,
                                                     float (&o)[Cfg::kORegs], float (&m)[2], float (&l)[2],
                                                     float scale_log2) {
  constexpr int kOVecs = Cfg::kORegs / 4;
  for (int split = 0; split < P.splits; ++split) {
    const float4* part = split_partial<Cfg>(P, split_tile, split, wg, thread);
    const float4 ml = __ldcg(part + 128 * kOVecs);  // L2: written by another SM
    const float part_m[2] = {ml.x, ml.y}, part_l[2] = {ml.z, ml.w};
    float keep[2] = {1.f, 1.f}, add[2] = {1.f, 1.f};
    if (split > 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float mx = fmaxf(m[r], part_m[r]);
        const float ref = scaled_max(mx, scale_log2);  // -inf maxima give factors of 0
        keep[r] = fast_exp2(__fmul_rn(m[r], scale_log2) - ref);  // the rounded references
        add[r] = fast_exp2(__fmul_rn(part_m[r], scale_log2) - ref);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] = split > 0 ? l[r] * keep[r] + part_l[r] * add[r] : part_l[r];
      m[r] = split > 0 ? fmaxf(m[r], part_m[r]) : part_m[r];
    }
#pragma unroll
    for (int k = 0; k < kOVecs; ++k) {
      const float4 v = __ldcg(part + 128 * k);
      const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = (e / 2) % 2;  // register 4j + 2r + e' holds row r
        o[4 * k + e] = split > 0 ? o[4 * k + e] * keep[r] + x[e] * add[r] : x[e];
      }
    }
  }
}

// tail split_kv, after a piece's last P V: its warpgroup writes O's registers, m and the
// per-thread l to its place in the workspace, then counts itself done on the tile's counter.
// The piece that completes the count reads every piece's partial back (its own too) and
// combines them in piece order (the same bits whichever piece comes last): m = max_i m_i,
// l = sum_i l_i 2^((m_i - m) c), O likewise; it returns true, and its warpgroup goes on to
// normalise and store the tile as a whole one would.  The others return false and skip the
// tile's tail.  The hand-over is global memory only: the writes, the warpgroup's named
// barrier kBarSplit + wg, thread 0's atom.inc with release and acquire semantics at GPU scope
// (wrapping to 0, so that the counter is ready for the next launch), a barrier reduction
// telling every thread the count, then L2 reads; no SMEM, no mbarrier and no barrier of the
// sync plan.  This hand-over is the launch's last step on most SMs, so it is kept short:
// the workspace is laid out [piece][warpgroup][vector][thread] (a warp's 16-byte accesses
// are 512 contiguous bytes) and one acq_rel atomic stands for fence, atomic, fence.
template <class Cfg>
__device__ __forceinline__ bool combine_split(const FwdParamsSm90& P, const TileWork& w, int wg,
                                              float (&o)[Cfg::kORegs], float (&m)[2], float (&l)[2],
                                              float scale_log2, int thread) {
  write_split_partial<Cfg>(split_partial<Cfg>(P, w.split_tile, w.split, wg, thread), o, m, l);
  // Every thread's partial before thread 0's count (the barrier at CTA scope, then the
  // atomic's release at GPU scope, cumulative); the atomic's acquire takes in the other
  // pieces' partials, and the barrier reduction passes that on to every thread.
  named_bar_sync(Cfg::kBarSplit + wg, 128);
  bool last = false;
  if (thread == 0) last = atomic_inc_acq_rel_gpu(P.split_counts + w.split_tile * Cfg::kConsumerWGs + wg, P.splits - 1) == P.splits - 1;
  if (!named_bar_red_or(Cfg::kBarSplit + wg, 128, last)) return false;
  merge_split_partials<Cfg>(P, w.split_tile, wg, thread, o, m, l, scale_log2);
  return true;
}

// A tile whose rows see no key (causal with seqlen_q > seqlen_k): O = 0 and LSE = -inf,
// written straight to global memory by the warpgroup's 128 threads (16 bytes a store),
// with no SMEM and no barrier, so that the tile takes no part in the pipeline.
template <class Cfg>
__device__ __forceinline__ void store_empty_tile(const FwdParams& p, const TileWork& w, int wg, int thread) {
  constexpr int kChunks = Cfg::kHeadDim * 2 / 16;  // 16-byte pieces per row
  const int row0 = w.m0 + 64 * wg;
  const int len_q = seqlen_q<Cfg>(p, w);
  if constexpr (Cfg::kPackGQA) {  // row r: query row r / G of query head head * G + r % G
    const int group = p.heads_q / p.heads_kv;
    for (int i = thread; i < 64 * kChunks; i += 128) {
      const int row = row0 + i / kChunks, query = row / group, head = w.head * group + row % group;
      if (query < len_q) {
        char* o = static_cast<char*>(p.o) + 2 * (w.batch * p.o_batch_stride + head * p.o_head_stride + query * p.o_seq_stride);
        reinterpret_cast<uint4*>(o)[i % kChunks] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    const int row = row0 + thread;
    if (p.lse != nullptr && thread < 64 && row / group < len_q) {
      p.lse[w.batch * p.lse_batch_stride + (w.head * group + row % group) * p.lse_head_stride + row / group] = -INFINITY;
    }
    return;
  }
  char* o = static_cast<char*>(p.o) + 2 * (w.batch * p.o_batch_stride + w.head * p.o_head_stride);
  for (int i = thread; i < 64 * kChunks; i += 128) {
    const int row = row0 + i / kChunks;
    if (row < len_q) {
      reinterpret_cast<uint4*>(o + 2 * q_row<Cfg>(w, row) * p.o_seq_stride)[i % kChunks] = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  if (p.lse != nullptr && thread < 64 && row0 + thread < len_q) {
    p.lse[w.batch * p.lse_batch_stride + w.head * p.lse_head_stride + q_row<Cfg>(w, row0 + thread)] = -INFINITY;
  }
}

}  // namespace fadsl::sm90
#include "sm90_guard.cuh"  // rescale guarded: the softmax without its row max (next to this file)
#include "sm90_varlen.cuh"
#include "sm90_kvcache.cuh"  // kv_cache, pack_gqa, splits auto: the combine kernel (next to this file)  // varlen on: the packed sequences' tile list and scheduler (next to this file)
