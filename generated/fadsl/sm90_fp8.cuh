// fadsl/sm90_fp8.cuh -- the FP8 forward's steps (research/fp8-forward.md §3.3-§3.6): what an
// 8-bit kernel (`dtype e4m3` or `e5m2`) does differently from fadsl/sm90.cuh's 16-bit one.
// Included by 8-bit kernels only, after fadsl/sm90.cuh; 16-bit kernels never see it.
//
//   1. the descales (a kernel parameter of their own) and the configuration (Fp8FwdConfig:
//      1-byte Q, K, V in 128-byte panels, a Vt ring, P in e4m3, the offset and the slack)
//   2. producer: the producer warps' transpose of a raw V slot into a Vt slot
//      (ldmatrix.x4.trans, prmt, stmatrix, Vt rows permuted by rho); the TMA loads are
//      fadsl/sm90.cuh's load_q and load_kv, by the Cfg's kInPanels, kInPanelCols, kInRowBytes
//   3. consumer: S = Q K^T and O += P Vt (k32 wgmma, fadsl/sm90_wgmma8.cuh), the online
//      softmax with FA3's offset, P to e4m3 in the registers' own order
//   4. epilogue: O's registers unpermuted (rho undone), v_descale / l, the LSE
//
// As in fadsl/sm90.cuh no function here waits, arrives or fences: the kernel body holds every
// sync the compiler placed (the transpose's: fadsl/targets/sm90/syncs/transpose.py).
//
// Numerics (§3.5, §4; tests/fp8_softmax_model.py models them): every factor is a normal fp32
// number.  c' = softmax_scale log2(e) q_descale k_descale is checked positive normal per tile
// (else NaN, and every row of the tile is NaN); the reference R = m c' - 8 puts a row's largest
// key at P = 2^8, the lazy slack 0.8 keeps P <= 2^8.8 < 448 (e4m3's largest: satfinite never
// clamps a finite P); l >= 2^8, so v_descale / l is one rounding of normal numbers.
#pragma once

// (after fadsl/sm90.cuh, which the kernel includes first: NVRTC names headers by their
// include spelling, so "sm90.cuh" here would be a second copy)
#include "sm90_wgmma8.cuh"  // Wgmma8<N>: m64nNk32 with 8-bit operands (next to this file)

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 1. Descales and configuration
// ---------------------------------------------------------------------------

// The 8-bit kernel's second parameter (`const __grid_constant__`): float32 descales of
// (batch, heads_kv) each, at any strides (an expanded scalar: strides 0); nullptr = 1.
// With varlen the batch is the sequence.
struct Fp8Descales {
  const float* q;
  const float* k;
  const float* v;
  int q_batch_stride, q_head_stride;
  int k_batch_stride, k_head_stride;
  int v_batch_stride, v_head_stride;
};

// FwdConfig with 1-byte inputs: T (O's 16-bit type) and everything of the epilogue as in
// 16-bit kernels; TIn the inputs' tag (e4m3 or e5m2), P always e4m3.
template <class TIn_, class TOut, int kHeadDim_, int kConsumerWGs_, int kBlockN_, int kStages_, bool kCausal_,
          bool kPersistent_, bool kLazyRescale_>
