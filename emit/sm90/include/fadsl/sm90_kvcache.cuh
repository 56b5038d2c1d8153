// fadsl/sm90_kvcache.cuh -- `kv_cache`, `pack_gqa on` and `splits auto`: attention over a KV
// cache for serving (decode: a few query rows per sequence against a long cache).
//
// kv_cache: batch b's keys are the first cache_seqlens[b] rows of its cache, contiguous
// (batch, capacity, heads_kv, head_dim) or paged (pages, kPageSize, heads_kv, head_dim) with a
// page table (load_kv_paged, fadsl/sm90.cuh). pack_gqa: a tile's rows are (query row, query
// head) pairs of one K/V head, so that a K/V block serves all its query heads in one wgmma
// (Q's and O's maps are 5-D boxes: head_dim, G heads, rows, ...). splits auto: every tile's
// K/V blocks are split into P.splits pieces (split_tile_work, the tail split's); each piece's
// warpgroups write their partial O, m and l to the workspace and skip the tile's tail, and
// <kernel>_combine (combine_pieces) adds the pieces up in piece order, normalises and writes
// O and the LSE. The attention kernel's sync plan is the split tail's, proven with pieces
// that skip their tails; the combine kernel starts after it (stream order).
#pragma once

namespace fadsl::sm90 {

// Bad input, never a silent wrong row: batch b's cache length outside 0 .. capacity, or (paged)
// a page-table entry outside the cache among those the tile's (or piece's) blocks read. The
// kernel reads the clamped length's keys, and TMA fills a page outside the cache with zeros,
// so nothing is read outside the cache; the rows of such a tile become NaN (poison_rows,
// store_empty_tile, write_empty_partial). Each warp checks the entries itself, its lanes
// striding, kCheckBatch loads a lane in flight at once (one memory latency per 32 x 8
// entries, not one an entry), then votes (no barrier, no SMEM): a tile's first lines,
// before its first wait.
constexpr int kCheckBatch = 8;

template <class Cfg>
__device__ __forceinline__ bool kv_input_bad(const FwdParamsSm90& P, const TileWork& w, int lane) {
  const int length = P.cache_seqlens[w.batch];
  bool bad = length < 0 || length > P.base.seqlen_k;
  if constexpr (Cfg::kPageSize > 0) {
    if (w.n_blocks > 0) {  // (then w.seqlen_k > 0) the pages of keys first_key .. w.seqlen_k - 1 at most
      const int first = (w.block_end - w.n_blocks) * Cfg::kBlockN / Cfg::kPageSize;
      const int last = (imin(w.block_end * Cfg::kBlockN, w.seqlen_k) - 1) / Cfg::kPageSize;
      for (int i0 = first + lane; i0 <= last; i0 += 32 * kCheckBatch) {
        int page[kCheckBatch];
#pragma unroll
        for (int u = 0; u < kCheckBatch; ++u) page[u] = i0 + 32 * u <= last ? w.pages[i0 + 32 * u] : 0;
#pragma unroll
        for (int u = 0; u < kCheckBatch; ++u) bad |= page[u] < 0 || page[u] >= P.num_pages;
      }
    }
  }
  return __any_sync(0xffffffffu, bad);
}

// A tile's rows NaN (kv_input_bad): O and the row sums l, so that O / l, the LSE and, for a
// split piece, the combined tile are NaN too.
template <class Cfg>
__device__ __forceinline__ void poison_rows(float (&o)[Cfg::kORegs], float (&l)[2]) {
#pragma unroll
  for (int i = 0; i < Cfg::kORegs; ++i) o[i] = quiet_nan();
  l[0] = l[1] = quiet_nan();
}

// Whether a thread whose first row (RowLimits::row0; row0 + 8 is its other) is `row0` holds
// any of the tile's rows. A piece's partial is written, and read by <kernel>_combine, only
// for threads that do: decode's packed tile holds G x seqlen_q of its 64 rows (4 at GQA
// 32/8: 16 of a warpgroup's 128 threads), so the other threads' bytes would be written and
// never read. Padding rows come last, so a thread's second row is padding if its first is.
template <class Cfg>
__device__ __forceinline__ bool holds_rows(const FwdParams& p, int row0) {
  return row0 < tile_rows<Cfg>(p);
}

// A piece with no K/V block (its tile's sequence is shorter than the split): its partial is
// the empty one (m = -inf, l = 0, O = 0), written without the pipeline; `poison` (bad
// input): O and l NaN.
template <class Cfg>
__device__ __forceinline__ void write_empty_partial(const FwdParamsSm90& P, const TileWork& w, int wg, int thread,
                                                    bool poison) {
  if (!holds_rows<Cfg>(P.base, row_limits<Cfg>(w, wg, thread / 32, thread % 32).row0)) return;
  const float fill = poison ? quiet_nan() : 0.f;
  float o[Cfg::kORegs];
#pragma unroll
  for (int i = 0; i < Cfg::kORegs; ++i) o[i] = fill;
  const float m[2] = {-INFINITY, -INFINITY}, l[2] = {fill, fill};
  write_split_partial<Cfg>(split_partial<Cfg>(P, w.split_tile, w.split, wg, thread), o, m, l);
}

// This thread's O registers (normalised) straight to global memory: o[4j' + 2r + e], j' < N / 4,
// is row 16 warp + lane / 4 + 8r, column 8 (first_j + j') + 2 (lane % 4) + e of the
// warpgroup's 64 rows (its wgmma register 4 (first_j + j') + 2r + e).
template <class Cfg, int N>
__device__ __forceinline__ void store_o_registers(const FwdParams& p, const TileWork& w, const RowLimits& rows,
                                                  const float (&o)[N], int first_j, int lane) {
  using T = typename Cfg::T;
  const int group = Cfg::kPackGQA ? p.heads_q / p.heads_kv : 1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = rows.row0 + 8 * r;
    const int query = Cfg::kPackGQA ? row / group : row;
    const int head = Cfg::kPackGQA ? w.head * group + row % group : w.head;
    if (query >= p.seqlen_q) continue;
    T* out = static_cast<T*>(p.o) + w.batch * p.o_batch_stride + head * p.o_head_stride + query * p.o_seq_stride;
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      const uint32_t pair = pack_f32x2<T>(o[4 * j + 2 * r], o[4 * j + 2 * r + 1]);
      *reinterpret_cast<uint32_t*>(out + 8 * (first_j + j) + 2 * (lane % 4)) = pair;
    }
  }
}

