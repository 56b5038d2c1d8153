"""`fadsl tune --backward`: the backward block's knobs searched for the fastest backward on
this GPU and workload.

The block's space is small: the tile's B_r (64, or 128 or 80 where the target admits it; at
80 dS's path becomes `rf -stmatrix-> smem`), the
consumer's order (`overlap`, `early_dv`), dQ's path (staged, or `rf -red.add-> gmem`) and
the Q / dO ring's `stages` (and, under the causal mask, the input's block with
`longest_first` flipped: the CTA order); `deterministic` stays as the spec has it (it is a promise, not a
speed). So every combination is tried: each written into the spec's backward block
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

import itertools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..atomic import write_atomic
from ..errors import SpecError
from ..frontend.rewrite import rewrite_backward
from ..ir import GradRole, Mask
from ..ir.backward import Backward
from ..pipeline import Compiled, compile_source
from .tune import NoGPUError  # (raised after the variants compiled)
from .tune_build import OK, BuildJob, build_all

# The knobs and the values each may take (the target's checks refuse what does not fit).
BLOCK_MS = (64, 128, 80)
# dS's path at each B_r (80: dQ^T reads dS with the queries as rows, stored transposed)
DS_PATHS = {80: "rf -stmatrix-> smem[cta] -wgmma-> rf"}
DS_STORED = "rf -st.shared-> smem[cta] -wgmma-> rf"
ORDERS = (("off", "off"), ("on", "off"), ("on", "on"))  # (overlap, early_dv)
STAGED, RED = "staged", "red.add"
DQ_PATHS = {STAGED: None, RED: "rf -red.add-> gmem"}  # None: the default (staged) path
STAGES = (2, 3)


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


def _label(
    block_m: int, overlap: bool, early_dv: bool, dq: str, stages: int, longest_first=False
) -> str:
    order = "early_dv" if early_dv else ("overlap" if overlap else "plain")
    first = ", longest first" if longest_first else ""
    return f"B_r {block_m}, {order}, dQ {dq}, stages {stages}{first}"


def label_of(bwd: Backward) -> str:
    """The knobs a backward block sets, as `fadsl tune --backward` names its variants."""
    dq = RED if bwd.dq_red else STAGED
    return _label(bwd.block_m, bwd.overlap, bwd.early_dv, dq, bwd.stages, bwd.longest_first)


def backward_variants(source: str, file: str = "<spec>") -> tuple[Compiled, list[BackwardVariant]]:
    """The spec, compiled, and every combination of the backward block's knobs written into
    it, each checked by the front end and the target (``backward`` None where refused); the
    input's own block first. ValueError for a spec without a backward block."""
    compiled = compile_source(source, file)
    base = compiled.kernel.backward
    if base is None:
        raise ValueError(f"{file} has no backward block: `fadsl tune --backward` varies it")
    name = compiled.kernel.config.name
    out = [BackwardVariant(label_of(base), source, base)]
    seen = {_knobs(base)}
    for block_m, (overlap, early_dv), dq, stages in itertools.product(
        BLOCK_MS, ORDERS, DQ_PATHS, STAGES
    ):
        settings = {
            "tile": f"B_r = {block_m}, B_c = {base.block_n}",
            "overlap": overlap,
            "early_dv": early_dv,
            "stages": str(stages),
        }
        paths = {GradRole.DQ.value: DQ_PATHS[dq]}
        if block_m in DS_PATHS or base.block_m in DS_PATHS:  # dS's path follows the tile
            paths[GradRole.DS.value] = DS_PATHS.get(block_m, DS_STORED)
        text = rewrite_backward(source, settings, paths, name)
        label = _label(block_m, overlap == "on", early_dv == "on", dq, stages)
        try:
            bwd = compile_source(text, file).kernel.backward
        except SpecError as err:
            reason = err.diagnostics[0].message if err.diagnostics else str(err)
            out.append(BackwardVariant(label, text, None, reason.splitlines()[0]))
            continue
        if _knobs(bwd) in seen:  # the input's own block, written again
            continue
        seen.add(_knobs(bwd))
        out.append(BackwardVariant(label_of(bwd), text, bwd))
    if compiled.kernel.config.mask is Mask.CAUSAL:  # the input's block in the other CTA order
        flipped = "off" if base.longest_first else "on"
        text = rewrite_backward(source, {"longest_first": flipped}, {}, name)
        bwd = compile_source(text, file).kernel.backward
        out.append(BackwardVariant(label_of(bwd), text, bwd))
    return compiled, out


def _knobs(bwd: Backward) -> tuple:
    return (bwd.block_m, bwd.overlap, bwd.early_dv, bwd.dq_red, bwd.stages, bwd.longest_first)


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