struct Fp8FwdConfig
    : FwdConfig<TOut, kHeadDim_, kConsumerWGs_, kBlockN_, kStages_, kCausal_, kPersistent_, kLazyRescale_, 1> {
  using TIn = TIn_;
  using TP = e4m3;  // P, P V's A operand
  // The lazy reference moves once the max grows past 2^0.8 of it: P <= 2^(8 + 0.8) = 445.7 < 448
  static constexpr float kRescaleSlack = 0.8f;
  static constexpr float kPOffset = 8.f;  // log2 of a row's largest P (FA3's Max_offset)
  static constexpr int kPRegs = kBlockN_ / 8;  // P, four e4m3 a register
  // Q, K and raw V: panels of 128 one-byte columns (128-byte rows, the 128-byte swizzle); at
  // head_dim 64 one panel of 64 (64-byte rows, the 64-byte swizzle)
  static constexpr int kInPanelCols = kHeadDim_ < 128 ? 64 : 128;
  static constexpr int kInRowBytes = kInPanelCols;  // (one byte a column; FwdConfig's 128 otherwise)
  static constexpr int kInPanels = kHeadDim_ / kInPanelCols;
  // Vt (head_dim rows of B_c keys): panels of 128 keys (128-byte swizzle), 64 when B_c is not
  // a multiple of 128 (64-byte swizzle)
  static constexpr int kVtPanelKeys = kBlockN_ % 128 == 0 ? 128 : 64;
  static constexpr int kVtBytes = kHeadDim_ * kBlockN_;  // one Vt ring slot
  static_assert(kHeadDim_ == 64 || kHeadDim_ == 128 || kHeadDim_ == 256, "8-bit head_dim 64, 128 or 256");
  static_assert(kBlockN_ % 64 == 0, "8-bit B_c: a multiple of 64 (whole Vt panels, k32 steps)");
  // transpose_v by transpose_v_lean (two bases, unrolled, stmatrix.x2 halves): at head_dim 256
  // the producer has 24 registers (the consumers need 240 of the launch's 384 x 168) and
  // transpose_v_units spills
  static constexpr bool kLeanTranspose = kHeadDim_ > 128;
};

// One descale of the tile's (batch, K/V head); 1 without the tensor. With varlen the batch
// index is the tile's sequence (w.batch is the packed tensors' one batch coordinate).
template <class Cfg>
__device__ __forceinline__ float descale_of(const float* d, int batch_stride, int head_stride, const TileWork& w) {
  const int batch = Cfg::kVarlen ? w.sequence : w.batch;
  return d == nullptr ? 1.f : d[batch * batch_stride + w.head_kv * head_stride];
}

// c' = softmax_scale log2(e) q_descale k_descale for the tile, the softmax's scale_log2 (two
// roundings after the 16-bit kernel's one, as tests/fp8_softmax_model.py's scale_log2). Not a
// positive normal fp32 (a descale 0, negative, inf or NaN, or the product out of range): NaN,
// which makes every P, l, O and LSE of the tile NaN (no host sync, no silent garbage; c' < 0
// would make every P at least 1).
template <class Cfg>
__device__ __forceinline__ float fp8_scale_log2(const FwdParams& p, const Fp8Descales& D, const TileWork& w) {
  const float c = __fmul_rn(__fmul_rn(__fmul_rn(p.softmax_scale, 1.4426950408889634f),
                                      descale_of<Cfg>(D.q, D.q_batch_stride, D.q_head_stride, w)),
                            descale_of<Cfg>(D.k, D.k_batch_stride, D.k_head_stride, w));
  return c >= 1.17549435e-38f && c <= 3.40282347e+38f ? c : quiet_nan();
}

// v_descale of the tile, used as given (inf or NaN propagate into O).
template <class Cfg>
__device__ __forceinline__ float fp8_v_descale(const Fp8Descales& D, const TileWork& w) {
  return descale_of<Cfg>(D.v, D.v_batch_stride, D.v_head_stride, w);
}

// ---------------------------------------------------------------------------
// 2. Producer steps
// ---------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t smem_src, uint32_t (&x)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3])
               : "r"(smem_src)
               : "memory");
}

// Vt's physical row of head_dim column `col` within its 16 columns (rho, §3.3): logical 2g + h
// sits at 8h + 2(g % 4) + g / 4, so that the 8 rows one stmatrix matrix writes are consecutive
// (else every stmatrix is a 2-way bank conflict).  O's accumulator comes out in this order;
// unpermute_o undoes it.
__host__ __device__ __forceinline__ constexpr int vt_row_rho(int col) {
  return 16 * (col / 16) + 8 * (col % 2) + 2 * ((col % 16 / 2) % 4) + (col % 16 / 2) / 4;
}

