// fadsl/sm90_bwd_block.cuh -- section 3 of fadsl/sm90_bwd.cuh (which includes it after the
// parameters and the configuration): the CTA's work, an n-block of keys and the m-blocks that
// see it (packed sequences' slots included), the order it visits them in, where each m-block's
// ordered adds and fused conversion count it, and which m-blocks need the mask.  Not a header
// of its own: include fadsl/sm90_bwd.cuh.
#pragma once

namespace fadsl::sm90 {

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

// __clz on the device, the compiler's builtin where the host runs bwd_block_at (tests)
__host__ __device__ __forceinline__ int bwd_clz(int x) {
#if defined(__CUDA_ARCH__)
  return __clz(x);
#else
  return __builtin_clz(static_cast<unsigned>(x));
#endif
}

// `deterministic on` in visit order (P.dq_in_visit_order, set by the host only without a
// window, packed sequences or longest_first, and without a mask with no more n-blocks per
// (batch, head) than the GPU runs CTAs at once): the n-blocks reach each m-block one after another instead of
// all at once, so an m-block's ordered adds (ordered_reduce_add) seldom wait.  Without a
// mask n-block n of N visits all M m-blocks from m-block visit_first = n M / N on,
// wrapping around, so that at any step the running n-blocks are spread over the m-blocks;
// with the causal mask it visits them upwards from its diagonal as always, which reaches an
// m-block from the last n-block that sees it down to n-block 0.
template <class Cfg>
__host__ __device__ __forceinline__ bool bwd_in_visit_order(const BwdParamsSm90& P) {
  if constexpr (!Cfg::kDeterministic || Cfg::kVarlen || Cfg::kLongestFirst || has_window<Cfg>()) return false;
  return P.dq_in_visit_order != 0;
}

// The block of grid position (x, y, z) in a grid of (gx, gy, gz) CTAs (bwd_block: the
// launch's own; `scheduler persistent`: a tile's, bwd_tile_block).
template <class Cfg>
__host__ __device__ __forceinline__ BwdBlock bwd_block_at(const BwdParamsSm90& P, int x, int y, int z, int gx, int gy,
                                                          int gz) {
  BwdBlock b;
  b.n_block = x;
  b.head = y;
  b.batch = z;
  b.seqlen_q = P.seqlen_q;
  b.seqlen_k = P.seqlen_k;
  b.q_row0 = b.k_row0 = 0;
  if constexpr (Cfg::kVarlen) {
    // slot x of the packed keys: its sequence and n-block (a gap slot past the
    // sequence's keys, or a malformed sequence, has no work and stores nothing)
    const int s = bwd_varlen_sequence(P.cu_seqlens_k, P.sequences, Cfg::kBlockN, x);
    const int q0 = P.cu_seqlens_q[s], q1 = P.cu_seqlens_q[s + 1];
    const int k0 = P.cu_seqlens_k[s], k1 = P.cu_seqlens_k[s + 1];
    const bool ok = bwd_sequence_ok(q0, q1, P.seqlen_q) && bwd_sequence_ok(k0, k1, P.seqlen_k);
    b.n_block = x - bwd_first_slot(P.cu_seqlens_k, s, Cfg::kBlockN);
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
  if constexpr (Cfg::kCausal) {
    // `deterministic on`, causal, in visit order: a (batch, head)'s n-blocks launch last first
    // (the shortest first: n-block n visits the m-blocks from its diagonal on). At m-block m
    // n-block n adds after n + 1 (causal_visit_place), which launched before it, so a CTA
    // never waits on one launched after it; and as one (batch, head)'s CTAs end (the short
    // ones first) the next one's start in its tickets' order. Launched n-block first (the
    // grid's order otherwise), the next (batch, head)'s n-block 0 would start first and wait
    // at every m-block for n-blocks not yet launched, its CTAs in step with the last one
    // launched (0.78x at head_dim 64, 16k: H200, 2026-12-01, docs/backward.md).
    if (bwd_in_visit_order<Cfg>(P)) b.n_block = gx - 1 - x;
  }
  if constexpr (Cfg::kLongestFirst && !Cfg::kVarlen) {
    // Blocks launch x fastest, then y, then z.  The launch index runs over sections of
    // `section` (head, batch) pairs, the n-block slowest inside each.  `section` is the power
    // of 2 of pairs whose Q and dO (2 bytes) and dQ accumulator (4 bytes) fit 40 MB of the
    // L2 (50 MB on H100 and H200): with the n-block slowest over all pairs at once, every
    // running CTA reads its own head's Q and dO and the L2 thrashes (measured 2026-11-29,
    // H200: -27 % at causal 1k, head_dim 128).  The last section holds the remainder.
    const int pairs = gy * gz;
    const int launched = x + gx * (y + gy * z);
    const long long head_bytes = (long long)P.seqlen_q_rounded * Cfg::kHeadDim * (2 * 2 + 4);
    const long long fit = (40ll << 20) / head_bytes;
    const int section = fit < 1 ? 1 : 1 << (31 - bwd_clz(fit > (1 << 30) ? 1 << 30 : (int)fit));
    const int section_ctas = section * gx;
    const int first_pair = launched / section_ctas * section;
    const int in_section = launched % section_ctas;
    const int pairs_here = imin(section, pairs - first_pair);
    const int hb = first_pair + in_section % pairs_here;
    b.n_block = in_section / pairs_here;
    b.head = hb % gy;
    b.batch = hb / gy;
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
// The grid position of the CTA launched `ahead` places after (x, y, z) in launch order (x
// fastest, then y, then z) in a grid of (gx, gy, gz) CTAs; ok false past the grid's end
// (`prefetch_kv on`'s later CTA, bwd_prefetch_later_kv).
struct BwdGridPos {
  bool ok;
  int x, y, z;
};
__host__ __device__ __forceinline__ BwdGridPos bwd_launched_after(int x, int y, int z, int gx, int gy, int gz,
                                                                  int ahead) {
  // (64-bit: a varlen grid's x runs over the packed keys' slots)
  const int64_t at = x + static_cast<int64_t>(gx) * (y + static_cast<int64_t>(gy) * z) + ahead;
  if (ahead < 0 || at >= static_cast<int64_t>(gx) * gy * gz) return BwdGridPos{false, 0, 0, 0};
  return BwdGridPos{true, static_cast<int>(at % gx), static_cast<int>(at / gx % gy), static_cast<int>(at / gx / gy)};
}
template <class Cfg>
__device__ __forceinline__ BwdBlock bwd_block(const BwdParamsSm90& P) {
  return bwd_block_at<Cfg>(P, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z);
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

// The lean path, three parts (SASS, NVRTC 13.5): each product's wgmma descriptors built
// once and moved per k16 step (issue_keys_by_rows, issue_dq, issue_dq_t), the warpgroup
// index warp-uniform (bwd_warpgroup), and dQ's red.add from one pinned pointer (red_add_dq).
// With the first two ptxas keeps the descriptors in uniform registers: they cut the head_dim
// 128 consumer loop from 862 to 635 instructions, the third to 587 (2026-11-30: +2-3 % on an
// H200). The first two cut a keep's common path (examples/modifiers/document_causal.fa) from
// 695 to 529, the first and the third packed sequences' (examples/serving/
// fa3_varlen_causal.fa) from 704 to 532 (2026-12-02; 1.01-1.02x its backward on an H200),
// the first two the dQ writer's (fa3_hdim64_causal's deterministic block) from 733 to 577.
// Each is left out where it made ptxas spill (4-48 bytes in some variant;
// tests/test_modifiers_backward.py, test_attention_variants.py,
// test_backward_hdim256_build.py, test_varlen_backward_build.py, test_backward_spec.py):
// the whole path with a softcap, a split head_dim (whose consumer builds its descriptors
// once a product itself: sm90_bwd_split.cuh) or packed sequences with a window; the uniform
// index also with packed sequences, or a score and a keep together (prefix_lm_alibi); the
// pinned pointer with any modifier, window or softcap.
template <class Cfg>
__host__ __device__ constexpr bool bwd_lean_path() {
  return !(Cfg::kSplitHeadDim || Cfg::kSoftcap > 0.f ||
           (Cfg::kVarlen && (Cfg::kWindowLeft >= 0 || Cfg::kWindowRight >= 0)));
}
template <class Cfg>
__host__ __device__ constexpr bool bwd_uniform_warpgroup() {
  return bwd_lean_path<Cfg>() && !Cfg::kVarlen && !(Cfg::kScore && Cfg::kKeep);
}
template <class Cfg>
__host__ __device__ constexpr bool bwd_pinned_dq() {
  return bwd_lean_path<Cfg>() &&
         !(Cfg::kScore || Cfg::kKeep || Cfg::kWindowLeft >= 0 || Cfg::kWindowRight >= 0);
}

// This thread's warpgroup (0: the producer); warp-uniform through a shuffle where
// bwd_uniform_warpgroup.
template <class Cfg>
__device__ __forceinline__ int bwd_warpgroup() {
  if constexpr (bwd_uniform_warpgroup<Cfg>()) {
    return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0);
  } else {
    return threadIdx.x / 128;
  }
}

// The first n-block whose keys m-block m sees (0 without a window): with `deterministic on`
// the m-block's tickets start there.  Every n-block from it to the last that m sees visits
// m-block m (bwd_block's range is the same condition), so the tickets come without a gap.
template <class Cfg>
__host__ __device__ __forceinline__ int bwd_first_n_block(const BwdBlock& b, int m) {
  if constexpr (has_window<Cfg>()) {
    const int first_key = m * Cfg::kBlockM + (b.seqlen_k - b.seqlen_q) - Cfg::kWindowLeft;  // (padded only: see validate)
    return first_key > 0 ? first_key / Cfg::kBlockN : 0;
  }
  return 0;
}

template <class Cfg>
__host__ __device__ __forceinline__ int bwd_n_blocks(const BwdBlock& b) {
  return (b.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
}

// The n-blocks that visit m-block m of block b's (batch, head): from the first whose keys m
// sees (bwd_first_n_block: 0 without a window) to the last, the largest n whose first key is
// within the right edge of m's last query, (m + 1) B_r - 1 + d + right (bwd_block's m_begin
// says n visits m iff n B_c - d - right < (m + 1) B_r); every n-block without a right edge.
// Without a window's left edge every m-block below P.m_blocks is in range of each n-block.
// (`fused_convert on`: the count that completes m-block m, fadsl/sm90_bwd_convert.cuh.)
template <class Cfg>
__host__ __device__ __forceinline__ int bwd_dq_contributors(const BwdBlock& b, int m) {
  const int n_blocks = bwd_n_blocks<Cfg>(b);
  int last = n_blocks - 1;
  if constexpr (bwd_has_right_edge<Cfg>()) {
    const int x = (m + 1) * Cfg::kBlockM - 1 + (b.seqlen_k - b.seqlen_q) + bwd_right_edge<Cfg>();
    last = x < 0 ? -1 : imin(x / Cfg::kBlockN, n_blocks - 1);
  }
  return imax(last - bwd_first_n_block<Cfg>(b, m) + 1, 0);
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

// The i-th m-block n-block b visits (producer and consumers alike): with a keep's classes made
// by a pass (and not `deterministic on`), the i-th of its list of kept m-blocks in ascending
// order (bwd_keep_trim; the list holds them the last first), so that the EMPTY ones between
// kept ones are neither loaded nor run; the rings count iterations, not m-blocks.
template <class Cfg>
__device__ __forceinline__ int bwd_m_block(const BwdParamsSm90& P, const BwdBlock& b, int i) {
  if constexpr (Cfg::kKeep && !Cfg::kDeterministic) {
    if constexpr (Cfg::Modifiers::kClassesInput >= 0) return __ldg(bwd_kept_list<Cfg>(P, b) + 1 + b.m_count - i);
  }
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
// - visit order (bwd_in_visit_order): causal_visit_place, visit_place without a mask.
//   Causal, a CTA waits on larger n-blocks, which bwd_block_at launches before it (last
//   first): no deadlock whatever runs at once.  Without a mask a CTA may wait on larger
//   n-blocks, which launch after it: the host asks for it only where every n-block of a
//   (batch, head) fits on the GPU at once, so that of the CTAs running only the last (batch,
//   head) launched can be short of a CTA it waits on, and the others, complete, finish and
//   make room for it.
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

}  // namespace fadsl::sm90
