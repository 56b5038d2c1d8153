"""The sm_90a target: TMA, wgmma, an mbarrier K/V ring and warp specialisation (FlashAttention-3).

A producer warpgroup (one elected thread) issues TMA loads of Q and of the K/V blocks
into rings of ``stages`` slots; 1 to 3 consumer warpgroups, 64 query rows each, run
S = Q K^T and O += P V as wgmma with the softmax between, optionally in ping-pong
(named-barrier turns) and with S(j+1) overlapping softmax(j); O goes through SMEM (its
own bytes where they fit, else over the dead V ring) to a TMA store. Each CTA loops over
(q block, head, batch) tiles (``scheduler persistent``: about one CTA per SM; ``grid``:
one per tile). The sync pass (insert_syncs) places every mbarrier,
wgmma wait, named barrier and fence; verify, written apart from it, proves the plan
over the async model (fadsl/passes/asyncmodel/model.py) for a CTA's tile loop (tile sequences of
1-3 tiles, 1 .. stages + 2 blocks each).
"""

from __future__ import annotations

from dataclasses import replace

from .. import Target
from .alone import alone
from .backward.validate import validate_backward
from .backward import BACKWARD_LAUNCH
from .backward.tune_space import BACKWARD_TUNE_SPACE
from .caps import BACKWARD_TRACE_HEADER, CAPABILITIES, SYNC_MODEL, TRACE_HEADER
from .config import read_config
from .settings import PAGE_SIZES, SETTINGS, TMA_SWIZZLE
from .emit import TEMPLATE, context
from .host.kvcache import plan_kvcache
from .host.launch import LAUNCH
from .host.varlen import MAX_SEQUENCES, plan_varlen
from .syncs.cluster import cluster_syncs
from .variants import variant_lines
from .syncs.insert import insert_syncs
from .plan_smem import plan_smem
from .report import REPORT
from .schedule import build_schedule
from .tune_space import TUNE_SPACE
from .validate import configure, validate, validate_path
from .verify import verify
from ..launch import ServingLaunch

SERVING = ServingLaunch(max_sequences=MAX_SEQUENCES, varlen=plan_varlen, kvcache=plan_kvcache)

TARGET = Target(
    name="sm_90a",
    package="sm90",
    capabilities=CAPABILITIES,
    sync_model=SYNC_MODEL,
    validate=validate,
    validate_path=validate_path,
    build_schedule=build_schedule,
    passes=(
        ("plan_smem", plan_smem),  # Q | K ring | V ring | O (or over the dead V ring) | mbarriers
        ("insert_syncs", insert_syncs),  # mbarriers with parity, wgmma waits, named barriers
        # after insert_syncs (it extends that plan to the cluster): peer arrivals on the K/V
        # empty barriers, cluster barriers after init and at exit; `cluster 1`: unchanged
        ("cluster_syncs", cluster_syncs),
        ("verify", verify),  # independent proof: every hazard ordered, no wait can hang
    ),
    template=TEMPLATE,
    context=context,
    required_keys=("warpgroups",),
    keys=(
        "mask",
        "swizzle",
        "stages",
        "q_slots",
        "ctas_per_sm",
        "registers",
        "pingpong",
        "overlap",
        "scheduler",
        "rescale",
        "tail",
        "cluster",
        "softcap",
        "varlen",
        "kv_cache",
        "pack_gqa",
        "splits",
        "spills",
        "output",
    ),
    key_hints={"warps": "use 'warpgroups producer = 1, consumers = N'"},
    configure=configure,
    report=REPORT,  # roles, rings, named barriers, one program per role
    alone=alone,  # `cluster 2`: the cluster-free kernel for launches that do not pair
    # FwdParamsSm90, the persistent tile grid, the split tail, clusters; varlen and kv-cache calls
    launch=replace(LAUNCH, serving=SERVING),
    trace_header=TRACE_HEADER,
    backward_trace_header=BACKWARD_TRACE_HEADER,
    settings=SETTINGS,
    swizzle_words=(TMA_SWIZZLE,),
    page_sizes=PAGE_SIZES,
    read_config=read_config,
    validate_backward=validate_backward,  # the backward block: what its first kernel supports
    tune_space=TUNE_SPACE,  # fadsl tune: the tile, pipeline and schedule knobs
    backward_launch=BACKWARD_LAUNCH,  # preprocess, main and convert_dq (docs/backward.md)
    backward_tune_space=BACKWARD_TUNE_SPACE,  # fadsl tune --backward: tile, order, dQ, stages
    variant_lines=variant_lines,  # a call's window or softcap: cluster, tail, tiles, backward
    # fadsl.attention on Hopper: the tuned examples (docs/performance.md)
    shipped={
        (64, False): "fa3_hdim64",
        (64, True): "fa3_hdim64_causal",
        (128, False): "fa3_hopper",
        (128, True): "fa3_causal",
        (256, False): "fa3_hdim256",
        (256, True): "fa3_hdim256_causal",
    },
    # up to 2k queries, head_dim 64 causal: 128-row tiles waste less of the diagonal than 192
    # (1.25x the 192-row spec at 1k, level at 2k; H200, 2026-11-30, docs/performance.md)
    shipped_short={(64, True): (2048, "fa3_hdim64_causal_short")},
    # fadsl.attention on 8-bit q, k, v (issue 42): head_dim 128 (both dtypes build with 0
    # spills, NVRTC 13.5, and ran on an H200, 2026-11-30) and head_dim 256 without a mask (0
    # spills; tests/test_gpu_fp8.py's loaded-spec test passed on an H200, 2026-11-30) and
    # head_dim 256 causal on 128 x 128 tiles with overlap off (0 spills, NVRTC 13.5;
    # tests/test_gpu_fp8.py on an H200, 2026-12-04); head_dim 64 with 64-byte rows and the 64-byte swizzle, 192 x 128
    # on three consumer warpgroups, causal too (0 spills; 1.02-1.12x cuDNN's FP8,
    # tests/test_gpu_fp8.py's head_dim 64 cases and compute-sanitizer clean on an H200,
    # 2026-12-04)
    shipped_fp8={
        (64, False): "fa3_fp8_hdim64",
        (64, True): "fa3_fp8_hdim64_causal",
        (128, False): "fa3_fp8_hdim128",
        (128, True): "fa3_fp8_hdim128_causal",
        (256, False): "fa3_fp8_hdim256",
        (256, True): "fa3_fp8_hdim256_causal",
    },
    # up to these query lengths 128 x 128 tiles: 1.07-1.08x the 192-key ones at 1k (head_dim
    # 128), 1.14x at 1k and 1.03x at 2k (head_dim 64 causal), 0.97-0.99x from 2k at 128 and
    # 1.00x at 64 without a mask (H200, 2026-12-04, research/probes/fp8_tile_ab.py)
    shipped_fp8_short={
        (64, True): (2048, "fa3_fp8_hdim64_causal_short"),
        (128, False): (1024, "fa3_fp8_hdim128_short"),
        (128, True): (1024, "fa3_fp8_hdim128_causal_short"),
    },
    # fadsl.attention_varlen and attention_with_kvcache (docs/serving.md)
    shipped_serving={
        ("varlen", 64): "fa3_varlen_hdim64",
        ("varlen", 128): "fa3_varlen_causal",
        ("kvcache", 128): "fa3_decode_paged",
        # on 8-bit q (issue 42): head_dim 64 too, written in (dispatch.fp8_kvcache_kernel)
        ("kvcache_fp8", 128): "fa3_fp8_decode_paged",
    },
)
