// fadsl/sm90_trace.cuh -- a tile timeline for development builds of the sm_90a kernels.
//
// Built with FADSL_TILE_TRACE defined (scripts/tile_trace.py prepends it), lane 0 of each
// consumer warpgroup's first warp stamps %globaltimer (ns) at eight marks of each tile the
// CTA runs, into the module's fadsl_tile_trace array, which the host reads after the launch.
// Marks: 0 the tile's work is known, 1 its first S = Q K^T is issued (its Q, first K and
// turn waited for), 2 its first block's softmax is done, 3 its mainloop is done, 4 the last
// P V's turn is taken (V and the previous store's read waited for), 5 the last P V is in,
// 6 O is in SMEM (normalised, stmatrix), 7 its O store is issued (fence, barrier, TMA).
// Without FADSL_TILE_TRACE every mark is empty: the kernels' code is unchanged.
#pragma once

#ifdef FADSL_TILE_TRACE
#include <cuda/std/cstdint>

namespace fadsl::sm90 {

constexpr int kTraceCtas = 160;    // grids of up to 160 CTAs (H100: 132, H200: 132)
constexpr int kTraceWgs = 3;       // consumer warpgroups
constexpr int kTraceSteps = 128;   // tiles per CTA kept (later ones are not stamped)
constexpr int kTraceMarks = 8;

}  // namespace fadsl::sm90

// [cta][warpgroup][step][mark], 0 where nothing was stamped (the host zeroes it first)
extern "C" {
__device__ unsigned long long fadsl_tile_trace[fadsl::sm90::kTraceCtas * fadsl::sm90::kTraceWgs *
                                               fadsl::sm90::kTraceSteps * fadsl::sm90::kTraceMarks];
}

namespace fadsl::sm90 {

__device__ __forceinline__ void tile_mark(int step, int mark, int wg, int warp, int lane) {
  if (warp != 0 || lane != 0 || blockIdx.x >= kTraceCtas || wg >= kTraceWgs || step >= kTraceSteps) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  fadsl_tile_trace[((blockIdx.x * kTraceWgs + wg) * kTraceSteps + step) * kTraceMarks + mark] = now;
}

}  // namespace fadsl::sm90

#define FADSL_TILE_MARK(step, mark) ::fadsl::sm90::tile_mark((step), (mark), wg, warp, lane)
#else
#define FADSL_TILE_MARK(step, mark)
#endif
