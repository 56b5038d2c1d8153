"""Targets: one package per instruction set, known to the rest of fadsl only through ``Target``.

Everything that differs between instruction sets lives in a target: its
capabilities (data), the checks a spec must pass for it (located errors), the
schedule builder (which ops, run by which threads, with which async writes), the
sync model, the pass list, the emitter (a template under ``emit/<package>/``
and the context it needs) and the host side of a launch (``Target.launch``). The front
end, the generic passes, the pipeline and the runtime ask the registry below for the
target a spec's ``target`` line names.

Adding an instruction set: README.md's "Adding a target".
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import Loc
from ..ir import (
    Backward,
    Config,
    Dtype,
    Instr,
    Kernel,
    Level,
    Lowered,
    Role,
    Scope,
    TargetConfig,
    Tensor,
)
from ..ir.syncmodel import SyncModel
from .archs import capability_of
from .launch import BackwardLaunch, Launch
from .tuning import BackwardTuneSpace, TuneSpace

if TYPE_CHECKING:
    from ..spec.checks import BackwardBlock, Checks

# spec spelling -> package under fadsl/targets (and emit/)
_PACKAGES: dict[str, str] = {"sm_80": "sm80", "sm_90a": "sm90"}
# Spellings the grammar reserves for targets still to come, with the message that says so.
RESERVED: dict[str, str] = {}
# Whose rules check a spec's paths when its target line is missing or wrong, so that
# the other mistakes are still reported.
FALLBACK = "sm_80"


@dataclass(frozen=True)
class Capabilities:
    """What an instruction set offers, as data."""

    mma: str  # in titles and messages: "mma.sync m16n8k16"
    smem_per_cta: int  # bytes of dynamic SMEM one CTA may use
    smem_per_sm: int
    registers_per_thread: int  # the most one thread may have
    registers_per_sm: int  # shared by a CTA's threads: at most this / threads each
    # the instructions each (from, to) hop may use
    hop_instrs: Mapping[tuple[Level, Level], tuple[Instr, ...]]
    # the nvcc architectures the kernel is built and reported for, with their GPUs
    archs: tuple[tuple[str, str], ...]
    # the GPUs its instructions run on: the lowest compute capability, and whether only that
    devices: tuple[tuple[int, int], bool]
    # why a tensor's strides and base must be 16-byte aligned (in the argument errors)
    alignment: str
    # the SMEM sharing scopes a path may name
    scopes: tuple[Scope, ...] = (Scope.WARP, Scope.CTA)
    # the dtypes a spec may list (a spec's `dtype` word outside them is refused at the word)
    dtypes: tuple[Dtype, ...] = (Dtype.BF16, Dtype.FP16)

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether the instructions run on a GPU of ``capability`` (``devices``)."""
        lowest, only = self.devices
        return capability == lowest if only else capability >= lowest


@dataclass(frozen=True)
class Report:
    """What `fadsl check` and `fadsl explain` (fadsl.tools.report) say about a target's kernels
    beyond the common report, which is sm_80's: every warp runs every step of one
    mainloop under a register cap of registers_per_sm / threads."""

    # check: the common (key, value) lines in, the target's lines out (replaced, dropped
    # or added; the registers line follows them)
    check_lines: Callable[[Kernel, list[tuple[str, str]]], list[tuple[str, str]]]
    # The registers per thread to compare the compiler's count with, and why that number.
    register_cap: Callable[[Kernel, Capabilities], tuple[int, str]]
    # explain --json: the target's sections as plain data, added to the common ones
    explain_data: Callable[[Kernel], dict[str, Any]]
    # explain's first line: the kernel's threads ("3 warpgroups (1 producer, 2 consumer)")
    threads_text: Callable[[Kernel], str]
    # explain: those sections as text (after the SMEM map) ...
    explain_sections: Callable[[Mapping[str, Any]], list[str]]
    # ... and the schedule's text, in place of the common one
    explain_schedule: Callable[[Mapping[str, Any]], list[str]]
    # A spilling kernel's error: (where, which kernel, the limit it passed, what to do);
    # None: the common advice (the registers the launch allows per thread).
    spill_advice: Callable[[Kernel], tuple[Loc, str, str, str]] | None = None
    # explain: a kernel's backward block (Kernel.backward) as plain data, and as text after
    # the schedule; None: the target has no backward pass.
    backward_data: Callable[[Kernel], dict[str, Any]] | None = None
    backward_sections: Callable[[Mapping[str, Any]], list[str]] | None = None


