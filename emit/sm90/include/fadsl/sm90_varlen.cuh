// fadsl/sm90_varlen.cuh -- `varlen on`: packed batches of sequences of any lengths
// (FlashAttention's varlen convention: q, k, v, o as (tokens, heads, head_dim), sequence b at
// rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 of each).
//
// A launch is two kernels on one stream:
//   1. <kernel>_varlen_tiles, one CTA: lists the sequences with a query row, longest K/V loop
//      first (a counting sort on the K/V blocks of a sequence's last q block), each with its
//      rows, keys and first tile; and the launch's tile count.
//   2. the attention kernel. Its tiles are the padded kernel's, sequence by sequence in the
//      list's order: a sequence's tiles are (head, q block) with the q block fastest, and its
//      q blocks in the padded scheduler's order (causal and persistent: a long and a short
//      block in turn, which CTAs take in pairs of equal work; causal on a grid: long first).
//      So the CTAs running at once share a head's K/V through L2 as the padded kernel's do,
//      the longest work goes first, and tile_index deals tiles out as it does for a padded
//      batch. No tile straddles two sequences: a sequence's last q block is short, and its
//      rows past the sequence are never stored. Every role finds its tile's sequence in the
//      list (a binary search over its first tiles, L1 hits after the first), so nothing of
//      the scheduler is exchanged between roles: the sync plan is the padded kernel's.
// The list lives in a workspace of the call (fadsl/runtime/varlen.py), written by kernel 1
// before kernel 2 starts (stream order), so a CUDA graph replays both.
#pragma once

