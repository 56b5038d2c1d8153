"""Compile the rendered kernel and refuse a spec whose kernel spills: the register truth
behind `fadsl check` and `fadsl explain`.

lower's register estimate counts the fragments a kernel must hold and refuses what
surely cannot fit; only the compiler knows what else it keeps live (addresses, loop
state, values it hoists), so where a CUDA compiler is available the kernel is compiled
for every architecture its target runs on, and a kernel that spills registers or uses
a stack frame, or whose wgmma ptxas serialized for lack of registers (its note C7512), is
refused with a message on the spec's `tile` (or `warps`) line, unless the spec says
`spills allow` (for experiments).

The compiler is a plain function ``(source, arch) -> Usage``; ``find_compiler`` picks the
runtime's (NVRTC, else nvcc), or says why there is none.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..codegen.render import Source, render, render_backward
from .nvrtc import Usage
from ..errors import Diagnostic, SpecError
from ..ir import Dtype, RegLoad
from ..pipeline import Compiled
from ..targets import Capabilities


@dataclass(frozen=True)
class KernelUsage:
    dtype: Dtype
    arch: str
    usage: Usage


Compiler = Callable[[Source, str], Usage]


@dataclass(frozen=True)
class RegisterCheck:
    """The outcome: one row per dtype and architecture, or why nothing was compiled."""

    rows: tuple[KernelUsage, ...]
    compiler: str  # e.g. "nvcc 13.0", or why there is none: "no CUDA compiler (...)"
    allowed_spills: bool = False

    @property
    def ran(self) -> bool:
        return bool(self.rows)


def nvcc_compiler() -> Compiler | None:
    """The runtime's compiler (NVRTC from the pip wheels, else nvcc on the PATH or in
    /usr/local/cuda), through fadsl.resources, or None."""
    from . import resources

    if not resources.can_compile():
        return None

    def compile_with_nvcc(source: Source, arch: str) -> Usage:
        usage = resources.ptxas_usage(source, arch, resources.usage_cache())
        return Usage(
            registers=usage["registers"],
            spill_store_bytes=usage["spill_store_bytes"],
            spill_load_bytes=usage["spill_load_bytes"],
            stack_bytes=usage["stack_bytes"],
            static_smem_bytes=usage["static_smem_bytes"],
            wgmma_serialized=usage["wgmma_serialized"],
        )

    return compile_with_nvcc


def find_compiler() -> tuple[Compiler | None, str]:
    """The compiler to check with and its name, or None and why there is none."""
    from .nvrtc import compiler_id

    compiler = nvcc_compiler()
    if compiler is None:
        return None, "no CUDA compiler: neither NVRTC (cuda-bindings) nor nvcc"
    return compiler, compiler_id()


def register_cap(caps: Capabilities, threads: int) -> int:
    """Registers per thread that one CTA of ``threads`` threads can have (ptxas's bound
    under __launch_bounds__)."""
    return min(caps.registers_per_thread, caps.registers_per_sm // threads)


def check_registers(
    compiled: Compiled, compiler: Compiler | None = None, name: str = "a CUDA compiler"
) -> RegisterCheck:
    """Compile every dtype of ``compiled`` (and of its cluster-free variant) for every
    architecture its target runs on (in parallel) and refuse, by SpecError, a kernel that
    spills or uses a stack frame, unless the spec allows spills. The result holds the spec's
    own kernel's rows. With no compiler given, ``find_compiler`` picks one; with none found,
    nothing is compiled and the result says why."""
    if compiler is None:
        compiler, name = find_compiler()
        if compiler is None:
            return RegisterCheck((), name)
    target = compiled.target
    archs = [arch for arch, _family in target.capabilities.archs]
    # A `cluster 2` spec's cluster-free variant (the launches that do not pair run it) too,
    # in the same pool. Rendered under each kernel's name, not the spec's path, so that one
    # kernel is compiled once whatever file it is checked from (results are cached).
    kernels = compiled.variants
    jobs = [
        (c, source, arch)
        for c in kernels
        for source in render(c.kernel, target, f"{c.kernel.config.name}.fa")
        for arch in archs
    ]
    # the backward's kernels (a spec with a backward block), checked alike
    backward_jobs = [
        (compiled, source, arch)
        for source in (
            render_backward(compiled.kernel, target, f"{compiled.kernel.config.name}.fa")
            if compiled.kernel.backward is not None
            else ()
        )
        for arch in archs
    ]
    everything = jobs + backward_jobs
    with ThreadPoolExecutor(max_workers=min(len(everything), os.cpu_count() or 1)) as pool:
        found = list(pool.map(lambda job: compiler(*job[1:]), everything))
    usages, backward_usages = found[: len(jobs)], found[len(jobs) :]
    rows: dict[int, list[KernelUsage]] = {id(c): [] for c in kernels}
    for (c, source, arch), usage in zip(jobs, usages):
        rows[id(c)].append(KernelUsage(source.dtype, arch, usage))
    allow = compiled.kernel.config.allow_spills
    for c in kernels:
        spilling = [row for row in rows[id(c)] if row.usage.short_of_registers]
        if spilling and not allow:
            raise SpecError([_spill_diagnostic(c, spilling)], compiled.source)
    backward_spills = [
        KernelUsage(source.dtype, arch, usage)
        for (_, source, arch), usage in zip(backward_jobs, backward_usages)
        if usage.short_of_registers
    ]
    if backward_spills and not allow:
        raise SpecError([_backward_spill_diagnostic(compiled, backward_spills)], compiled.source)
    return RegisterCheck(tuple(rows[id(compiled)]), name, allow)


def _backward_spill_diagnostic(compiled: Compiled, spilling: list[KernelUsage]) -> Diagnostic:
    u = max(spilling, key=lambda r: (r.usage.spill_store_bytes, r.usage.stack_bytes)).usage
    where = ", ".join(sorted({f"{r.dtype.value} on {r.arch}" for r in spilling}))
    # dq_lag's order keeps more live at once (dQ(i - 1) issued in m-block i): the first to drop
    lag = "turn dq_lag off, " if compiled.kernel.backward.dq_lag else ""
    return Diagnostic(
        compiled.kernel.backward.loc,
        f"the backward's kernels {_symptom(u)} ({u.shortfall()}; {where}); {lag}raise the "
        "consumers' registers, turn overlap off, or add 'spills allow' to accept it for "
        "an experiment",
    )


def _symptom(usage: Usage) -> str:
    """What a kernel short of registers does, as the diagnostics say it."""
    if usage.spills:
        return "spill"
    return "do not fit their registers: ptxas serialized their wgmma, so no MMA overlaps another"


def _spill_diagnostic(compiled: Compiled, spilling: list[KernelUsage]) -> Diagnostic:
    cfg = compiled.kernel.config
    caps = compiled.target.capabilities
    cap = register_cap(caps, cfg.threads)
    worst = max(
        spilling,
        key=lambda r: (r.usage.spill_store_bytes, r.usage.stack_bytes, r.usage.wgmma_serialized),
    )
    u = worst.usage
    where = ", ".join(sorted({f"{r.dtype.value} on {r.arch}" for r in spilling}))
    report = compiled.target.report
    which = "the kernel"
    if report is not None and report.spill_advice is not None:  # sm_90a: setmaxnreg's cap
        loc, which, limit, hint = report.spill_advice(compiled.kernel)
    elif cap < caps.registers_per_thread:
        loc = cfg.loc_of("warps")
        limit = f"the {cap} registers per thread that {cfg.threads} threads allow"
        full = caps.registers_per_sm // (32 * caps.registers_per_thread)
        hint = f"use at most {full} warps (then each thread may have {caps.registers_per_thread})"
    else:
        loc = cfg.loc_of("tile")
        limit = f"the {cap}-register limit per thread"
        tiles = [t.role.value for t in compiled.kernel.tensors if t.reg_load is RegLoad.TILE]
        hint = "use a smaller B_c or more warps"
        if set(tiles) - {"O"}:
            hint = "load fragment-wise (rf[frag]), " + hint
    return Diagnostic(
        loc,
        f"{which} does not fit {limit}: it uses {u.registers} registers and "
        f"{'spills' if u.spills else 'ptxas serialized its wgmma'} ({u.shortfall()}; "
        f"{where}); {hint}, or add 'spills allow' to accept it for an experiment",
    )
