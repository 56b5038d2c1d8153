"""Decode at head_dim 256 over an 8-bit KV cache (issue 42: the one 8-bit decode not yet timed):
fadsl.attention_with_kvcache on e4m3 q and caches (dispatch.fp8_kvcache_kernel: the decode
example rewritten for head_dim 256, B_c 64) beside SDPA's cuDNN backend on contiguous bf16
K and V (fadsl's bf16 decode is head_dim 128's only); GQA 4 (16 heads over 4 K/V heads), one query row,
pages of 64, descales per (batch, K/V head). Each call captured in a CUDA graph and replayed
in balanced orders; printed: microseconds a call and the cache bytes read a second (K and V
of every batch's keys: half as many at 8 bits), and 8-bit x cuDNN by time.

    python3 -P research/probes/fp8_decode_hdim256.py [--shapes 1x16384,8x16384,32x8192,1x131072]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

for cand in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parents[2]):
    if (cand / "fadsl").is_dir():
        sys.path.insert(0, str(cand))
        break

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadsl
from fadsl.fp8 import quantize
from fadsl.tools.bench import median_times
from fadsl.tools.bench_kvcache import graphed

D, HEADS, HEADS_KV, PAGE = 256, 16, 4, 64


def paged(x, table):
    """(pages, PAGE, heads_kv, D) holding x (batch, keys, heads_kv, D) under ``table``."""
    batch, length = x.shape[:2]
    per = table.shape[1]
    out = torch.zeros(batch * per, PAGE, HEADS_KV, D, device="cuda", dtype=x.dtype)
    flat = F.pad(x.float(), (0, 0, 0, 0, 0, per * PAGE - length)).to(x.dtype)
    out[table.view(-1).long()] = flat.reshape(batch * per, PAGE, HEADS_KV, D)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x16384,8x16384,32x8192,1x131072")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        torch.manual_seed(0)
        q = torch.randn(batch, 1, HEADS, D, device="cuda")
        k = torch.randn(batch, length, HEADS_KV, D, device="cuda")
        v = torch.randn(batch, length, HEADS_KV, D, device="cuda")
        per = -(-length // PAGE)
        table = torch.randperm(batch * per, device="cuda").view(batch, per).to(torch.int32)
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        q8, qd = quantize(q, torch.float8_e4m3fn, scale_heads=HEADS_KV)
        k8, kd = quantize(k, torch.float8_e4m3fn)
        v8, vd = quantize(v, torch.float8_e4m3fn)
        kc8, vc8 = paged(k8, table), paged(v8, table)
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        qt, kt, vt = (t.transpose(1, 2) for t in (qb, kb, vb))

        def e4m3(_):
            return fadsl.attention_with_kvcache(q8, kc8, vc8, seqlens, page_table=table,
                                                q_descale=qd, k_descale=kd, v_descale=vd)  # fmt: skip

        def cudnn(_):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)

        ref = cudnn(0).transpose(1, 2).float()
        err = (e4m3(0).float() - ref).abs().max().item()
        assert err < 0.1, err
        calls = {"e4m3": graphed(e4m3), "cudnn": graphed(cudnn)}
        ms = median_times(calls, 8, 40)
        elements = 2 * batch * length * HEADS_KV * D
        cells = "  ".join(
            f"{n} {t * 1e3:7.1f} us {elements * (1 if n == 'e4m3' else 2) / (t * 1e-3) / 1e12:.2f} TB/s"
            for n, t in ms.items()
        )
        print(f"{batch:3d} x {length:6d}: {cells} | e4m3 x cuDNN {ms['cudnn'] / ms['e4m3']:.2f}",
              flush=True)  # fmt: skip
        del calls
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
