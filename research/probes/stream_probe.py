"""How fast can an SM stream a paged KV cache, by load mechanism (issue 31, decode bandwidth)?

Decode reads K and V once; fadsl's decode kernel reaches 88-92 % of cuDNN's bandwidth (H200,
2026-11-27), with DRAM less busy than cuDNN keeps it. This probe streams the same paged cache
(pages of 64 rows, (pages, 64, heads_kv, 128) bf16, a shuffled page table, the decode
kernel's (sequence, head, piece) work split) into SMEM rings with no arithmetic, so that only
the load path differs:

  tma_B_S     one elected producer thread issues TMA boxes of 64 columns x 64 rows per page
              (fadsl's load_kv_paged), a ring of S slots of B keys for K and for V; a
              consumer warpgroup waits for each slot and frees it (mbarriers, as the kernel)
  cpasync_B_S the producer warpgroup's 128 threads issue cp.async 16-byte copies (a warp
              covers two whole 256-byte token rows at a time) into the same 128-byte-swizzled
              layout, completing on the slot's mbarrier (cp.async.mbarrier.arrive.noinc)
  tmapre_B_S  tma_B_S with the piece's page-table entries copied into SMEM by the producer
              warpgroup first, so that no global load sits between a slot's empty wait and
              its boxes (does the issuing thread's lookup latency bound the TMA path?)
  ldg         256 threads a CTA load the same bytes into registers (ld.global.nc, 16 bytes)
              and fold them into a checksum: no SMEM, as many CTAs as fit

B = 64 rings fit twice on an SM (two CTAs), B = 128 once. Printed: TB/s of K and V per
variant and shape, each the median of 10 timed launches after 3 warm-ups (CUDA events).
Usage (on the GPU machine, fadsl installed): python3 -P research/probes/stream_probe.py [--shape
128x8192] [--variant tma_128_3]; `bash scripts/device.sh streamprobe` runs it, then Nsight
Compute on one launch of each 128-key variant and ldg.
"""

from __future__ import annotations

import statistics
import struct
import tempfile
from pathlib import Path

import torch

from fadsl.build.nvrtc import compile_cubin
from fadsl.runtime.driver import Module
from fadsl.targets.sm90.host.tma import MAP_BYTES, tensor_map

HEAD_DIM, PAGE, HEADS_KV = 128, 64, 8
SHAPES = [(1, 131072), (8, 16384), (128, 8192)]  # (sequences, keys each)
VARIANTS = [
    ("tma", 128, 3), ("tma", 64, 3), ("tma", 64, 6), ("cpasync", 128, 3), ("cpasync", 64, 3),
    ("cpasync", 64, 6), ("tmapre", 128, 3), ("tmapre", 64, 3), ("tmapre", 64, 2), ("ldg", 0, 0),
]  # fmt: skip
MAX_PAGES = 1024  # page-table entries of one piece the tmapre variants hold in SMEM

