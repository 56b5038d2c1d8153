"""One decode step of a kv-cache spec and of SDPA's cuDNN backend, for Nsight Compute (issue 31).

Usage: ncu --nvtx --nvtx-include "profiled/" ... python3 -P research/probes/profile_decode.py SPEC BATCH KEYS
(GQA 32/8, head_dim 128, bf16; two warm calls each, then one inside the NVTX range "profiled")
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fadsl

spec, batch, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kern = fadsl.load(spec, verbose=False)
page, d, hq, hkv = kern.config.ext.kv_cache, 128, 32, 8
q = torch.randn(batch, 1, hq, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(batch, hkv, length, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
if page:
    per = -(-length // page)
    table = torch.randperm(batch * per, device="cuda").view(batch, per).to(torch.int32)
    kc = torch.empty(batch * per, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    for src, dst in ((k, kc), (v, vc)):
        flat = F.pad(src.transpose(1, 2), (0, 0, 0, 0, 0, per * page - length))
        dst[table.view(-1).long()] = flat.reshape(batch * per, page, hkv, d)
else:
    table = None
    kc, vc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def cudnn():
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, enable_gqa=True)


for _ in range(2):
    kern.kvcache(q, kc, vc, seqlens, table)
    cudnn()
torch.cuda.synchronize()
with torch.cuda.nvtx.range("profiled"):
    kern.kvcache(q, kc, vc, seqlens, table)
    cudnn()
torch.cuda.synchronize()
print("done")
