// fadsl/sm90_modifiers.cuh -- score and mask modifiers (issue 41) on sm_90a: a spec's
// `score EXPR` and `keep EXPR`, rendered by fadsl/targets/cuda_expr.py into the generated
// kernel's SpecModifiers (Cfg::Modifiers), applied to a consumer's S in registers.
//
// Included at the end of fadsl/sm90.cuh (it uses FwdConfig, TileWork and RowLimits); the
// tile rule's EMPTY blocks are trimmed in the tile scheduler (keep_work, sm90_tiles.cuh).
//
// Where they run, in the softmax step of every block (ops.cu.j2): S = Q K^T in registers ->
// apply_score -> the built-in mask (mask_scores) -> mask_keep (PARTIAL blocks only) -> the
// online softmax. The score is taken in natural units, s = S softmax_scale, and left in
// them: the kernel's scale_log2 is then log2 e, so the row max and every later factor are of
// the modified scores (docs/numerics.md, "Score and mask modifiers"). Before the mask, so
// that a masked key stays -inf whatever the score makes of it.
//
// A thread's rows past seqlen_q (a tile's padding, never stored) are read as the last row,
// and keys past seqlen_k (masked) as the last key, so that an input indexed by q_idx or
// kv_idx is never read outside its rows: check_modifiers proved every index inside its
// dimension for q_idx < seqlen_q and kv_idx < seqlen_k.
#pragma once

#include "modifiers.cuh"  // the functions the expressions call (the common header)

namespace fadsl::sm90 {

// Where a block's scores lie, by value (a struct of references to the kernel's TileWork
// and RowLimits would take their addresses and put them on the stack): the tile's batch and
// head, this thread's first row, the sequence lengths, the block's first key of this thread.
struct ScoreSite {
  int b, h;
  int row0, seqlen_q, seqlen_k;
  int col0;  // n_block B_c + 2 (lane % 4)
};

template <class Cfg>
__device__ __forceinline__ ScoreSite score_site(const TileWork& w, const RowLimits& rows, int n_block, int lane) {
  return {w.batch, w.head, rows.row0, rows.seqlen_q, rows.seqlen_k, n_block * Cfg::kBlockN + 2 * (lane % 4)};
}

// The indices of this thread's score of its row r (0 or 1) and its column c (8j + e: the
// wgmma accumulator layout's s[4j + 2r + e]): query row0 + 8r, key col0 + c, clamped to the
// sequences.
__device__ __forceinline__ int score_q_idx(const ScoreSite& at, int r) { return imin(at.row0 + 8 * r, at.seqlen_q - 1); }
__device__ __forceinline__ int score_kv_idx(const ScoreSite& at, int c) { return imin(at.col0 + c, at.seqlen_k - 1); }

// f(x, q_idx, kv_idx) on each of this thread's scores x.
template <class Cfg, class F>
__device__ __forceinline__ void for_each_score(float (&s)[Cfg::kSRegs], const ScoreSite& at, F f) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) f(s[4 * j + 2 * r + e], score_q_idx(at, r), score_kv_idx(at, 8 * j + e));
    }
  }
}

// `score` of one raw score S: score(S softmax_scale, b, h, q_idx, kv_idx), natural units.
// (u: the tile's Uniforms, what the expressions read that is the same for all its scores.)
template <class Cfg, class U>
struct ScoreOf {
  const FwdParamsSm90& P;
  U u;  // (by value: a reference to the kernel's would take its address)
  ScoreSite at;
  __device__ __forceinline__ float operator()(float x, int r, int c) const {
    return Cfg::Modifiers::score(P, u, x * P.base.softmax_scale, at.b, at.h, score_q_idx(at, r), score_kv_idx(at, c));
  }
};

template <class Cfg, class U>
__device__ __forceinline__ ScoreOf<Cfg, U> score_of(const FwdParamsSm90& P, const U& u, const ScoreSite& at) {
  return {P, u, at};
}

// A score s + f(b, h, d), d = q_idx - kv_idx (split_distance_term), where f is dear (T5's
// log-bucketed table): a warp's scores of one block meet few distances, so each lane
// evaluates f at kWindows of them and each score reads its value from the lane that holds it
// (a shuffle). The warp's scores have distances d = base + o + spread: base warp-uniform, o a
// compile-time offset in [kLo, kHi] (the score's register), spread the lane's part, in
// [kSpreadLo, kSpreadLo + 14]. Window k of lane l holds f at base + kLo + kSpreadLo + 16 k + l:
// 32 distances 16 apart, so that the 15 distances of one offset over the warp's lanes lie in
// window (o - kLo) / 16, at lane (o - kLo) % 16 + spread - kSpreadLo (0 .. 29). Evaluated at
// distances clamped into [-(seqlen_k - 1), seqlen_q - 1], where every real score's lies and
// check_modifiers proved f's indices in bounds (a padding row's or key's value is never used).
template <int kLo, int kHi>
struct DistanceTable {
  static constexpr int kSpreadLo = -7;
  static constexpr int kWindows = (kHi - kLo) / 16 + 1;
  float t[kWindows];

