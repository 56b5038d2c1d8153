"""Where a split decode call's time goes inside its attention kernel (issue 31, batch 1).

Builds the kv-cache spec with FADSL_TILE_TRACE (fadsl/sm90_trace.cuh: lane 0 of each consumer
warpgroup stamps %globaltimer at its tile's marks), runs one decode call on a paged cache of
each shape, and prints, over the CTAs' first pieces, the times of the marks from the earliest
CTA's mark 0 (its tile known: cache_seqlens read, kv_input_bad done): 1 the first S issued (Q
and the first K block in), 2 the first softmax done, 3 the mainloop done, 5 the last P V in;
each as min / median / max over the CTAs, with the mainloop's time per K/V block; and the
call's time by CUDA events (attention and combine kernels), for what lies outside the marks.
--grid: each CTA's end, tile by piece; --boundaries: for CTAs that run several whole tiles
(larger batches), the medians of the stretches between consecutive tiles.

Usage (a Hopper GPU, fadsl installed): python3 -P research/probes/decode_trace.py [SPEC]
[--shapes 1x4096,1x32768,1x131072] [--grid] [--boundaries]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fadsl
from fadsl.runtime.attention import arch_of
from fadsl.tools import tiletrace

HEADS_Q, HEADS_KV = 32, 8  # GQA 32/8, as bench_kvcache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default="examples/serving/fa3_decode_paged.fa")
    parser.add_argument("--shapes", default="1x4096,1x32768,1x131072")
    parser.add_argument("--grid", action="store_true", help="each CTA's end, tile by piece")
    parser.add_argument(
        "--boundaries", action="store_true", help="the gaps between a CTA's consecutive tiles"
    )
    args = parser.parse_args()
    kern = fadsl.load(args.spec, verbose=False)
    dtype = kern.config.dtypes[0]
    page = kern.config.ext.kv_cache
    if page <= 0:
        raise SystemExit(f"{args.spec}: a paged kv_cache spec is needed (kv_cache paged(N))")
    kern.use_development_build(dtype, arch_of(0), {"FADSL_TILE_TRACE": 1})
    module = kern.module(dtype, 0)
    layout = tiletrace.TraceLayout.of_target(kern.compiled.target)
    for shape in args.shapes.split(","):
        batch, length = map(int, shape.split("x"))
        per = length // page
        q = torch.randn(batch, 1, HEADS_Q, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch * per, page, HEADS_KV, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        table = torch.randperm(batch * per, device="cuda").view(batch, per).to(torch.int32)
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        out = torch.empty_like(q)
        call = lambda: kern.kvcache(q, k, v, seqlens, table, out=out)  # noqa: E731
        for _ in range(3):
            call()
        times = []
        for _ in range(10):
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        module.zero_global("fadsl_tile_trace")
        call()
        torch.cuda.synchronize()
        trace = layout.unpack(module.read_global("fadsl_tile_trace"))
        rows = []  # per CTA, step 0, warpgroup 0: its marks
        for cta in range(layout.ctas):
            base = (cta * layout.warpgroups) * layout.steps * layout.marks
            marks = trace[base : base + layout.marks]
            if marks[0]:
                rows.append(marks)
        t0 = min(r[0] for r in rows)
        cells = []
        for mark in (0, 1, 2, 3, 5):
            got = [(r[mark] - t0) / 1e3 for r in rows if r[mark]]
            if got:
                cells.append(
                    f"m{mark} {min(got):6.2f} / {statistics.median(got):6.2f} / {max(got):6.2f}"
                )
        loop = [(r[3] - r[2]) / 1e3 for r in rows if r[3] and r[2]]
        print(
            f"{shape}: {len(rows)} CTAs, call {statistics.median(times):.1f} us (events, host "
            f"launch included); marks us from the first CTA's m0, min / median / max:"
        )
        print("   " + "  |  ".join(cells))
        print(f"   mainloop (m2 -> m3) median {statistics.median(loop):.2f} us", flush=True)
        if args.boundaries:
            print("   " + boundaries(trace, layout, -(-length // kern.config.block_c)))
        if args.grid:  # each CTA's m5 (us), a row a tile (its pieces in order)
            splits = len(rows) // (batch * HEADS_KV)  # PackGQA: a tile a (batch, K/V head)
            for t in range(len(rows) // max(1, splits)):
                ends = [(r[5] - t0) / 1e3 for r in rows[t * splits : (t + 1) * splits]]
                print("   tile %d: " % t + " ".join(f"{e:5.1f}" for e in ends))


def boundaries(trace: list[int], layout, blocks: int) -> str:
    """Medians over the CTAs' consecutive tiles (warpgroup 0; whole tiles of ``blocks``
    blocks, no split) of each stretch between a tile's last P V (m5) and the next tile's
    first S (m1), beside a mainloop block's time: a stream without bubbles spends about a
    block there."""
    spans: dict[str, list[float]] = {"m5->m7": [], "m7->m0'": [], "m0'->m1'": [], "block": []}
    for cta in range(layout.ctas):
        base = cta * layout.warpgroups * layout.steps * layout.marks
        tiles = [
            trace[base + s * layout.marks : base + (s + 1) * layout.marks]
            for s in range(layout.steps)
        ]
        for prev, cur in zip(tiles, tiles[1:]):
            if not (prev[5] and prev[7] and cur[0] and cur[1]):
                break
            spans["m5->m7"].append((prev[7] - prev[5]) / 1e3)
            spans["m7->m0'"].append((cur[0] - prev[7]) / 1e3)
            spans["m0'->m1'"].append((cur[1] - cur[0]) / 1e3)
            if cur[3] and cur[2] and blocks > 1:
                spans["block"].append((cur[3] - cur[2]) / 1e3 / (blocks - 1))
    if not spans["block"]:
        return "(no CTA ran two whole tiles: a split call runs one piece a CTA)"
    cells = [f"{name} {statistics.median(v):.2f}" for name, v in spans.items() if v]
    return f"boundaries ({len(spans['block'])} tile pairs), median us: " + "  ".join(cells)


if __name__ == "__main__":
    main()
