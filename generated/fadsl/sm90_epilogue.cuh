// fadsl/sm90_epilogue.cuh -- section 5 of fadsl/sm90.cuh (which includes it after the
// consumer steps): row sums, normalise, LSE, O into SMEM (stmatrix) and its TMA store, a
// split piece's partial and its combination, a tile with no key.
#pragma once

namespace fadsl::sm90 {

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

// 1 / l per row, 0 for a row with l == 0 (it saw no key): O's normalisation.
__device__ __forceinline__ void inverse_row_sums(const float (&l)[2], float (&inv)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = l[r] == 0.f ? 0.f : 1.f / l[r];
}

// O /= l; a row with l == 0 (it saw no key) becomes 0.
template <class Cfg>
__device__ __forceinline__ void normalize_o(float (&o)[Cfg::kORegs], const float (&l)[2]) {
  float inv[2];
  inverse_row_sums(l, inv);
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
  } else {
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
  } else if constexpr (Cfg::kVarlen) {
    const int rows = imin(64, w.seqlen_q - first);
    if (rows > 0) {
#pragma unroll
      for (int panel = 0; panel < Cfg::kPanels; ++panel) {
        tma_store_4d(&P.tma_o, smem_o_wg + panel * Cfg::kBlockM * Cfg::kRowBytes, 64 * panel, 64 - rows, w.head,
                     q_row<Cfg>(w, first) + rows);
      }
    }
  } else {
#pragma unroll
    for (int panel = 0; panel < Cfg::kPanels; ++panel) {
      tma_store_4d(&P.tma_o, smem_o_wg + panel * Cfg::kBlockM * Cfg::kRowBytes, 64 * panel, first, w.head, w.batch);
    }
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

// A piece's m[2] and l[2] for this thread (its place `part`: the float4 after O's
// registers). An L2 load: another SM wrote it.
template <class Cfg>
__device__ __forceinline__ float4 read_partial_ml(const float4* part) {
  return __ldcg(part + 128 * (Cfg::kORegs / 4));
}

// N of this thread's O registers from a piece's partial (its place `part`), from float4
// `first_vec` on: O register 4 (first_vec + k) + e is x[4k + e]. L2 loads: another SM wrote it.
template <int N>
__device__ __forceinline__ void read_partial_o(const float4* part, int first_vec, float (&x)[N]) {
  static_assert(N % 4 == 0, "whole float4s");
#pragma unroll
  for (int k = 0; k < N / 4; ++k) {
    const float4 v = __ldcg(part + 128 * (first_vec + k));
    x[4 * k] = v.x, x[4 * k + 1] = v.y, x[4 * k + 2] = v.z, x[4 * k + 3] = v.w;
  }
}

// One piece's partial (m and l in `ml`, N of this thread's O registers in `x`: whole float4s,
// element 4k + e of row (e / 2) % 2) merged into the running (o, m, l); the first piece is
// taken as it is. m = max(m, m_i), l = l 2^((m - m') c) + l_i 2^((m_i - m') c) with the
// rounded references, O likewise (-inf maxima give factors of 0). The split tail's combine
// and <kernel>_combine both merge through this, in piece order from piece 0.
template <int N>
__device__ __forceinline__ void merge_piece(float (&o)[N], const float (&x)[N], float (&m)[2], float (&l)[2], float4 ml,
                                            bool first, float scale_log2) {
  const float part_m[2] = {ml.x, ml.y}, part_l[2] = {ml.z, ml.w};
  float keep[2] = {1.f, 1.f}, add[2] = {1.f, 1.f};
  if (!first) {
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
    l[r] = first ? part_l[r] : l[r] * keep[r] + part_l[r] * add[r];
    m[r] = first ? part_m[r] : fmaxf(m[r], part_m[r]);
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int r = (i / 2) % 2;
    o[i] = first ? x[i] : o[i] * keep[r] + x[i] * add[r];
  }
}

// Every piece's partial of a split tile (this thread's place in each), merged in piece order
// from piece 0, so that the result has the same bits whichever piece wrote last.
template <class Cfg>
__device__ __forceinline__ void merge_split_partials(const FwdParamsSm90& P, int split_tile, int wg, int thread,
                                                     float (&o)[Cfg::kORegs], float (&m)[2], float (&l)[2],
                                                     float scale_log2) {
  for (int split = 0; split < P.splits; ++split) {
    const float4* part = split_partial<Cfg>(P, split_tile, split, wg, thread);
    const float4 ml = read_partial_ml<Cfg>(part);
    float x[Cfg::kORegs];
    read_partial_o(part, 0, x);
    merge_piece(o, x, m, l, ml, split == 0, scale_log2);
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
// with no SMEM and no barrier, so that the tile takes no part in the pipeline. `poison`
// (a kv-cache call's bad input, kv_input_bad): O and the LSE NaN instead.
template <class Cfg>
__device__ __forceinline__ void store_empty_tile(const FwdParams& p, const TileWork& w, int wg, int thread,
                                                 bool poison = false) {
  constexpr int kChunks = Cfg::kHeadDim * 2 / 16;  // 16-byte pieces per row
  const int row0 = w.m0 + 64 * wg;
  const int len_q = seqlen_q<Cfg>(p, w);
  const uint32_t word = poison ? pack_f32x2<typename Cfg::T>(quiet_nan(), quiet_nan()) : 0u;
  const uint4 fill = make_uint4(word, word, word, word);
  const float lse_fill = poison ? quiet_nan() : -INFINITY;
  if constexpr (Cfg::kPackGQA) {  // row r: query row r / G of query head head * G + r % G
    const int group = p.heads_q / p.heads_kv;
    for (int i = thread; i < 64 * kChunks; i += 128) {
      const int row = row0 + i / kChunks, query = row / group, head = w.head * group + row % group;
      if (query < len_q) {
        char* o = static_cast<char*>(p.o) + 2 * (w.batch * p.o_batch_stride + head * p.o_head_stride + query * p.o_seq_stride);
        reinterpret_cast<uint4*>(o)[i % kChunks] = fill;
      }
    }
    const int row = row0 + thread;
    if (p.lse != nullptr && thread < 64 && row / group < len_q) {
      p.lse[w.batch * p.lse_batch_stride + (w.head * group + row % group) * p.lse_head_stride + row / group] = lse_fill;
    }
  } else {
    char* o = static_cast<char*>(p.o) + 2 * (w.batch * p.o_batch_stride + w.head * p.o_head_stride);
    for (int i = thread; i < 64 * kChunks; i += 128) {
      const int row = row0 + i / kChunks;
      if (row < len_q) {
        reinterpret_cast<uint4*>(o + 2 * q_row<Cfg>(w, row) * p.o_seq_stride)[i % kChunks] = fill;
      }
    }
    if (p.lse != nullptr && thread < 64 && row0 + thread < len_q) {
      p.lse[w.batch * p.lse_batch_stride + w.head * p.lse_head_stride + q_row<Cfg>(w, row0 + thread)] = lse_fill;
    }
  }
}

}  // namespace fadsl::sm90
