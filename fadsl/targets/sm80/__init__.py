"""The sm_80 target: mma.sync m16n8k16, cp.async and ldmatrix; runs on sm_80 to sm_90.

Every warp runs every step (its rows of a warp-scoped tile, or all of a
CTA-scoped one); SMEM is ordered by __syncwarp() / __syncthreads() and cp.async
commit groups by cp.async.wait_group.
"""

from __future__ import annotations

from ...passes.insert_barriers import insert_barriers
from ...passes.plan_smem import plan_smem
from ...passes.verify import verify
from .. import Target
from .caps import CAPABILITIES, SYNC_MODEL
from .emit import TEMPLATE, context
from .host import LAUNCH
from .schedule import build_schedule
from .tune_space import TUNE_SPACE
from .validate import validate, validate_path

TARGET = Target(
    name="sm_80",
    package="sm80",
    capabilities=CAPABILITIES,
    sync_model=SYNC_MODEL,
    validate=validate,
    validate_path=validate_path,
    build_schedule=build_schedule,
    passes=(
        ("plan_smem", plan_smem),  # liveness -> regions and offsets; SMEM limit check
        ("insert_barriers", insert_barriers),  # cheapest syncs for every SMEM hazard
        ("verify", verify),  # independent proof that the syncs suffice
    ),
    template=TEMPLATE,
    context=context,
    launch=LAUNCH,
    tune_space=TUNE_SPACE,  # fadsl tune: the tile and the warps
    # fadsl.attention elsewhere (sm_80 and newer): the fastest sm_80 examples
    shipped={
        (64, False): "fa2_hdim64",
        (128, False): "fa2_pipelined",
        (128, True): "fa2_causal",
        (256, False): "fa2_hdim256",
    },
)
