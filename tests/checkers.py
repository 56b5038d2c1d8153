"""Independent checkers for compiled kernels, used by the tests.

``smem_plan_problems`` checks an SMEM plan against liveness computed by running the
schedule, not by dataflow: the steps of prologue + n mainloop iterations + epilogue
(n = 1..3, and 0 when the loop may be empty) are walked in order and each written
value is live from the step that writes it to the last step that reads it before the
next write (a value never read still occupies its bytes at the step that writes it).
Two buffers whose bytes overlap must never be live at the same step.
"""

from __future__ import annotations

from fadsl import targets
from fadsl.ir import Kernel, Mode, Step

ALIGN = 16  # bytes: cp.async and ldmatrix move 16-byte vectors


def trace_steps(kernel: Kernel, n: int) -> list[tuple[Step, str]]:
    """The steps of prologue + n iterations + epilogue, each with where it runs."""

    def steps(items):
        return [i for i in items if isinstance(i, Step)]

    out = [(s, "prologue") for s in steps(kernel.prologue)]
    for it in range(n):
        out += [(s, f"mainloop iteration {it}") for s in steps(kernel.mainloop)]
    return out + [(s, "epilogue") for s in steps(kernel.epilogue)]


def live_ranges(kernel: Kernel, n: int) -> dict[str, list[tuple[int, int]]]:
    """For each buffer, the [first, last] step positions over which each written value lives."""
    ranges: dict[str, list[tuple[int, int]]] = {b.name: [] for b in kernel.buffers}
    current: dict[str, tuple[int, int]] = {}
    for pos, (step, _) in enumerate(trace_steps(kernel, n)):
        for acc in step.accesses:
            if acc.mode is Mode.READ and acc.buffer in current:
                current[acc.buffer] = (current[acc.buffer][0], pos)
        for acc in step.accesses:
            if acc.mode is Mode.WRITE:
                if acc.buffer in current:
                    ranges[acc.buffer].append(current[acc.buffer])
                current[acc.buffer] = (pos, pos)
    for name, span in current.items():
        ranges[name].append(span)
    return ranges


def smem_plan_problems(kernel: Kernel) -> list[str]:
    """Everything wrong with the kernel's SMEM plan; empty when the plan is sound."""
    problems = []
    if kernel.smem_bytes is None:
        return ["the kernel has no smem_bytes: it was not planned"]
    if kernel.smem_bytes > targets.target_of(kernel).capabilities.smem_per_cta:
        problems.append(f"smem_bytes {kernel.smem_bytes} exceeds the target's limit")
    for buf in kernel.buffers:
        if buf.offset is None:
            problems.append(f"{buf.name} has no offset")
        elif buf.offset % ALIGN:
            problems.append(f"{buf.name} at offset {buf.offset} is not {ALIGN}-byte aligned")
        elif buf.offset < 0 or buf.offset + buf.nbytes > kernel.smem_bytes:
            problems.append(
                f"{buf.name} [{buf.offset}, {buf.offset + buf.nbytes}) does not fit in "
                f"{kernel.smem_bytes} bytes"
            )
    if problems:
        return problems
    bufs = kernel.buffers
    pairs = [
        (a, b)
        for i, a in enumerate(bufs)
        for b in bufs[i + 1 :]
        if max(a.offset, b.offset) < min(a.offset + a.nbytes, b.offset + b.nbytes)
    ]
    seen = set()
    for n in (0, 1, 2, 3) if kernel.loop_may_be_empty else (1, 2, 3):
        steps = trace_steps(kernel, n)
        live = live_ranges(kernel, n)
        for a, b in pairs:
            for s1, e1 in live[a.name]:
                for s2, e2 in live[b.name]:
                    if s1 <= e2 and s2 <= e1 and (a.name, b.name) not in seen:
                        seen.add((a.name, b.name))
                        step, where = steps[max(s1, s2)]
                        lo = max(a.offset, b.offset)
                        hi = min(a.offset + a.nbytes, b.offset + b.nbytes)
                        problems.append(
                            f"{a.name} and {b.name} share bytes [{lo}, {hi}) and are both live "
                            f"at {step.op.spelling} ({where}; trace with {n} iteration(s))"
                        )
    return problems


def check_smem_plan(kernel: Kernel) -> None:
    problems = smem_plan_problems(kernel)
    assert not problems, "bad SMEM plan:\n  " + "\n  ".join(problems)
