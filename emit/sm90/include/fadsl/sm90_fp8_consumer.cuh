// fadsl/sm90_fp8_consumer.cuh -- sections 3 and 4 of fadsl/sm90_fp8.cuh (which includes it):
// the FP8 forward's consumer steps, S = Q K^T and O += P Vt with k32 wgmma, the online softmax
// with FA3's offset, P to e4m3, and the epilogue's renaming of O, v_descale / l and the LSE.
#pragma once

namespace fadsl::sm90 {

// ---------------------------------------------------------------------------
// 3. Consumer steps (one warpgroup, 64 query rows)
// ---------------------------------------------------------------------------

// The K-major descriptor of a tile of kRowBytes-byte rows: 128 (8-row groups 1,024 bytes
// apart, the 128-byte swizzle) or 64 (the 64-byte swizzle: descriptor swizzle mode 2, 8-row
// groups 512 bytes apart), as TMA or the producer warps wrote it.
template <int kRowBytes>
__device__ __forceinline__ uint64_t make_desc_kmajor8(uint32_t smem_addr) {
  if constexpr (kRowBytes == 128) {
    return make_desc_kmajor_sw128(smem_addr);
  } else {
    static_assert(kRowBytes == 64, "rows of 128 or 64 bytes");
    constexpr uint64_t kSwizzle64B = 2;  // bits 62-63
    const uint64_t desc = make_smem_desc(smem_addr, 16, 8 * kRowBytes);
    return (desc & ~(3ull << 62)) | (kSwizzle64B << 62);
  }
}

// Issue S = Q K^T (64 x kBlockN) over one K slot: head_dim / 32 k32 wgmma, both operands
// K-major in panels of kInPanelCols one-byte columns (128: 4 k32 steps of 32 bytes a panel;
// head_dim 64's one panel of 64: 2).
template <class Cfg>
__device__ __forceinline__ void issue_qk8(float (&s)[Cfg::kSRegs], uint32_t smem_q_wg, uint32_t smem_k_slot) {
  using TIn = typename Cfg::TIn;
  constexpr int kRow = Cfg::kInRowBytes, kStepsPerPanel = kRow / 32;
  const uint64_t k0 = make_desc_kmajor8<kRow>(smem_k_slot);
#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 32; ++kk) {
    const uint32_t panel = kk / kStepsPerPanel, k_bytes = (kk % kStepsPerPanel) * 32;
    const uint64_t desc_q = make_desc_kmajor8<kRow>(smem_q_wg + panel * Cfg::kBlockM * kRow + k_bytes);
    const uint64_t desc_k = desc_advance(k0, panel * Cfg::kBlockN * kRow + k_bytes);
    Wgmma8<Cfg::kBlockN>::template ss<TIn, TIn>(s, desc_q, desc_k, kk > 0 ? 1u : 0u);
  }
}

// The K-major descriptor of a Vt slot (head_dim rows, keys contiguous): panels of 128 keys
// (128-byte rows) or 64 (64-byte rows), as the producer warps wrote it (transpose_v).
template <class Cfg>
__device__ __forceinline__ uint64_t make_desc_vt(uint32_t smem_vt_slot) {
  return make_desc_kmajor8<Cfg::kVtPanelKeys>(smem_vt_slot);
}

// Issue O += P Vt over one Vt slot: kBlockN / 32 RS k32 wgmma, P (e4m3) from registers, Vt
// K-major.  k32 step kk reads keys 32kk.. of Vt's panel kk / (keys a panel / 32), 32 bytes a step.
// O's accumulator columns are Vt's physical rows (rho's order) until unpermute_o.
template <class Cfg>
__device__ __forceinline__ void issue_pv8(float (&o)[Cfg::kORegs], const uint32_t (&p)[Cfg::kPRegs],
                                          uint32_t smem_vt_slot) {
  constexpr int kStepsPerPanel = Cfg::kVtPanelKeys / 32;
  const uint64_t vt0 = make_desc_vt<Cfg>(smem_vt_slot);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 32; ++kk) {
    const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
    const uint64_t desc_vt = desc_advance(
        vt0, (kk / kStepsPerPanel) * Cfg::kHeadDim * Cfg::kVtPanelKeys + (kk % kStepsPerPanel) * 32);
    Wgmma8<Cfg::kHeadDim>::template rs<typename Cfg::TP, typename Cfg::TIn>(o, a, desc_vt, 1u);
  }
}

