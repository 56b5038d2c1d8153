// fadsl/sm90_ptx.cuh -- the lowest layer of the fadsl sm_90a code path: thin wrappers over
// the Hopper-only PTX that the tile operations (fadsl/sm90.cuh) and the generated kernels
// are written in.  Each wrapper is one instruction (or one retry loop); none of them
// synchronises anything beyond what its instruction does, so every wait, arrive and fence
// stays visible in the kernel body, where the compiler's sync plan puts it.
//
// Contents:
//   1. mbarriers: init, arrive, arrive.expect_tx, try_wait.parity (+ a blocking wait)
//   2. fences: fence.proxy.async, fence.mbarrier_init
//   3. TMA (cp.async.bulk.tensor): 2-D/3-D/4-D tiled loads completing on an mbarrier,
//      4-D tiled store, its bulk-group commit/wait, descriptor prefetch
//   4. wgmma: fence / commit_group / wait_group<N>, shared-memory matrix descriptors for
//      the 128-byte swizzle (K-major and MN-major), operand fences; the mma_async
//      instructions themselves are in sm90_wgmma.cuh (generated)
//   5. warp specialisation: setmaxnreg inc/dec, named barriers, elect.sync; atom.inc acq_rel
//   6. stmatrix, 16-bit packing, ex2
//
// Needs sm_90a (wgmma, setmaxnreg): nvcc -gencode=arch=compute_90a,code=sm_90a.
#pragma once

#include <cuda/std/cstdint>
#include <cuda/std/type_traits>

#if defined(__CUDACC_RTC__)
// NVRTC has no <cuda.h>: the driver's opaque 128-byte tensor map, aligned as CUDA 13's
// cuda.h aligns it (FwdParamsSm90's layout, 768 bytes, depends on it).
struct alignas(128) CUtensorMap {
  unsigned long long opaque[16];
};
#else
#include <cuda.h>  // CUtensorMap
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "sm90_wgmma.cuh"  // (next to this file)

namespace fadsl::sm90 {

// 32-bit .shared::cta address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ---------------------------------------------------------------------------
// 1. mbarriers (64-bit objects in shared memory, 8-byte aligned)
// ---------------------------------------------------------------------------
// An mbarrier completes its current phase when `count` arrivals have been made and the
// transaction count (bytes announced with expect_tx, minus bytes delivered by the copy
// engine with complete_tx) is back at zero; the phase bit then flips and the arrival
// count resets.  A fresh mbarrier is in phase 0.  try_wait.parity(P) succeeds once the
// phase with parity P has completed, i.e. while the current phase's parity differs from
// P: on a fresh barrier, parity 1 (the "previous" phase) succeeds at once and parity 0
// waits for the first completion.  A waiter that tracks `phase` as the ring wraps waits
// with parity = phase (consumers of a full barrier), or phase ^ 1 (producers on an empty
// barrier, whose first round must not block).

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// One arrival (release semantics at CTA scope: this thread's prior memory accesses are
// visible to whoever observes the phase completion).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival that also announces `tx_bytes` bytes the copy engine will deliver to this
// phase (complete_tx); the phase cannot complete before they have landed.
// FADSL_TMA_LOADS (development builds only, research/probes/energy_probe.py; 1 otherwise): every
// TMA load is issued that many times into the same bytes and every expect_tx scaled alike,
// so that the L2 -> SMEM traffic, and nothing else, grows by that factor.
#ifndef FADSL_TMA_LOADS
#define FADSL_TMA_LOADS 1
#endif

__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t tx_bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
               "r"(tx_bytes * FADSL_TMA_LOADS)
               : "memory");
}

// Non-blocking probe (the hardware may suspend the thread for a while inside it): true
// once the phase with parity `parity` has completed.  Acquire semantics at CTA scope.
__device__ __forceinline__ bool mbar_try_wait_parity(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Block until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait_parity(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait_parity(bar, parity)) {
  }
}