@dataclass(frozen=True)
class VariantLines:
    """The lines a target's spec needs beside a call's window or softcap
    (``Target.variant_lines``): kernel settings (key -> value) and SMEM scopes (tensor ->
    scope) for the forward, and the backward block's settings and paths (tensor -> path)."""

    settings: Mapping[str, str]
    scopes: Mapping[str, str]
    backward: Mapping[str, str]
    backward_paths: Mapping[str, str]


@dataclass(frozen=True)
class Target:
    name: str  # as a spec spells it: "sm_80"
    package: str  # fadsl/targets/<package>, emit/<package>
    capabilities: Capabilities
    sync_model: SyncModel
    # Target-specific checks of a lowered spec; report through ``checks``, return ok.
    validate: Callable[[Checks, dict[Role, Tensor]], bool]
    # The paths each tensor may take, checked per path; report through ``checks``.
    validate_path: Callable[[Checks, Role, Any, list[Level], list[Any]], bool]
    build_schedule: Callable[[Lowered], Kernel]
    # The passes after schedule building, in order, each (name, pass(kernel, target)).
    passes: tuple[tuple[str, Callable[[Kernel, "Target"], Kernel]], ...]
    template: str  # under emit/
    context: Callable[[Kernel, Dtype], dict[str, Any]]  # the template's target-specific slots
    # The settings keys of its own (beyond those every target shares,
    # fadsl.frontend.settings), each with the function that reads its value
    # (fadsl/spec/readers.py's helpers): the front end reads a spec's lines with them.
    settings: Mapping[str, Callable[[Checks, Any], object]] = dataclasses.field(
        default_factory=dict
    )
    # Words `swizzle` may take beyond 'none' and 'xor(B, M, S)' (sm_90a: '128B').
    swizzle_words: tuple[str, ...] = ()
    # The page sizes a `kv_cache paged(N)` spec takes (the serving calls check a cache's).
    page_sizes: tuple[int, ...] = ()
    # Settings beyond fadsl.frontend.settings.REQUIRED_KEYS that this target needs / takes.
    required_keys: tuple[str, ...] = ("warps",)
    keys: tuple[str, ...] = ("mask", "swizzle", "smem_alias", "stages", "spills")
    key_hints: Mapping[str, str] = dataclasses.field(default_factory=dict)  # for foreign keys
    # Builds the Config itself (sm_90a: warp specialisation); None: the common fields only.
    configure: Callable[[Checks], Config] | None = None
    # How check and explain describe its kernels; None: the common report (fadsl.tools.report).
    report: Report | None = None
    # A schedule's variant for the launches that do not use its clusters (sm_90a: `cluster 2`
    # run alone), compiled beside it and launched in its place; None: no such variant.
    alone: Callable[[Kernel], Kernel | None] | None = None
    # The host side: params, grid, clusters (fadsl/targets/<package>/host).
    launch: Launch | None = None
    # The header that declares the tile timeline's layout (a FADSL_TILE_TRACE build,
    # fadsl/tools/tiletrace.py); None: the target's kernels record no timeline.
    trace_header: str | None = None
    # The same for the backward's m-block timeline (a FADSL_BWD_TRACE build,
    # fadsl/tools/bwdtrace.py); None: the target's backward records none.
    backward_trace_header: str | None = None
    # fadsl.attention's specs: (head_dim, causal) -> an example's name (examples/NAME.fa)
    shipped: Mapping[tuple[int, bool], str] = dataclasses.field(default_factory=dict)
    # fadsl.attention's specs for short queries: (head_dim, causal) -> (longest seqlen_q, an
    # example's name), run in place of ``shipped``'s where seqlen_q is at most that
    shipped_short: Mapping[tuple[int, bool], tuple[int, str]] = dataclasses.field(
        default_factory=dict
    )
    # fadsl.attention's 8-bit specs (issue 42): (head_dim, causal) -> an example's name, whose
    # `dtype` line holds both 8-bit dtypes
    shipped_fp8: Mapping[tuple[int, bool], str] = dataclasses.field(default_factory=dict)
    # the 8-bit specs for short queries, as ``shipped_short`` for ``shipped``
    shipped_fp8_short: Mapping[tuple[int, bool], tuple[int, str]] = dataclasses.field(
        default_factory=dict
    )
    # fadsl.attention_varlen / attention_with_kvcache: ("varlen" or "kvcache", head_dim) -> a
    # serving spec (examples/serving/NAME.fa) whose mask, softcap and cache lines a call sets
    shipped_serving: Mapping[tuple[str, int], str] = dataclasses.field(default_factory=dict)
    # Reads the line its ``Config.ext`` prints in the IR's text form (None for another line);
    # None: the target has no such line.
    read_config: Callable[[str], TargetConfig | None] | None = None
    # What `fadsl tune` may change in its specs (fadsl.targets.tuning); None: not tunable.
    tune_space: TuneSpace | None = None
    # Checks a spec's `backward { ... }` block (its settings and paths as the front end read
    # them, and the kernel's settings it depends on: head_dim, dtypes, mask), reports through
    # ``checks`` and returns the block with every default filled in, or None when it reported
    # errors. None: the target has no backward pass, and a block is refused at its keyword.
    validate_backward: Callable[[Checks, BackwardBlock], Backward | None] | None = None
    # The backward's kernels: template, slots and host side (fadsl.targets.launch's
    # BackwardLaunch); None: no backward pass.
    backward_launch: BackwardLaunch | None = None
    # What `fadsl tune --backward` may change in its backward blocks (fadsl.targets.tuning);
    # None: not tunable.
    backward_tune_space: BackwardTuneSpace | None = None
    # The lines a compiled spec needs beside a call's sliding window or softcap
    # (kernel, windowed, capped, causal) -> VariantLines; None: the spec takes the call's mask
    # and softcap lines alone.
    variant_lines: Callable[[Kernel, bool, bool, bool, bool], VariantLines] | None = None