// The reference of a row whose max is row_max: R = m c' - 8 with both roundings (0 for a row
// still at -inf, so that 2^(-inf - R) = 0 rather than NaN); its largest key's P is 2^8.
template <class Cfg>
__device__ __forceinline__ float scaled_max8(float row_max, float scale_log2) {
  return row_max == -INFINITY ? 0.f : __fsub_rn(__fmul_rn(row_max, scale_log2), Cfg::kPOffset);
}

// online_softmax (fadsl/sm90.cuh) with the offset: P = 2^(S c' - R), R = m c' - 8, so P <=
// 2^(8 + kRescaleSlack) = 2^8.8 under the lazy rule (0.8 here); a move's factor is 2^(R_old -
// R_new) from the two references as rounded when the P were taken (R_old = m_old c' - 8 again,
// the same two roundings: factors compose from the rounded references, docs/numerics.md's rule).
template <class Cfg>
__device__ __forceinline__ void online_softmax8(float (&s)[Cfg::kSRegs], float (&m)[2], float (&l)[2],
                                                float (&scale)[2], float scale_log2) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = m[r];
#pragma unroll
    for (int j = 0; j < Cfg::kBlockN / 8; ++j) {
      mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // m = -inf and a finite max: inf > slack, the first key sets m; both -inf: NaN, kept
    const bool keep = Cfg::kLazyRescale && !((mx - m[r]) * scale_log2 > Cfg::kRescaleSlack);
    if (keep) mx = m[r];
    const float ref = scaled_max8<Cfg>(mx, scale_log2);
    // m_old = -inf: -inf - R, a factor 0 (its l and O are 0 anyway)
    scale[r] = keep ? 1.f : fast_exp2(__fsub_rn(__fmul_rn(m[r], scale_log2), Cfg::kPOffset) - ref);
    const float sum = exp2_row<Cfg>(s, r, ref, scale_log2);
    l[r] = l[r] * scale[r] + sum;
    m[r] = mx;
  }
}

// Four fp32 values to four e4m3 bytes of one register, `a` in the low byte
// (cvt.rn.satfinite: +-inf and values past +-448 clamp to +-448, NaN stays NaN).
__device__ __forceinline__ uint32_t pack_e4m3x4(float a, float b, float c, float d) {
  uint32_t packed;
  asm("{\n"
      "  .reg .b16 lo, hi;\n"
      "  cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n"  // the first operand lands in the high byte
      "  cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
      "  mov.b32 %0, {lo, hi};\n"
      "}\n"
      : "=r"(packed)
      : "f"(a), "f"(b), "f"(c), "f"(d));
  return packed;
}

// P (fp32, accumulator layout) -> e4m3, P V's A operand, four registers per k32 slice kk:
//   a_(2h + r) = (s[16kk + 8h + 2r], s[.. + 1], s[.. + 4], s[.. + 5]),  h, r < 2
// i.e. row g + 8r, keys 16h + 2t, 16h + 2t + 1, 16h + 8 + 2t, 16h + 9 + 2t: wgmma reads byte b of
// a_(2h + r) as k position 16h + 4t + b, and transpose_v put those keys there in Vt (§3.4).
// Relative to convert_p's consecutive pairs, s[+2, +3] and s[+4, +5] trade places: a choice
// of registers, no shuffle.
template <class Cfg>
__device__ __forceinline__ void convert_p8(const float (&s)[Cfg::kSRegs], uint32_t (&p)[Cfg::kPRegs]) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 32; ++kk) {
#pragma unroll
    for (int reg = 0; reg < 4; ++reg) {
      const int first = 16 * kk + 8 * (reg / 2) + 2 * (reg % 2);
      p[4 * kk + reg] = pack_e4m3x4(s[first], s[first + 1], s[first + 4], s[first + 5]);
    }
  }
}

