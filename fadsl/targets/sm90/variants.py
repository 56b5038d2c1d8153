"""How an sm_90a spec takes a call's sliding window or softcap (fadsl.attention's variants of
the shipped examples, and the serving calls' of the serving specs): the lines besides the
mask and softcap lines themselves that the target's sharing and registers need
(``Target.variant_lines``; fadsl/runtime/dispatch.py writes them into the spec's text); and
the backward block a call's ``deterministic=True`` runs."""

from __future__ import annotations

from ...ir import GradRole, Kernel, Mask
from .. import VariantLines
from .backward.plan_smem import split_head_dim
from .backward.validate import PATHS, TRANSPOSED_BLOCK_M, WIDE_BLOCK_M

# A window runs neither CTA pairs (`cluster 2`: their K/V blocks are shared, a window's are
# each tile's own) nor split tiles (`tail split_kv`)
WINDOW_CLUSTER, WINDOW_TAIL = "1", "whole"
# The softcap's tanh in the forward does not fit 3 consumers' 160 registers: 2 of 240
SOFTCAP_FORWARD = {
    "tile": "B_r = 128, B_c = {block_c}",
    "warpgroups": "producer = 1, consumers = 2",
    "registers": "producer = 24, consumers = 240",
}
# A softcap's backward keeps 1 - tanh^2 per score in registers: B_r 64 fits beside it (B_r 80
# and 128 spill, as early_dv does), with dS stored as B_r 64 stores it; ptxas (NVRTC 13.5,
# 2026-11-29, tests/test_attention_variants.py) fits the overlapped order with the causal mask
# and the plain one without (the overlapped order spills 12 bytes with a two-sided window,
# the plain one 4 with the causal mask).
# The examples' `dq_lag on` (and `dq_first on`, which orders it) stays off there: that order
# needs `overlap on` and dQ split other than by keys, and is not timed beside a softcap
# (2026-11-30); so do their dK and dV by TMA, which need it.
SOFTCAP_BACKWARD = {"tile": "B_r = 64, B_c = {block_n}", "early_dv": "off", "dq_lag": "off"}
SOFTCAP_BACKWARD |= {"dq_first": "off"}
SOFTCAP_ORDER = {True: "on", False: "off"}  # causal -> `overlap`
# At head_dim 256 the backward's own tile takes the softcap as it is (B_c 80: 238 registers,
# no spill, NVRTC 13.5, tests/test_backward_hdim256_build.py), so its block is left alone.


# Deterministic mode: dQ's adds ordered by the writer warps (staged dQ), each example's block
# as timed fastest (research/probes/backward_ab.py, deterministic x the example, H100,
# 2026-12-06, docs/performance.md): causal blocks keep their lag (0.92-0.96x at 4k and 16k);
# the others meet at dS^T (the lag's order loses with the ordered adds), B_r 80 with 2 stages
# (0.90-0.93x), head_dim 64 at B_r 128 with the writer's 32 registers (at 24 it spills); head
# dim 64 adds in two chains of tickets (0.88-0.90x, one chain 0.85-0.86x); a persistent
# block runs on the grid (the ordered adds refuse it).
DETERMINISTIC = {"deterministic": "on", "dq_writer": "on", "fused_convert": "off"}
DETERMINISTIC_MEETING = {"dq_lag": "off", "dq_first": "off", "late_v": "off", "peel_dead": "off"}
DETERMINISTIC_STAGES = {TRANSPOSED_BLOCK_M: "2"}
DETERMINISTIC_REGISTERS = {WIDE_BLOCK_M: "producer = 32, consumers = 232"}
DETERMINISTIC_CHAINS = {64: "2"}  # head_dim -> dq_chains


