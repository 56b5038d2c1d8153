"""sm_80's capabilities and sync model, as data.

mma.sync m16n8k16 on registers, cp.async (16 bytes a lane, completed by commit
groups and cp.async.wait_group), ldmatrix; runs on sm_80 to sm_90.
"""

from __future__ import annotations

from ...ir import Dtype, Instr, Level, Scope
from ...ir.syncmodel import AsyncKind, SyncKind, SyncModel, WaitRule
from .. import Capabilities
from ..archs import SM_LIMITS
from ..common_syncs import SYNCTHREADS

CAPABILITIES = Capabilities(
    mma="mma.sync m16n8k16",
    smem_per_cta=163 * 1024,
    smem_per_sm=SM_LIMITS["sm_80"]["smem"],
    registers_per_thread=255,
    registers_per_sm=SM_LIMITS["sm_80"]["regs"],
    hop_instrs={
        (Level.GMEM, Level.SMEM): (Instr.CP_ASYNC,),
        (Level.SMEM, Level.RF): (Instr.LDMATRIX, Instr.LDMATRIX_TRANS),
        (Level.RF, Level.SMEM): (Instr.ST_SHARED,),
        (Level.SMEM, Level.GMEM): (Instr.ST_GLOBAL,),
    },
    archs=(("sm_80", "A100"), ("sm_90a", "H100/H200")),
    devices=((8, 0), False),  # sm_80 and newer
    alignment="16-byte vector loads",
    dtypes=(Dtype.BF16, Dtype.FP16),  # mma.sync's 16-bit inputs (FP8 is sm_90a's)
)

# A cp.async copy lands in SMEM some time after it is issued; each step that issues
# copies commits them as one group.
CP_ASYNC = AsyncKind(name="cp.async", flag="async")

SYNCWARP = SyncKind("__syncwarp()", "a warp barrier", scope=Scope.WARP, cost=1)
# cp.async.wait_group N: all but this thread's N most recent groups have landed. It
# orders nothing across threads: a barrier must follow for other threads to see the data.
CP_ASYNC_WAIT = SyncKind(
    "cp.async.wait_group",
    "a cp.async wait",
    completes=CP_ASYNC,
    rule=WaitRule.NEWEST_PENDING,
    cost=2,
)

SYNC_MODEL = SyncModel(
    async_kinds=(CP_ASYNC,),
    barriers=(SYNCWARP, SYNCTHREADS),
    waits=(CP_ASYNC_WAIT,),
)
