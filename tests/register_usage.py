"""The register and spill check (fadsl.build.spill_check.check_registers) with each kernel's
usage kept: how the compile-only tests assert that a spec's kernels build without spills
(skipped where no compiler is found)."""

from __future__ import annotations

import pytest

from fadsl.build.spill_check import check_registers, find_compiler


def kernel_usages(compiled) -> list[tuple[str, object]]:
    """(kernel name, Usage) of every kernel ``compiled``'s check builds, after the check ran
    (it raises the spec's error where a kernel spills)."""
    compiler, why = find_compiler()
    if compiler is None:
        pytest.skip(why)
    seen = []

    def recording(source, arch):
        usage = compiler(source, arch)
        seen.append((source.kernel_name, usage))
        return usage

    assert check_registers(compiled, recording, why).ran
    return seen


def assert_no_spills(usages) -> None:
    """Some kernel was built, none spills or serializes its wgmmas."""
    assert usages and not any(u.spills or u.wgmma_serialized for _, u in usages), usages
