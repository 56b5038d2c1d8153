// fadsl/modifiers.cuh -- the functions a spec's `score` and `keep` expressions call
// (issue 41): fadsl/targets/cuda_expr.py renders an expression into C++ that calls these.
// Target-neutral (no target header; tanh's ex2 and rcp are sm_80's too), but only sm_90a
// applies modifiers yet, so it sits with sm_90a's headers (emit/common/include once another
// target does).
#pragma once

#include <cuda/std/cstdint>  // (device code only: NVRTC needs no host headers)

namespace fadsl::modifiers {

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ int iabs(int a) { return a < 0 ? -a : a; }

// Python's a // b and a % b (b != 0: check_modifiers proves it): the quotient rounded
// down, the remainder with the divisor's sign. C++'s / and % round toward 0.
__device__ __forceinline__ int floordiv(int a, int b) {
  const int q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int floormod(int a, int b) {
  const int r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1), one ex2 and one rcp (both approximate, subnormals
// flushed): an absolute error of about 2^-21, as the built-in softcap's (docs/numerics.md);
// 2^(..) = inf gives 1, 0 gives -1.
__device__ __forceinline__ float tanh(float x) {
  float e, r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(x * 2.8853900817779268f));
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(e + 1.f));
  return 1.f - 2.f * r;
}

// Element `offset` of an input (read-only for the kernel's lifetime: the non-coherent path).
template <class T>
__device__ __forceinline__ T load(const void* base, int offset) {
  return __ldg(static_cast<const T*>(base) + offset);
}

}  // namespace fadsl::modifiers
