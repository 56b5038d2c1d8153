"""Host time per call of each public call at a tiny shape (bf16, head_dim 128), beside SDPA
FLASH, then where a call's host time goes: cProfile of 200 calls of each, the top functions by
own time. Run on the GPU machine: python3 scripts/host_profile.py [--profile]."""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "scripts")
from runtime_bench import per_call_us  # noqa: E402

import fadsl  # noqa: E402


def calls() -> dict:
    dev, bf = "cuda", torch.bfloat16
    q, k, v = (torch.randn(1, 128, 1, 128, device=dev, dtype=bf) for _ in range(3))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    qv, kv_, vv = (torch.randn(256, 4, 128, device=dev, dtype=bf) for _ in range(3))
    cu = torch.tensor([0, 100, 256], device=dev, dtype=torch.int32)
    batch, pages, page = 2, 8, 64
    q1 = torch.randn(batch, 1, 32, 128, device=dev, dtype=bf)
    kc, vc = (torch.randn(pages * batch, page, 8, 128, device=dev, dtype=bf) for _ in range(2))
    table = torch.arange(pages * batch, device=dev, dtype=torch.int32).view(batch, pages)
    seqlens = torch.tensor([300, 17], device=dev, dtype=torch.int32)
    kn, vn = (torch.randn(batch, 1, 8, 128, device=dev, dtype=bf) for _ in range(2))
    kcc, vcc = (torch.randn(batch, 512, 8, 128, device=dev, dtype=bf) for _ in range(2))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)

    return {
        "sdpa_flash": sdpa,
        "attention": lambda: fadsl.attention(q, k, v),
        "attention_causal": lambda: fadsl.attention(q, k, v, causal=True),
        "attention_varlen": lambda: fadsl.attention_varlen(qv, kv_, vv, cu, cu, 156, 156),
        "kvcache_paged": lambda: fadsl.attention_with_kvcache(
            q1, kc, vc, seqlens, page_table=table, causal=True
        ),
        "kvcache_paged_append": lambda: fadsl.attention_with_kvcache(
            q1, kc, vc, seqlens, kn, vn, page_table=table, causal=True
        ),
        "kvcache_contiguous": lambda: fadsl.attention_with_kvcache(q1, kcc, vcc, seqlens),
        "append_kv_paged": lambda: fadsl.append_kv(kc, vc, kn, vn, seqlens, table),
    }


def main() -> None:
    found = calls()
    for name, fn in found.items():
        fn()
    torch.cuda.synchronize()
    for name, fn in found.items():
        print(f"host us/call {name}: {per_call_us(fn):.1f}", flush=True)
    if "--compile" in sys.argv:
        for name, fn in found.items():
            torch._dynamo.reset()
            try:
                torch.compile(fn, fullgraph=True)()
                print(f"fullgraph {name}: ok")
            except Exception as exc:  # the first lines of why
                print(f"fullgraph {name}: {type(exc).__name__}: {str(exc)[:300]!r}")
    if "--profile" in sys.argv:
        for name in ("attention", "kvcache_paged", "kvcache_paged_append", "attention_varlen"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                found[name]()
            prof.disable()
            torch.cuda.synchronize()
            print(f"== {name}: 200 calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
