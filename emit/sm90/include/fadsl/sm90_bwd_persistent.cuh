// fadsl/sm90_bwd_persistent.cuh -- section 3b of fadsl/sm90_bwd.cuh (which includes it after
// the blocks, section 3, before the producer): `scheduler persistent`'s tiles.  About one CTA
// per SM (the host's grid: min(tiles, SMs)), each running the producer and the consumers once
// per tile t = blockIdx.x, blockIdx.x + gridDim.x, ... of the grid's (n-block, head, batch)
// order (bwd_block_at, longest_first's too).  Across tiles the ring's slot, its parity and
// dS^T's buffer follow the CTA's running m-block count (BwdRun::m0, so no ring restarts), and
// K and V are freed per tile on kv_empty (every consumer thread, once the tile's last wgmma
// retired), which the producer waits on before loading the next tile's: that load overlaps
// the consumers' dK and dV stores.  Proven with two and three tiles (backward/verify.py).
// Not a header of its own: include fadsl/sm90_bwd.cuh.
#pragma once

namespace fadsl::sm90 {

// A role's position in the CTA's tiles: m-blocks visited before this tile (the ring's and
// dS^T's running index starts there) and tiles with an m-block before it (kv_full's and
// kv_empty's phase; a tile without one loads and waits nothing).  All zero with one tile.
struct BwdRun {
  int m0 = 0;
  int kv = 0;
};

__device__ __forceinline__ BwdRun bwd_next_run(BwdRun run, const BwdBlock& b) {
  return BwdRun{run.m0 + b.m_count, run.kv + (b.m_count > 0 ? 1 : 0)};
}

// kv_empty: after every barrier of the base plan (BwdConfig's kNumBars is one more with it).
template <class Cfg>
__device__ __forceinline__ uint32_t bwd_bar_kv_empty(uint32_t smem) {
  return smem + Cfg::kOffBar + 8 * (1 + 2 * Cfg::kStages + Cfg::kDoBars);
}

// The grid's tiles (padded batches: `scheduler persistent` is refused with varlen on):
// cdiv(seqlen_k, B_c) n-blocks x heads x batch (P.batch, set by the host for these kernels).
template <class Cfg>
__device__ __forceinline__ int bwd_n_tiles(const BwdParamsSm90& P) {
  return (P.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN;
}
template <class Cfg>
__device__ __forceinline__ int bwd_tiles(const BwdParamsSm90& P) {
  return bwd_n_tiles<Cfg>(P) * P.heads_q * P.batch;
}
// Tile `tile` is the block the grid launch would give CTA number `tile` (x fastest).
template <class Cfg>
__device__ __forceinline__ BwdBlock bwd_tile_block(const BwdParamsSm90& P, int tile) {
  const int gx = bwd_n_tiles<Cfg>(P);
  const int x = tile % gx, yz = tile / gx;
  return bwd_block_at<Cfg>(P, x, yz % P.heads_q, yz / P.heads_q, gx, P.heads_q, P.batch);
}

}  // namespace fadsl::sm90