  template <class F>
  __device__ __forceinline__ void fill(int base, int lane, int seqlen_q, int seqlen_k, F f) {
#pragma unroll
    for (int k = 0; k < kWindows; ++k) {
      const int d = imax(1 - seqlen_k, imin(base + kLo + kSpreadLo + 16 * k + lane, seqlen_q - 1));
      t[k] = f(d);
    }
  }
  // f at base + o + spread (o a constant once unrolled)
  __device__ __forceinline__ float at(int o, int spread) const {
    const int k = (o - kLo) / 16;
    return __shfl_sync(0xffffffffu, t[k], (o - kLo) % 16 + spread - kSpreadLo);
  }
};

// `score` on this thread's S.
template <class Cfg, class U>
__device__ __forceinline__ void apply_score(float (&s)[Cfg::kSRegs], const FwdParamsSm90& P, const U& u,
                                            const ScoreSite& at) {
  if constexpr (Cfg::kScore && Cfg::kScoreByDistance) {
    // this thread's score (r, c = 8j + e): q_idx row0 + 8r, kv_idx col0 + c, so d = row0 - col0
    // + 8r - c, row0 - col0 = base + spread with spread = lane / 4 - 2 (lane % 4) (row0 =
    // the warp's first row + lane / 4, col0 = the block's first key + 2 (lane % 4))
    const int lane = threadIdx.x % 32;
    const int spread = lane / 4 - 2 * (lane % 4);
    DistanceTable<7 - Cfg::kBlockN, 8> table;
    table.fill(at.row0 - at.col0 - spread, lane, at.seqlen_q, at.seqlen_k,
               [&](int d) { return Cfg::Modifiers::score_term(P, u, at.b, at.h, d); });
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * r + e];
          x = x * P.base.softmax_scale + table.at(8 * r - 8 * j - e, spread);
        }
      }
    }
  } else if constexpr (Cfg::kScore) {
    const ScoreOf<Cfg, U> score{P, u, at};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) s[4 * j + 2 * r + e] = score(s[4 * j + 2 * r + e], r, 8 * j + e);
      }
    }
  }
}

// `keep`: -inf where the predicate does not hold (a PARTIAL block's scores).
template <class Cfg, class U>
__device__ __forceinline__ void mask_keep(float (&s)[Cfg::kSRegs], const FwdParamsSm90& P, const U& u,
                                          const ScoreSite& at) {
  if constexpr (Cfg::kKeep) {
    for_each_score<Cfg>(s, at, [&](float& x, int q_idx, int kv_idx) {
      if (!Cfg::Modifiers::keep(P, u, at.b, at.h, q_idx, kv_idx)) x = -INFINITY;
    });
  }
}

// Whether block n_block needs `keep`'s mask for warpgroup wg's 64 rows: not FULL by the tile
// rule (a PARTIAL block, or an EMPTY one that keep_work left inside the range). The rows past
// seqlen_q count as the last row, as for_each_score reads them; warp-uniform.
template <class Cfg>
__device__ __forceinline__ bool keep_partial(const FwdParamsSm90& P, const TileWork& w, int wg, int n_block) {
  if constexpr (!Cfg::kKeep) {
    return false;
  } else {
    const int q_lo = imin(w.m0 + 64 * wg, w.seqlen_q - 1), q_hi = imin(w.m0 + 64 * wg + 63, w.seqlen_q - 1);
    const int kv_lo = n_block * Cfg::kBlockN, kv_hi = imin(kv_lo + Cfg::kBlockN, w.seqlen_k) - 1;
    if (Cfg::Modifiers::full(P, w.batch, w.head, q_lo, q_hi, kv_lo, kv_hi)) return false;
    if constexpr (Cfg::Modifiers::kClassesInput >= 0) return keep_class<Cfg>(P, w, n_block) != kTileFull;
    return true;
  }
}

// One tile's class by keep_at(r, c), whether query row r < rows keeps key column c < cols,
// over a CTA of kThreads threads: a thread per key column, the rows in turn, so that what the
// predicate reads per key is loaded once a thread and what it reads per query is one
// broadcast load a warp (no index divided by the tile's width). EMPTY: no score kept; FULL:
// every one; PARTIAL otherwise. Every thread of the CTA calls it (two CTA-wide reductions).
template <int kThreads, class KeepAt>
__device__ __forceinline__ int keep_tile_class(int rows, int cols, KeepAt keep_at) {
  bool any = false, all = true;
  for (int c = threadIdx.x; c < cols; c += kThreads) {
#pragma unroll 8
    for (int r = 0; r < rows; ++r) {
      const bool kept = keep_at(r, c);
      any = any || kept;
      all = all && kept;
    }
  }
  any = __syncthreads_or(any);  // (the CTA's threads all reach both: orders nothing else)
  all = __syncthreads_and(all);
  return all ? kTileFull : any ? kTilePartial : kTileEmpty;
}