// ---------------------------------------------------------------------------
// 1b. Clusters (`cluster 2`)
// ---------------------------------------------------------------------------

// This CTA's rank in its cluster, and the cluster's CTAs (1 for a launch without clusters).
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
__device__ __forceinline__ uint32_t cluster_nctarank() {
  uint32_t ctas;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(ctas));
  return ctas;
}

// One arrival on the mbarrier at `bar`'s offset in the SMEM of the cluster's CTA `rank`
// (mapa: this CTA's address -> the same offset there).  A thread may arrive on a peer's
// mbarrier, never wait on one.  Release at CTA scope, as CUTLASS's ClusterBarrier::arrive:
// what it orders before the arrival is the warpgroup's wgmma reads of the slot, complete
// by wgmma.wait_group already.  (Release at cluster scope puts a MEMBAR.ALL.GPU before
// every arrival: a mainloop block took 2.59 us instead of 1.41, docs/performance.md.)
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cta.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// The cluster barrier: every thread of every CTA of the cluster arrives, then waits for the
// others.  arrive (release) orders the thread's memory accesses before the others' wait
// (acquire); arrive.relaxed orders none.
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait;\n" ::: "memory"); }

// ---------------------------------------------------------------------------
// 2. Fences
// ---------------------------------------------------------------------------

// Orders this thread's generic-proxy shared-memory accesses (st.shared, stmatrix) before
// later async-proxy accesses (TMA store reading SMEM, wgmma reading SMEM, TMA load writing
// SMEM it read before).  Each writing thread fences before the barrier that hands the
// data to the thread issuing the async operation.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Makes mbarrier.init visible to the async proxy (TMA complete_tx) and, with the CTA (or
// cluster) barrier that follows, to the other threads (and the peer CTA's).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// ---------------------------------------------------------------------------
// 2b. Programmatic dependent launch (a split launch's combine kernel)
// ---------------------------------------------------------------------------

// This CTA lets the grid's programmatic dependents be placed (once every CTA has said so or
// exited); they may run beside it, so they must wait (below) before reading its results.
// A no-op where nothing was launched as a dependent.
__device__ __forceinline__ void grid_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" :::); }

// Waits until the grids this one depends on have completed and their memory operations are
// performed and visible to it; a no-op in a kernel not launched as a dependent.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// ---------------------------------------------------------------------------
// 3. TMA: cp.async.bulk.tensor (tiled mode)
// ---------------------------------------------------------------------------
// Coordinates are element indices in the tensor map's dimension order (innermost first);
// a box that reaches past the tensor's extent is zero-filled on load and clipped on
// store.  A load delivers the whole box's bytes (zero-filled ones too) as complete_tx on
// `bar`.  The destination must be aligned to the swizzle's repeat (1024 bytes for the
// 128-byte swizzle).  `tmap` is the generic address of a CUtensorMap in .param (a
// __grid_constant__ kernel parameter), .const or .global memory.

__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// A hint: the box at (c0, c1, c2, c3) fetched from global memory into the L2, nothing
// written to SMEM and no barrier completed; a later load of it then hits the L2.
__device__ __forceinline__ void tma_prefetch_l2_4d(const CUtensorMap* tmap, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// The number of SM identifiers (%nsmid: at least the SMs, ids may have gaps).
__device__ __forceinline__ int sm_id_count() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%nsmid;\n" : "=r"(n));
  return static_cast<int>(n);
}

