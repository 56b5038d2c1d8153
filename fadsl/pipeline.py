"""The pipeline: spec text -> the target's schedule -> the target's passes, in order.

    parse (syntax) -> lower (settings, paths, mainloop order; target.validate)
    -> target.build_schedule -> target.passes (sm_80: plan_smem, insert_barriers,
    verify) -> codegen.render(kernel, target) (the target's template)

The target is the one the spec's ``target`` line names (fadsl.targets). Each pass
is a pure function (Kernel, Target) -> Kernel. Ordering rules on sm_80:
- plan_smem runs before insert_barriers: aliasing creates hazards (K's reads
  against V's writes into the same bytes), and the barriers must see the final
  byte offsets to know which warps' accesses overlap.
- verify runs last and shares no code with insert_barriers: it re-derives every
  hazard from the final schedule and proves the placed syncs order each one.

A target may also derive a variant of the schedule (``Target.alone``: sm_90a's `cluster 2`
without its cluster, for the launches that do not pair CTAs). The variant runs through the
same passes, its own proof included, after the spec's kernel, and is ``Compiled.alone``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from . import targets
from .errors import DiagnosticSink, SpecError
from .ir import Kernel
from .frontend.lower import lower
from .spec.syntax import MAX_CHARS, parse_recovering, spec_text


@dataclass(frozen=True)
class Compiled:
    """A spec taken through every pass, with the text and name it came from."""

    kernel: Kernel
    source: str
    file: str
    stages: tuple[tuple[str, Kernel], ...]  # the IR after each pass, for golden tests and explain
    # The target's variant for the launches that do not use the kernel's clusters (sm_90a:
    # `cluster 2` run alone), through the same passes; the runtime launches it in their place.
    alone: Compiled | None = None

    @property
    def variants(self) -> tuple[Compiled, ...]:
        """The spec's kernels: its own, then its cluster-free variant where it has one."""
        return (self,) if self.alone is None else (self, self.alone)

    @property
    def target(self) -> targets.Target:
        return targets.target_of(self.kernel)


def front_end(source: str, file: str = "<spec>") -> Kernel:
    """Parse and validate a spec and build its (sync-free, unplanned) schedule."""
    source = spec_text(source)
    sink = DiagnosticSink(source)
    decl = parse_recovering(source, file, sink)
    lowered = lower(decl, sink, partial=bool(sink.diagnostics)) if decl is not None else None
    sink.raise_if_any()
    assert lowered is not None
    try:
        return targets.get(lowered.config.target).build_schedule(lowered)
    except SpecError as err:  # what a target reads but does not build yet (sm_90a: FP8)
        raise SpecError(err.diagnostics, source) from None


def compile_source(source: str, file: str = "<spec>", skip: tuple[str, ...] = ()) -> Compiled:
    """The spec through every pass. ``skip``: passes left out by name (fadsl tune judges
    hundreds of variants without "verify", the proof, which takes a second and refuses no spec
    with a SpecError; every variant it compiles then runs the whole pipeline)."""
    source = spec_text(source)
    schedule = front_end(source, file)
    target = targets.target_of(schedule)
    compiled = _passes(schedule, target, source, file, skip)
    variant = target.alone(schedule) if target.alone else None
    if variant is None:
        return compiled
    try:
        return replace(compiled, alone=_passes(variant, target, source, file, skip))
    except SpecError as err:  # say which kernel: the spec's own passed
        prefix = f"in its cluster-free variant {variant.config.name}: "
        raise SpecError(
            [replace(d, message=prefix + d.message) for d in err.diagnostics], source
        ) from None
    except Exception as err:  # a pass's own failure (verify's): name the kernel too
        if hasattr(err, "add_note"):  # Python 3.11+
            err.add_note(f"(in the cluster-free variant {variant.config.name})")
        raise


def _passes(
    kernel: Kernel, target: targets.Target, source: str, file: str, skip: tuple[str, ...] = ()
) -> Compiled:
    stages = [("schedule", kernel)]
    try:
        for name, run in target.passes:
            if name in skip:
                continue
            kernel = run(kernel, target)
            stages.append((name, kernel))
    except SpecError as err:
        raise SpecError(err.diagnostics, source) from None
    return Compiled(kernel, source, file, tuple(stages))


def compile_file(path: str | Path) -> Compiled:
    path = Path(path)
    return compile_source(read_spec(path), str(path))


def read_spec(path: Path) -> str:
    """Read a spec as text; undecodable bytes become U+FFFD and are reported by the parser.
    Of a huge file only the beginning is read: enough for the parser to refuse it."""
    with path.open("rb") as spec:
        data = spec.read(4 * (2 * MAX_CHARS + 2))  # UTF-8: up to 4 bytes a character
    return data.decode("utf-8-sig", errors="replace")
