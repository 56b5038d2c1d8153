"""Decode with two CTAs an SM (issue 45's eager decode bar): does a second resident CTA take
back the 2-4 % the shipped decode kernel trails cuDNN by from batch 8 x 8k up?

The shipped decode spec (examples/serving/fa3_decode_paged.fa) runs one CTA an SM: its
setmaxnreg split (56 / 256) needs the SM's whole register file at launch, though its 99,408
bytes of SMEM would fit twice. The development build here is that spec with the split 40 /
216 (128 x 256 = 32,768 registers a CTA, half the file) and `__launch_bounds__(256, 2)`, so
that ptxas allocates 128 registers a thread at launch; the host then counts twice the SMs
(persistent CTAs and split pieces: `sm_count` doubled while the dev kernel plans and
launches). Printed: TB/s of K and V (GQA 32/8, head_dim 128, bf16, one query row, pages of
64), each contender eager and as a CUDA-graph replay, balanced orders, and each over cuDNN's
contiguous figure. Usage (GPU machine): python3 -P research/probes/decode_two_ctas.py
[--shapes 8x8192,32x8192,128x8192,1x131072] [--rounds 2] [--eager]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from fadsl.build import cache
from fadsl.runtime.attention import arch_of
from fadsl.targets.sm90.host import kvcache as kvhost
from fadsl.tools.bench import median_times
from fadsl.tools.bench_kvcache import graphed

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples/serving/fa3_decode_paged.fa"
D, HQ, HKV, PAGE = 128, 32, 8, 64


def two_cta_kernel(name: str, entry=None):
    text = SPEC.read_text()
    old = "registers  producer = 56, consumers = 256"
    assert old in text
    text = text.replace(old, "registers  producer = 40, consumers = 216", 1)
    text = text.replace("kernel fa3_decode_paged", f"kernel {name}", 1)
    kern = fadsl.load(text, verbose=False)
    dtype, arch = kern.config.dtypes[0], arch_of(0)
    if entry is not None:
        kern._entries[dtype, arch] = entry
        return kern
    request = kern.request(dtype, arch)
    name = request.kernel
    bounds = f"__launch_bounds__(Cfg::kThreads, 1) {name}("
    assert bounds in request.text, name
    twice = request.text.replace(bounds, f"__launch_bounds__(Cfg::kThreads, 2) {name}(")
    kern._entries[dtype, arch] = cache.development_build(
        dataclasses.replace(request, text=twice), {"FADSL_NOTHING": 1}
    )
    regs = [line for line in kern._entries[dtype, arch].log.splitlines() if "registers" in line]
    print("two-CTA build:", regs[:1], flush=True)
    return kern


class DoubledSms:
    """sm_count doubled inside (the dev kernel's plans and launches); with ``splits``
    False the pieces are still chosen for one CTA an SM (only the persistent grid doubles)."""

    def __init__(self, splits: bool = True) -> None:
        self.splits = splits

    def __enter__(self):
        self.old, self.old_choose = kvhost.sm_count, kvhost.choose_splits
        doubled = lambda index: 2 * self.old(index)  # noqa: E731
        kvhost.sm_count = doubled
        if not self.splits:

            def choose(*args):
                kvhost.sm_count = self.old
                try:
                    return self.old_choose(*args)
                finally:
                    kvhost.sm_count = doubled

            kvhost.choose_splits = choose

    def __exit__(self, *exc):
        kvhost.sm_count, kvhost.choose_splits = self.old, self.old_choose


def paged(k_bhsd, table):
    batch, heads, length, _ = k_bhsd.shape
    per = table.shape[1]
    cache_ = torch.empty(batch * per, PAGE, heads, D, device="cuda", dtype=k_bhsd.dtype)
    flat = F.pad(k_bhsd.transpose(1, 2), (0, 0, 0, 0, 0, per * PAGE - length))
    cache_[table.view(-1).long()] = flat.reshape(batch * per, PAGE, heads, D)
    return cache_


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8x8192,32x8192,128x8192,1x131072")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="eager calls too (kern.kvcache's path)")
    args = p.parse_args()
    shipped = fadsl.load(SPEC.read_text(), verbose=False)
    two = two_cta_kernel("decode_two")
    two_s1 = two_cta_kernel("decode_two", two._entries[two.config.dtypes[0], arch_of(0)])
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        torch.manual_seed(0)
        q = torch.randn(batch, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, HKV, length, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        per = -(-length // PAGE)
        table = torch.randperm(batch * per, device="cuda").view(batch, per).to(torch.int32)
        kc, vc = paged(k, table), paged(v, table)
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        ref = F.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.float(), v.float(), enable_gqa=True
        ).transpose(1, 2)
        outs = {}

        def fadsl_call(kern, wrap=None):
            out = torch.empty_like(q)
            outs[id(out)] = out

            def call(_):
                if wrap is not None:
                    with wrap:
                        return kern.kvcache(q, kc, vc, seqlens, table, out=out)
                return kern.kvcache(q, kc, vc, seqlens, table, out=out)

            out.fill_(float("nan"))
            call(0)
            err = (out.float() - ref).abs().max().item()
            assert err < 0.02, err
            return call

        qt = q.transpose(1, 2)

        def cudnn(_):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)

        eager = {
            "fadsl": fadsl_call(shipped),
            "two": fadsl_call(two, DoubledSms()),
            "two_s1": fadsl_call(two_s1, DoubledSms(splits=False)),
            "cudnn": cudnn,
        }
        contenders = {f"{n}:graph": graphed(fn) for n, fn in eager.items()}
        if args.eager:
            contenders.update(eager)
        ms = median_times(contenders, 8, 32, rounds=args.rounds * len(contenders))
        kv_bytes = 2 * batch * length * HKV * D * 2
        tbs = {n: kv_bytes / (t * 1e-3) / 1e12 for n, t in ms.items()}
        cells = "  ".join(f"{n} {x:.2f}" for n, x in tbs.items())
        ratios = " ".join(
            f"{n} {tbs[n] / tbs['cudnn' + n[n.index(':'):] if ':' in n else 'cudnn']:.3f}"
            for n in tbs
            if not n.startswith("cudnn")
        )
        print(f"{batch:4d} x {length:6d}: {cells} TB/s | {ratios}", flush=True)
        del contenders, eager, outs, q, k, v, kc, vc, ref
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
