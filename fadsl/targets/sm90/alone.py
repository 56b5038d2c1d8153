"""The cluster-free variant of a `cluster 2` schedule, for the launches that run alone.

The runtime launches a `cluster 2` kernel in pairs only where a head's query blocks pair
up and the K/V loop is long enough (fadsl.targets.sm90.host.launch.launch_cluster). The pair kernel can run
alone too, but pays for the cluster there: its barriers at setup and exit, a second arrival
on every empty barrier, and the producer's choice of load path (2-3 % at seqlen 2048,
research/performance-history.md, 2026-11-24). So the spec compiles a second kernel, `<name>_alone`:
the same schedule with one CTA per cluster and every cluster-scoped tile CTA-scoped. The
passes plan, sync and verify it as any `cluster 1` kernel; the runtime launches it where
pairs are not used.
"""

from __future__ import annotations

from dataclasses import replace

from ...ir import Kernel, Scope

ALONE_SUFFIX = "_alone"


def alone_name(name: str) -> str:
    """The variant's kernel name for the spec's kernel ``name``."""
    return name + ALONE_SUFFIX


def alone(kernel: Kernel) -> Kernel | None:
    """``kernel``'s schedule (before any pass) without its cluster, named <name>_alone;
    None for a kernel without one."""
    hw = kernel.config.ext
    if hw is None or hw.cluster == 1:
        return None

    def scope(s: Scope) -> Scope:
        return Scope.CTA if s is Scope.CLUSTER else s

    config = replace(
        kernel.config,
        name=alone_name(kernel.config.name),
        ext=replace(hw, cluster=1, alone_of=kernel.config.name),
    )
    return replace(
        kernel,
        config=config,
        tensors=tuple(replace(t, smem_scope=scope(t.smem_scope)) for t in kernel.tensors),
        buffers=tuple(replace(b, scope=scope(b.scope)) for b in kernel.buffers),
        backward=None,  # the spec's backward is the spec kernel's: built and run once
    )
