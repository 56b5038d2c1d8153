"""The generic passes with the kernel's own target, as the pipeline gives it them: the passes
take their target as an argument (fadsl/passes/target.py), and the tests that run them on
hand-written or read-back kernels look it up here."""

from __future__ import annotations

from fadsl import targets
from fadsl.ir import Kernel
from fadsl.passes import insert_barriers as _insert
from fadsl.passes import plan_smem as _plan
from fadsl.passes import verify as _verify
from fadsl.passes.plan_smem import occupancy
from fadsl.passes.verify import VerifyError

__all__ = ["VerifyError", "insert_barriers", "occupancy", "plan_smem", "verify"]


def plan_smem(kernel: Kernel) -> Kernel:
    return _plan.plan_smem(kernel, targets.target_of(kernel))


def insert_barriers(kernel: Kernel) -> Kernel:
    return _insert.insert_barriers(kernel, targets.target_of(kernel))


def verify(kernel: Kernel) -> Kernel:
    return _verify.verify(kernel, targets.target_of(kernel))
