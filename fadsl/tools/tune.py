"""`fadsl tune`: search a spec's knobs for the fastest variant on this GPU and workload.

The search is best-first over the target's knobs (``Target.tune_space``): the input spec is
the first centre (other specs' knobs applied to the input, fadsl/tools/tune_starts.py, are
screened with its first round, so the search can go on from whichever start is best); each
round takes the centre's neighbours (fadsl/tools/variants.py: one knob moved, failed moves
repaired, the front end and the register model pruning what cannot work), compiles them in
parallel (fadsl/tools/tune_build.py: every pass, then NVRTC; spills refused) and times them
against the input in one run per sequence length (fadsl/tools/tune_measure.py: bench's
method, fewer runs). The next centre is the best measured variant not yet expanded, while
it is within ``EXPAND_WITHIN`` of the best; the search ends there, after ``PATIENCE`` rounds
without a better variant, at ``max_rounds`` or when the budget is spent. Then the best
``FINAL_TOP`` are built for every dtype and architecture of the spec (the winner must pass
`fadsl check`) and timed once more with bench's full method, beside the input and the
references (SDPA's FLASH_ATTENTION and CUDNN_ATTENTION, FlashAttention-4 where installed).

Without a GPU the first round is still enumerated and compiled (the cubins land in the
cache), and then ``NoGPUError`` says that timing needs one.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence, TextIO

from .. import targets
from ..atomic import write_atomic
from ..build.nvrtc import compiler_id
from ..errors import BuildError
from ..ir import Mask
from ..pipeline import Compiled, read_spec
from ..targets.archs import arch_for
from . import bench
from .tune_build import OK, REJECTED, SPILLS, BuildJob, Builder, build_all
from .tune_measure import (
    FINAL,
    REFERENCES,
    SCREEN,
    BenchTimer,
    MeasurementCache,
    Timer,
    TimingRound,
    Workload,
)
from .tune_report import Candidate, TuneResult, spec_with_header
from .tune_starts import shipped_starts, start_points
from .variants import Base, Variant, neighbours, values_key

DEFAULT_SEQLENS = (2048, 4096, 8192, 16384)
# A measured variant is expanded (its neighbours tried) while its score is within this of the
# best: screening runs are short, and a near-tie may lead somewhere the best does not ...
EXPAND_WITHIN = 0.01
# ... for at most PATIENCE rounds in a row that find nothing better than the best by MIN_GAIN
# (a plateau of near-ties, knobs that do not matter here, would otherwise be walked whole).
PATIENCE, MIN_GAIN = 3, 0.005
FINAL_TOP = 3  # the best variants timed again with the references
# Of a budget, the share (at most so many seconds) kept for the final round.
FINAL_SHARE, FINAL_MAX_SECONDS = 0.2, 90.0
NOT_COMPILED, NOT_TIMED = "not compiled (budget)", "not timed (budget)"
# Build verdicts a rerun may trust; a failure (a worker killed, a fadsl bug) is tried again.
CACHED_VERDICTS = (OK, REJECTED, SPILLS)


class NoGPUError(RuntimeError):
    """Timing needs a CUDA GPU and none is visible (raised after the CPU part)."""


class Progress:
    """One status line on a terminal (rewritten in place), plain lines elsewhere."""

    def __init__(self, stream: TextIO | None, clock: Callable[[], float], budget: float | None):
        self.stream, self.clock, self.budget = stream, clock, budget
        self.start = clock()
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self._open = False  # a status line waits to be finished
        self._last_quarter = -1

    def _elapsed(self) -> str:
        spent = self.clock() - self.start
        text = f"{int(spent // 60)}:{int(spent % 60):02d}"
        if self.budget is not None:
            text += f" of {int(self.budget // 60)}:{int(self.budget % 60):02d}"
        return text

    def note(self, text: str) -> None:
        if self.stream is None:
            return
        if self._open:
            self.stream.write("\n")
            self._open = False
        self.stream.write(f"fadsl tune: {text}\n")
        self.stream.flush()

    def bar(self, label: str, done: int, total: int) -> None:
        if self.stream is None or total <= 0:
            return
        width = 24
        filled = width * done // total
        drawn = "#" * filled + "." * (width - filled)
        line = f"fadsl tune: {label} [{drawn}] {done}/{total}  {self._elapsed()}"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done == total else ""))
            self._open = done != total
        else:  # a log: the start, each quarter, the end
            quarter = 4 * done // total
            if done in (0, total) or quarter != self._last_quarter:
                self.stream.write(line + "\n")
            self._last_quarter = quarter
        self.stream.flush()


def _workload(
    compiled: Compiled,
    seqlens: Sequence[int],
    dtype: str | None,
    causal: bool | None,
    heads: int | None,
    hidden: int | None,
    tokens: int,
    batch: int | None,
) -> Workload:
    """The workload, or ValueError naming the argument that does not fit the spec."""
    cfg = compiled.kernel.config
    spec_causal = cfg.mask is Mask.CAUSAL
    if causal is not None and causal != spec_causal:
        raise ValueError(
            f"--causal: spec '{cfg.name}' has mask {cfg.mask.value}; the tuner keeps the "
            "spec's mask (it is the problem, not a knob)"
            if causal
            else f"spec '{cfg.name}' is causal: the tuner times causal attention"
        )
    compiles = [d.value for d in cfg.dtypes]
    dtype = dtype or compiles[0]
    if dtype not in compiles:
        raise ValueError(f"--dtype {dtype}: the spec compiles {', '.join(compiles)}")
    if heads is not None and hidden is not None:
        raise ValueError("give --heads or --hidden, not both")
    if hidden is not None:
        if hidden <= 0 or hidden % cfg.head_dim:
            raise ValueError(
                f"--hidden {hidden} is not a positive multiple of the spec's head_dim {cfg.head_dim}"
            )
        heads = hidden // cfg.head_dim
    heads = bench.DEFAULT_HEADS if heads is None else heads
    if not seqlens or any(s <= 0 for s in seqlens) or heads <= 0 or tokens <= 0:
        raise ValueError("sequence lengths, heads and tokens must be positive")
    if batch is not None and batch <= 0:
        raise ValueError(f"--batch must be positive, got {batch}")
    return Workload(dtype, spec_causal, cfg.head_dim, heads, tuple(seqlens), tokens, batch)


def _base(spec: str | os.PathLike, file: str | None, knobs: Sequence[str] | None) -> Base:
    """The input spec compiled, with the target's knobs (only ``knobs`` if given)."""
    text, file = _source(spec, file)
    base = Base.of(text, file)
    if not knobs:
        return base
    try:
        return replace(base, space=base.space.restricted(tuple(knobs)))
    except KeyError as err:
        names = ", ".join(k.name for k in base.space.knobs)
        raise ValueError(f"--knobs: no knob {err.args[0]} here; this target has {names}") from None