SOURCE = r"""
#include "fadsl/sm90_ptx.cuh"
using namespace fadsl::sm90;

struct ProbeParams {
  CUtensorMap k_map, v_map;  // (head_dim, page rows, heads, pages), boxes of 64 x 64
  const char* k;
  const char* v;
  const int* table;          // (sequences, per) page table
  unsigned long long* sink;  // ldg's checksum
  int per, heads, splits, blocks;  // pages a sequence; heads_kv; pieces a (sequence, head); blocks a piece
};

constexpr int kRowBytes = 256, kPage = 64;

__device__ __forceinline__ void work_of(const ProbeParams& P, int item, int& seq, int& head, int& split) {
  split = item % P.splits;
  head = (item / P.splits) % P.heads;
  seq = item / (P.splits * P.heads);
}

__device__ __forceinline__ void cp_async_16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// K and V rings: slot s of K at s * kSlot, of V after them; full and empty mbarriers per slot
constexpr int kMaxPages = 1024;  // tmapre: the piece's page-table entries in SMEM

template <int kBlockN, int kStages, bool kCpAsync, bool kPagesInSmem = false>
__device__ __forceinline__ void stream(const ProbeParams& P) {
  constexpr uint32_t kSlot = kBlockN * kRowBytes;
  extern __shared__ __align__(1024) unsigned char smem_raw[];  // the rings, then the mbarriers
  const uint32_t smem = smem_u32(smem_raw), bar0 = smem + 2 * kStages * kSlot;  // full K, V, empty K, V
  auto full = [&](int kv, int s) { return bar0 + 8u * (kv * kStages + s); };
  auto empty = [&](int kv, int s) { return bar0 + 8u * ((2 + kv) * kStages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(0, s), kCpAsync ? 128 : 1);
      mbar_init(full(1, s), kCpAsync ? 128 : 1);
      mbar_init(empty(0, s), 4);
      mbar_init(empty(1, s), 4);
    }
    fence_mbarrier_init();
  }
  int seq, head, split;
  work_of(P, blockIdx.x, seq, head, split);
  const int first = split * P.blocks;
  const int* pages = P.table + seq * P.per;
  if constexpr (kPagesInSmem) {  // the piece's entries, indexed from its first page
    int* cached = reinterpret_cast<int*>(smem_raw + 2 * kStages * kSlot + 32 * kStages);
    const int first_page = first * kBlockN / kPage, count = P.blocks * kBlockN / kPage;
    for (int i = threadIdx.x; i < count && i < kMaxPages; i += blockDim.x) cached[i] = pages[first_page + i];
    pages = cached - first_page;
  }
  __syncthreads();
  if (threadIdx.x < 128) {  // producer warpgroup
    if (!kCpAsync && threadIdx.x != 0) return;
    for (int j = 0; j < P.blocks; ++j) {
      const int s = j % kStages;
      const uint32_t parity = ((j / kStages) & 1) ^ 1;
      for (int kv = 0; kv < 2; ++kv) {
        mbar_wait_parity(empty(kv, s), parity);
        const uint32_t slot = smem + (kv * kStages + s) * kSlot;
        const int key0 = (first + j) * kBlockN;
        if constexpr (!kCpAsync) {
          mbar_arrive_expect_tx(full(kv, s), kSlot);
          const CUtensorMap* map = kv ? &P.v_map : &P.k_map;
          for (int part = 0; part < kBlockN / kPage; ++part) {
            const int page = pages[(key0 + part * kPage) / kPage];
            for (int panel = 0; panel < 2; ++panel) {
              tma_load_4d(slot + (panel * kBlockN + part * kPage) * 128, map, full(kv, s), 64 * panel, 0, head, page);
            }
          }
        } else {
          const char* base = kv ? P.v : P.k;
          // chunk i: row i / 16 of the block, 16-byte column c = i % 16 (panel c / 8)
          for (int i = threadIdx.x; i < kBlockN * 16; i += 128) {
            const int row = i / 16, c = i % 16, key = key0 + row;
            const int page = pages[key / kPage];
            const char* src = base + ((static_cast<size_t>(page) * kPage + key % kPage) * P.heads + head) * kRowBytes + c * 16;
            const uint32_t dst = slot + (c / 8) * kBlockN * 128 + row * 128 + (((c % 8) ^ (row % 8)) * 16);
            cp_async_16(dst, src);
          }
          cp_async_arrive(full(kv, s));
        }
      }
    }
  } else {  // consumer warpgroup: waits for each slot, frees it
    const int lane = threadIdx.x % 32;
    for (int j = 0; j < P.blocks; ++j) {
      const int s = j % kStages;
      const uint32_t parity = (j / kStages) & 1;
      for (int kv = 0; kv < 2; ++kv) {
        mbar_wait_parity(full(kv, s), parity);
        if (lane == 0) mbar_arrive(empty(kv, s));
      }
    }
  }
}

// The same bytes into registers: each thread 16-byte loads of its chunks, kUnroll blocks at a time
__device__ __forceinline__ void load_sum(const ProbeParams& P) {
  int seq, head, split;
  work_of(P, blockIdx.x, seq, head, split);
  const int* pages = P.table + seq * P.per;
  constexpr int kBlockN = 64;
  unsigned long long acc = 0;
  for (int j = 0; j < P.blocks; ++j) {
    const int key0 = (split * P.blocks + j) * kBlockN;
    uint4 got[8];
#pragma unroll
    for (int n = 0; n < 8; ++n) {  // 64 rows x 16 chunks x (K, V) = 2048 chunks, 8 a thread
      const int i = threadIdx.x + 256 * n, kv = i / 1024, row = (i % 1024) / 16, c = i % 16;
      const int key = key0 + row;
      const char* src = (kv ? P.v : P.k) + ((static_cast<size_t>(pages[key / kPage]) * kPage + key % kPage) * P.heads + head) * kRowBytes + c * 16;
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(got[n].x), "=r"(got[n].y), "=r"(got[n].z), "=r"(got[n].w) : "l"(src));
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) acc ^= got[n].x ^ got[n].y ^ got[n].z ^ got[n].w;
  }
  if (acc == 0x1234567ull) *P.sink = acc;  // (never: keeps the loads)
}

extern "C" __global__ void __launch_bounds__(256, 1) tma_128_3(const __grid_constant__ ProbeParams P) { stream<128, 3, false>(P); }
extern "C" __global__ void __launch_bounds__(256, 2) tma_64_3(const __grid_constant__ ProbeParams P) { stream<64, 3, false>(P); }
extern "C" __global__ void __launch_bounds__(256, 1) cpasync_128_3(const __grid_constant__ ProbeParams P) { stream<128, 3, true>(P); }
extern "C" __global__ void __launch_bounds__(256, 2) cpasync_64_3(const __grid_constant__ ProbeParams P) { stream<64, 3, true>(P); }
extern "C" __global__ void __launch_bounds__(256, 1) tma_64_6(const __grid_constant__ ProbeParams P) { stream<64, 6, false>(P); }
extern "C" __global__ void __launch_bounds__(256, 1) cpasync_64_6(const __grid_constant__ ProbeParams P) { stream<64, 6, true>(P); }
extern "C" __global__ void __launch_bounds__(256, 1) tmapre_128_3(const __grid_constant__ ProbeParams P) { stream<128, 3, false, true>(P); }
extern "C" __global__ void __launch_bounds__(256, 2) tmapre_64_3(const __grid_constant__ ProbeParams P) { stream<64, 3, false, true>(P); }
extern "C" __global__ void __launch_bounds__(256, 2) tmapre_64_2(const __grid_constant__ ProbeParams P) { stream<64, 2, false, true>(P); }
extern "C" __global__ void __launch_bounds__(256) ldg(const __grid_constant__ ProbeParams P) { load_sum(P); }
"""