// <kernel>_combine's work split: each thread combines kCombineVecs float4s of its warpgroup
// thread's O registers (a slice of its columns; blockIdx.y picks the slice), the pieces read
// kCombineBatch at a time (their loads in flight together: one piece after another waited a
// memory latency each, 14 us of a 153 us decode step at 16 pieces, H200, 2026-11-27).
constexpr int kCombineVecs = 2, kCombineBatch = 8;

// <kernel>_combine: CTAs (split tile x consumer warpgroup, slice of O's columns) of 128
// threads, each the warpgroup thread whose registers it combines, placed while the attention
// kernel still runs (PDL) and waiting for it first: every piece's partial in piece order
// (merge_piece, as the split tail merges), then the row sums, O / l, the LSE (slice 0) and
// O's rows (an 8-bit kernel's pieces: O already v-descaled in the accumulator's column
// order, the maxima scaled, fp8_piece_partial: so no descale here). A warp whose 16 rows
// all lie past the tile's rows stops at once, and a thread whose rows do reads no partial
// (holds_rows: the pieces wrote none for it); nothing of those rows is stored.
template <class Cfg>
__device__ __forceinline__ void combine_pieces(const FwdParamsSm90& P) {
  // launched as the attention kernel's programmatic dependent: nothing is read before its
  // pieces have finished and their partials are visible (the host: run_kvcache)
  grid_dependency_wait();
  constexpr int kOVecs = Cfg::kORegs / 4, kN = 4 * kCombineVecs;
  static_assert(kOVecs % kCombineVecs == 0, "O's registers in whole slices (host: head_dim / 16 of them)");
  const int split_tile = blockIdx.x / Cfg::kConsumerWGs, wg = blockIdx.x % Cfg::kConsumerWGs;
  const int first_vec = blockIdx.y * kCombineVecs;
  const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
  const TileWork w = tile_work<Cfg>(P, tile_coords<Cfg>(P, P.split_start + split_tile));
  const RowLimits rows = row_limits<Cfg>(w, wg, warp, lane);
  if (!holds_rows<Cfg>(P.base, rows.row0 - lane / 4)) return;  // the warp's first row: warp-uniform
  const bool mine = holds_rows<Cfg>(P.base, rows.row0);  // else no partial was written for it
  // an 8-bit kernel's pieces write their maxima already scaled, R = m c' - 8 (fp8_piece_partial)
  const float scale_log2 = Cfg::kInBytes == 1 ? 1.f : P.base.softmax_scale * 1.4426950408889634f;
  float o[kN] = {}, m[2] = {}, l[2] = {};
  for (int base = 0; mine && base < P.splits; base += kCombineBatch) {
    float4 ml[kCombineBatch];
    float x[kCombineBatch][kN];
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (base + i >= P.splits) break;
      const float4* part = split_partial<Cfg>(P, split_tile, base + i, wg, thread);
      ml[i] = read_partial_ml<Cfg>(part);
      read_partial_o(part, first_vec, x[i]);
    }
#pragma unroll
    for (int i = 0; i < kCombineBatch; ++i) {
      if (base + i >= P.splits) break;
      merge_piece(o, x[i], m, l, ml[i], base + i == 0, scale_log2);
    }
  }
  row_sum_quad(l);
  float inv[2];
  inverse_row_sums(l, inv);
#pragma unroll
  for (int i = 0; i < kN; ++i) o[i] *= inv[(i / 2) % 2];
  if (blockIdx.y == 0) store_lse<Cfg>(P.base, w, rows, m, l, scale_log2, lane);
  store_o_registers<Cfg>(P.base, w, rows, o, first_vec, lane);
}

}  // namespace fadsl::sm90
