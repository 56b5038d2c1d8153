"""Development builds of one backward side by side, sustained, in one process: for a spec
with a backward block (a file, or a training variant's name as for --against), each define set of --sets (";"-separated, "NAME=VALUE ..." each, the
first the control, e.g. FADSL_NOTHING=1) built as its own development build
(use_development_build), every build's backward timed back to back for --seconds after as
long a warm-up (research/probes/bwd_vs_fa4.py's `sustained`: the board at its steady clock),
in rotated orders over --rounds, on the same tensors. Prints TF/s (2.5 x the forward's
FLOPs), the SM clock and each set's ratio to the control. Sustained timing rather than
probe_backward.py's 16-call medians: at 16k those ranged 0.93-1.09 between two builds of
the same code (H200, 2026-12-01).

Usage (a Hopper GPU): python3 -P research/probes/backward_ab.py examples/fa3_hopper.fa
  --sets "FADSL_NOTHING=1;FADSL_MY_EXPERIMENT=1" [--seqlens 1024,4096,16384] [--seconds 1]
  [--against OTHER.fa ...]
--against: other specs of the same head_dim and mask (another backward block), each timed
as shipped beside the sets, on the same tensors: a spec file, or a training variant's name
as tests/training_specs.py's training_spec reads it (fa3_causal+prefetch_kv); the
energy per call is printed too (at the board's power cap a backward's speed is its work
per joule). A spec with score or mask modifiers (examples/modifiers/) gets its inputs from
modifier_inputs, the same for every contender (so the --against specs declare the same).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402

import fadsl  # noqa: E402
from fadsl.runtime.arguments import torch_dtype_of  # noqa: E402
from fadsl.runtime.attention import arch_of  # noqa: E402
from fadsl.tools import clocks  # noqa: E402

from bwd_vs_fa4 import energy_reader, sustained  # noqa: E402


def _spec_text(spec: str) -> str:
    """A spec file's text, or the training variant ``spec`` names (training_spec)."""
    if pathlib.Path(spec).is_file():
        return pathlib.Path(spec).read_text()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
    from training_specs import training_spec

    return training_spec(spec)


