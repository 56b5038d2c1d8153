"""Write .carry/h64t.cu: fa3_hdim64_bf16 with fine marks (proto_trace) at given lines."""

from pathlib import Path

src = Path("generated/fa3_hdim64_bf16.cu").read_text().splitlines()
# line number (1-based) -> mark inserted AFTER that line (consumer marks) ; producer marks
after = {
    163: 0,  # tile start
    172: 1,  # Q waited
    174: 2,  # K0 waited
    176: 3,  # turn (prologue)
    186: 4,  # QK0 done
    196: 5,  # softmax0 done
    242: 6,  # mainloop done
    253: 7,  # V waited + store read waited (epilogue, before turn)
    256: 8,  # turn (PV_last)
    272: 9,  # PV_last done
    283: 10,  # w, rows recomputed; combine checked
    287: 11,  # normalized (row sum, lse)
    291: 12,  # stmatrix + fence done
    293: 13,  # bar done
    300: 14,  # TMA store issued
}
producer_after = {100: 15}  # q_empty waited (Q load about to issue)
out = []
head = r"""
extern "C" { __device__ unsigned long long proto_trace[160 * 4 * 32 * 16]; }
__device__ __forceinline__ void proto_mark(int step, int mark, int slot, bool who) {
  if (!who || blockIdx.x >= 160 || step >= 32) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  proto_trace[((blockIdx.x * 4 + slot) * 32 + step) * 16 + mark] = now;
}
"""
for i, line in enumerate(src, 1):
    out.append(line)
    if line.startswith('#include "fadsl/sm90.cuh"'):
        out.append(head)
    if i in after:
        out.append(f"      proto_mark(step, {after[i]}, wg, warp == 0 && lane == 0);")
    if i in producer_after:
        out.append(f"          proto_mark(tile_count, {producer_after[i]}, 3, true);")
Path(".carry/h64t.cu").write_text("\n".join(out) + "\n")