__device__ __forceinline__ void tma_load_2d(uint32_t smem_dst, const CUtensorMap* tmap, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_3d(uint32_t smem_dst, const CUtensorMap* tmap, uint32_t bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

__device__ __forceinline__ void tma_load_4d(uint32_t smem_dst, const CUtensorMap* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
#pragma unroll
  for (int copy = 0; copy < FADSL_TMA_LOADS; ++copy) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(smem_dst),
        "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
  }
}

// The same load into the SMEM of every CTA of the cluster whose bit is set in `mask` (bit i:
// %cluster_ctarank i): the box lands at `smem_dst`'s offset and its bytes complete on the
// mbarrier at `bar`'s offset, in each of those CTAs (`cluster 2`).
__device__ __forceinline__ void tma_load_4d_multicast(uint32_t smem_dst, const CUtensorMap* tmap, uint32_t bar,
                                                      uint16_t mask, int c0, int c1, int c2, int c3) {
#pragma unroll
  for (int copy = 0; copy < FADSL_TMA_LOADS; ++copy) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%4, %5, %6, %7}], [%2], %3;\n" ::"r"(smem_dst),
        "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "h"(mask), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
  }
}

// The same for a 5-D map (`pack_gqa on`: Q's and O's (head_dim, query heads of a K/V head,
// rows, K/V heads, batch) boxes, fadsl/sm90_kvcache.cuh).
__device__ __forceinline__ void tma_load_5d(uint32_t smem_dst, const CUtensorMap* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n" ::"r"(smem_dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

__device__ __forceinline__ void tma_store_5d(const CUtensorMap* tmap, uint32_t smem_src, int c0, int c1, int c2,
                                             int c3, int c4) {
  asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5, %6}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(smem_src), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
               : "memory");
}

// SMEM -> GMEM, one box; elements outside the tensor are not written.  Completion is
// tracked per thread with bulk groups (tma_store_commit / tma_store_wait_read).
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* tmap, uint32_t smem_src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(tmap)),
               "r"(smem_src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's bulk groups still read their SMEM source (the
// SMEM may then be reused or the CTA may exit; the global writes may still be in flight).
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------------------
// 4. wgmma: ordering, and shared-memory matrix descriptors
// ---------------------------------------------------------------------------

// Must precede the first wgmma.mma_async of a batch whenever its accumulator or A
// registers were written by ordinary instructions since the previous fence (e.g. after
// rescaling O or converting P), and orders prior SMEM writes by the warpgroup.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the batch of wgmma.mma_async issued since the previous commit into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Wait until at most N committed groups of this warpgroup are pending: the accumulators
// (and RS A registers) of the others may be used, and their SMEM operands were read.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Compiler-only fence on registers in flight in an async wgmma: keeps the compiler from
// moving ordinary reads/writes of these registers across the mma_async/wait pair.
template <int R>
__device__ __forceinline__ void fence_regs(float (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int R>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The 128-byte swizzle, as TMA (CU_TENSOR_MAP_SWIZZLE_128B) writes it and wgmma reads it:
// within each 1024-byte block of 8 rows x 128 bytes, the 16-byte chunk index (address
// bits 4..6) is XORed with the row index (address bits 7..9).  Tiles are stored as
// column panels of 64 16-bit elements: element (row, col) of a ROWS-row tile lies at
//   (col / 64) * ROWS * 128 + row * 128 + swizzle((col % 64) * 2).
// Byte offset within a 1024-byte-aligned tile:
__host__ __device__ __forceinline__ constexpr uint32_t swizzle128(uint32_t byte_offset) {
  return byte_offset ^ (((byte_offset >> 7) & 7u) << 4);
}

constexpr uint64_t kDescSwizzle128B = 1;  // descriptor bits 62-63: 1 = 128-byte swizzle

// Descriptor fields (PTX ISA, "Matrix Descriptor"): bits 0-13 start address >> 4,
// 16-29 leading-dimension byte offset (LBO) >> 4, 32-45 stride-dimension byte offset
// (SBO) >> 4, 49-51 base offset (0: every tile here starts 1024-byte aligned), 62-63
// swizzle mode.
__device__ __forceinline__ uint64_t make_smem_desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32) | (kDescSwizzle128B << 62);
}

// K-major operand (rows = M or N, K contiguous; Q and K for S = Q K^T), 128-byte swizzle:
// core matrices are 8 rows x 16 bytes; 8-row groups lie SBO = 1024 bytes apart; one
// k16 step spans 32 bytes of a 128-byte row, so the k16 slices inside a 64-column panel
// are addressed by moving the start address by 32 bytes (the hardware applies the
// swizzle to the final address); LBO is unused for swizzled K-major layouts (set to 1).
__device__ __forceinline__ uint64_t make_desc_kmajor_sw128(uint32_t smem_addr) {
  return make_smem_desc(smem_addr, 16, 1024);
}

// MN-major operand (K rows, MN contiguous; V for O = P V with N = head_dim), 128-byte
// swizzle: 64 MN elements per 128-byte row, 8 K rows per 1024-byte atom, atoms along K
// SBO = 1024 bytes apart, 64-wide MN panels LBO = panel_bytes apart.
__device__ __forceinline__ uint64_t make_desc_mnmajor_sw128(uint32_t smem_addr, uint32_t panel_bytes) {
  return make_smem_desc(smem_addr, panel_bytes, 1024);
}

// The descriptor of the tile `byte_offset` bytes (a multiple of 16) past desc's start: the
// start-address field holds the address >> 4 in bits 0-13, and every shared-memory address
// (under 228 KB) >> 4 fits there, so a 32-bit add to the low word never carries out of the
// field.  One integer add per wgmma, where building each descriptor from its address again
// masks and shifts it (and ptxas does that inside the ping-pong turn).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t byte_offset) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (byte_offset >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// ---------------------------------------------------------------------------
// 5. Warp specialisation
// ---------------------------------------------------------------------------

// Move this warpgroup's per-thread register budget (all 4 warps execute it; takes effect
// only with a register cap at entry, __launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `count` threads (a multiple of 32):
// sync waits until `count` arrivals (its own included); arrive adds this warp's and goes on.
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// atomicInc at GPU scope with release and acquire semantics: *counter becomes
// (old >= limit ? 0 : old + 1); returns old.  The release orders this thread's earlier
// writes, and those it has synchronised with (a barrier before it), before the count; the
// acquire orders the writes behind the counts it reads before this thread's later reads.
__device__ __forceinline__ uint32_t atomic_inc_acq_rel_gpu(uint32_t* counter, uint32_t limit) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(counter), "r"(limit) : "memory");
  return old;
}

