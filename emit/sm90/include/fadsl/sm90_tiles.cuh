// fadsl/sm90_tiles.cuh -- section 2b of fadsl/sm90.cuh (which includes it after the
// configuration): the tile scheduler, which (q block, head, batch) tiles a CTA runs and in
// which order, and each tile's K/V blocks (causal, a sliding window, a split piece, a KV
// cache's length, packed query heads).
#pragma once

namespace fadsl::sm90 {

// One tile of the launch: 128 (kBlockM) query rows of one (batch, head).
struct TileCoord {
  int m_block, head, batch;
};

// Which tiles this CTA runs, and in which order.  Tiles are numbered query block
// fastest, then head, then batch, so that the CTAs running at once work on few heads and
// share their K and V through L2.
//   kPersistent (`scheduler persistent`): grid = min(tiles, SMs x ctas_per_sm); CTA c runs steps
//     s = 0, 1, ...  Without a mask, step s is tile c + s * gridDim.x.  Causal (and a
//     `keep` without a mask: longest_tiles_first): tiles go in pairs of a head's long and
//     short query block (m = num_m - 1 - i, then i: the pair's blocks add up to num_m + 1
//     under causal), the CTA running pairs c, c + gridDim.x, ..., so that every CTA gets
//     the same work however long each tile is.
//   grid (`scheduler grid`): one CTA per tile, the hardware handing out tiles as SMs
//     free up; causal (and keep) puts the longest query blocks first.
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
  if constexpr (Cfg::kPersistent && longest_tiles_first<Cfg>()) {
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
  if constexpr (longest_tiles_first<Cfg>() && Cfg::kPersistent) {
    c.m_block = (j & 1) ? j / 2 : m - 1 - j / 2;  // num_m - 1, 0, num_m - 2, 1, ...
  } else {
    c.m_block = longest_tiles_first<Cfg>() ? m - 1 - j : j;  // long rows first
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
  int sequence;  // varlen: the sequence's index in the call's batch (cu_seqlens' b; batch is 0)
  const int* pages;  // a paged kv_cache: the batch's row of the page table
};

// The tile's query rows: FwdParams' for a padded batch, its own sequence's with varlen (its
// keys, w.seqlen_k, are set for every tile).
template <class Cfg>
__device__ __forceinline__ int seqlen_q(const FwdParams& p, const TileWork& w) {
  if constexpr (Cfg::kVarlen) return w.seqlen_q;
  return p.seqlen_q;
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

// `keep` (issue 41): the blocks whose tile rule says EMPTY (no row of the tile keeps a key of
// them: fadsl/passes/modifiers/sparsity.py, rendered into Cfg::Modifiers::empty) trimmed off
// both ends of the tile's range, so that the producer loads none of them and the consumers
// run none. Each end is scanned while EMPTY: causal masks, windows and prefix-LM have their
// EMPTY blocks at the ends; one left in the middle runs masked (every score -inf). The
// producer and the consumers trim alike, from the same values. The leading iterations that
// mask for the seqlen_k tail or the causal diagonal (n_masked) lose those trimmed off the top.
//
// A keep that reads inputs per token (document ids: TileRule.by_pass) has its tiles classed
// by <kernel>_keep_classes before the kernel (fadsl/sm90_modifiers.cuh, keep_classes): then
// the tile visits only the blocks the pass found a kept score in, from its list (keep_list,
// kv_block), and a block is FULL where its class says so (keep_class).
enum : uint8_t { kTileEmpty = 0, kTilePartial = 1, kTileFull = 2 };

// The (batch, head) row of the classes: one per batch, or per head where keep reads h.
template <class Cfg>
__device__ __forceinline__ int keep_class_row(const FwdParamsSm90& P, int batch, int head) {
  return Cfg::Modifiers::kClassesPerHead ? batch * P.base.heads_q + head : batch;
}

// The tile's q block's list of kept kv blocks, from P.inputs[kClassesInput + 1]
// (keep_kept_list, fadsl/sm90_modifiers.cuh): [1] their count, [2 ..] the blocks, the last first.
template <class Cfg>
__device__ __forceinline__ const int* keep_list(const FwdParamsSm90& P, const TileWork& w) {
  const int q_blocks = (P.base.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int kv_blocks = (P.base.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const int* lists = static_cast<const int*>(P.inputs[Cfg::Modifiers::kClassesInput + 1]);
  const long long row = static_cast<long long>(keep_class_row<Cfg>(P, w.batch, w.head)) * q_blocks + w.m0 / Cfg::kBlockM;
  return lists + row * (2 + kv_blocks);
}

// The K/V block of the tile's iteration it (0 .. n_blocks - 1, the last block first): with
// classes made by a pass, the it-th kept block of the list, so that the EMPTY blocks between
// kept ones are neither loaded nor run; else block_end - 1 - it. The producer and the
// consumers read the same list, so they visit the same blocks in the same order, and the ring
// protocol counts iterations, not blocks.
template <class Cfg>
__device__ __forceinline__ int kv_block(const FwdParamsSm90& P, const TileWork& w, int it) {
  if constexpr (Cfg::kKeep && Cfg::Modifiers::kClassesInput >= 0) {
    return __ldg(keep_list<Cfg>(P, w) + 2 + it);
  } else {
    return w.block_end - 1 - it;
  }
}

// The class of the tile's block n_block, from P.inputs[kClassesInput].
template <class Cfg>
__device__ __forceinline__ int keep_class(const FwdParamsSm90& P, const TileWork& w, int n_block) {
  const int q_blocks = (P.base.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
  const int kv_blocks = (P.base.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
  const uint8_t* classes = static_cast<const uint8_t*>(P.inputs[Cfg::Modifiers::kClassesInput]);
  const int row = keep_class_row<Cfg>(P, w.batch, w.head) * q_blocks + w.m0 / Cfg::kBlockM;
  return __ldg(classes + static_cast<long long>(row) * kv_blocks + n_block);
}

template <class Cfg>
__device__ __forceinline__ void keep_work(const FwdParamsSm90& P, TileWork& w) {
  if constexpr (Cfg::Modifiers::kClassesInput >= 0) {
    // the pass's list: its blocks lie in the causal range (the pass classes the tiles above
    // the diagonal EMPTY), the last first; a block's place in it is at most its place in the
    // range below the list's first block, so the leading n_masked iterations (less the
    // blocks above that first one) still take every block that needs the diagonal's or the
    // seqlen_k tail's mask (masking one more is exact)
    const int* list = keep_list<Cfg>(P, w);
    const int count = w.n_blocks > 0 ? __ldg(list + 1) : 0;
    const int top = count > 0 ? w.block_end - 1 - __ldg(list + 2) : 0;
    w.block_end -= top;
    w.n_blocks = count;
    w.n_masked = imin(imax(w.n_masked - top, 0), w.n_blocks);
    w.masked_from = w.n_blocks;
    return;
  }
  const int q_lo = w.m0, q_hi = imin(w.m0 + Cfg::kBlockM, w.seqlen_q) - 1;
  auto empty = [&](int n) {
    const int kv_lo = n * Cfg::kBlockN, kv_hi = imin(kv_lo + Cfg::kBlockN, w.seqlen_k) - 1;
    return Cfg::Modifiers::empty(P, w.batch, w.head, q_lo, q_hi, kv_lo, kv_hi);
  };
  int top = 0;
  for (; w.n_blocks > 0 && empty(w.block_end - 1); ++top) {
    --w.block_end;
    --w.n_blocks;
  }
  while (w.n_blocks > 0 && empty(w.block_end - w.n_blocks)) --w.n_blocks;
  w.n_masked = imin(imax(w.n_masked - top, 0), w.n_blocks);
  w.masked_from = w.n_blocks;
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
  if constexpr (Cfg::kKeep) keep_work<Cfg>(P, w);
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

}  // namespace fadsl::sm90
