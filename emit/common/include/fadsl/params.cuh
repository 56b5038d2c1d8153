// fadsl/params.cuh -- what every target's kernel takes at run time: FwdParams.
// Target-neutral: no PTX, no target header; the host side (fadsl/targets/launch.py) packs the same bytes.
#pragma once

#include <cuda/std/cstdint>  // (device code only: NVRTC needs no host headers)

namespace fadsl {

// Tensors are (batch, seqlen, heads, head_dim); strides are in elements and the
// head_dim stride is 1.  GQA: query head h reads KV head h / (heads_q / heads_kv).
// Any seqlen_q, seqlen_k >= 0 (a seqlen_k of 0 gives O = 0, LSE = -inf).
struct FwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  // Optional log-sum-exp of each row's scaled scores (natural log), fp32, shape
  // (batch, heads_q, seqlen_q) with seq stride 1; -inf for a row that sees no key.
  // nullptr: not written.
  float* lse;
  int64_t q_batch_stride, q_seq_stride, q_head_stride;
  int64_t k_batch_stride, k_seq_stride, k_head_stride;
  int64_t v_batch_stride, v_seq_stride, v_head_stride;
  int64_t o_batch_stride, o_seq_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride;
  int batch, heads_q, heads_kv, seqlen_q, seqlen_k;
  float softmax_scale;  // e.g. 1/sqrt(head_dim)
};

}  // namespace fadsl