def use_l2_promotion(name: str) -> None:
    """Encode the TMA maps with CU_TENSOR_MAP_L2_PROMOTION_<name> (NONE, L2_64B, L2_128B,
    L2_256B: fadsl's) instead of fadsl's; `--l2` (does the promotion cost the TMA path?)."""
    from fadsl.cudadriver import driver
    from fadsl.targets.sm90.host import tma

    promotion = getattr(driver().CUtensorMapL2promotion, f"CU_TENSOR_MAP_L2_PROMOTION_{name}")
    tma._promotion = lambda streamed: promotion
    tma._encoded.clear()


def params(k, v, table, sink, heads, splits, blocks) -> bytes:
    maps = tensor_map(k, 64, PAGE) + tensor_map(v, 64, PAGE)
    assert len(maps) == 2 * MAP_BYTES
    tail = struct.pack(
        "<QQQQiiii",
        k.data_ptr(),
        v.data_ptr(),
        table.data_ptr(),
        sink.data_ptr(),
        table.shape[1],
        heads,
        splits,
        blocks,
    )
    raw = maps + tail
    return raw + bytes(-len(raw) % 128)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", help="one shape, SEQUENCESxKEYS (default: 1x131072 8x16384 128x8192)"
    )
    parser.add_argument("--variant", help="one variant (e.g. tma_128_3, cpasync_64_3, ldg)")
    parser.add_argument("--l2", help="the TMA maps' L2 promotion: NONE, L2_64B, L2_128B, L2_256B")
    args = parser.parse_args()
    if args.l2:
        use_l2_promotion(args.l2)
    shapes = [tuple(map(int, args.shape.split("x")))] if args.shape else SHAPES
    variants = [
        v
        for v in VARIANTS
        if args.variant in (None, v[0] if v[0] == "ldg" else "{}_{}_{}".format(*v))
    ]
    with tempfile.TemporaryDirectory() as where:
        cubin = compile_cubin(SOURCE, "stream_probe.cu", "tma_128_3", "sm_90a", Path(where)).cubin
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(0), f"{sms} SMs", flush=True)
    stream = torch.cuda.current_stream().cuda_stream
    for seqs, keys in shapes:
        per = keys // PAGE
        pages = seqs * per
        k = torch.randn(pages, PAGE, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sink = torch.zeros(1, dtype=torch.int64, device="cuda")
        nbytes = 2 * k.numel() * 2
        for order in ("shuffled", "linear"):  # linear: the paged cache is the contiguous one
            pick = torch.randperm(pages, device="cuda") if order == "shuffled" else None
            table = pick if pick is not None else torch.arange(pages, device="cuda")
            table = table.view(seqs, per).to(torch.int32).contiguous()
            cells = []
            for kind, block_n, stages in variants:
                rows = block_n or 64
                ctas_per_sm = 2 if (block_n, stages) in ((64, 3), (64, 2)) else 1
                # pieces: fill the SMs once (as splits auto), at least 4 blocks each
                items = seqs * HEADS_KV
                per_sm = 8 if kind == "ldg" else ctas_per_sm
                splits = max(1, min((sms * per_sm) // items, keys // rows // 4))
                blocks = keys // rows // splits
                name = f"{kind}_{block_n}_{stages}" if kind != "ldg" else "ldg"
                smem = 2 * stages * block_n * 256 + 32 * stages if kind != "ldg" else 0
                smem += 4 * MAX_PAGES if kind == "tmapre" else 0
                assert kind != "tmapre" or blocks * rows // PAGE <= MAX_PAGES
                module = Module(cubin, name, smem, 256)
                module.prepare(0)
                raw = params(k, v, table, sink, HEADS_KV, splits, blocks)
                grid = (items * splits, 1, 1)
                ms = median_ms(lambda: module.launch(grid, (256, 1, 1), raw, stream))
                read = (
                    nbytes * (blocks * splits * rows) / keys
                )  # (keys past the pieces' blocks: none)
                cells.append(f"{name} {read / (ms * 1e-3) / 1e12:5.2f}")
            print(f"  {seqs:3d} x {keys:6d} {order:8s}: " + "  ".join(cells) + " TB/s", flush=True)
        if args.variant is None:
            print(
                f"  {seqs:3d} x {keys:6d} cuDNN decode (contiguous): {cudnn_tbs(k, seqs):5.2f} TB/s"
            )


def median_ms(launch) -> float:
    for _ in range(3):
        launch()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cudnn_tbs(k: torch.Tensor, seqs: int) -> float:
    """SDPA's cuDNN backend on the same bytes as contiguous (seqs, heads_kv, keys, head_dim)
    K and V, one query row of 32 heads, replayed from a CUDA graph (as bench times it)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    keys = k.numel() // (seqs * HEADS_KV * HEAD_DIM)
    kc = k.view(seqs, keys, HEADS_KV, HEAD_DIM).transpose(1, 2).contiguous()
    vc = torch.randn_like(kc)
    q = torch.randn(seqs, 32, 1, HEAD_DIM, device="cuda", dtype=k.dtype)

    def call():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, kc, vc, enable_gqa=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return 2 * kc.numel() * 2 / (median_ms(graph.replay) * 1e-3) / 1e12


if __name__ == "__main__":
    main()
