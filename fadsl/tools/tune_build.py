"""`fadsl tune`'s compile step: each candidate through every pass, then NVRTC, in a process pool.

A job compiles one variant's spec (``fadsl.pipeline.compile_source``: a SpecError from a
pass, plan_smem's O placement or the SMEM limit, refuses it) and builds its cubins exactly as
the runtime will load them (``FlashAttention.cubin``: the same cache entries, so timing
finds them built), for the dtypes and architectures asked, the cluster-free variant of a
`cluster 2` spec included. A cubin that spills or has a stack frame (ptxas's report, kept
with the cache entry) refuses the variant: `fadsl check` would.

Jobs run in worker processes (the front end and the passes are Python, NVRTC holds a core),
as many as ``jobs``; ``jobs = 1`` runs them here, one after another. When ``stop()`` says so
(the budget is spent) the workers are killed: jobs under way are lost, the cubin cache's
entries are written whole or not at all (fadsl/build/cache.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from ..errors import BuildError, SpecError
from ..pipeline import Compiled, compile_source

if TYPE_CHECKING:
    from ..build.nvrtc import Usage

OK, REJECTED, SPILLS, FAILED = "ok", "rejected", "spills", "failed"


@dataclass(frozen=True)
class BuildJob:
    name: str  # the variant's kernel name
    text: str  # its spec
    dtypes: tuple[str, ...]
    archs: tuple[str, ...]
    backward: bool = False  # the backward's kernels built (and checked for spills) too


@dataclass(frozen=True)
class Built:
    """What a job found: ``verdict`` OK (``compiled`` set), REJECTED (a pass refused the
    spec), SPILLS or FAILED (the compiler refused the source; a fadsl bug)."""

    name: str
    verdict: str
    reason: str = ""
    compiled: Compiled | None = None
    registers: int = 0  # ptxas's count, the largest over the cubins
    seconds: float = 0.0


Builder = Callable[[BuildJob], Built]


def build_variant(job: BuildJob) -> Built:
    """Compile one variant through every pass and build its cubins (in a worker)."""
    from ..ir import Dtype
    from ..runtime.attention import FlashAttention

    start = time.monotonic()
    try:
        compiled = compile_source(job.text, f"{job.name}.fa")
    except SpecError as err:
        reason = err.diagnostics[0].message if err.diagnostics else str(err)
        return Built(job.name, REJECTED, reason, seconds=time.monotonic() - start)
    kern = FlashAttention(compiled, verbose=False)
    registers, spilling = 0, []
    try:
        for each in kern.variants:  # `cluster 2`: the cluster-free kernel too
            for dtype in job.dtypes:
                for arch in job.archs:
                    entry = each.cubin(Dtype(dtype), arch)
                    usage = _usage(entry)
                    registers = max(registers, usage.registers)
                    if usage.short_of_registers:
                        spilling.append(
                            f"{each.config.name} {dtype} on {arch}: {usage.registers} registers, "
                            f"{usage.shortfall()}"
                        )
        if job.backward:  # `fadsl tune --backward`: its kernels, refused alike if they spill
            for dtype in job.dtypes:
                for arch in job.archs:
                    entry = kern._backward_kernels().cubin(Dtype(dtype), arch)
                    usage = _usage(entry)
                    if usage.short_of_registers:
                        spilling.append(
                            f"the backward {dtype} on {arch}: {usage.registers} registers, "
                            f"{usage.shortfall()}"
                        )
    except BuildError as err:
        reason = str(err).splitlines()[0]
        return Built(job.name, FAILED, reason, seconds=time.monotonic() - start)
    seconds = time.monotonic() - start
    if spilling:
        return Built(job.name, SPILLS, "; ".join(spilling), registers=registers, seconds=seconds)
    return Built(job.name, OK, compiled=compiled, registers=registers, seconds=seconds)


def _usage(entry) -> Usage:
    """ptxas's report on a cached cubin, read from its log (the metadata of an entry written
    before a field was added lacks it), else from the metadata."""
    from ..build.nvrtc import Usage, parse_resource_usage

    if entry.log:
        return parse_resource_usage(entry.log)
    return Usage(**entry.meta["ptxas"])


def _guarded(build: Builder, job: BuildJob) -> Built:
    """A job that raised (a fadsl bug in a pass, verify's VerifyError) refuses its variant
    with the error's first line instead of ending the search."""
    try:
        return build(job)
    except Exception as err:
        text = str(err).splitlines()[0] if str(err) else ""
        return Built(job.name, FAILED, f"internal error: {type(err).__name__}: {text}")


def build_all(
    jobs: Iterable[BuildJob],
    workers: int,
    stop: Callable[[], bool] = lambda: False,
    build: Builder | None = None,
) -> Iterator[Built]:
    """Each job's Built, in the order they finish, until ``stop()``; then the jobs not done
    are dropped (the workers under way are killed). ``build``: the job function (default
    ``build_variant``); one other than the default runs here, one job after another, as do
    all jobs with ``workers`` = 1."""
    jobs = list(jobs)
    if build is not None or workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            if stop():
                return
            yield _guarded(build or build_variant, job)
        return
    pool = _Pool(min(workers, len(jobs)), jobs)
    try:
        for _ in jobs:
            while True:
                if stop():
                    return
                try:
                    built = pool.results.get(timeout=0.5)
                except queue.Empty:
                    continue
                break
            yield built
    finally:
        pool.close()


class _Pool:
    """Worker processes, each running ``_serve``: pickled jobs in on its stdin, each Built
    out on its stdout, fed by one thread each. Plain
    subprocesses, not multiprocessing: nothing re-imports the caller's main module (a script
    without a main guard, a notebook, ``python -``), and close() can kill a worker mid-job."""

    def __init__(self, workers: int, jobs: list[BuildJob]) -> None:
        self.jobs: queue.Queue = queue.Queue()
        for job in jobs:
            self.jobs.put(job)
        self.results: queue.Queue = queue.Queue()
        self.closing = threading.Event()
        self.procs: list[subprocess.Popen] = []
        self.errors: dict[int, object] = {}  # pid -> its stderr file
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._feed, daemon=True) for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def _start(self) -> subprocess.Popen | None:
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        # The fadsl this process runs, first on the path: not one the working folder holds
        # (a source tree beside an installed copy).
        root = str(Path(__file__).resolve().parents[2])
        serve = f"import sys; sys.path.insert(0, {root!r}); from {__name__} import _serve; _serve()"
        with self.lock:
            if self.closing.is_set():
                return None
            errors = tempfile.TemporaryFile()  # read back if the worker dies
            proc = subprocess.Popen(
                [sys.executable, "-c", serve],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                env=env,
            )
            self.procs.append(proc)
            self.errors[proc.pid] = errors
        return proc

    def _last_words(self, proc: subprocess.Popen) -> str:
        errors = self.errors[proc.pid]
        errors.seek(0)
        lines = errors.read().decode(errors="replace").strip().splitlines()
        return f": {lines[-1]}" if lines else ""

    def _feed(self) -> None:
        proc = None
        while not self.closing.is_set():
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if proc is None or proc.poll() is not None:
                proc = self._start()
                if proc is None:
                    break
            try:
                _send(proc.stdin, job)
                built = _receive(proc.stdout)
            except (OSError, EOFError, pickle.UnpicklingError):
                if self.closing.is_set():
                    break
                code = proc.wait()
                why = f"the compile worker died (exit status {code}){self._last_words(proc)}"
                built = Built(job.name, FAILED, why)
                proc = None
            self.results.put(built)
        if proc is not None and proc.poll() is None:
            proc.stdin.close()

    def close(self) -> None:
        self.closing.set()
        with self.lock:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
        for thread in self.threads:
            thread.join()
        for proc in self.procs:
            proc.wait()
        for errors in self.errors.values():
            errors.close()


def _send(stream, item) -> None:
    data = pickle.dumps(item)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def _serve() -> None:
    """A worker: jobs in on stdin, Builts out on the original stdout; anything else that
    prints (torch, NVRTC) goes to stderr instead."""
    results = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    warnings.filterwarnings("ignore")
    logging.getLogger("fadsl").setLevel(logging.WARNING)
    jobs = sys.stdin.buffer
    while True:
        try:
            job = _receive(jobs)
        except EOFError:
            return
        _send(results, _guarded(build_variant, job))