namespace fadsl::sm90 {

// The list: varlen_tile_count[0] the launch's tiles, [1] the sequences listed; sequence k of
// the list is two int4 of varlen_tiles:
//   [2k]      its first query row, query rows, first key, keys
//   [2k + 1]  its first tile, its q blocks, its index in the batch, its sort key
constexpr int kVarlenTileThreads = 1024;
constexpr int kVarlenMaxBatch = 8192;  // sequences of one launch (the runtime refuses more)
constexpr int kVarlenBuckets = 2048;   // the sort's keys: K/V blocks, the longest ones together

// Tile number `step` of this CTA, or -1 when it has no more: tile_index's order over the
// list's tiles.
template <class Cfg>
__device__ __forceinline__ int varlen_tile_index(const FwdParamsSm90& P, int step) {
  const int tiles = P.varlen_tile_count[0];
  const int ctas = gridDim.x, cta = blockIdx.x;
  int t = cta;  // one CTA per tile (the grid has one per tile the list may hold): step 0 only
  if constexpr (Cfg::kPersistent && Cfg::kCausal && !has_window<Cfg>()) {
    t = 2 * (cta + (step / 2) * ctas) + (step & 1);
  } else if constexpr (Cfg::kPersistent) {
    t = cta + step * ctas;
  } else if (step > 0) {
    return -1;
  }
  return t < tiles ? t : -1;
}

template <class Cfg>
__device__ __forceinline__ TileWork varlen_tile_work(const FwdParamsSm90& P, int t) {
  // the last sequence of the list whose first tile is at or before t
  const int* first_tiles = reinterpret_cast<const int*>(P.varlen_tiles) + 4;  // [8k]: sequence k's
  int lo = 0, hi = P.varlen_tile_count[1] - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_tiles[8 * mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  const int4 sequence = P.varlen_tiles[2 * lo];
  const int4 tiles = P.varlen_tiles[2 * lo + 1];
  const int blocks = tiles.y, r = t - tiles.x;
  const int head = r / blocks, j = r - head * blocks;
  TileWork w;
  w.batch = 0;  // one packed "batch": the tensors' batch coordinate
  w.sequence = tiles.z;  // its index in the batch (an 8-bit kernel's descales are per sequence)
  w.head = head;
  w.head_kv = fast_div(head, P.div_group);
  if constexpr (Cfg::kCausal && Cfg::kPersistent && !has_window<Cfg>()) {
    w.m_block = (j & 1) ? j / 2 : blocks - 1 - j / 2;  // blocks - 1, 0, blocks - 2, 1, ...
  } else {
    w.m_block = Cfg::kCausal && !has_window<Cfg>() ? blocks - 1 - j : j;  // causal: long first
  }
  w.m0 = w.m_block * Cfg::kBlockM;
  w.q_start = sequence.x;
  w.seqlen_q = sequence.y;
  w.k_start = sequence.z;
  w.seqlen_k = sequence.w;
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
    p.lse[(i / p.seqlen_q) * p.lse_head_stride + i % p.seqlen_q] = quiet_nan();
  }
}

// Kernel 1: the list. One CTA of kVarlenTileThreads threads; batch <= kVarlenMaxBatch.
template <class Cfg>
__device__ __forceinline__ void varlen_tiles(const FwdParamsSm90& P) {
  __shared__ int blocks_of[kVarlenMaxBatch];  // the q blocks of the list's sequence k
  __shared__ int bucket[kVarlenBuckets];      // sequences per key, then each key's next place
  __shared__ int warp_sums[32];
  __shared__ int total;
  const int batch = P.base.batch;
  if (__syncthreads_or(batch > kVarlenMaxBatch || !valid_sequences(P))) {  // (the host refuses more)
    poison_output<Cfg>(P);
    if (threadIdx.x == 0) P.varlen_tile_count[0] = P.varlen_tile_count[1] = 0;
    return;
  }
  for (int i = threadIdx.x; i < kVarlenBuckets; i += kVarlenTileThreads) bucket[i] = 0;
  __syncthreads();  // the buckets zeroed
  // A sequence's key: the K/V blocks of its last q block, its longest tile (causal: the
  // others run fewer; no mask: as many; a window: about as many). None without a query row.
  auto key_of = [&](int b, TileWork& w) {
    w.q_start = P.cu_seqlens_q[b];
    w.seqlen_q = P.cu_seqlens_q[b + 1] - w.q_start;
    w.k_start = P.cu_seqlens_k[b];
    w.seqlen_k = P.cu_seqlens_k[b + 1] - w.k_start;
    w.m_block = (w.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;  // (its q blocks)
    w.m0 = (w.m_block - 1) * Cfg::kBlockM;
    kv_work<Cfg>(w, w.seqlen_q, w.seqlen_k);
    return imin(imax(w.n_blocks, 0), kVarlenBuckets - 1);
  };
  for (int b = threadIdx.x; b < batch; b += kVarlenTileThreads) {
    TileWork w;
    const int key = key_of(b, w);
    if (w.m_block > 0) atomicAdd(&bucket[key], 1);
  }
  __syncthreads();  // every sequence counted
  // Each key's first place, longest first: the sequences of larger keys come before it.
  // Thread t holds keys kVarlenBuckets - 1 - 2t and the one below it.
  static_assert(kVarlenBuckets == 2 * kVarlenTileThreads, "two keys a thread");
  const int hi_key = kVarlenBuckets - 1 - 2 * static_cast<int>(threadIdx.x), lo_key = hi_key - 1;
  const int hi_count = bucket[hi_key], lo_count = bucket[lo_key];
  const int start = block_exclusive_sum(hi_count + lo_count, warp_sums, &total);
  const int listed = total;  // (read after the sum's last barrier: every thread sees it)
  bucket[hi_key] = start;
  bucket[lo_key] = start + hi_count;
  __syncthreads();  // every key's place set
  for (int b = threadIdx.x; b < batch; b += kVarlenTileThreads) {
    TileWork w;
    const int key = key_of(b, w);
    if (w.m_block == 0) continue;  // no query row: no tile
    const int at = atomicAdd(&bucket[key], 1);
    P.varlen_tiles[2 * at] = make_int4(w.q_start, w.seqlen_q, w.k_start, w.seqlen_k);
    P.varlen_tiles[2 * at + 1].y = w.m_block;
    P.varlen_tiles[2 * at + 1].z = b;
    P.varlen_tiles[2 * at + 1].w = key;
    blocks_of[at] = w.m_block;
  }
  __syncthreads();  // blocks_of complete
  // Each listed sequence's first tile: the tiles (q blocks x heads) of those before it.
  int carry = 0;
  for (int base = 0; base < listed; base += kVarlenTileThreads) {
    const int k = base + threadIdx.x;
    const int tiles = k < listed ? blocks_of[k] * P.base.heads_q : 0;
    const int before = block_exclusive_sum(tiles, warp_sums, &total);
    if (k < listed) P.varlen_tiles[2 * k + 1].x = carry + before;
    carry += total;
  }
  if (threadIdx.x == 0) {
    P.varlen_tile_count[0] = carry;
    P.varlen_tile_count[1] = listed;
  }
}

}  // namespace fadsl::sm90