// The XOR a row's 16-byte chunks take under its panel's swizzle: 128-byte rows (Vt's 128-key
// panels, Q/K/V's 128 columns) the row % 8; 64-byte rows (64-key panels, head_dim 64's Q/K/V)
// (row % 8) / 2.
template <int kRowBytes>
__device__ __forceinline__ constexpr uint32_t row_swizzle_xor(int row) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "rows of 128 bytes (128-byte swizzle) or 64 (64-byte)");
  return 16u * static_cast<uint32_t>(kRowBytes == 128 ? row % 8 : row % 8 / 2);
}

// The producer warps' transpose of one raw V slot (B_c keys x head_dim bytes, as TMA wrote it)
// into a Vt slot (head_dim rows, permuted by rho, of B_c keys): warp `warp` writes the Vt rows
// of head_dim columns [warp d / 4, (warp + 1) d / 4), all keys, in units of 16 keys x 32
// columns: one ldmatrix.x4.trans (lane 8m + i: raw row k0 + 8(m % 2) + i, bytes d0 + 16(m / 2)),
// four prmt, one stmatrix.x4 (lane 8m + i: Vt row rho(d0 + 16(m / 2) + 2i + m % 2), keys k0..).
// Within each 16 keys, Vt byte 4t + 2u + e holds key 2t + 8u + e: the order convert_p8's
// registers hold P in (§3.4), so that the P hand-over moves no lane and no byte.
// tests/fp8_layout_model.py's transpose_v is this function, address for address.
template <class Cfg>
__device__ __forceinline__ void transpose_v_units(uint32_t smem_v_slot, uint32_t smem_vt_slot, int warp, int lane) {
  constexpr int kRows = Cfg::kHeadDim / 4;    // Vt rows of one warp
  constexpr int kPanel = Cfg::kVtPanelKeys;   // Vt's row bytes within a panel
  constexpr int kRawPanelBytes = Cfg::kBlockN * Cfg::kInRowBytes;
  constexpr int kVtPanelBytes = Cfg::kHeadDim * kPanel;
  static_assert(kRows % 32 == 0, "whole 32-column units per warp (head_dim 128 or 256)");
  static_assert(Cfg::kInRowBytes == 128, "raw rows of 128-byte panels");
  const int m = lane / 8, i = lane % 8;
  // ldmatrix: this lane's raw row in the unit (its swizzle row is i: k0 is a multiple of 8)
  const uint32_t ld_row = (8 * (m % 2) + i) * Cfg::kInRowBytes;
  const int ld_col = 16 * (m / 2);
  // stmatrix: this lane's Vt row in the unit (rho; d0 is a multiple of 32), and its swizzle
  const int st_row = vt_row_rho(16 * (m / 2) + 2 * i + m % 2);
  const uint32_t st_xor = row_swizzle_xor<kPanel>(st_row);
#pragma unroll
  for (int u = 0; u < kRows / 32; ++u) {
    const int d0 = warp * kRows + 32 * u;
    const uint32_t raw = smem_v_slot + (d0 / 128) * kRawPanelBytes + ld_row +
                         ((static_cast<uint32_t>(d0 % 128 + ld_col)) ^ row_swizzle_xor<128>(i));
    const uint32_t vt = smem_vt_slot + (d0 + st_row) * kPanel;
    // a loop, not unrolled: unrolled, ptxas keeps each unit's swizzled Vt address (the XOR
    // below) in a register of its own, and the producer's 24 spill them
#pragma unroll 1
    for (int k0 = 0; k0 < Cfg::kBlockN; k0 += 16) {
      uint32_t x[4];
      ldmatrix_x4_trans(raw + k0 * Cfg::kInRowBytes, x);
      stmatrix_x4(vt + (k0 / kPanel) * kVtPanelBytes + ((k0 % kPanel) ^ st_xor), __byte_perm(x[0], x[1], 0x6420),
                  __byte_perm(x[0], x[1], 0x7531), __byte_perm(x[2], x[3], 0x6420), __byte_perm(x[2], x[3], 0x7531));
    }
  }
}

