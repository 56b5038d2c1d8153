// fadsl/sm90_varlen.cuh -- `varlen on`: packed batches of sequences of any lengths
// (FlashAttention's varlen convention: q, k, v, o as (tokens, heads, head_dim), sequence b at
// rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 of each).
//
// A launch is two kernels on one stream:
//   1. <kernel>_varlen_tiles, one CTA: lists the launch's (sequence, q block) pairs, each as
//      a VarlenTile, sorted by the number of K/V blocks its tile runs, longest first (a
//      counting sort), and their count. No tile straddles two sequences: a sequence's last
//      q block is short, and its rows past the sequence are never stored.
//   2. the attention kernel, whose scheduler (varlen_tile_index, varlen_tile_work) runs tile
//      t = pair * heads_q + head of that list; persistent CTAs take the tiles round by round,
//      the order of CTAs reversed every other round (a boustrophedon: the CTA that took a
//      round's longest tile takes the next round's shortest), so that longest-first sorted
//      work spreads evenly. Every role reads the tile from the list (an L2 hit), so nothing of
//      the scheduler is exchanged between roles: the sync plan is the padded kernel's.
// The list lives in a workspace of the call (the runtime's, fadsl/runtime/varlen.py), written
// by kernel 1 before kernel 2 starts (stream order), so a CUDA graph replays both.
#pragma once

namespace fadsl::sm90 {

// A (sequence, q block) pair of the list: two int4.
//   first:  sequence, q block, the sequence's first query row, its query rows
//   second: its first key, its keys, the K/V blocks the tile runs (the sort key), 0
constexpr int kVarlenTileThreads = 1024;
constexpr int kVarlenMaxBatch = 8192;  // sequences of one launch (the runtime refuses more)
constexpr int kVarlenBuckets = 2048;   // the sort's keys: K/V blocks, the longest ones together

// Tile number `step` of this CTA, or -1 when it has no more (the count is the list's).
template <class Cfg>
__device__ __forceinline__ int varlen_tile_index(const FwdParamsSm90& P, int step) {
  const int tiles = *P.varlen_tile_count * P.base.heads_q;
  int t = blockIdx.x;
  if constexpr (Cfg::kPersistent) {
    const int ctas = gridDim.x;
    t = step * ctas + ((step & 1) ? ctas - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x));
  } else if (step > 0) {
    return -1;
  }
  return t < tiles ? t : -1;
}

template <class Cfg>
__device__ __forceinline__ TileWork varlen_tile_work(const FwdParamsSm90& P, int t) {
  const int pair = fast_div(t, P.div_heads);
  const int4 first = P.varlen_tiles[2 * pair];
  const int4 second = P.varlen_tiles[2 * pair + 1];
  TileWork w;
  w.batch = 0;  // one packed "batch": the tensors' batch coordinate
  w.m_block = first.y;
  w.head = t - pair * P.base.heads_q;
  w.head_kv = fast_div(w.head, P.div_group);
  w.m0 = w.m_block * Cfg::kBlockM;
  w.q_start = first.z;
  w.seqlen_q = first.w;
  w.k_start = second.x;
  w.seqlen_k = second.y;
  kv_work<Cfg>(w, w.seqlen_q, w.seqlen_k);
  return w;
}

// An exclusive prefix sum over the CTA (kVarlenTileThreads threads, one value each); the
// total goes to *total. Two barriers inside, so every thread calls it.
__device__ __forceinline__ int block_exclusive_sum(int value, int* warp_sums, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();  // every warp's sum written
  if (warp == 0) {
    const int sum = warp_sums[lane];
    int prefix = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, prefix, d);
      if (lane >= d) prefix += other;
    }
    warp_sums[lane] = prefix - sum;  // exclusive, over warps
    if (lane == 31) *total = prefix;
  }
  __syncthreads();  // the warps' offsets and the total written
  const int result = warp_sums[warp] + inclusive - value;
  __syncthreads();  // warp_sums read before a next call writes it
  return result;
}