def names() -> tuple[str, ...]:
    """The target spellings a spec may use."""
    return tuple(_PACKAGES)


def packages() -> tuple[str, ...]:
    return tuple(_PACKAGES.values())


def get(name: str) -> Target:
    """The target a spec's ``target`` line names (KeyError for an unknown one)."""
    module = importlib.import_module(f"{__name__}.{_PACKAGES[name]}")
    target = module.TARGET
    assert isinstance(target, Target) and target.name == name
    return target


def settings_readers() -> dict[str, Callable[[Checks, Any], object]]:
    """Every target's own settings keys with their readers (a key two targets share must be
    read alike)."""
    found: dict[str, Callable[[Checks, Any], object]] = {}
    for name in names():
        for key, reader in get(name).settings.items():
            assert found.setdefault(key, reader) is reader, f"{key} read two ways"
    return found


def swizzle_words() -> tuple[str, ...]:
    """The words `swizzle` takes beyond 'none' and 'xor(B, M, S)', over every target."""
    return tuple(dict.fromkeys(w for name in names() for w in get(name).swizzle_words))


def target_of(kernel: Kernel) -> Target:
    return get(kernel.config.target)


def check_arch(name: str, arch: str) -> None:
    """Refuse an architecture name that is malformed or that target ``name`` cannot run on."""
    capability = capability_of(arch)  # a malformed name first
    caps = get(name).capabilities
    if caps.devices[1] and arch != name:
        raise ValueError(f"target {name} runs only on {name}, not {arch}")
    if not caps.runs_on(capability):
        raise ValueError(f"target {name} needs {name} or newer, not {arch}")


def launch_for(name: str) -> Launch:
    """The host side of target ``name``'s kernels."""
    launch = get(name).launch
    if launch is None:
        raise NotImplementedError(f"fadsl has no launcher for target {name} yet")
    return launch
