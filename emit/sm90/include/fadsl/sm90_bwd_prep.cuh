// fadsl/sm90_bwd_prep.cuh -- section 7 of fadsl/sm90_bwd.cuh (which includes it after the
// main kernel's sections): the preprocess kernel's body (varlen's zeroing, D, the LSE in log2
// units, dQ's accumulator and semaphores) and dQ's conversion.  Not a header of its own:
// include fadsl/sm90_bwd.cuh.
#pragma once

namespace fadsl::sm90 {

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

__device__ __forceinline__ void zero_bytes(void* base, int64_t begin, int64_t end, uint32_t word = 0u) {
  const int64_t first = begin / 16, last = end / 16;  // (rows of 16-byte multiples)
  const int ctas = imin(kZeroCtas, static_cast<int>(gridDim.x));
  uint4* at = static_cast<uint4*>(base);
  for (int64_t i = first + blockIdx.x * 256 + threadIdx.x; i < last; i += ctas * 256) {
    at[i] = make_uint4(word, word, word, word);
  }
}

__device__ __forceinline__ void zero_outside(void* t, const int* cu, int sequences, int tokens, int row_bytes,
                                             bool valid, uint32_t word = 0u) {
  if (t == nullptr) return;
  const int64_t bytes = static_cast<int64_t>(tokens) * row_bytes;
  const int64_t begin = valid ? static_cast<int64_t>(cu[0]) * row_bytes : bytes;
  const int64_t end = valid ? static_cast<int64_t>(cu[sequences]) * row_bytes : bytes;
  zero_bytes(t, 0, begin, word);
  zero_bytes(t, end, bytes, word);
}

template <class Cfg>
__device__ __forceinline__ void bwd_zero_outside(const BwdPrepParams& P) {
  if (blockIdx.x >= kZeroCtas || blockIdx.y != 0) return;
  bool ok = true;  // every sequence as the main kernel takes it (bwd_sequence_ok)
  for (int b = threadIdx.x; b < P.sequences; b += 256) {
    ok = ok && bwd_sequence_ok(P.cu_seqlens_q[b], P.cu_seqlens_q[b + 1], P.seqlen_q) &&
         bwd_sequence_ok(P.cu_seqlens_k[b], P.cu_seqlens_k[b + 1], P.tokens_k);
  }
  const bool valid = __syncthreads_and(ok);
  // `fused_convert on`: malformed cu_seqlens may give two sequences one dQ chunk, whose count
  // then completes twice or never (fadsl/sm90_bwd_convert.cuh): dQ starts as NaN (all bits
  // set: a NaN in bf16 and fp16) rather than zeros, so that no finite dQ comes of it
  const uint32_t dq_word = Cfg::kFusedConvert && !valid ? 0xffffffffu : 0u;
  zero_outside(P.dq, P.cu_seqlens_q, P.sequences, P.seqlen_q, P.q_row_bytes, valid, dq_word);
  zero_outside(P.dk, P.cu_seqlens_k, P.sequences, P.tokens_k, P.k_row_bytes, valid);
  zero_outside(P.dv, P.cu_seqlens_k, P.sequences, P.tokens_k, P.k_row_bytes, valid);
}

// `fused_convert on` with `varlen on`: whether padded chunk `chunk` of a sequence is an m-block
// that no n-block of the sequence visits (causal or a window, its queries before every key),
// so that no CTA converts it (fadsl/sm90_bwd_convert.cuh); the host zeroes such rows of padded
// calls.  (A malformed sequence's rows are none of the preprocess's `real` ones.)
template <class Cfg>
__host__ __device__ __forceinline__ bool bwd_keyless_chunk(const int* cu_q, const int* cu_k, int sequences, int chunk) {
  const int s = bwd_varlen_sequence(cu_q, sequences, Cfg::kBlockM, chunk);
  BwdBlock b{};
  b.seqlen_q = cu_q[s + 1] - cu_q[s];
  b.seqlen_k = cu_k[s + 1] - cu_k[s];
  return bwd_dq_contributors<Cfg>(b, chunk - bwd_first_slot(cu_q, s, Cfg::kBlockM)) == 0;
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
  if constexpr (Cfg::kFusedConvert && Cfg::kVarlen) {
    if (real && bwd_keyless_chunk<Cfg>(P.cu_seqlens_q, P.cu_seqlens_k, P.sequences, chunk)) {  // no CTA converts it: 0
      uint8_t* row_bytes = static_cast<uint8_t*>(P.dq) + static_cast<int64_t>(query) * P.q_row_bytes;
      *reinterpret_cast<uint4*>(row_bytes + (head * Cfg::kHeadDim + 8 * part) * sizeof(T)) = make_uint4(0u, 0u, 0u, 0u);
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
      for (int share = 0; share < bwd_dq_counters<Cfg>(); ++share) {
        P.dq_semaphore[at / Cfg::kBlockM * bwd_dq_counters<Cfg>() + share] = 0;
      }
    }
  }
  // A chunk with no query (a sequence's padding slot: none of its rows is `real`, so its LSE
  // is +inf and D 0 as above) is not converted by convert_dq, and with well-formed
  // cu_seqlens never visited by the main kernel: its accumulator is not zeroed.  (With
  // malformed cu_seqlens the main kernel may still visit it for another sequence,
  // bwd_varlen_sequence's search assuming rising slots: P = 0, dS = 0, zeros added into an
  // accumulator nobody reads.)
  if (!bwd_chunk_holds_query<Cfg>(rows, chunk)) return;
  // the row's head_dim floats of dQ's accumulator zeroed: 2 float4 per thread; not where each
  // chain's first ticket stores (bwd_dq_stored_first: every block with `dq_chains N`)
  if constexpr (!bwd_dq_stored_first<Cfg>()) {
    static_assert(Cfg::kDqChains == 1, "more chains than one are the deterministic writer's, stored first");
    float4* zero = reinterpret_cast<float4*>(P.dq_accum + at * Cfg::kHeadDim) + 2 * part;
    zero[0] = zero[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// The preprocess kernel's body: with `varlen on` first the gradients' rows outside every
// sequence (bwd_zero_outside), then the CTA's rows.
template <class Cfg>
__device__ __forceinline__ void bwd_preprocess(const BwdPrepParams& P) {
  if constexpr (Cfg::kVarlen) bwd_zero_outside<Cfg>(P);
  bwd_preprocess_row<Cfg>(P);
}

// dQ from the accumulator.  Row order (dQ not transposed): a warp converts a pair of rows
// (q, q + 8) of an m-block, q % 16 < 8 (the kernel's CTA: 16 rows, a warp per pair); lane L
// converts columns c = 2L (+ 64 j) of both rows. In a warpgroup share's staging order
// (stage_dq), float4 q of thread tid holds, of the share's 64 queries and kDqCols columns, row
// u' = 16 (tid / 32) + (tid % 32) / 4 and u' + 8, columns 8q + 2 (tid % 4) + {0, 1}
// (registers 4q + 2r + e: row u' + 8r, column + e). So the lane reads one whole float4
// (both rows) and the warp's reads are runs of 64 bytes, its writes whole rows. Share s
// covers queries 64s.. (split by queries), columns s kDqCols.. (by panels), or all of
// the m-block (by keys: one share).
//
// Transposed (kDqTransposed: B_r 80; and head_dim 256: share s = head_dim panel s): float4
// q of thread tid holds columns d = 64 s + 16 (tid / 32) + (tid % 32) / 4 and d + 8 of
// queries u = 8q + 2 (tid % 4) and u + 1 (registers 4q + 2r + e: column d + 8r, query
// u + e).  A warp converts, for a group of 16 queries (q-groups 2c and 2c + 1 of its m-block),
// the 16 columns of warp j (0..3) of one share: each lane reads one float4 of each q-group
// and swaps two values with its partner lane (lane ^ 4: column d ^ 1) so that each holds two
// adjacent columns of one query.
//
// A unit is one such warp's work; its loads and its stores are separate calls so that a
// warp converting a whole m-block (`fused_convert on`: bwd_convert_m_block) issues a batch
// of units' loads before their stores.  kL2: the loads bypass L1 (ld.global.cg), for an
// accumulator other CTAs added into during this kernel.
template <class Cfg>
__host__ __device__ constexpr bool bwd_dq_by_columns() {
  return Cfg::kDqTransposed || Cfg::kSplitHeadDim;
}
template <class Cfg>
__host__ __device__ constexpr int bwd_dq_unit_vectors() {  // float4 loads per lane and unit
  return bwd_dq_by_columns<Cfg>() ? 2 : Cfg::kHeadDim / 64;
}
template <class Cfg>
__host__ __device__ constexpr int bwd_dq_units() {  // units per m-block
  return bwd_dq_by_columns<Cfg>() ? Cfg::kBlockM / 16 * (Cfg::kHeadDim / 64) * 4 : Cfg::kBlockM / 2;
}

template <bool kL2>
__device__ __forceinline__ float4 load_dq_accum(const float* at) {
  if constexpr (kL2) return __ldcg(reinterpret_cast<const float4*>(at));
  return *reinterpret_cast<const float4*>(at);
}

// A float4 of the m-block's dQ sum at `at` in chain 0's copy: `dq_chains N` sums the N chains'
// copies in chain order, ((c0 + c1) + c2) + c3, the same every run (each chain's own sum is
// in ticket order); all N loads issued before the adds.  `written`: bit c set where chain c
// holds a sum (bwd_dq_written), zeros read for the others.
template <class Cfg, bool kL2>
__device__ __forceinline__ float4 load_dq_chains(const float* at, unsigned written) {
  float4 part[Cfg::kDqChains];
#pragma unroll
  for (int chain = 0; chain < Cfg::kDqChains; ++chain) {
    part[chain] = (written >> chain) & 1u ? load_dq_accum<kL2>(at + chain * (Cfg::kBlockM * Cfg::kHeadDim))
                                          : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float4 sum = part[0];
#pragma unroll
  for (int chain = 1; chain < Cfg::kDqChains; ++chain) {
    sum.x += part[chain].x;
    sum.y += part[chain].y;
    sum.z += part[chain].z;
    sum.w += part[chain].w;
  }
  return sum;
}

// A unit's place: row order, q (its rows q and q + 8 of the m-block); column order, q (the
// first of its two q-groups), the share and the share's warp j.
struct BwdDqUnit {
  int q, share, j;
};
// The unit-th of an m-block's bwd_dq_units (`fused_convert on`: a warp takes them in turn).
template <class Cfg>
__device__ __forceinline__ BwdDqUnit bwd_dq_unit(int unit) {
  if constexpr (bwd_dq_by_columns<Cfg>()) {
    return {2 * (unit / (4 * (Cfg::kHeadDim / 64))), unit / 4 % (Cfg::kHeadDim / 64), unit % 4};
  }
  return {16 * (unit / 8) + unit % 8, 0, 0};
}

// Every chain of an m-block: the mask where the accumulator was zeroed (or converted in the
// main kernel, which bwd_dq_stored_first excludes).
template <class Cfg>
__host__ __device__ constexpr unsigned bwd_dq_all_chains() {
  return (1u << Cfg::kDqChains) - 1u;
}

// The chains of m-block `chunk_index` (the accumulator's m-block index, bwd_dq_chunk's) that
// hold a sum: where each chain's first ticket stores (bwd_dq_stored_first), those whose
// share-0 counter moved (every n-block that adds into an m-block adds every share); else all.
template <class Cfg>
__device__ __forceinline__ unsigned bwd_dq_written(const BwdConvertParams& P, int64_t chunk_index) {
  if constexpr (bwd_dq_stored_first<Cfg>()) {
    const int* counts = P.dq_semaphore + chunk_index * bwd_dq_counters<Cfg>();
    unsigned written = 0u;
#pragma unroll
    for (int chain = 0; chain < Cfg::kDqChains; ++chain) {
      if (counts[chain * Cfg::kDqSemaphores] != 0) written |= 1u << chain;
    }
    return written;
  } else {
    return bwd_dq_all_chains<Cfg>();
  }
}

template <class Cfg, bool kL2 = false>
__device__ __forceinline__ void bwd_dq_unit_load(const float* chunk, const BwdDqUnit& at, int lane,
                                                 float4 (&v)[bwd_dq_unit_vectors<Cfg>()], unsigned written) {
  if constexpr (bwd_dq_by_columns<Cfg>()) {
    const float* share = chunk + at.share * Cfg::kDqFloats;
#pragma unroll
    for (int half = 0; half < 2; ++half) v[half] = load_dq_chains<Cfg, kL2>(share + ((at.q + half) * 128 + 32 * at.j + lane) * 4, written);
  } else {
    const int u = at.q % 64;
#pragma unroll
    for (int k = 0; k < Cfg::kHeadDim / 64; ++k) {
      const int col = 2 * lane + 64 * k;
      const int share = Cfg::kDqByQueries ? at.q / 64 : col / Cfg::kDqCols, c = col % Cfg::kDqCols;
      const int tid = 32 * (u / 16) + 4 * (u % 8) + (c % 8) / 2;
      v[k] = load_dq_chains<Cfg, kL2>(chunk + share * Cfg::kDqFloats + ((c / 8) * 128 + tid) * 4, written);
    }
  }
}

// The unit's stores into dq (the (batch, head)'s base): dQ = the sums times softmax_scale in
// T, rows that hold no query skipped; row0, the m-block's first padded row.  Every lane of the
// warp calls it (the column order's shuffles).
template <class Cfg>
__device__ __forceinline__ void bwd_dq_unit_store(const BwdConvertParams& P, const BwdQueryRows& rows,
                                                  typename Cfg::T* dq, int row0, const BwdDqUnit& at, int lane,
                                                  const float4 (&v)[bwd_dq_unit_vectors<Cfg>()]) {
  if constexpr (bwd_dq_by_columns<Cfg>()) {
    const bool odd = (lane / 4) % 2 == 1;  // column d odd: takes query u + 1
    const int col = 64 * at.share + 16 * at.j + (lane / 4) - (odd ? 1 : 0);  // the pair's first column
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // even d sends its query u + 1 values (v.y, v.w), odd d its query u values (v.x, v.z)
      const float got0 = __shfl_xor_sync(0xffffffffu, odd ? v[half].x : v[half].y, 4);
      const float got1 = __shfl_xor_sync(0xffffffffu, odd ? v[half].z : v[half].w, 4);
      const float2 lo = odd ? make_float2(got0, v[half].y) : make_float2(v[half].x, got0);  // columns col, col + 1
      const float2 hi = odd ? make_float2(got1, v[half].w) : make_float2(v[half].z, got1);  // columns col + 8, col + 9
      const int row = row0 + 8 * (at.q + half) + 2 * (lane % 4) + (odd ? 1 : 0);
      if (bwd_holds_query<Cfg>(rows, P.seqlen_q, row)) {
        typename Cfg::T* out = dq + bwd_query_of<Cfg>(rows, row) * P.dq_row_stride + col;
        *reinterpret_cast<uint32_t*>(out) = pack_f32x2<typename Cfg::T>(lo.x * P.softmax_scale, lo.y * P.softmax_scale);
        *reinterpret_cast<uint32_t*>(out + 8) =
            pack_f32x2<typename Cfg::T>(hi.x * P.softmax_scale, hi.y * P.softmax_scale);
      }
    }
  } else {
    const int row = row0 + at.q;
#pragma unroll
    for (int k = 0; k < Cfg::kHeadDim / 64; ++k) {
      const int col = 2 * lane + 64 * k;
      if (bwd_holds_query<Cfg>(rows, P.seqlen_q, row)) {
        *reinterpret_cast<uint32_t*>(dq + bwd_query_of<Cfg>(rows, row) * P.dq_row_stride + col) =
            pack_f32x2<typename Cfg::T>(v[k].x * P.softmax_scale, v[k].y * P.softmax_scale);
      }
      if (bwd_holds_query<Cfg>(rows, P.seqlen_q, row + 8)) {
        *reinterpret_cast<uint32_t*>(dq + bwd_query_of<Cfg>(rows, row + 8) * P.dq_row_stride + col) =
            pack_f32x2<typename Cfg::T>(v[k].z * P.softmax_scale, v[k].w * P.softmax_scale);
      }
    }
  }
}

// m-block m_block of (batch, head) among the accumulator's (and the counters') m-blocks, its
// accumulator, and that head's dQ.
__device__ __forceinline__ int64_t bwd_dq_chunk_index(const BwdConvertParams& P, int head, int batch, int m_block) {
  return (static_cast<int64_t>(batch) * P.heads_q + head) * P.m_blocks + m_block;
}
template <class Cfg>
__device__ __forceinline__ const float* bwd_dq_chunk(const BwdConvertParams& P, int head, int batch, int m_block) {
  return P.dq_accum + bwd_dq_chunk_index(P, head, batch, m_block) * bwd_dq_block_floats<Cfg>();
}
template <class Cfg>
__device__ __forceinline__ typename Cfg::T* bwd_dq_head(const BwdConvertParams& P, int head, int batch) {
  return static_cast<typename Cfg::T*>(P.dq) + batch * P.dq_batch_stride + head * P.dq_head_stride;
}

// The convert_dq kernel: a CTA per 16 rows of an m-block (the host's grid: m_blocks B_r / 16
// CTAs per (head, batch)), 8 warps: row order, warp w the pair (w, w + 8); column order, the
// 128 threads of warpgroup g the units of shares g + 2 r (r < head_dim / 128), warp w as j = w % 4.
// The kernel's m-block `m_block` of (batch, head): its rows, accumulator, dQ and written chains
// (bwd_dq_written) for `convert` (a padding slot, or an m-block past the end: nothing).
template <class Cfg, class Convert>
__device__ __forceinline__ void bwd_convert_dq_block(const BwdConvertParams& P, int m_block, Convert&& convert) {
  const int head = blockIdx.y, batch = blockIdx.z;
  if (m_block >= P.m_blocks) return;
  const BwdQueryRows rows = bwd_query_rows<Cfg>(P.cu_seqlens_q, P.sequences, P.seqlen_q, m_block);
  if (!bwd_chunk_holds_query<Cfg>(rows, m_block)) return;  // a padding slot: nothing to write
  const unsigned written = bwd_dq_written<Cfg>(P, bwd_dq_chunk_index(P, head, batch, m_block));
  convert(rows, bwd_dq_chunk<Cfg>(P, head, batch, m_block), bwd_dq_head<Cfg>(P, head, batch), written);
}

template <class Cfg>
__device__ __forceinline__ void bwd_convert_dq_row(const BwdConvertParams& P) {
  const int lane = threadIdx.x % 32;
  float4 v[bwd_dq_unit_vectors<Cfg>()];
  if constexpr (bwd_dq_by_columns<Cfg>()) {
    const int row0 = blockIdx.x * 16, m_block = row0 / Cfg::kBlockM;
    bwd_convert_dq_block<Cfg>(P, m_block, [&](const BwdQueryRows& rows, const float* chunk, typename Cfg::T* dq,
                                                  unsigned written) {
#pragma unroll
      for (int round = 0; round < Cfg::kHeadDim / 128; ++round) {
        const int tid = threadIdx.x % 128;
        const BwdDqUnit at{(row0 % Cfg::kBlockM) / 8, static_cast<int>(threadIdx.x / 128) + 2 * round, tid / 32};
        bwd_dq_unit_load<Cfg>(chunk, at, lane, v, written);
        bwd_dq_unit_store<Cfg>(P, rows, dq, m_block * Cfg::kBlockM, at, lane, v);
      }
    });
  } else {
    const int row = blockIdx.x * 16 + threadIdx.x / 32, m_block = row / Cfg::kBlockM;  // (and row + 8)
    bwd_convert_dq_block<Cfg>(P, m_block, [&](const BwdQueryRows& rows, const float* chunk, typename Cfg::T* dq,
                                                  unsigned written) {
      const BwdDqUnit at{row % Cfg::kBlockM, 0, 0};
      bwd_dq_unit_load<Cfg>(chunk, at, lane, v, written);
      bwd_dq_unit_store<Cfg>(P, rows, dq, row - at.q, at, lane, v);
    });
  }
}

// `fused_convert on`: one warp converts all of m-block m_block of (batch, head), kBatch units'
// loads (16 float4 a lane) issued before their stores, through L2 (other CTAs' adds).
template <class Cfg>
__device__ __forceinline__ void bwd_convert_m_block(const BwdConvertParams& P, int head, int batch, int m_block,
                                                    int lane) {
  const BwdQueryRows rows = bwd_query_rows<Cfg>(P.cu_seqlens_q, P.sequences, P.seqlen_q, m_block);
  if (!bwd_chunk_holds_query<Cfg>(rows, m_block)) return;
  const float* chunk = bwd_dq_chunk<Cfg>(P, head, batch, m_block);
  typename Cfg::T* dq = bwd_dq_head<Cfg>(P, head, batch);
  constexpr int kUnits = bwd_dq_units<Cfg>(), kBatch = 16 / bwd_dq_unit_vectors<Cfg>();
#pragma unroll 1
  for (int first = 0; first < kUnits; first += kBatch) {
    float4 v[kBatch][bwd_dq_unit_vectors<Cfg>()];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (first + k < kUnits) {
        bwd_dq_unit_load<Cfg, true>(chunk, bwd_dq_unit<Cfg>(first + k), lane, v[k], bwd_dq_all_chains<Cfg>());
      }
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      if (first + k < kUnits) {
        bwd_dq_unit_store<Cfg>(P, rows, dq, m_block * Cfg::kBlockM, bwd_dq_unit<Cfg>(first + k), lane, v[k]);
      }
    }
  }
}

}  // namespace fadsl::sm90
