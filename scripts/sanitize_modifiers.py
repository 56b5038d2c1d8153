"""Run each example with score or mask modifiers (examples/modifiers/) once per dtype at a few
ragged shapes, forward and backward (and prefix-LM's backward with `deterministic on`), for
compute-sanitizer (racecheck, synccheck, memcheck):

    compute-sanitizer --tool racecheck python3 -P scripts/sanitize_modifiers.py [NAME ...]

(NAMEs: those examples alone, e.g. document_causal.)

Inputs: ALiBi's slopes per head, the T5-style bias table per head and bucket, prefix-LM's
prefix lengths per batch, among them 0, one past the keys and a prefix longer than the keys
(the predicate's edges), block_sparse's table (full, partial and skipped blocks at random),
and document ids packed, single, scattered and foreign to the keys
(tests/document_ids.py), so that every tile class (full, empty, partial) runs. Each backward
runs twice where the spec has float inputs: as given, and with them requiring grad (the
learnable variant, whose adds into their gradients are global atomics)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fadsl
from fadsl.runtime.arguments import torch_dtype_of

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from block_text import deterministic  # noqa: E402
from document_ids import PATTERNS, document_ids  # noqa: E402

SHAPES = ((1, 1), (70, 333), (333, 70), (300, 1100))  # (seqlen_q, seqlen_k)
HEADS, BATCH = 4, 4


def inputs(kern, sq: int, sk: int) -> dict[str, torch.Tensor]:
    """The spec's declared inputs, by name (the examples declare slopes, bias, prefix and the
    document ids)."""
    made = {}
    names = {i.name for i in kern.config.modifiers.inputs}
    if "slopes" in names:
        made["slopes"] = torch.tensor([2.0 ** -(h + 1) for h in range(HEADS)], device="cuda")
    if "bias" in names:
        made["bias"] = torch.linspace(-1, 1, HEADS * 32, device="cuda").view(HEADS, 32)
    if "prefix" in names:
        made["prefix"] = torch.tensor([0, sk // 3, sk + 1, 1], device="cuda", dtype=torch.int32)
    if "q_doc" in names:  # one pattern a batch row (tests/document_ids.py)
        made.update(document_ids(PATTERNS[:BATCH], sq, sk, seed=sq + sk))
    if "blocks" in names:  # block_sparse's table: full (2), partial (1), skipped (0), mixed
        shape = (BATCH, HEADS, -(-sq // 128), -(-sk // 128))
        gen = torch.Generator(device="cuda").manual_seed(sq * sk)
        made["blocks"] = torch.randint(0, 3, shape, device="cuda", generator=gen, dtype=torch.int32)
    unknown = names - made.keys()
    if unknown:
        sys.exit(f"{kern.config.name}: no input made for {sorted(unknown)}")
    return made


def specs() -> list[tuple[str, str]]:
    """The examples (each with its backward block), and prefix-LM's with `deterministic on`
    (keep trims no m-block there; every n-block adds in ticket order)."""
    found = [
        (p.stem, p.read_text()) for p in sorted((ROOT / "examples" / "modifiers").glob("*.fa"))
    ]
    prefix = dict(found)["prefix_lm"].replace("kernel prefix_lm {", "kernel prefix_lm_det {")
    found.append(("prefix_lm_det", deterministic(prefix)))
    return found


for name, text in [s for s in specs() if s[0] in sys.argv[1:] or len(sys.argv) == 1]:
    kern = fadsl.load(text, verbose=False)
    d = kern.config.head_dim
    for dtype in kern.config.dtypes:
        torch_dtype = torch_dtype_of(dtype)
        for sq, sk in SHAPES:
            q = torch.randn(BATCH, sq, HEADS, d, device="cuda", dtype=torch_dtype)
            k = torch.randn(BATCH, sk, HEADS, d, device="cuda", dtype=torch_dtype)
            v = torch.randn(BATCH, sk, HEADS, d, device="cuda", dtype=torch_dtype)
            with torch.no_grad():
                out, lse = kern(q, k, v, return_lse=True, **inputs(kern, sq, sk))
            torch.cuda.synchronize()
            print(f"{name} {dtype.value} {sq}x{sk}: ran, finite={bool(out.isfinite().all())}")
            if not kern.has_backward:
                continue
            # the backward (issue 41, step 4): its three kernels, the LSE's gradient too
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = kern(*leaves, return_lse=True, **inputs(kern, sq, sk))
            (out.float().square().sum() + lse.nan_to_num(0.0, 0.0, 0.0).sum()).backward()
            torch.cuda.synchronize()
            finite = all(bool(t.grad.isfinite().all()) for t in leaves)
            print(f"{name} {dtype.value} {sq}x{sk}: backward ran, finite={finite}")
            learnable = {
                n: t.requires_grad_()
                for n, t in inputs(kern, sq, sk).items()
                if t.is_floating_point()
            }
            if not learnable or name.endswith(
                "_det"
            ):  # (deterministic: refused with learnable inputs)
                continue
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = kern(*leaves, **{**inputs(kern, sq, sk), **learnable})
            out.float().square().sum().backward()
            torch.cuda.synchronize()
            finite = all(bool(t.grad.isfinite().all()) for t in (*leaves, *learnable.values()))
            print(
                f"{name} {dtype.value} {sq}x{sk}: learnable {sorted(learnable)} ran, finite={finite}"
            )
