"""Kernels up to (not through) verify, so that a test can hand verify a plan it refuses."""

from __future__ import annotations

from pathlib import Path

from fadsl import targets
from fadsl.ir import Kernel
from fadsl.pipeline import front_end

ROOT = Path(__file__).resolve().parents[1]
# The sm_90a examples (serving's too), the test specs, and FlashAttention-3's 128 x 176 (O over
# the dead V ring)
SM90_SPECS = (
    sorted(ROOT.glob("examples/fa3_*.fa"))
    + sorted(ROOT.glob("examples/serving/*.fa"))
    + sorted(ROOT.glob("tests/specs/sm90/*.fa"))
    + [ROOT / "tests/specs/bench/fa3_hopper_bc176.fa"]
)


def unverified(source: str, file: str = "<spec>") -> Kernel:
    """The kernel after every pass before verify."""
    kernel = front_end(source, file)
    target = targets.target_of(kernel)
    for name, run in target.passes:
        if name == "verify":
            return kernel
        kernel = run(kernel, target)
    raise AssertionError("the target has no verify pass")
