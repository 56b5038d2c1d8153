"""The GPU architectures fadsl builds for, as data: nvcc's flags and each SM's limits.

A target runs on one or more of them (``Capabilities.archs``): sm_80's kernels on sm_80
and sm_90a, sm_90a's on sm_90a only.
"""

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
