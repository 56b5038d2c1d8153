"""An 8-bit example beside variants of its own spec (tile, stages), the same e4m3 tensors, in
rotated rounds: which tile fadsl.attention should run at short sequences (issue 42).

    python3 -P research/probes/fp8_tile_ab.py examples/fa3_fp8_hdim128.fa \
        --variant "bc128=B_c = 192/B_c = 128" --variant "bc128s3=B_c = 192/B_c = 128;stages     2/stages     3" \
        --seqlens 1024,2048,4096

Each --variant is NAME=OLD/NEW[;OLD/NEW...]: text edits of the spec (the kernel renamed).
TF/s over the work the mask keeps (hidden 2048 / head_dim heads, 16k tokens a call), the
median of the rounds' medians in balanced orders (fadsl.tools.bench.median_times), and each
variant over the example."""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

import fadsl
from fadsl.tools.bench import median_times


def variants(spec: pathlib.Path, edits: list[str], tmp: pathlib.Path) -> dict[str, object]:
    tmp.mkdir(exist_ok=True)
    text = spec.read_text()
    name = text.split("kernel ", 1)[1].split()[0]
    kernels = {"example": fadsl.load(str(spec), verbose=False)}
    for edit in edits:
        label, _, pairs = edit.partition("=")
        new_text = text.replace(f"kernel {name} ", f"kernel {name}_{label} ")
        for pair in pairs.split(";"):
            old, new = pair.split("/")
            assert old in new_text, (label, old)
            new_text = new_text.replace(old, new)
        path = tmp / f"{name}_{label}.fa"
        path.write_text(new_text)
        kernels[label] = fadsl.load(str(path), verbose=False)
    return kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec", type=pathlib.Path)
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--seqlens", default="1024,2048,4096")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--build-only", action="store_true", help="fill the cubin cache, no GPU")
    args = p.parse_args()

    kernels = variants(args.spec, args.variant, pathlib.Path(tempfile.gettempdir()) / "fp8_tile_ab")
    if args.build_only:
        from fadsl.ir import Dtype

        for kern in kernels.values():
            kern.cubin(Dtype("e4m3"), "sm_90a")
        return
    cfg = kernels["example"].config
    d, causal = cfg.head_dim, cfg.mask.value == "causal"
    heads = args.hidden // d
    names = list(kernels)
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        batch = max(1, args.tokens // seqlen)
        g = torch.Generator(device="cuda").manual_seed(seqlen)
        q, k, v = (
            torch.randn(batch, seqlen, heads, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
            for _ in range(3)
        )
        calls = {n: (lambda i, kern=kernels[n]: kern(q, k, v)) for n in names}  # (i: one set)
        outs = {n: calls[n](0).float() for n in names}
        for n in names[1:]:
            diff = (outs[n] - outs["example"]).abs().max().item()
            assert diff < 0.05, (n, seqlen, diff)
        ms = median_times(calls, warmup=5, runs=args.runs, rounds=args.rounds)
        work = 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
        row = [
            f"{n} {work / (ms[n] * 1e-3) / 1e12:.0f} TF/s ({ms['example'] / ms[n]:.3f}x)"
            for n in names
        ]
        print(f"{cfg.name} seqlen {seqlen}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
