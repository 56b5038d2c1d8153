"""What ptxas says a rendered kernel uses, and the occupancy that follows (no GPU needed).

The seeds' appendix reads registers per thread, spill bytes and SMEM per CTA
off `nvcc --resource-usage`; from those and the SM's limits follow the CTAs
per SM. Results are cached on disk by source hash, since ptxas takes a while.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .codegen import Source, header_text, write_headers
from .compile_check import parse_resource_usage

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


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


@functools.cache
def nvcc_version() -> str:
    """nvcc's release, e.g. '13.0' (part of every cache key)."""
    compiler = nvcc()
    if compiler is None:
        return "none"
    out = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    release = [line for line in out.splitlines() if "release" in line]
    return release[-1].split("release")[-1].split(",")[0].strip() if release else "unknown"


def usage_cache() -> Path:
    """Where ptxas reports are cached: under $FADSL_CACHE_DIR (default ~/.cache/fadsl)."""
    root = os.environ.get("FADSL_CACHE_DIR") or Path.home() / ".cache" / "fadsl"
    return Path(root) / "ptxas"


def ptxas_usage(source: Source, arch: str, cache: Path | None = None) -> dict[str, int]:
    """Compile ``source`` to a cubin for ``arch`` and return what ptxas reports."""
    compiler = nvcc()
    if compiler is None:
        raise FileNotFoundError("nvcc is not on the PATH")
    key = hashlib.sha256(
        (source.text + header_text() + arch + nvcc_version()).encode()
    ).hexdigest()[:20]
    cached = cache / f"ptxas-{key}.json" if cache else None
    if cached and cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_headers(root)
        cu = root / source.filename
        cu.write_text(source.text)
        cmd = [compiler, "-std=c++17", "-O3", "-cubin", "--resource-usage", *ARCH_FLAGS[arch]]
        proc = subprocess.run(
            cmd + ["-o", str(root / "k.cubin"), str(cu)], capture_output=True, text=True
        )
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed on {source.filename}:\n{proc.stderr}")
    usage = dataclasses.asdict(parse_resource_usage(proc.stdout + proc.stderr))
    usage["warnings"] = (proc.stdout + proc.stderr).lower().count("warning")
    if cached:  # written whole or not at all: a concurrent reader never sees half a file
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_text(json.dumps(usage))
        os.replace(partial, cached)
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