// The sequence whose pairs include pair i: the last b with first_pair[b] <= i.
__device__ __forceinline__ int sequence_of(const int* first_pair, int batch, int i) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_pair[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Whether this thread's sequences are well formed: cu_seqlens start at 0 or later, never
// decrease and end within the tensors (FwdParams' seqlen_q and seqlen_k: their rows).
__device__ __forceinline__ bool valid_sequences(const FwdParamsSm90& P) {
  const FwdParams& p = P.base;
  bool ok = true;
  for (int b = threadIdx.x; b < p.batch; b += kVarlenTileThreads) {
    const int q0 = P.cu_seqlens_q[b], q1 = P.cu_seqlens_q[b + 1];
    const int k0 = P.cu_seqlens_k[b], k1 = P.cu_seqlens_k[b + 1];
    ok = ok && 0 <= q0 && q0 <= q1 && q1 <= p.seqlen_q && 0 <= k0 && k0 <= k1 && k1 <= p.seqlen_k;
  }
  return ok;
}

// Malformed cu_seqlens: every element of O and of the LSE (if asked for) becomes NaN, so that
// the mistake shows in the result rather than as plausible numbers (the host cannot read the
// device's cu_seqlens without waiting for the GPU). One CTA, 16 bytes a store.
template <class Cfg>
__device__ __forceinline__ void poison_output(const FwdParamsSm90& P) {
  const FwdParams& p = P.base;
  constexpr int kChunks = Cfg::kHeadDim * 2 / 16;  // 16-byte pieces of a row
  constexpr bool kBf16 = cuda::std::is_same_v<typename Cfg::T, __nv_bfloat16>;
  const uint32_t nan2 = kBf16 ? 0x7fc07fc0u : 0x7e007e00u;  // two quiet NaNs
  const int64_t pieces = static_cast<int64_t>(p.seqlen_q) * p.heads_q * kChunks;
  for (int64_t i = threadIdx.x; i < pieces; i += kVarlenTileThreads) {
    const int64_t row = i / (p.heads_q * kChunks), rest = i % (p.heads_q * kChunks);
    char* at = static_cast<char*>(p.o) + 2 * (row * p.o_seq_stride + (rest / kChunks) * p.o_head_stride);
    reinterpret_cast<uint4*>(at)[rest % kChunks] = make_uint4(nan2, nan2, nan2, nan2);
  }
  if (p.lse == nullptr) return;
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(p.seqlen_q) * p.heads_q; i += kVarlenTileThreads) {
    p.lse[(i / p.seqlen_q) * p.lse_head_stride + i % p.seqlen_q] = __int_as_float(0x7fc00000);
  }
}

// Kernel 1: the list. One CTA of kVarlenTileThreads threads; batch <= kVarlenMaxBatch.
template <class Cfg>
__device__ __forceinline__ void varlen_tiles(const FwdParamsSm90& P) {
  __shared__ int first_pair[kVarlenMaxBatch + 1];  // pairs of the sequences before b
  __shared__ int bucket[kVarlenBuckets];           // pairs per key, then each key's next place
  __shared__ int warp_sums[32];
  __shared__ int total;
  const int batch = P.base.batch;
  if (__syncthreads_or(!valid_sequences(P))) {
    poison_output<Cfg>(P);
    if (threadIdx.x == 0) *P.varlen_tile_count = 0;
    return;
  }
  for (int i = threadIdx.x; i < kVarlenBuckets; i += kVarlenTileThreads) bucket[i] = 0;
  // first_pair: the q blocks of the sequences before b, a chunk of kVarlenTileThreads at a time
  int carry = 0;
  for (int base = 0; base < batch; base += kVarlenTileThreads) {
    const int b = base + threadIdx.x;
    const int rows = b < batch ? P.cu_seqlens_q[b + 1] - P.cu_seqlens_q[b] : 0;
    const int blocks = (imax(rows, 0) + Cfg::kBlockM - 1) / Cfg::kBlockM;
    const int before = block_exclusive_sum(blocks, warp_sums, &total);
    if (b < batch) first_pair[b] = carry + before;
    carry += total;  // (read after the sum's last barrier: every thread sees the same)
  }
  if (threadIdx.x == 0) first_pair[batch] = carry;
  __syncthreads();  // first_pair and the zeroed buckets complete
  const int pairs = carry;
  // Each pair's tile as the attention kernel will see it, and its key.
  auto tile_of = [&](int i, TileWork& w) {
    const int b = sequence_of(first_pair, batch, i);
    w.m_block = i - first_pair[b];
    w.m0 = w.m_block * Cfg::kBlockM;
    w.q_start = P.cu_seqlens_q[b];
    w.seqlen_q = P.cu_seqlens_q[b + 1] - w.q_start;
    w.k_start = P.cu_seqlens_k[b];
    w.seqlen_k = P.cu_seqlens_k[b + 1] - w.k_start;
    kv_work<Cfg>(w, w.seqlen_q, w.seqlen_k);
    return b;
  };
  for (int i = threadIdx.x; i < pairs; i += kVarlenTileThreads) {
    TileWork w;
    tile_of(i, w);
    atomicAdd(&bucket[imin(w.n_blocks, kVarlenBuckets - 1)], 1);
  }
  __syncthreads();  // every pair counted
  // Each key's first place, longest first: the pairs of larger keys come before it. Thread t
  // holds keys kVarlenBuckets - 1 - 2t and the one below it.
  static_assert(kVarlenBuckets == 2 * kVarlenTileThreads, "two keys a thread");
  const int hi_key = kVarlenBuckets - 1 - 2 * static_cast<int>(threadIdx.x), lo_key = hi_key - 1;
  const int hi_count = bucket[hi_key], lo_count = bucket[lo_key];
  const int start = block_exclusive_sum(hi_count + lo_count, warp_sums, &total);
  bucket[hi_key] = start;
  bucket[lo_key] = start + hi_count;
  __syncthreads();  // every key's place set
  for (int i = threadIdx.x; i < pairs; i += kVarlenTileThreads) {
    TileWork w;
    const int b = tile_of(i, w);
    const int at = atomicAdd(&bucket[imin(w.n_blocks, kVarlenBuckets - 1)], 1);
    P.varlen_tiles[2 * at] = make_int4(b, w.m_block, w.q_start, w.seqlen_q);
    P.varlen_tiles[2 * at + 1] = make_int4(w.k_start, w.seqlen_k, w.n_blocks, 0);
  }
  if (threadIdx.x == 0) *P.varlen_tile_count = pairs;
}

}  // namespace fadsl::sm90