def _source(spec: str | os.PathLike, file: str | None) -> tuple[str, str]:
    """(text, file name) of a spec given as a path or as its text (fadsl.load's rule)."""
    if isinstance(spec, os.PathLike) or ("\n" not in spec and "{" not in spec):
        return read_spec(Path(spec)), file or str(spec)
    return spec, file or "<spec>"


def tune(
    spec: str | os.PathLike,
    *,
    starts: Sequence[str | os.PathLike | tuple[str, str]] = (),
    shipped: bool = True,
    seqlens: Sequence[int] = DEFAULT_SEQLENS,
    dtype: str | None = None,
    causal: bool | None = None,
    heads: int | None = None,
    hidden: int | None = None,
    tokens: int = 16384,
    batch: int | None = None,
    budget: float | None = None,
    jobs: int | None = None,
    output: str | os.PathLike | None = None,
    knobs: Sequence[str] | None = None,
    fresh: bool = False,
    max_rounds: int | None = None,
    progress: bool | TextIO = True,
    file: str | None = None,
    timer: Timer | None = None,
    build: Builder | None = None,
    cache: os.PathLike | bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> TuneResult:
    """Search the knobs of ``spec`` (a path or the text) for the fastest variant on GPU 0.

    The workload is bench's (``seqlens``; batch = ``tokens`` / seqlen unless ``batch``;
    ``heads``, or ``hidden`` / head_dim; the spec's mask and first dtype by default).
    ``starts``: other specs (paths, texts, or (text, file name) pairs) of the same target,
    head_dim, mask, window and dtype width, whose knobs applied to the input are screened in
    the first round beside the input's neighbours (several starting points: a search that
    would climb from the input alone may stop on a hill the start is past). ``shipped``: the
    target's shipped specs for the input's head_dim and mask are starts too, where they fit
    (fadsl/tools/tune_starts.py).
    ``budget``: minutes, after which no new variant is compiled or timed (the final round,
    kept a share of it, still runs). ``jobs``: compile processes (default: the CPUs).
    ``output``: write the winner's spec there. ``knobs``: only these (e.g. ["B_c",
    "stages"]). ``fresh``: ignore cached measurements. ``timer``/``build``/``clock``: the
    timing, the compile job and the clock (tests inject them); ``cache``: the measurements
    file (True: under the fadsl cache dir; False: none). Raises SpecError for a bad spec,
    ValueError for an argument that does not fit it, NoGPUError without a GPU (after
    compiling the first round).
    """
    base = _base(spec, file, knobs)
    compiled_input = base.compiled
    start_variants = start_points(
        base, [s if isinstance(s, tuple) else _source(s, None) for s in starts]
    )
    if shipped:
        start_variants += shipped_starts(base)
    workload = _workload(compiled_input, seqlens, dtype, causal, heads, hidden, tokens, batch)
    stream = sys.stderr if progress is True else (progress or None)
    budget_s = None if budget is None else max(0.0, budget * 60.0)
    bar = Progress(stream, clock, budget_s)
    search = _Search(
        base=base,
        compiled_input=compiled_input,
        workload=workload,
        timer=timer or BenchTimer(log=bar.note),
        build=build,
        jobs=jobs or os.cpu_count() or 1,
        cache=_cache(cache),
        fresh=fresh,
        clock=clock,
        budget=budget_s,
        progress=bar,
        starts=start_variants,
    )
    result = search.run(max_rounds)
    if output is not None:
        write_atomic(Path(output), result.spec_text)
        search.progress.note(f"wrote {output}")
    return result


def list_variants(spec: str | os.PathLike, file: str | None = None, knobs=None) -> str:
    """The first round's variants of ``spec`` and the moves the checks refused (no compile,
    no GPU): what `fadsl tune --list` prints."""
    base = _base(spec, file, knobs)
    found = neighbours(base, base.values, {values_key(base.values)})
    width = max([len(v.name) for v in found.variants] + [10]) + 2
    lines = [f"{base.config.name} ({file}): the first round's {len(found.variants)} variants"]
    lines += [f"  {v.name:<{width}}{v.describe()}" for v in found.variants]
    lines.append(
        f"{sum(found.pruned.values())} moves refused before compiling "
        f"({found.repaired} repaired by moving another knob):"
    )
    lines += [f"  {move}: {why}" for move, why in found.refusals]
    lines.append(
        "knobs: " + "; ".join(f"{k.name} {', '.join(map(str, k.values))}" for k in base.space.knobs)
    )
    return "\n".join(lines)


def _cache(cache: os.PathLike | bool) -> MeasurementCache:
    if cache is True:
        return MeasurementCache(MeasurementCache.default_path())
    if cache is False:
        return MeasurementCache(None)
    return MeasurementCache(Path(cache))


class _Search:
    """The state of one tuning: the candidates met, the budget, the cache."""

    def __init__(
        self,
        base: Base,
        compiled_input: Compiled,
        workload: Workload,
        timer: Timer,
        build: Builder | None,
        jobs: int,
        cache: MeasurementCache,
        fresh: bool,
        clock: Callable[[], float],
        budget: float | None,
        progress: Progress,
        starts: Sequence[Variant] = (),
    ) -> None:
        self.base, self.workload, self.timer = base, workload, timer
        self.starts = tuple(starts)
        self.build, self.jobs, self.cache, self.fresh = build, jobs, cache, fresh
        self.clock, self.progress = clock, progress
        self.start = clock()
        reserve = 0.0 if budget is None else min(FINAL_SHARE * budget, FINAL_MAX_SECONDS)
        self.deadline = None if budget is None else self.start + budget - reserve
        self.budget_spent = False
        self.target = targets.target_of(compiled_input.kernel)
        self.input = Candidate(base.variant(base.values), OK, compiled=compiled_input)
        self.candidates: list[Candidate] = [self.input]
        self.pruned: Counter = Counter()
        self.repaired = 0
        self.rounds = 0
        self.best_score, self.stale = 1.0, 0  # the input's score, rounds without a better one
        self.device = timer.device()
        self.all_archs = tuple(arch for arch, _ in self.target.capabilities.archs)
        try:
            self.compiler = compiler_id()
        except BuildError:  # none here: every build will say so
            self.compiler = "no compiler"
        if self.device is None:  # the cubins for every GPU the target runs on
            self.archs = self.all_archs
        elif not self.target.capabilities.runs_on(self.device.capability):
            raise ValueError(
                f"the spec's target {self.target.name} does not run on {self.device.name}"
            )
        else:
            self.archs = (arch_for(self.device.capability),)

    def over_budget(self) -> bool:
        return self.deadline is not None and self.clock() > self.deadline

    # ----------------------------------------------------------------- the search
    def run(self, max_rounds: int | None) -> TuneResult:
        seen = {values_key(self.base.values)}
        centre: Candidate | None = self.input
        if self.device is None:
            self.progress.note(
                "no CUDA GPU is visible: enumerating and compiling the first round's "
                "variants (into the cubin cache), then stopping before the timing"
            )
        while centre is not None:
            if max_rounds is not None and self.rounds >= max_rounds:
                break
            if self.over_budget():
                self.budget_spent = True
                break
            self.rounds += 1
            centre.expanded = True
            found = neighbours(self.base, centre.variant.knobs, seen)
            self.pruned += found.pruned
            self.repaired += found.repaired
            starts = [Candidate(v) for v in self._unseen_starts(seen)] if self.rounds == 1 else []
            fresh = starts + [Candidate(v) for v in found.variants]
            self.candidates += fresh
            said = f", and {len(starts)} start(s): {', '.join(c.name for c in starts)}"
            self.progress.note(
                f"round {self.rounds}: {len(found.variants)} variants of {centre.name} "
                f"({sum(found.pruned.values())} moves pruned, {found.repaired} repaired)"
                + (said if starts else "")
            )
            if self.device is None:
                self._compile(fresh, (self.workload.dtype,), self.archs)
                raise NoGPUError(self._no_gpu_message(fresh))
            self._screen(fresh)
            centre = self._next_centre()
        return self._finish()

    def _unseen_starts(self, seen: set) -> list[Variant]:
        """The starts not met yet (one may be a neighbour of the input), now seen."""
        unseen = []
        for variant in self.starts:
            if variant.values not in seen:
                seen.add(variant.values)
                unseen.append(variant)
        return unseen

    def _improved(self) -> bool:
        """Whether the last round found a variant better than the best before it."""
        seqlens = self.workload.seqlens
        best = max(c.score(seqlens) or 0.0 for c in self.candidates)
        improved = best > self.best_score * (1 + MIN_GAIN)
        self.best_score = max(self.best_score, best)
        return improved

    def _next_centre(self) -> Candidate | None:
        """The best measured candidate not yet expanded, if it is within EXPAND_WITHIN of
        the best and the search has found a better variant in the last PATIENCE rounds."""
        self.stale = 0 if self._improved() else self.stale + 1
        if self.stale >= PATIENCE:
            return None
        seqlens = self.workload.seqlens
        scored = [(c.score(seqlens), c) for c in self.candidates]
        scored = [(score, c) for score, c in scored if score is not None]
        best = max(score for score, _ in scored)
        waiting = [
            (score, c)
            for score, c in scored
            if not c.expanded and score >= best * (1 - EXPAND_WITHIN)
        ]
        return max(waiting, key=lambda pair: pair[0])[1] if waiting else None

    # ----------------------------------------------------------------- compiling
    def _verdict_key(self, candidate: Candidate, dtypes, archs) -> str:
        """A build's verdict holds for this variant, dtypes and archs under this compiler (a
        newer ptxas may spill less)."""
        return (
            f"{self.compiler} | {candidate.variant.digest} | {','.join(dtypes)} | "
            f"{','.join(archs)}"
        )

    def _compile(self, todo: list[Candidate], dtypes, archs, need_kernel: bool = True) -> None:
        """Build ``todo`` for ``dtypes`` on ``archs``, setting each one's status (and its
        Compiled, for timing). A verdict in the cache stands for the build: a refusal always,
        a success where the kernel itself is not needed (``need_kernel``). Candidates the
        budget leaves unbuilt are NOT_COMPILED."""
        jobs = []
        for c in todo:
            cached = None if self.fresh else self.cache.verdict(self._verdict_key(c, dtypes, archs))
            if cached is not None and (cached[0] != OK or not need_kernel):
                c.status, c.reason = cached
            else:
                c.status = "pending"
                jobs.append(BuildJob(c.name, c.variant.text, tuple(dtypes), tuple(archs)))
        by_name = {c.name: c for c in todo}
        self.progress.bar("compiling", 0, len(jobs))
        for done, built in enumerate(build_all(jobs, self.jobs, self.over_budget, self.build), 1):
            candidate = by_name[built.name]
            candidate.status, candidate.reason = built.verdict, built.reason
            if built.verdict == OK:
                candidate.compiled = candidate.compiled or built.compiled
            if built.verdict in CACHED_VERDICTS:
                key = self._verdict_key(candidate, dtypes, archs)
                self.cache.put_verdict(key, built.verdict, built.reason)
            self.progress.bar("compiling", done, len(jobs))
        for job in jobs:
            if by_name[job.name].status == "pending":
                by_name[job.name].status = NOT_COMPILED
                self.budget_spent = True

    # ----------------------------------------------------------------- timing
    def _key(self, name: str, seqlen: int, method: str) -> str:
        return MeasurementCache.key(self.device.name, name, self.workload, seqlen, method)

    def _cached(self, candidates: list[Candidate], method: str) -> None:
        if self.fresh:
            return
        for c in candidates:
            records = c.screen if method == SCREEN else c.final
            for seqlen in self.workload.seqlens:
                got = self.cache.get(self._key(c.variant.digest, seqlen, method))
                if got is not None:
                    records[seqlen] = got

    def _time(self, contenders: list[Candidate], seqlen: int, final: bool) -> dict[str, float]:
        if self.input.compiled is None:
            raise AssertionError("the input is compiled before anything is timed")
        round_ = TimingRound(
            self.input.contender(),
            tuple(c.contender() for c in contenders),
            self.workload,
            seqlen,
            final,
        )
        times = self.timer(round_)
        if self.input.name not in times:
            raise RuntimeError(f"the timer did not time the input spec at seqlen {seqlen}")
        return times

    def _screen(self, fresh: list[Candidate]) -> None:
        """Time the new candidates against the input, each seqlen in one run, the cache's
        records first."""
        seqlens = self.workload.seqlens
        self._cached(fresh, SCREEN)
        if not self.input.screen:  # its ratio to itself: 1
            self.input.screen.update({s: (1.0, 1.0) for s in seqlens})
        for c in fresh:
            if c.score(seqlens) is not None:
                c.status = OK  # measured before: no need to build it
        self._compile(
            [c for c in fresh if c.score(seqlens) is None], (self.workload.dtype,), self.archs
        )
        need = [c for c in fresh if c.status == OK and c.score(seqlens) is None]
        label = f"timing {len(need)} variants"
        for i, seqlen in enumerate(seqlens):
            if not need:
                break
            self.progress.bar(label, i, len(seqlens))
            if self.over_budget():
                self.budget_spent = True
                break
            missing = [c for c in need if seqlen not in c.screen]
            times = self._time(missing, seqlen, final=False)
            base = times[self.input.name]
            self.input.screen[seqlen] = (base, base)
            records = {}
            for c in missing:
                if c.name in times:
                    c.screen[seqlen] = (times[c.name], base)
                    records[self._key(c.variant.digest, seqlen, SCREEN)] = c.screen[seqlen]
            self.cache.put(records)
        else:
            self.progress.bar(label, len(seqlens), len(seqlens))
        for c in need:
            if c.score(seqlens) is None:
                c.status = NOT_TIMED if self.budget_spent else "not measured (wrong output)"

    # ----------------------------------------------------------------- the final round
    def _finish(self) -> TuneResult:
        seqlens = self.workload.seqlens
        measured = [c for c in self.candidates[1:] if c.score(seqlens) is not None]
        measured.sort(key=lambda c: -c.score(seqlens))
        top = measured[:FINAL_TOP]
        self.deadline = None  # the final round runs on the budget's reserve
        # Written as a spec, the winner must pass `fadsl check`: every dtype and every
        # architecture the target builds for, unspilled.
        dtypes = tuple(d.value for d in self.input.compiled.kernel.config.dtypes)
        if dtypes != (self.workload.dtype,) or self.all_archs != self.archs:
            checks = [Candidate(c.variant) for c in top]
            self._compile(checks, dtypes, self.all_archs, need_kernel=False)
            for c, check in zip(top, checks):
                if check.status != OK:
                    c.status, c.reason = check.status, f"in the full check: {check.reason}"
            top = [c for c in top if c.status == OK]
        references = self._final_round(top)
        finalists = [c for c in [self.input] + top if c.score(seqlens, FINAL) is not None]
        winner = max(finalists, key=lambda c: c.score(seqlens, FINAL), default=self.input)
        result = TuneResult(
            device=self.device.name,
            workload=self.workload,
            input=self.input,
            winner=winner,
            candidates=self.candidates,
            references=references,
            rounds=self.rounds,
            pruned=self.pruned,
            repaired=self.repaired,
            budget_spent=self.budget_spent,
            seconds=self.clock() - self.start,
            spec_text="",
        )
        result.spec_text = spec_with_header(result, self.base.file)
        return result

    def _final_round(self, top: list[Candidate]) -> dict[str, dict[int, tuple[float, float]]]:
        """Time the input, ``top`` and the references together, bench's full method, at each
        seqlen the cache lacks for any of them; the references' records."""
        seqlens = self.workload.seqlens
        everyone = [self.input] + top
        self._cached(everyone, FINAL)
        references: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in REFERENCES}
        for name in REFERENCES:
            for seqlen in seqlens:
                got = (
                    None if self.fresh else self.cache.get(self._key(f"ref:{name}", seqlen, FINAL))
                )
                if got is not None:
                    references[name][seqlen] = got
        todo = [s for s in seqlens if any(s not in c.final for c in everyone)]
        if todo:  # top candidates measured before (the cache) are built now
            self._compile(
                [c for c in top if c.compiled is None], (self.workload.dtype,), self.archs
            )
        timed = [c for c in top if c.status == OK]
        label = f"final round: {len(timed) + 1} specs and the references"
        for i, seqlen in enumerate(todo):
            self.progress.bar(label, i, len(todo))
            times = self._time(timed, seqlen, final=True)
            base = times[self.input.name]
            records = {}
            for c in everyone:
                if c.name in times:
                    c.final[seqlen] = (times[c.name], base)
                    records[self._key(c.variant.digest, seqlen, FINAL)] = c.final[seqlen]
            for name in REFERENCES:
                if name in times:
                    references[name][seqlen] = (times[name], base)
                    records[self._key(f"ref:{name}", seqlen, FINAL)] = references[name][seqlen]
            self.cache.put(records)
        self.progress.bar(label, len(todo), len(todo))
        return {name: records for name, records in references.items() if records}

    def _no_gpu_message(self, fresh: list[Candidate]) -> str:
        counts = Counter(c.status for c in fresh)
        return (
            "timing needs a CUDA GPU, and none is visible (torch.cuda.is_available() is "
            f"False). The CPU part ran: {len(fresh)} variants of {self.input.name} passed the "
            f"checks ({sum(self.pruned.values())} moves pruned); {counts.get(OK, 0)} compiled "
            f"into the cubin cache, {counts.get('spills', 0)} spill, "
            f"{counts.get('rejected', 0)} refused by the passes, {counts.get('failed', 0)} "
            "failed. Run fadsl tune where the GPU is."
        )