// Orders this thread's earlier global accesses, its red.adds included (performed before
// the fence completes), before its later ones, at GPU scope (release and acquire).
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;\n" ::: "memory"); }

// atomicAdd at GPU scope with release and acquire semantics (as atomic_inc_acq_rel_gpu); returns old.
__device__ __forceinline__ int atomic_add_acq_rel_gpu(int* counter, int value) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(counter), "r"(value) : "memory");
  return old;
}

// bar.red.or over named barrier `id`: waits like bar.sync, and returns whether any of the
// `count` threads passed true.
__device__ __forceinline__ bool named_bar_red_or(uint32_t id, uint32_t count, bool value) {
  uint32_t any;
  asm volatile(
      "{\n"
      "  .reg .pred p, q;\n"
      "  setp.ne.u32 q, %1, 0;\n"
      "  bar.red.or.pred p, %2, %3, q;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(value)), "r"(id), "r"(count)
      : "memory");
  return any != 0;
}

// x, which every lane of the (converged, full) warp holds, read back through lane 0. The
// value is unchanged; what changes is what ptxas knows: a shuffle's result from a fixed lane
// is warp-uniform, while a value derived from %ctaid is not treated as such. Given the
// consumers' tile index this way, in the tile loop (a shuffle hoisted out of the loop does
// not help), ptxas keeps the tile's K/V range and the ring counters that follow from it in
// uniform registers, so the wgmma descriptors and mbarrier addresses need no R2UR moves
// before each wgmma (SASS: causal kernels 158 R2UR -> 70, tail split_kv 123 -> 59).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// True in exactly one lane of the (converged, full) warp.
__device__ __forceinline__ bool elect_one() {
  uint32_t elected;
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  .reg .b32 r;\n"
      "  elect.sync r|p, 0xffffffff;\n"
      "  selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(elected));
  return elected != 0;
}