// A row of tiles' list of kept blocks along x (the forward's kv_block and the backward's
// bwd_m_block read it), by the CTA that
// classes the row's last tile, whichever that is: list[0] counts the row's CTAs done (the host
// zeroes it), list[1] is the count of kept blocks, list[2 ..] the blocks, the last first (the
// order the kernel visits them in). Thread 0 of each CTA, after its class byte: the fence
// makes that byte visible to the device before the count says it is done; the CTA whose add
// completes the count fences again and reads every byte of the row, each written and fenced
// before its CTA's add (the threadfence reduction's pattern, CUDA C++ Programming Guide).
__device__ __forceinline__ void keep_kept_list(const uint8_t* row, int* list, int blocks) {
  __threadfence();  // (orders: this CTA's class byte before its count)
  if (atomicAdd(list, 1) != blocks - 1) return;
  __threadfence();  // (orders: every CTA's count before the reads of their bytes)
  const volatile uint8_t* bytes = row;
  int count = 0;
  for (int x = blocks - 1; x >= 0; --x) {
    if (bytes[x] != kTileEmpty) list[2 + count++] = x;
  }
  list[1] = count;
}

// A classing kernel's CTA (the forward's <kernel>_keep_classes and the backward's), 128
// threads, on either's params P (their inputs and sizes): the tile of blockIdx.x and
// blockIdx.y (queries on x where kQueriesOnX: the backward's m-blocks; else keys: the
// forward's kv blocks) in row blockIdx.z of the classes (a batch, or a (batch, head) where
// keep reads h), classed by Cfg's keep. Writes the tile's class byte at
// P.inputs[kClassesInput][(z gridDim.y + y) gridDim.x + x] and, with keep_kept_list, that row
// of tiles' list of kept blocks along x at P.inputs[kClassesInput + 1]. Rows past seqlen_q and
// keys past seqlen_k are not scores; a causal tile wholly above the diagonal is EMPTY unread
// (no kernel reaches it).
template <class Cfg, int kBlockQ, int kBlockK, bool kQueriesOnX, class Params>
__device__ __forceinline__ void keep_classes_cta(const Params& P, int heads_q, int seqlen_q, int seqlen_k) {
  const int q0 = (kQueriesOnX ? blockIdx.x : blockIdx.y) * kBlockQ;
  const int k0 = (kQueriesOnX ? blockIdx.y : blockIdx.x) * kBlockK;
  const int rows = imin(kBlockQ, seqlen_q - q0), cols = imin(kBlockK, seqlen_k - k0);
  const long long row_of_tiles = static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y;
  uint8_t* cls = static_cast<uint8_t*>(const_cast<void*>(P.inputs[Cfg::Modifiers::kClassesInput])) +
                 row_of_tiles * gridDim.x + blockIdx.x;
  int found = kTileEmpty;
  // (uniform over the CTA: every thread reaches keep_tile_class's barriers, or none does)
  if (!(Cfg::kCausal && k0 > q0 + rows - 1 + seqlen_k - seqlen_q)) {
    const int heads = Cfg::Modifiers::kClassesPerHead ? heads_q : 1;
    const int b = blockIdx.z / heads, h = blockIdx.z % heads;
    const auto u = Cfg::Modifiers::uniforms(P, b, h);
    found = keep_tile_class<128>(
        rows, cols, [&](int r, int c) { return Cfg::Modifiers::keep(P, u, b, h, q0 + r, k0 + c); });
  }
  if (threadIdx.x != 0) return;
  *cls = static_cast<uint8_t>(found);
  int* lists = static_cast<int*>(const_cast<void*>(P.inputs[Cfg::Modifiers::kClassesInput + 1]));
  keep_kept_list(cls - blockIdx.x, lists + row_of_tiles * (2 + gridDim.x), gridDim.x);
}

// <kernel>_keep_classes (a keep that reads inputs per token, TileRule.by_pass), before each
// launch of the attention kernel: tile (q block blockIdx.y, kv block blockIdx.x), each q
// block's list of kept kv blocks.
template <class Cfg>
__device__ __forceinline__ void keep_classes(const FwdParamsSm90& P) {
  keep_classes_cta<Cfg, Cfg::kBlockM, Cfg::kBlockN, false>(P, P.base.heads_q, P.base.seqlen_q, P.base.seqlen_k);
}

}  // namespace fadsl::sm90