// transpose_v_units' counterpart at head_dim 64 (raw V rows of 64 bytes, the 64-byte swizzle): a warp's
// kRows = 16 Vt rows are 16 columns, so a unit is 32 keys x 16 columns (the layout model's
// NARROW unit): ldmatrix.x4.trans's matrix m reads raw rows k0 + 8m + i at byte d0 = 16 warp
// (lane 8m + i), and stmatrix.x4's matrix m writes Vt row rho(d0 + 2i + m % 2), 16 keys from
// k0 + 16(m / 2); the same prmt pairs, so the same key order within each 16 keys. Warp w
// writes its own Vt rows [16 w, 16 w + 16) of every panel, as for the wide units.
// tests/fp8_layout_model.py's transpose_v (head_dim 64) is this function, address for address.
template <class Cfg>
__device__ __forceinline__ void transpose_v_narrow(uint32_t smem_v_slot, uint32_t smem_vt_slot, int warp, int lane) {
  constexpr int kPanel = Cfg::kVtPanelKeys;
  constexpr int kRow = Cfg::kInRowBytes;
  constexpr int kVtPanelBytes = Cfg::kHeadDim * kPanel;
  static_assert(Cfg::kHeadDim == 64 && kRow == 64, "head_dim 64: one raw panel of 64-byte rows");
  static_assert(Cfg::kBlockN % 32 == 0, "whole 32-key units");
  const int m = lane / 8, i = lane % 8, d0 = 16 * warp;
  // ldmatrix: raw row k0 + 8m + i (its swizzle row is i: k0 is a multiple of 32), byte d0
  const uint32_t raw = smem_v_slot + (8 * m + i) * kRow + (static_cast<uint32_t>(d0) ^ row_swizzle_xor<kRow>(i));
  // stmatrix: Vt row rho(d0 + 2i + m % 2), keys 16(m / 2) past k0 (bits below k0's, so an XOR)
  const int st_row = vt_row_rho(d0 + 2 * i + m % 2);
  const uint32_t st_xor = row_swizzle_xor<kPanel>(st_row) ^ (16u * static_cast<uint32_t>(m / 2));
  const uint32_t vt = smem_vt_slot + st_row * kPanel;
#pragma unroll 1
  for (int k0 = 0; k0 < Cfg::kBlockN; k0 += 32) {
    uint32_t x[4];
    ldmatrix_x4_trans(raw + k0 * kRow, x);
    stmatrix_x4(vt + (k0 / kPanel) * kVtPanelBytes + ((k0 % kPanel) ^ st_xor), __byte_perm(x[0], x[1], 0x6420),
                __byte_perm(x[0], x[1], 0x7531), __byte_perm(x[2], x[3], 0x6420), __byte_perm(x[2], x[3], 0x7531));
  }
}

__device__ __forceinline__ void stmatrix_x2(uint32_t smem_dst, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};\n" ::"r"(smem_dst), "r"(r0), "r"(r1)
               : "memory");
}