// ---------------------------------------------------------------------------
// 4. Epilogue steps
// ---------------------------------------------------------------------------

// O's columns as P Vt left them are Vt's rows, rho's order: thread t holds, in each 16 columns
// J, physical 2t, 2t + 1, 8 + 2t, 9 + 2t = true 2t, 8 + 2t, 2t + 1, 9 + 2t; swapping
// o[8J + 2r + 1] with o[8J + 4 + 2r] restores the accumulator layout.  Each swap stays within
// row r (a row's rescales commute with it); in unrolled code it is a renaming, no instruction.
template <class Cfg>
__device__ __forceinline__ void unpermute_o(float (&o)[Cfg::kORegs]) {
#pragma unroll
  for (int base = 0; base < Cfg::kORegs; base += 8) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float x = o[base + 2 * r + 1];
      o[base + 2 * r + 1] = o[base + 4 + 2 * r];
      o[base + 4 + 2 * r] = x;
    }
  }
}

// O *= v_descale / l, one rounding (l >= 2^8: a normal quotient unless v_descale is below
// 2^-126 l, where the true |O| is itself below fp32's normals); a row with l == 0 (it saw no
// key) becomes 0.
template <class Cfg>
__device__ __forceinline__ void normalize_o8(float (&o)[Cfg::kORegs], const float (&l)[2], float v_descale) {
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) inv[r] = l[r] == 0.f ? 0.f : __fdiv_rn(v_descale, l[r]);
  rescale_o<Cfg>(o, inv);
}

// LSE = (m c' + log2 l - 8) ln 2: store_lse's with l 2^-8 (exact: l >= 2^8 for a row that saw
// a key, and 0 stays 0, -inf).
template <class Cfg>
__device__ __forceinline__ void store_lse8(const FwdParams& p, const TileWork& w, const RowLimits& rows,
                                           const float (&m)[2], const float (&l)[2], float scale_log2, int lane) {
  static_assert(Cfg::kPOffset == 8.f, "l scaled by 2^-offset");
  const float l8[2] = {l[0] * 0.00390625f, l[1] * 0.00390625f};
  store_lse<Cfg>(p, w, rows, m, l8, scale_log2, lane);
}

// A split piece's O, m (`splits auto`) as the 16-bit pieces write theirs, for
// combine_pieces (fadsl/sm90_kvcache.cuh) to merge with a scale of 1 and no descale: O
// unpermuted (rho undone) and times v_descale (one factor a tile), m replaced by its
// reference R = m c' - 8 (-inf kept: a row that saw no key). The piece's l keeps its 2^8
// (P = 2^(S c' - R)), so the combined O / L and (R + log2 L) ln 2 are normalize_o8's and
// store_lse8's values: L = sum_i l_i 2^(R_i - R) with R the largest R_i, each factor <= 1
// from the rounded references (docs/numerics.md's rule). A NaN c' (bad descales) makes
// the piece's l and O NaN (R may stay -inf: the lazy rule keeps m), and so the combined row.
template <class Cfg>
__device__ __forceinline__ void fp8_piece_partial(float (&o)[Cfg::kORegs], float (&m)[2], float scale_log2,
                                                  float v_descale) {
  unpermute_o<Cfg>(o);
#pragma unroll
  for (int i = 0; i < Cfg::kORegs; ++i) o[i] *= v_descale;
#pragma unroll
  for (int r = 0; r < 2; ++r) m[r] = m[r] == -INFINITY ? -INFINITY : scaled_max8<Cfg>(m[r], scale_log2);
}

}  // namespace fadsl::sm90