def modifier_inputs(kern, batch: int, heads: int, seqlen: int) -> dict:
    """The spec's modifier inputs (examples/modifiers/) at one shape, made once and passed to
    every contender: ALiBi's slopes, a prefix of a quarter of the keys, a T5 bias table, 8
    equal documents a row, half the blocks below the diagonal full, the diagonal's partial, the rest skipped.
    """
    made = {}
    for tensor in kern.config.modifiers.inputs if kern.config.modifiers else ():
        if tensor.name == "slopes":
            made["slopes"] = 2.0 ** (-8 * torch.arange(1, heads + 1, device="cuda") / heads)
        elif tensor.name == "prefix":
            made["prefix"] = torch.full((batch,), seqlen // 4, device="cuda", dtype=torch.int32)
        elif tensor.name == "bias":
            made["bias"] = torch.randn(heads, 32, device="cuda")
        elif tensor.name in ("q_doc", "kv_doc"):
            ids = torch.arange(seqlen, device="cuda") * 8 // seqlen
            made[tensor.name] = ids.to(torch.int32).expand(batch, seqlen).contiguous()
        elif tensor.name == "blocks":
            n = -(-seqlen // 128)
            i, j = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None]
            full = (j < i) & (torch.rand(batch, heads, n, n, device="cuda") < 0.5)
            made["blocks"] = torch.where(j == i, 1, torch.where(full, 2, 0)).to(torch.int32)
        else:
            raise SystemExit(f"backward_ab.py: no made input for {tensor.name!r}")
    return made


def print_errors(outs, inputs, dout, when: str) -> None:
    """Each set's gradients against the control's (``outs[0]``), relative to their max."""
    ref = torch.autograd.grad(outs[0], inputs, dout, retain_graph=True)
    for i, o in enumerate(outs[1:], 1):
        got = torch.autograd.grad(o, inputs, dout, retain_graph=True)
        errs = [
            ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
            for a, b in zip(ref, got)
        ]
        shown = " / ".join(f"{e:.1e}" for e in errs)
        print(f"  set {i} {when}: dq/dk/dv max error {shown} of max")


def rotated_rounds(calls, flops: float, seconds: float, rounds: int) -> list[list[tuple]]:
    """Each of ``calls`` timed sustained (bwd_vs_fa4.sustained) in each of ``rounds``, the
    order rotated a place a round and reversed every other: per call, a (TF/s of ``flops``,
    SM MHz, mJ a call) per round."""
    read = clocks.nvml_reader()
    sampler = clocks.Sampler(read, interval=0.005) if read else None
    energy = energy_reader()
    results: list[list[tuple]] = [[] for _ in calls]
    for r in range(rounds):
        order = list(range(len(calls)))
        order = order[r % len(order) :] + order[: r % len(order)]
        order = order if r % 2 == 0 else order[::-1]
        for i in order:
            ms, readings, joules = sustained(calls[i], seconds, sampler, energy)
            s = clocks.summarize(readings)
            mhz = s.sm_mhz if s else float("nan")
            mj = 1000 * joules if joules else float("nan")
            results[i].append((flops / (ms * 1e-3) / 1e12, mhz, mj))
    return results


def print_rounds(results: list[list[tuple]], labels: list[str], notes: list[str] | None = None):
    """A line per call of rotated_rounds' results: the medians, the ratio to the first (the
    control), the rounds' TF/s, its note (if any) and its label."""
    ctrl = statistics.median(t for t, _, _ in results[0])
    for i, label in enumerate(labels):
        tf = statistics.median(t for t, _, _ in results[i])
        mhz = statistics.median(m for _, m, _ in results[i])
        mj = statistics.median(e for _, _, e in results[i])
        runs = " ".join(f"{t:.1f}" for t, _, _ in results[i])
        note = f"  {notes[i]}" if notes else ""
        print(
            f"  {tf:7.1f} TF/s {mhz:6.0f} MHz {mj:7.1f} mJ/call  x control {tf / ctrl:.3f}"
            f"{note}  ({runs})  {label}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("spec")
    p.add_argument("--sets", required=True)
    p.add_argument("--seqlens", default="1024,4096,16384")
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--against", nargs="*", default=[])
    args = p.parse_args()
    text = _spec_text(args.spec)
    base = fadsl.load(text, verbose=False)
    name, dtype = base.config.name, base.config.dtypes[0]
    sets = [dict(d.split("=") for d in s.split()) for s in args.sets.split(";")]
    kerns = []
    for i, defines in enumerate(sets):
        kern = fadsl.load(text.replace(f"kernel {name}", f"kernel ab{i}_{name}", 1), verbose=False)
        kern._backward_kernels().use_development_build(dtype, arch_of(0), defines)
        kerns.append(kern)
    for i, other in enumerate(args.against):  # other blocks as built for users
        other_text = _spec_text(other)
        other_name = fadsl.load(other_text, verbose=False).config.name
        renamed = other_text.replace(f"kernel {other_name}", f"kernel abx{i}_{other_name}", 1)
        kerns.append(fadsl.load(renamed, verbose=False))
    d, causal = base.config.head_dim, base.config.mask.value == "causal"
    heads = 2048 // d
    tdtype = torch_dtype_of(dtype)
    labels = [" ".join(f"{k}={v}" for k, v in s.items()) for s in sets] + list(args.against)
    for seqlen in map(int, args.seqlens.split(",")):
        batch = max(1, 16384 // seqlen)
        shape = (batch, seqlen, heads, d)
        torch.manual_seed(0)
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=tdtype, requires_grad=True) for _ in range(3)
        )
        dout = torch.randn(shape, device="cuda", dtype=tdtype)
        extra = modifier_inputs(base, batch, heads, seqlen)
        outs = [kern(q, k, v, **extra) for kern in kerns]
        print_errors(outs, (q, k, v), dout, "against the control")
        calls = [
            (lambda o=o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)) for o in outs
        ]
        flops = 2.5 * 4 * batch * heads * seqlen * seqlen * d * (0.5 if causal else 1.0)
        results = rotated_rounds(calls, flops, args.seconds, args.rounds)
        # again after the timed calls: a build whose state outlives a call (a development
        # build's counter) fails here, not at the first call
        print_errors(outs, (q, k, v), dout, "after the timed calls")
        print(f"== {name}, {batch} x {seqlen}")
        print_rounds(results, labels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