def deterministic_lines(kernel: Kernel) -> tuple[dict[str, str], dict[str, str]]:
    """The backward block's settings and paths (tensor -> path text) of ``kernel``'s
    deterministic twin (DETERMINISTIC above)."""
    bwd, cfg = kernel.backward, kernel.config
    settings = dict(DETERMINISTIC)
    paths = {GradRole.DQ.value: PATHS[GradRole.DQ].text()}  # staged: the writer adds it
    if bwd.persistent:
        settings["scheduler"] = "grid"
    if not (bwd.dq_lag and cfg.mask is Mask.CAUSAL):
        settings |= DETERMINISTIC_MEETING
        # dK and dV from registers: their TMA path is the lagged consumer's
        paths |= {g.value: PATHS[g].text() for g in (GradRole.DK, GradRole.DV)}
        if bwd.block_m in DETERMINISTIC_STAGES:
            settings["stages"] = DETERMINISTIC_STAGES[bwd.block_m]
        if bwd.block_m in DETERMINISTIC_REGISTERS:
            settings["registers"] = DETERMINISTIC_REGISTERS[bwd.block_m]
    if cfg.head_dim in DETERMINISTIC_CHAINS:
        settings["dq_chains"] = DETERMINISTIC_CHAINS[cfg.head_dim]
    return settings, paths


def variant_lines(
    kernel: Kernel, windowed: bool, capped: bool, causal: bool, deterministic: bool = False
) -> VariantLines:
    """The lines ``kernel`` (a shipped spec, as compiled) needs beside a call's window
    (``windowed``) or softcap (``capped``), forward and backward; with ``deterministic`` (a
    call without either) its deterministic twin's backward block."""
    if deterministic:
        if kernel.backward is None:
            raise ValueError(f"{kernel.config.name} has no backward block to make deterministic")
        if windowed or capped:  # (dispatch.check_deterministic refuses these calls first)
            raise ValueError("deterministic backward blocks are built for the plain masks")
        if split_head_dim(kernel.config.head_dim):
            raise ValueError(
                f"head_dim {kernel.config.head_dim}'s backward adds dQ from registers (its "
                "staging does not fit in SMEM), so its adds cannot be ordered: no deterministic "
                "mode there"
            )
        backward, backward_paths = deterministic_lines(kernel)
        return VariantLines({}, {}, backward, backward_paths)
    cfg = kernel.config
    ext = cfg.ext
    settings: dict[str, str] = {}
    scopes: dict[str, str] = {}
    if windowed and ext is not None:
        if ext.cluster > 1:  # the pairs' shared K and V become each CTA's own
            settings["cluster"] = WINDOW_CLUSTER
            scopes = {"K": "cta", "V": "cta"}
        if ext.split_kv:
            settings["tail"] = WINDOW_TAIL
    if capped and cfg.warps == 4 * (1 + 3):  # a producer and 3 consumer warpgroups
        settings |= {k: v.format(block_c=cfg.block_c) for k, v in SOFTCAP_FORWARD.items()}
    backward: dict[str, str] = {}
    backward_paths: dict[str, str] = {}
    if capped and kernel.backward is not None and not split_head_dim(cfg.head_dim):
        block_n = kernel.backward.block_n
        backward = {k: v.format(block_n=block_n) for k, v in SOFTCAP_BACKWARD.items()}
        backward["overlap"] = SOFTCAP_ORDER[causal]
        backward_paths = {GradRole.DS.value: PATHS[GradRole.DS].text()}
        # dK and dV from registers: their TMA path is the lagged consumer's
        backward_paths |= {g.value: PATHS[g].text() for g in (GradRole.DK, GradRole.DV)}
    if (windowed or capped) and kernel.backward is not None and kernel.backward.peel_dead:
        # `peel_dead on` (fa3_causal's) peels the lagged consumer, which a softcap's block
        # leaves; with a window it is refused (not timed or tested there, 2026-12-04)
        backward["peel_dead"] = "off"
    if capped and backward.get("dq_lag") == "off" and kernel.backward.late_v:
        backward["late_v"] = "off"  # (V late is the lagged consumer's, which a softcap's leaves)
    return VariantLines(settings, scopes, backward, backward_paths)
