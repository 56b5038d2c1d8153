"""`fadsl tune --backward`: the backward block's knobs searched for the fastest backward on
this GPU and workload.

The blocks tried are the target's (``Target.backward_tune_space``; sm_90a's:
fadsl/targets/sm90/backward/tune_space.py: the tile's B_r, the consumer's order, dQ's path,
the Q / dO ring's stages and, under the causal mask, the CTA order); `deterministic` stays as
the spec has it (it is a promise, not a speed). Each is written into the spec's backward block
(fadsl/frontend/rewrite.py's ``rewrite_backward``), the front end and the target's checks
refuse what cannot be built, and the rest are compiled in parallel with their backward
kernels (fadsl/tools/tune_build.py: a variant whose kernels spill is refused, as `fadsl
check` would). Then all are timed in one run per sequence length on the same tensors,
balanced orders, after each one's gradients were checked against cuDNN's (else FLASH's)
(fadsl/tools/bench_backward.py), beside PyTorch's backends and FlashAttention-4 where
installed. The winner is the best geometric mean of TF/s over the lengths; ``-o`` writes its
spec, with a header that says what was measured.

Without a GPU the variants are still enumerated and compiled (into the cubin cache), and then
``NoGPUError`` says that timing needs one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..atomic import write_atomic
from ..errors import SpecError
from ..frontend.rewrite import rewrite_backward
from .. import targets
from ..ir import Mask
from ..ir.backward import Backward
from ..pipeline import Compiled, compile_source
from ..targets.tuning import BackwardTuneSpace
from .tune import NoGPUError  # (raised after the variants compiled)
from .tune_build import OK, BuildJob, build_all


@dataclass(frozen=True)
class BackwardVariant:
    label: str  # the knobs it sets, e.g. "B_r 128, overlap, dQ red.add, stages 2"
    text: str  # its spec
    backward: Backward | None = None  # None: refused (``reason`` says why)
    reason: str = ""


@dataclass
class BackwardTuneResult:
    input_label: str
    variants: list[BackwardVariant]
    built: dict[str, str] = field(default_factory=dict)  # label -> verdict, for those refused
    timing: dict | None = None  # bench_backward.run's result, the labels as contenders
    scores: dict[str, float] = field(default_factory=dict)  # label -> geometric mean TF/s
    winner: str = ""

    def table(self) -> str:
        lines = [f"fadsl tune --backward: {len(self.variants)} variants of the backward block"]
        for v in self.variants:
            verdict = "refused: " + v.reason if v.backward is None else self.built.get(v.label, "")
            score = self.scores.get(v.label)
            figure = f"{score:7.1f} TF/s" if score is not None else " " * 12
            mark = " <- best" if v.label == self.winner else ""
            mark += " (the input)" if v.label == self.input_label else ""
            lines.append(f"  {figure}  {v.label}{mark}" + (f"  [{verdict}]" if verdict else ""))
        if self.timing is not None:
            from .bench_backward import table

            lines += ["", table(self.timing, first=self.winner)]
        return "\n".join(lines)


def _space(compiled: Compiled) -> BackwardTuneSpace:
    space = targets.target_of(compiled.kernel).backward_tune_space
    if space is None:
        raise ValueError(f"target {compiled.kernel.config.target} has no backward knobs to tune")
    return space


def backward_variants(source: str, file: str = "<spec>") -> tuple[Compiled, list[BackwardVariant]]:
    """The spec, compiled, and every backward block its target's tune space proposes
    (``Target.backward_tune_space``) written into it, each checked by the front end and the
    target (``backward`` None where refused); the input's own block first, no block twice.
    ValueError for a spec without a backward block."""
    compiled = compile_source(source, file)
    base = compiled.kernel.backward
    if base is None:
        raise ValueError(f"{file} has no backward block: `fadsl tune --backward` varies it")
    space = _space(compiled)
    name = compiled.kernel.config.name
    out = [BackwardVariant(space.label(base), source, base)]
    seen = {space.knobs(base)}
    causal = compiled.kernel.config.mask is Mask.CAUSAL
    for candidate in space.candidates(base, causal):
        text = rewrite_backward(source, dict(candidate.settings), dict(candidate.paths), name)
        try:
            bwd = compile_source(text, file).kernel.backward
        except SpecError as err:
            reason = err.diagnostics[0].message if err.diagnostics else str(err)
            out.append(BackwardVariant(candidate.label, text, None, reason.splitlines()[0]))
            continue
        if space.knobs(bwd) in seen:  # a block tried already (the input's, written again)
            continue
        seen.add(space.knobs(bwd))
        out.append(BackwardVariant(space.label(bwd), text, bwd))
    return compiled, out


def tune_backward(
    source: str,
    file: str,
    seqlens: tuple[int, ...],
    dtype: str | None = None,
    causal: bool | None = None,
    heads: int | None = None,
    hidden: int | None = None,
    tokens: int = 16384,
    jobs: int | None = None,
    output: str | os.PathLike | None = None,
    log: Callable[[str], None] = print,
) -> BackwardTuneResult:
    """Compile every admissible variant of the spec's backward block, time them all (a GPU
    needed) and pick the best; ``output``: where to write the winner's spec."""
    from ..runtime.attention import FlashAttention, arch_of

    compiled, variants = backward_variants(source, file)
    config = compiled.kernel.config
    spec_causal = config.mask.value == "causal"
    if causal is not None and causal != spec_causal:
        raise ValueError(f"--causal: the spec's mask is {config.mask_text}; it decides")
    dtype = dtype or config.dtypes[0].value
    if dtype not in {d.value for d in config.dtypes}:
        raise ValueError(f"{file} does not compile {dtype}")
    if hidden is not None:
        if hidden % config.head_dim:
            raise ValueError(f"--hidden {hidden} is not a multiple of head_dim {config.head_dim}")
        heads = hidden // config.head_dim
    result = BackwardTuneResult(variants[0].label, variants)
    gpu = _gpu()
    archs = (arch_of(0),) if gpu else tuple(a for a, _ in compiled.target.capabilities.archs)
    admitted = [v for v in variants if v.backward is not None]
    log(f"compiling {len(admitted)} variants (forward and backward kernels, {dtype})")
    by_name = {}
    build_jobs = []
    for n, v in enumerate(admitted):
        job_name = f"{config.name}_v{n}"
        by_name[job_name] = v
        build_jobs.append(BuildJob(job_name, v.text, (dtype,), archs, backward=True))
    ready: dict[str, Compiled] = {}
    for built in build_all(build_jobs, jobs or os.cpu_count() or 1):
        variant = by_name[built.name]
        result.built[variant.label] = built.verdict + (f": {built.reason}" if built.reason else "")
        if built.verdict == OK:
            result.built[variant.label] = ""
            ready[variant.label] = built.compiled
    if variants[0].label not in ready:
        raise RuntimeError(f"the spec's own backward does not build: {result.built}")
    if not gpu:
        raise NoGPUError(
            f"{len(ready)} variants compiled into the cubin cache; timing them needs a CUDA GPU"
        )
    from . import bench, bench_backward

    kernels = {label: FlashAttention(c, verbose=False) for label, c in ready.items()}
    named = {variants[0].label: kernels[variants[0].label]}
    named |= {label: k for label, k in kernels.items() if label != variants[0].label}
    result.timing = bench_backward.run(
        named[variants[0].label],
        seqlens=seqlens,
        causal=spec_causal,
        tokens=tokens,
        heads=heads or bench.DEFAULT_HEADS,
        dtype_name=dtype,
        named=named,
        log=log,
    )
    for label in named:
        figures = [row["tflops"][label] for row in result.timing["rows"]]
        result.scores[label] = math.exp(sum(map(math.log, figures)) / len(figures))
    result.winner = max(result.scores, key=result.scores.get)
    if output is not None:
        winner = next(v.text for v in variants if v.label == result.winner)
        write_atomic(Path(output), (header(result) + winner).encode())
    return result


def header(result: BackwardTuneResult) -> str:
    """The comment lines the written spec starts with: what was measured."""
    figures = ", ".join(
        f"{row['seqlen']}: {row['tflops'][result.winner]:.1f}" for row in result.timing["rows"]
    )
    return (
        f"# fadsl tune --backward: the fastest of {len(result.scores)} backward blocks timed "
        f"({result.winner}); its TF/s (2.5 x the forward's FLOPs / backward time) by seqlen "
        f"{figures};\n# geometric mean over the lengths {result.scores[result.winner]:.1f}, "
        f"the input's block ({result.input_label}) {result.scores[result.input_label]:.1f}.\n"
    )


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()