// ---------------------------------------------------------------------------
// 6. stmatrix, packing, ex2
// ---------------------------------------------------------------------------

// Four 8x8 16-bit matrices to SMEM: lane L gives the address of row L % 8 of matrix L / 8;
// register rI holds (row lane / 4, cols 2 * (lane % 4) + {0, 1}) of matrix I, which is the
// accumulator layout (d[4j + 2r + e]) after packing pairs.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_dst, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_dst), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

// The same four matrices stored transposed: register rI's element (row lane / 4, col
// 2 * (lane % 4) + e) lands in row 2 * (lane % 4) + e, col lane / 4 of matrix I, whose
// rows lane L (L / 8 == I) addresses as above.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t smem_dst, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_dst), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Two of the matrices above stored transposed (matrices 0 and 1: lanes 0-15 give the row
// addresses; the upper lanes' are not read).
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t smem_dst, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(smem_dst), "r"(r0), "r"(r1)
               : "memory");
}

// Round two fp32 values to 16 bits (RNE); `lo` lands in the low half (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack_f32x2(float lo, float hi) {
  static_assert(cuda::std::is_same_v<T, __nv_bfloat16> || cuda::std::is_same_v<T, half>, "bf16 or fp16 only");
  uint32_t packed;
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

// The quiet NaN that bad input's rows are filled with (kv_input_bad, malformed cu_seqlens).
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

// 2^x with one MUFU.EX2 (flushes subnormal results to 0; 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x and log2(x) with one MUFU each (approximate; subnormals flushed).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------
// 7. The backward's: bulk copies and reduce-adds, reductions from registers, global
//    semaphores, plain shared-memory accesses, 16-bit pairs unpacked
// ---------------------------------------------------------------------------


// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> SMEM; they land as
// complete_tx on `bar`.
__device__ __forceinline__ void bulk_load(uint32_t smem_dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_dst),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
               : "memory");
}

// global[i] += smem[i] for `bytes` / 4 floats (each add atomic, performed in the L2); read
// through the async proxy, tracked by this thread's bulk groups (tma_store_commit, then
// tma_store_wait_read before the SMEM is written again).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   reinterpret_cast<uint64_t>(dst)),
               "r"(smem_src), "r"(bytes)
               : "memory");
}

// global[i] = smem[i] for `bytes` / 4 floats: bulk_reduce_add_f32's store twin (the same
// proxy, bulk groups and waits), for the first add into memory nobody zeroed.
__device__ __forceinline__ void bulk_store_f32(float* dst, uint32_t smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(reinterpret_cast<uint64_t>(dst)),
               "r"(smem_src), "r"(bytes)
               : "memory");
}

// Wait until this thread's bulk groups have completed (their global writes performed).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Acquire / release of a semaphore in global memory at GPU scope (deterministic mode).
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
// Orders this thread's generic-proxy and async-proxy accesses to global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float2 ld_shared_v2_f32(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// dst[0..3] += (a, b, c, d) in global memory, each add atomic, performed in the L2 (rounds to
// nearest, flushes fp32 subnormals); dst 16-byte aligned.
__device__ __forceinline__ void red_add_v4_f32(float* dst, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// dst[0..1] += (a, b), as red_add_v4_f32; dst 8-byte aligned.
__device__ __forceinline__ void red_add_v2_f32(float* dst, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
}

// The two 16-bit values of a packed pair as fp32 (exact): (low half, high half).
template <typename T>
__device__ __forceinline__ float2 unpack_f32x2(uint32_t packed) {
  if constexpr (cuda::std::is_same_v<T, __nv_bfloat16>) {
    return make_float2(__uint_as_float(packed << 16), __uint_as_float(packed & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&packed));
  }
}

}  // namespace fadsl::sm90
