"""`fadsl tune`'s timing step and its cache of measurements.

The timer is a parameter of the search (tests inject one): ``Timer.device()`` names the GPU
(None without one) and ``Timer.__call__(round)`` times one ``TimingRound`` (the input spec,
some candidates, one sequence length) and returns each contender's TFLOP/s, all from one
run, so their ratios to the input are fair. ``BenchTimer`` times as `fadsl bench` does
(fadsl/tools/bench.py: the same tensors for every contender, a correctness check first,
warm-up runs, the median of CUDA-event timings, the rounds in a balanced order): screening
rounds take fewer runs and two rounds of the design and leave the references out; the
final round is bench's full method with SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends
and FlashAttention-4 where flash_attn.cute imports.

Measurements are kept in ``<cache dir>/tune/measurements.json``, keyed by the GPU's name, the
variant's digest (its text under this fadsl version), the workload at one sequence length
and the method (screen or final), so a second run of the same tuning answers at once.
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from filelock import FileLock

from ..atomic import write_atomic
from ..build.cache import cache_dir
from ..pipeline import Compiled

SCREEN, FINAL = "screen", "final"
# The reference contenders of a final round, as bench names them, and as tables show them.
REFERENCES = {"flash": "SDPA flash", "cudnn": "cuDNN", "fa4": "FA4"}


@dataclass(frozen=True)
class Workload:
    """The problem every contender is timed on (bench's shape rules)."""

    dtype: str
    causal: bool
    head_dim: int
    heads: int
    seqlens: tuple[int, ...]
    tokens: int = 16384  # batch = tokens / seqlen, unless ``batch`` is set
    batch: int | None = None

    def batch_at(self, seqlen: int) -> int:
        return self.batch if self.batch is not None else max(1, self.tokens // seqlen)

    def key(self, seqlen: int) -> str:
        mask = "causal" if self.causal else "none"
        return (
            f"{self.dtype} mask {mask} d{self.head_dim} h{self.heads} "
            f"b{self.batch_at(seqlen)} s{seqlen}"
        )

    def text(self) -> str:
        shape = (
            f"batch {self.batch}"
            if self.batch is not None
            else f"batch = {self.tokens} tokens / seqlen"
        )
        return (
            f"{self.dtype}, mask {'causal' if self.causal else 'none'}, head_dim {self.head_dim}, "
            f"{self.heads} heads, {shape}, seqlens {', '.join(map(str, self.seqlens))}"
        )


@dataclass(frozen=True)
class Device:
    name: str  # e.g. "NVIDIA H100 80GB HBM3": part of every cache key
    capability: tuple[int, int]


@dataclass(frozen=True)
class Contender:
    name: str  # the kernel's name (unique among the variants)
    compiled: Compiled | None  # None only for a timer that needs no kernel (tests)
    knobs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TimingRound:
    baseline: Contender  # the input spec: every ratio is to it, from the same run
    contenders: tuple[Contender, ...]
    workload: Workload
    seqlen: int
    final: bool  # bench's full method, with the references


class Timer(Protocol):
    def device(self) -> Device | None: ...

    def __call__(self, round: TimingRound) -> dict[str, float]: ...


class BenchTimer:
    """Times with fadsl.tools.bench.run on GPU 0."""

    def __init__(
        self,
        warmup: int = 32,
        runs: int = 128,
        screen_warmup: int = 8,
        screen_runs: int = 32,
        screen_rounds: int = 2,
        log: Callable[[str], None] = lambda text: None,
    ) -> None:
        self.warmup, self.runs = warmup, runs
        self.screen = (screen_warmup, screen_runs, screen_rounds)
        self.log = log
        self._kernels: dict[str, Any] = {}

    def device(self) -> Device | None:
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available():
            return None
        return Device(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))

    def _kernel(self, contender: Contender):
        from ..runtime.attention import FlashAttention

        if contender.name not in self._kernels:
            self._kernels[contender.name] = FlashAttention(contender.compiled, verbose=False)
        return self._kernels[contender.name]

    def __call__(self, round: TimingRound) -> dict[str, float]:
        try:
            return self._run(round, round.contenders)
        except Exception as err:  # one bad kernel (a launch failure) must not sink the round
            if len(round.contenders) <= 1:
                raise
            self.log(f"timing together failed ({str(err).splitlines()[0]}); one at a time")
        # Each candidate with the input alone; its TF/s scaled so that its ratio to the
        # input is the one its own run measured.
        merged: dict[str, float] = {}
        for contender in round.contenders:
            try:
                got = self._run(round, (contender,))
            except Exception as err:
                self.log(f"{contender.name}: {str(err).splitlines()[0]}; not timed")
                continue
            base = got.pop(round.baseline.name)
            merged.setdefault(round.baseline.name, base)
            scale = merged[round.baseline.name] / base
            merged.update({name: tflops * scale for name, tflops in got.items()})
        return merged

    def _bench_log(self, text: str) -> None:
        """bench's news that matters here (a backend or FA4 unavailable), not its progress
        lines or its note on screening's two rounds (by design not a whole balanced design)."""
        if text.startswith("fadsl bench: seqlen") or "not whole designs" in text:
            return
        self.log(text.removeprefix("fadsl bench: "))

    def _run(self, round: TimingRound, contenders) -> dict[str, float]:
        from . import bench

        workload = round.workload
        warmup, runs, rounds = (self.warmup, self.runs, None) if round.final else self.screen
        names = {"fadsl": round.baseline.name}
        names.update({f"fadsl:{c.name}": c.name for c in contenders})
        result = bench.run(
            self._kernel(round.baseline),
            seqlens=(round.seqlen,),
            dtype_name=workload.dtype,
            causal=workload.causal,
            tokens=workload.batch_at(round.seqlen) * round.seqlen,
            heads=workload.heads,
            warmup=warmup,
            runs=runs,
            log=self._bench_log,
            against=tuple(self._kernel(c) for c in contenders),
            rounds=rounds,
            references=round.final,
            on_wrong=lambda name, message: self.log(f"{message}; dropped"),
        )
        tflops = result["rows"][0]["tflops"]
        return {names.get(name, name): value for name, value in tflops.items()}


class MeasurementCache:
    """TF/s by key in a JSON file, each with the input spec's TF/s of the same run (the ratios
    are taken within one run), merged under a file lock on every write."""

    VERSION = 1

    def __init__(self, path: Path | None) -> None:
        self.path = path
        data = self._read() if path is not None else {}
        self.entries: dict[str, dict] = data.get("measurements", {})
        # variants refused at their compile (rejected, spills, failed), so a rerun skips them
        self.verdicts: dict[str, dict] = data.get("verdicts", {})

    @staticmethod
    def default_path() -> Path:
        return cache_dir() / "tune" / "measurements.json"

    @staticmethod
    def key(device: str, digest: str, workload: Workload, seqlen: int, method: str) -> str:
        return f"{device} | {digest} | {workload.key(seqlen)} | {method}"

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and data.get("version") == self.VERSION else {}

    def get(self, key: str) -> tuple[float, float] | None:
        """(the contender's TF/s, the input's TF/s in the same run), or None."""
        entry = self.entries.get(key)
        if not isinstance(entry, dict):
            return None
        pair = entry.get("tflops"), entry.get("input_tflops")
        if all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in pair):
            return float(pair[0]), float(pair[1])
        return None

    def put(self, values: dict[str, tuple[float, float]]) -> None:
        """Keep ``values`` (key -> (TF/s, the input's TF/s in that run)), in memory and in
        the file."""
        date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        fresh = {
            key: {"tflops": tflops, "input_tflops": base, "date": date}
            for key, (tflops, base) in values.items()
        }
        self.entries.update(fresh)
        self._save("measurements", fresh)

    def verdict(self, key: str) -> tuple[str, str] | None:
        """(verdict, reason) of a variant refused at its compile, or None."""
        entry = self.verdicts.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("verdict"), str):
            return entry["verdict"], str(entry.get("reason", ""))
        return None

    def put_verdict(self, key: str, verdict: str, reason: str) -> None:
        fresh = {key: {"verdict": verdict, "reason": reason}}
        self.verdicts.update(fresh)
        self._save("verdicts", fresh)

    def _save(self, section: str, fresh: dict[str, dict]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path) + ".lock"):  # another tune may have written meanwhile
            data = self._read()
            payload = {
                "version": self.VERSION,
                "measurements": data.get("measurements", {}),
                "verdicts": data.get("verdicts", {}),
            }
            payload[section].update(fresh)
            write_atomic(self.path, json.dumps(payload, indent=1, sort_keys=True) + "\n")


def geomean(values) -> float:
    values = [v for v in values if v and v > 0]
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))
