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

// A piece with no K/V block (its tile's sequence is shorter than the split): its partial is
// the empty one (m = -inf, l = 0, O = 0), written without the pipeline.
template <class Cfg>
__device__ __forceinline__ void write_empty_partial(const FwdParamsSm90& P, const TileWork& w, int wg, int thread) {
  float o[Cfg::kORegs];
#pragma unroll
  for (int i = 0; i < Cfg::kORegs; ++i) o[i] = 0.f;
  const float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  write_split_partial<Cfg>(split_partial<Cfg>(P, w.split_tile, w.split, wg, thread), o, m, l);
}

// This thread's O registers (normalised) straight to global memory: register 4j + 2r + e is
// row 16 warp + lane / 4 + 8r, column 8j + 2 (lane % 4) + e of the warpgroup's 64 rows.
template <class Cfg>
__device__ __forceinline__ void store_o_registers(const FwdParams& p, const TileWork& w, const RowLimits& rows,
                                                  const float (&o)[Cfg::kORegs], int lane) {
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
    for (int j = 0; j < Cfg::kHeadDim / 8; ++j) {
      const uint32_t pair = pack_f32x2<T>(o[4 * j + 2 * r], o[4 * j + 2 * r + 1]);
      *reinterpret_cast<uint32_t*>(out + 8 * j + 2 * (lane % 4)) = pair;
    }
  }
}

// <kernel>_combine: one CTA of 128 threads per (split tile, consumer warpgroup), each thread
// the warpgroup thread whose registers it combines: every piece's partial, then the row sums,
// O / l, the LSE and O's rows (the tile's rows past seqlen_q are not written).
template <class Cfg>
__device__ __forceinline__ void combine_pieces(const FwdParamsSm90& P) {
  const int split_tile = blockIdx.x / Cfg::kConsumerWGs, wg = blockIdx.x % Cfg::kConsumerWGs;
  const int thread = threadIdx.x, warp = thread / 32, lane = thread % 32;
  const float scale_log2 = P.base.softmax_scale * 1.4426950408889634f;
  float o[Cfg::kORegs], m[2], l[2];
  merge_split_partials<Cfg>(P, split_tile, wg, thread, o, m, l, scale_log2);
  row_sum_quad(l);
  normalize_o<Cfg>(o, l);
  const TileWork w = tile_work<Cfg>(P, tile_coords<Cfg>(P, P.split_start + split_tile));
  const RowLimits rows = row_limits<Cfg>(w, wg, warp, lane);
  store_lse<Cfg>(P.base, w, rows, m, l, scale_log2, lane);
  store_o_registers<Cfg>(P.base, w, rows, o, lane);
}

}  // namespace fadsl::sm90