// transpose_v_units for a producer of 24 registers (head_dim 256, Cfg::kLeanTranspose): each
// 16-key x 32-column unit by one ldmatrix.x4.trans and two stmatrix.x2 (its halves of 16
// columns: a pair of registers each, so the unit needs 6 data registers, not the x4 store's
// 8), the loops unrolled so that every address but one per unit is an immediate offset from
// two bases of the call, %tid.x read here (asm volatile). transpose_v_units spilled 52 bytes at
// 24 registers (2026-11-30, NVRTC 13.5); a stmatrix.x4 here spilled 4 (2026-12-04); this, none.
// Addresses: with d0 = 64 warp + 32 u, lane half h = lane / 16 and c = 32 u, transpose_v_units'
// raw column (d0 % 128 + 16 h) ^ 16 i is ((64 (warp % 2) ^ 16 i) ^ 16 h) ^ c (c's bit apart);
// its Vt byte (d0 + 16 h + rho(2 i + m)) P + (k0 % P ^ st_xor) + (k0 / P) P d (P the Vt
// panel's keys) is ((vt0 + P c) ^ k0 % P) + (k0 / P) P d + 16 P h, half h's store at lanes
// 0-15 (slots are 1,024-byte aligned); tests/test_fp8_layouts.py checks both against the
// layout model, lane for lane.
// Measured (H200, 2026-12-04, research/probes/fp8_probe.py --spec examples/fa3_fp8_hdim256.fa,
// e4m3, hidden 2048): the earlier loop of two ldmatrix.x2 -> stmatrix.x2 halves a unit, each
// waiting on its own load, held the kernel at 708 / 812 / 832 TF/s at 1k / 4k / 16k (with no
// transpose at all: 1,272 / 1,377 at 4k / 16k); one x4 load a unit ran 915 / 1,080 / 1,104.
template <class Cfg>
__device__ __forceinline__ void transpose_v_lean(uint32_t smem_v_slot, uint32_t smem_vt_slot) {
  constexpr int kRows = Cfg::kHeadDim / 4;
  constexpr int kPanel = Cfg::kVtPanelKeys;
  constexpr int kRawPanelBytes = Cfg::kBlockN * Cfg::kInRowBytes;
  constexpr int kVtPanelBytes = Cfg::kHeadDim * kPanel;
  static_assert(kRows == 64, "head_dim 256: two 32-column units a warp");
  static_assert(Cfg::kInRowBytes == 128, "raw rows of one 128-byte panel");
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
  const int warp = static_cast<int>(tid / 32 % 4), lane = static_cast<int>(tid % 32);
  const int h = lane / 16, m = lane / 8 % 2, i = lane % 8;
  // the storing lane's Vt row is 2 i + m past a multiple of 16, so its swizzle is rho(2 i + m)'s
  const uint32_t st_xor = row_swizzle_xor<kPanel>(vt_row_rho(2 * i + m));
  const uint32_t raw0 = smem_v_slot + (warp * kRows / 128) * kRawPanelBytes + (8 * m + i) * Cfg::kInRowBytes +
                        ((static_cast<uint32_t>(warp * kRows % 128)) ^ (16u * i) ^ (16u * h));
  const uint32_t vt0 = smem_vt_slot + (warp * kRows + vt_row_rho(2 * i + m)) * kPanel + st_xor;
#pragma unroll
  for (int c = 0; c < kRows; c += 32) {  // the warp's two 32-column units
    const uint32_t raw = raw0 ^ static_cast<uint32_t>(c), vt = vt0 + c * kPanel;
#pragma unroll
    for (int k0 = 0; k0 < Cfg::kBlockN; k0 += 16) {
      uint32_t x[4];
      ldmatrix_x4_trans(raw + k0 * Cfg::kInRowBytes, x);
      const uint32_t dst = (vt ^ static_cast<uint32_t>(k0 % kPanel)) + (k0 / kPanel) * kVtPanelBytes;
      stmatrix_x2(dst, __byte_perm(x[0], x[1], 0x6420), __byte_perm(x[0], x[1], 0x7531));
      stmatrix_x2(dst + 16 * kPanel, __byte_perm(x[2], x[3], 0x6420), __byte_perm(x[2], x[3], 0x7531));
    }
  }
}

// V(it-1) -> Vt(it-1) by the producer warps: transpose_v_units, at head_dim 256 the same
// bytes in fewer registers (transpose_v_lean), at head_dim 64 in narrow units (transpose_v_narrow).
template <class Cfg>
__device__ __forceinline__ void transpose_v(uint32_t smem_v_slot, uint32_t smem_vt_slot, int warp, int lane) {
  if constexpr (Cfg::kLeanTranspose) {
    transpose_v_lean<Cfg>(smem_v_slot, smem_vt_slot);
  } else if constexpr (Cfg::kHeadDim == 64) {
    transpose_v_narrow<Cfg>(smem_v_slot, smem_vt_slot, warp, lane);
  } else {
    transpose_v_units<Cfg>(smem_v_slot, smem_vt_slot, warp, lane);
  }
}

}  // namespace fadsl::sm90

#include "sm90_fp8_consumer.cuh"  // 3. and 4.: the consumers' steps (next to this file)
