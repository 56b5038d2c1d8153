"""What ptxas says a rendered kernel uses, and the occupancy that follows (no GPU needed).

The seeds' appendix reads registers per thread, spill bytes and SMEM per CTA
off ptxas's report; from those and the SM's limits follow the CTAs per SM. The
kernel is compiled as the runtime compiles it (NVRTC, else nvcc), and the cubin
and its log are kept in a cubin cache, since ptxas takes a while.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from .._data import cache_dir
from ..codegen.render import Source, header_text
from ..targets.archs import ARCH_FLAGS, SM_LIMITS
from .nvrtc import nvcc, parse_resource_usage

def usage_cache() -> Path:
    """Where ptxas reports are cached: under $FADSL_CACHE_DIR (default ~/.cache/fadsl)."""
    return cache_dir() / "ptxas"


def can_compile() -> bool:
    """Whether a compiler is here: NVRTC from the pip wheels, or nvcc."""
    from .nvrtc import nvrtc_available

    return nvrtc_available() or nvcc() is not None


def ptxas_usage(source: Source, arch: str, cache: Path | None = None) -> dict[str, int]:
    """Compile ``source`` to a cubin for ``arch`` as the runtime does (NVRTC, else nvcc; see
    fadsl/build/nvrtc.py) and return what ptxas reports, and the count of warnings. ``cache``: a
    cubin cache folder (fadsl/build/cache.py: entries written whole, built once across processes)."""
    from . import cache as cubin_cache
    from .nvrtc import compile_cubin

    if arch not in ARCH_FLAGS:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {sorted(ARCH_FLAGS)}")
    request = cubin_cache.Request(
        kernel=f"{source.kernel_name}_kernel",
        filename=source.filename,
        text=source.text,
        headers=header_text(),
        normalised="",
        arch=arch,
    )
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(cache) if cache is not None else Path(tmp)

        def build():
            return compile_cubin(source.text, source.filename, request.kernel, arch, where)

        if cache is None:
            log = build().log
        else:
            log = cubin_cache.get_or_build(request, build, announce=False, folder=cache).log
    usage = dataclasses.asdict(parse_resource_usage(log))
    usage["warnings"] = log.lower().count("warning")
    return usage


def ctas_per_sm(registers: int, threads: int, smem_bytes: int, arch: str) -> dict[str, int]:
    """CTAs per SM allowed by each limit, and the binding one."""
    lim = SM_LIMITS[arch]
    warps = threads // 32
    regs_per_warp = -(-registers * 32 // lim["unit"]) * lim["unit"]
    by = {
        "registers": lim["regs"] // (regs_per_warp * warps) if registers else lim["ctas"],
        "smem": lim["smem"] // (smem_bytes + lim["reserved"]),
        "warps": lim["warps"] // warps,
        "ctas": lim["ctas"],
    }
    by["ctas_per_sm"] = min(by.values())
    return by
