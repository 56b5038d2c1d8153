// fadsl/sm90_bwd_trace.cuh -- an m-block timeline for development builds of the sm_90a backward.
//
// Built with FADSL_BWD_TRACE defined (scripts/backward_trace.py asks for it), lane 0 of each
// role's first warp stamps %globaltimer (ns) at marks of each m-block its CTA visits, into
// the module's fadsl_bwd_trace array [cta][role][step][mark] (role: the consumer warpgroups,
// then the producer), for the first kBwdTraceCtas CTAs of the launch (x fastest) and their
// first kBwdTraceSteps m-blocks; and at four marks of every one of the first kBwdTraceAllCtas
// CTAs into fadsl_bwd_ctas [cta][mark], with the SM that ran it, for the gaps between CTAs.
// The host zeroes both before the traced launch and reads them after
// (fadsl/tools/bwdtrace.py lists the marks).  Without FADSL_BWD_TRACE every mark is empty:
// the kernels' code is unchanged.
#pragma once

#ifdef FADSL_BWD_TRACE
namespace fadsl::sm90 {

constexpr int kBwdTraceCtas = 160;     // CTAs with m-block marks (H100, H200: 132 SMs)
constexpr int kBwdTraceRoles = 3;      // 2 consumer warpgroups, then the producer
constexpr int kBwdTraceSteps = 256;    // m-blocks per CTA kept (later ones are not stamped)
constexpr int kBwdTraceMarks = 10;
constexpr int kBwdTraceAllCtas = 4096;  // CTAs with CTA marks
constexpr int kBwdCtaMarks = 5;         // the SM, then 4 stamps

}  // namespace fadsl::sm90

extern "C" {
__device__ unsigned long long fadsl_bwd_trace[fadsl::sm90::kBwdTraceCtas * fadsl::sm90::kBwdTraceRoles *
                                              fadsl::sm90::kBwdTraceSteps * fadsl::sm90::kBwdTraceMarks];
__device__ unsigned long long fadsl_bwd_ctas[fadsl::sm90::kBwdTraceAllCtas * fadsl::sm90::kBwdCtaMarks];
}

namespace fadsl::sm90 {

__device__ __forceinline__ unsigned long long bwd_trace_now() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)::"memory");
  return now;
}
__device__ __forceinline__ int bwd_trace_cta() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

// Mark `mark` of m-block `step` of role `role` (lane 0 of the role's first warp only).
__device__ __forceinline__ void bwd_mark(int role, int step, int mark) {
  const int cta = bwd_trace_cta();
  if (threadIdx.x % 128 != 0 || cta >= kBwdTraceCtas || role >= kBwdTraceRoles || step >= kBwdTraceSteps) return;
  fadsl_bwd_trace[((cta * kBwdTraceRoles + role) * kBwdTraceSteps + step) * kBwdTraceMarks + mark] = bwd_trace_now();
}

// CTA mark `mark` (1..4; 0 holds the SM, written with mark 1).
__device__ __forceinline__ void bwd_cta_mark(int mark) {
  const int cta = bwd_trace_cta();
  if (cta >= kBwdTraceAllCtas) return;
  if (mark == 1) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    fadsl_bwd_ctas[cta * kBwdCtaMarks] = smid;
  }
  fadsl_bwd_ctas[cta * kBwdCtaMarks + mark] = bwd_trace_now();
}

}  // namespace fadsl::sm90

#define FADSL_BWD_MARK(role, step, mark) ::fadsl::sm90::bwd_mark((role), (step), (mark))
#define FADSL_BWD_CTA_MARK(mark) ::fadsl::sm90::bwd_cta_mark(mark)
#else
#define FADSL_BWD_MARK(role, step, mark)
#define FADSL_BWD_CTA_MARK(mark)
#endif
