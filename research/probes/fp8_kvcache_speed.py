"""Decode over an 8-bit KV cache beside the 16-bit one (issue 42, research/fp8-forward.md §14):
examples/serving/fa3_fp8_decode_paged.fa (e4m3, descales per (batch, K/V head)) and
examples/serving/fa3_decode_paged.fa (bf16) through kern.kvcache, the same shapes and page
tables, each call captured in a CUDA graph (the kernels' time, not the eager call's host
path) and replayed in balanced orders; each call's time and the cache bytes it reads a
second (K and V of every batch's keys: half as many at 8 bits). ``--variant NAME=OLD/NEW``
(repeatable; several OLD/NEW pairs ";"-separated) adds the 8-bit spec with OLD replaced by
NEW in its text.

    python3 -P research/probes/fp8_kvcache_speed.py --lengths 4096,16384,65536 --batches 1,8,32 \
        --variant "s4=stages     2/stages     4"

heads 32 of head_dim 128 over 8 K/V heads (GQA 4), one query row a call, pages of 64."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import fadsl
from fadsl.tools.bench import median_times
from fadsl.tools.bench_kvcache import graphed

ROOT = Path(__file__).resolve().parents[2]
PAGE, HEADS, HEADS_KV, D = 64, 32, 8, 128


def cache(batch: int, length: int, dtype):
    per = -(-length // PAGE)
    k = torch.randn(batch * per, PAGE, HEADS_KV, D, device="cuda").to(dtype)
    v = torch.randn_like(k, dtype=torch.float32).to(dtype)
    table = torch.randperm(batch * per, device="cuda").view(batch, per).to(torch.int32)
    return k, v, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,16384,65536")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--variant", action="append", default=[])
    args = p.parse_args()
    serving = ROOT / "examples" / "serving"
    text = (serving / "fa3_fp8_decode_paged.fa").read_text()
    kernels = {"e4m3": fadsl.load(text, verbose=False)}
    for variant in args.variant:
        name, changes = variant.split("=", 1)
        renamed = text
        for change in changes.split(";"):
            old, new = change.split("/", 1)
            assert old in renamed, old
            renamed = renamed.replace(old, new)
        renamed = renamed.replace("fa3_fp8_decode_paged", f"fp8_decode_{name}")
        kernels[name] = fadsl.load(renamed, verbose=False)
    sixteen = fadsl.load(serving / "fa3_decode_paged.fa", verbose=False)
    for batch in map(int, args.batches.split(",")):
        for length in map(int, args.lengths.split(",")):
            seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            k8, v8, table = cache(batch, length, torch.float8_e4m3fn)
            k16, v16 = (t.to(torch.bfloat16) for t in (k8, v8))
            q8 = torch.randn(batch, 1, HEADS, D, device="cuda").to(torch.float8_e4m3fn)
            q16 = q8.to(torch.bfloat16)
            descales = {n: torch.rand(batch, HEADS_KV, device="cuda") + 0.5 for n in
                        ("q_descale", "k_descale", "v_descale")}  # fmt: skip
            calls = {
                n: (lambda _, kern=kern: kern.kvcache(q8, k8, v8, seqlens, table, **descales))
                for n, kern in kernels.items()
            }
            calls["bf16"] = lambda _: sixteen.kvcache(q16, k16, v16, seqlens, table)
            contenders = {n: graphed(f) for n, f in calls.items()}
            ms = median_times(contenders, 10, args.runs)
            elements = 2 * batch * length * HEADS_KV * D  # K and V
            cells = "  ".join(
                f"{n} {ms[n] * 1e3:.1f} us "
                f"{elements * (2 if n == 'bf16' else 1) / ms[n] / 1e6:.0f} GB/s"
                for n in ms
            )
            print(f"batch {batch} keys {length}: {cells}  bf16/e4m3 {ms['bf16'] / ms['e4m3']:.2f}x",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    with torch.no_grad():
        main()
