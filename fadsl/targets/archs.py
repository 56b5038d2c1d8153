"""The GPU architectures fadsl builds for, as data: nvcc's flags and each SM's limits.

A target runs on one or more of them (``Capabilities.archs``): sm_80's kernels on sm_80
and sm_90a, sm_90a's on sm_90a only.
"""

from __future__ import annotations

import re

# nvcc flags per architecture; wgmma-era Hopper needs the arch-specific "a" target.
ARCH_FLAGS = {
    "sm_80": ["-arch=sm_80"],
    "sm_90a": ["-gencode=arch=compute_90a,code=sm_90a"],
}
# Per-SM limits: registers, register allocation unit per warp, warps, CTAs, SMEM and
# the SMEM the driver reserves per CTA.
SM_LIMITS = {
    "sm_80": {
        "regs": 65536,
        "unit": 256,
        "warps": 64,
        "ctas": 32,
        "smem": 164 * 1024,
        "reserved": 1024,
    },
    "sm_90a": {
        "regs": 65536,
        "unit": 256,
        "warps": 64,
        "ctas": 32,
        "smem": 228 * 1024,
        "reserved": 1024,
    },
}


# sm_90a: (9, 0); sm_100: (10, 0); the "a" and "f" suffixes name arch-specific instructions
ARCH_PATTERN = re.compile(r"sm_(\d+)(\d)([af]?)")


def arch_for(capability: tuple[int, int]) -> str:
    """The architecture to build for on a GPU of ``capability``: sm_90a on Hopper (wgmma,
    setmaxnreg need the arch-specific target), else sm_XY."""
    major, minor = capability
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def capability_of(arch: str) -> tuple[int, int]:
    """The compute capability an architecture name stands for (ValueError if malformed)."""
    match = ARCH_PATTERN.fullmatch(arch)
    if match is None:
        raise ValueError(f"bad architecture '{arch}': expected a name such as sm_80 or sm_90a")
    return int(match.group(1)), int(match.group(2))
