"""What a rendered sm_90a forward kernel syncs, beside what its proven plan says (the checks of
tests/test_emitted_plan.py and tests/test_fp8_codegen.py): the spec rendered, each role's
sync calls as the plan orders them, and as the CUDA text makes them."""

from __future__ import annotations

import re

from conftest import ROOT
from fadsl.codegen.render import render
from fadsl.ir import Sync
from fadsl.pipeline import compile_file
from fadsl.targets.sm90 import caps
from fadsl.targets.sm90.syncs.insert import role_of


def rendered(spec):
    """(compiled, sources) of a spec file under the repository."""
    compiled = compile_file(spec.relative_to(ROOT))
    return compiled, render(compiled.kernel, compiled.target, compiled.file)


_CALL = re.compile(
    r"\b(mbar_wait_parity|mbar_arrive_expect_tx|mbar_arrive|fence_proxy_async_smem|__syncwarp"
    r"|wgmma_fence|wgmma_commit|wgmma_wait<\d>|named_bar_sync|named_bar_arrive|tma_store_commit"
    r"|tma_store_wait_read<\d>)\((?:bar_(\w+?)\b)?"
)
_KIND = {
    caps.MBAR_WAIT: "mbar_wait_parity",
    caps.MBAR_EXPECT_TX: "mbar_arrive_expect_tx",
    caps.MBAR_ARRIVE: "mbar_arrive",
    caps.FENCE_PROXY_ASYNC: "fence_proxy_async_smem",
    caps.SYNCWARP: "__syncwarp",
    caps.WGMMA_FENCE: "wgmma_fence",
    caps.WGMMA_COMMIT: "wgmma_commit",
    caps.BAR_SYNC: "named_bar_sync",
    caps.BAR_ARRIVE: "named_bar_arrive",
    caps.BULK_COMMIT: "tma_store_commit",
}


def planned_syncs(kernel, role):
    """The role's syncs as the plan orders them (phase by phase): (call, barrier)."""
    out = []
    for phase, items in kernel.phases():
        for item in items:
            if not isinstance(item, Sync) or role_of(item.who) != role:
                continue
            if item.kind is caps.WGMMA_WAIT:
                out.append((f"wgmma_wait<{item.groups}>", None))
            elif item.kind is caps.BULK_WAIT:
                out.append((f"tma_store_wait_read<{item.groups}>", None))
            elif item.kind in (caps.BAR_SYNC, caps.BAR_ARRIVE):  # named by their ids
                out.append((_KIND[item.kind], None))
            elif item.kind in _KIND:
                out.append((_KIND[item.kind], item.barrier or None))
    return out


def emitted_syncs(text):
    return [(m.group(1), m.group(2)) for m in _CALL.finditer(text)]
