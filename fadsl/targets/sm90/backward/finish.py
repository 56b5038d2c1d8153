"""`fused_convert on`'s hand-over across CTAs, as data: what emit/sm90/include/fadsl/
sm90_bwd_convert.cuh's bwd_finish_dq does, call by call, after a CTA's consumer warpgroups
have made their last dQ red.add (their consumer function returned: the m-block loop, the
lagged last dQ and the dK / dV stores).

The order it must keep (verify_finish.py proves the plan keeps it; tests/
test_backward_fused_convert.py reads the header's calls against the plan):
- every consumer thread's red.adds performed at GPU scope before its CTA's counts (each
  thread's fence.acq_rel.gpu, then a meeting of every consumer thread: the count is made by
  one thread, after all the fences);
- a count is a release (the CTA's adds, through the meeting) and an acquire (the adds of every
  CTA whose count came before): atom.acq_rel.gpu;
- the lanes that read the sums are ordered after the acquiring lane (a warp barrier, which
  orders memory among its lanes), and read them through L2 (ld.global.cg: L1 is not coherent
  with other SMs' writes);
- no dQ add after the fence.

Kinds are program.py's where they exist; the three this protocol adds are its own (``FinishStep``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ....ir import WARPGROUP_THREADS


class FinishStep(Enum):
    RED_ADD = "red.global.add.f32 of dQ (the consumer function's, before bwd_finish_dq)"
    FENCE_ACQ_REL_GPU = "fence.acq_rel.gpu"
    BAR_SYNC = "bar.sync"
    COUNT = "atom.global.add.s32"
    SYNCWARP = "__syncwarp"
    LOAD_SUMS = "ld.global of dQ's sums"
    STORE_DQ = "st.global of dQ"


class Sem(Enum):
    """A count's memory semantics at GPU scope."""

    RELAXED = "relaxed"
    RELEASE = "release"
    ACQUIRE = "acquire"
    ACQ_REL = "acq_rel"


class Cache(Enum):
    """Where a load may find the sums."""

    L1 = "ld.global (L1 may hold a stale line)"
    L2 = "ld.global.cg (L2: where the adds are performed)"


class Executor(Enum):
    EVERY_CONSUMER_THREAD = "every consumer thread"
    ONE_THREAD_PER_M_BLOCK = "one consumer thread per m-block (its count)"
    EVERY_LANE_OF_THE_WARP = "every lane of the counting thread's warp"


@dataclass(frozen=True)
class FinishCall:
    step: FinishStep
    who: Executor
    why: str = ""
    threads: int = 0  # a bar.sync's
    sem: Sem | None = None  # a count's
    cache: Cache | None = None  # a load's
    header_call: str = ""  # the call in bwd_finish_dq (tests read the header against it)


def finish_plan(consumers: int) -> tuple[FinishCall, ...]:
    """The calls of one CTA from its last dQ add to its conversions, in order."""
    consumer_threads = consumers * WARPGROUP_THREADS
    return (
        FinishCall(
            FinishStep.RED_ADD, Executor.EVERY_CONSUMER_THREAD, "the consumer function's last adds"
        ),
        FinishCall(
            FinishStep.FENCE_ACQ_REL_GPU,
            Executor.EVERY_CONSUMER_THREAD,
            "RAW across CTAs: the thread's red.adds performed before the counts",
            header_call="fence_acq_rel_gpu",
        ),
        FinishCall(
            FinishStep.BAR_SYNC,
            Executor.EVERY_CONSUMER_THREAD,
            "every consumer thread's fence before any count",
            threads=consumer_threads,
            header_call="named_bar_sync",
        ),
        FinishCall(
            FinishStep.COUNT,
            Executor.ONE_THREAD_PER_M_BLOCK,
            "release: the CTA's adds; acquire: every earlier contributor's",
            sem=Sem.ACQ_REL,
            header_call="atomic_add_acq_rel_gpu",
        ),
        FinishCall(
            FinishStep.SYNCWARP,
            Executor.EVERY_LANE_OF_THE_WARP,
            "the completing lanes' acquires before every lane's reads",
            header_call="__syncwarp",
        ),
        FinishCall(
            FinishStep.LOAD_SUMS,
            Executor.EVERY_LANE_OF_THE_WARP,
            "the completed m-block's sums",
            cache=Cache.L2,
            header_call="bwd_dq_unit_load<Cfg, true>",
        ),
        FinishCall(
            FinishStep.STORE_DQ,
            Executor.EVERY_LANE_OF_THE_WARP,
            "dQ in the input dtype",
            header_call="bwd_dq_unit_store<Cfg>",
        ),
    )
