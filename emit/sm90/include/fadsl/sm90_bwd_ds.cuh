// fadsl/sm90_bwd_ds.cuh -- section 5a of fadsl/sm90_bwd.cuh (which includes it before the
// producer and the consumers, sections 4-6): a consumer warpgroup's dS^T from registers into
// SMEM, by st.shared (store_ds, the default), stmatrix (store_ds_stmatrix:
// `dS: rf -stmatrix-> smem[cta]`) or, where dQ is computed transposed (B_r 80), stmatrix
// .trans (store_ds_t).  Not a header of its own: include fadsl/sm90_bwd.cuh.
//
// Each is a generic-proxy store of the warpgroup's own part of one dS buffer, ordered before
// the wgmmas that read it by the same fence.proxy.async and named barrier (bwd_consumer), so
// the sync plan does not depend on which one stores.
#pragma once

namespace fadsl::sm90 {

// The byte (before the swizzle) of x[2j + r]'s pair in store_ds: keys row 64 wg + 16 warp +
// lane / 4 + 8r of the buffer, queries 8j + 2 (lane % 4) + {0, 1}, in query panel j / 8.
// store_ds spells the same sum inline: called from it, this function changed ptxas's
// allocation and a dQ writer variant spilled 8 bytes (NVRTC 13.5, 2026-11-30).
template <class Cfg>
__host__ __device__ __forceinline__ constexpr uint32_t ds_pair_byte(int j, int r, int wg, int warp, int lane) {
  const int row = 64 * wg + 16 * warp + lane / 4;
  return (j / 8) * Cfg::kDSPanelBytes + (row + 8 * r) * Cfg::kRowBytes + (8 * (j % 8) + 2 * (lane % 4)) * 2;
}

// dS^T (this warpgroup's 64 key rows) into an SMEM buffer of B_c rows x B_r queries
// (per 64-query panel, one 128-byte swizzled row per key).
template <class Cfg>
__device__ __forceinline__ void store_ds(uint32_t ds_buf, const uint32_t (&x)[Cfg::kPRegs], int wg, int warp, int lane) {
  const int row = 64 * wg + 16 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < Cfg::kBlockM / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t byte =
          (j / 8) * Cfg::kDSPanelBytes + (row + 8 * r) * Cfg::kRowBytes + (8 * (j % 8) + 2 * (lane % 4)) * 2;
      st_shared_b32(ds_buf + swizzle128(byte), x[2 * j + r]);
    }
  }
}

// The byte (before the swizzle) of the 16-byte row that lane `lane` addresses in
// store_ds_stmatrix's n-th x4: matrix I = lane / 8 is block (j, r) = (2n + I / 2, I % 2),
// x[4n + I], and the lane gives its row lane % 8: key 64 wg + 16 warp + 8r + lane % 8,
// queries 8j .. 8j + 7 (one 16-byte chunk of the key's row in query panel j / 8, which the
// 128-byte swizzle moves whole).
template <class Cfg>
__host__ __device__ __forceinline__ constexpr uint32_t ds_stmatrix_row_byte(int n, int wg, int warp, int lane) {
  const int block = lane / 8, j = 2 * n + block / 2;
  const int key = 64 * wg + 16 * warp + 8 * (block % 2) + lane % 8;
  return (j / 8) * Cfg::kDSPanelBytes + key * Cfg::kRowBytes + (j % 8) * 16;
}

// store_ds's bytes by stmatrix (`dS: rf -stmatrix-> smem[cta]`, Cfg::kDsStmatrix): the
// accumulator's fragment is stmatrix's register layout (x[2j + r] holds row lane / 4,
// columns 2 (lane % 4) + {0, 1} of 8 x 8 block (j, r): keys 16 warp + 8r + 0..7, queries
// 8j .. 8j + 7), so each block goes out whole, four per instruction: B_r / 16 stores a
// thread instead of B_r / 4 (tests/test_backward_ds_stmatrix.py checks the two maps agree).
template <class Cfg>
__device__ __forceinline__ void store_ds_stmatrix(uint32_t ds_buf, const uint32_t (&x)[Cfg::kPRegs], int wg, int warp,
                                                  int lane) {
  static_assert(!Cfg::kDqTransposed && !Cfg::kSplitHeadDim, "dS^T with the keys as rows (stmatrix .trans otherwise)");
#pragma unroll
  for (int n = 0; n < Cfg::kBlockM / 16; ++n) {
    const uint32_t byte = ds_stmatrix_row_byte<Cfg>(n, wg, warp, lane);
    stmatrix_x4(ds_buf + swizzle128(byte), x[4 * n], x[4 * n + 1], x[4 * n + 2], x[4 * n + 3]);
  }
}

// dS^T (this warpgroup's 64 keys) into key panel wg of a buffer with the B_r queries as
// rows (128-byte swizzled rows of 64 keys): each 8 x 8 block of the registers stored
// transposed by stmatrix .trans.  x[2j + r] holds keys 16 warp + lane / 4 + 8r, queries
// 8j + 2 (lane % 4) + {0, 1}; an x4 stores blocks (j, r) = (2n + I / 2, I % 2), I < 4,
// whose query row lane % 8 lane L / 8 addresses.
template <class Cfg>
__device__ __forceinline__ void store_ds_t(uint32_t ds_buf, const uint32_t (&x)[Cfg::kPRegs], int wg, int warp,
                                           int lane) {
  const int block = lane / 8;
  const uint32_t key_bytes = (16 * warp + 8 * (block % 2)) * 2;
#pragma unroll
  for (int n = 0; n < Cfg::kBlockM / 16; ++n) {
    const int query = 8 * (2 * n + block / 2) + lane % 8;
    const uint32_t byte = wg * Cfg::kDSPanelBytes + query * Cfg::kRowBytes + key_bytes;
    stmatrix_x4_trans(ds_buf + swizzle128(byte), x[4 * n], x[4 * n + 1], x[4 * n + 2], x[4 * n + 3]);
  }
}

}  // namespace fadsl::sm90
