"""Compile a rendered kernel to a cubin: NVRTC from NVIDIA's pip wheels, nvcc as a fallback.

No CUDA toolkit is needed: ``cuda-bindings`` calls NVRTC (the ``nvidia-cuda-nvrtc`` wheel),
and ``cuda-pathfinder`` finds the CUDA headers the kernel includes (``cuda_fp16.h`` and
``cuda_bf16.h`` from the cudart wheel, ``<cuda/std/...>`` from the CCCL wheel). ptxas runs
with ``-v``, so the compiler's log holds the registers, spills and stack it reports.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import BuildError

# Options that change the binary (besides the architecture); part of every cache key.
# -default-device: NVRTC 13.0 takes a generic lambda inside a kernel (sm_90a's mainloop body)
# for host code unless unannotated functions default to __device__ (later NVRTCs do not ask).
OPTIONS = ("-std=c++17", "-lineinfo", "--ptxas-options=-v", "-default-device")


@dataclass(frozen=True)
class Cubin:
    """A cubin and what the compiler said while building it."""

    cubin: bytes
    log: str
    compiler: str  # e.g. "nvrtc 13.0"

    def ptxas(self) -> dict[str, int]:
        """ptxas's report as a dict (all zero when the log has none)."""
        try:
            return dataclasses.asdict(parse_resource_usage(self.log))
        except ValueError:
            return dataclasses.asdict(Usage(registers=0))


@dataclass(frozen=True)
class Usage:
    """What the compiler reports for one kernel (its entry function and what it calls)."""

    registers: int
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    stack_bytes: int = 0
    static_smem_bytes: int = 0
    # ptxas's note C7512: it made the kernel's wgmma.mma_async wait for each other ("serialized
    # due to insufficient register resources"), which costs a Hopper kernel its overlap of
    # MMAs with everything else (a backward 15-21 % slower on an H200, 2026-11-30)
    wgmma_serialized: bool = False

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes or self.stack_bytes)

    @property
    def short_of_registers(self) -> bool:
        """Spills, a stack frame, or wgmma serialized: the kernel did not fit its registers."""
        return self.spills or self.wgmma_serialized

    def shortfall(self) -> str:
        """What ptxas did for lack of registers, in words ("" where nothing)."""
        parts = []
        if self.spills:
            parts.append(
                f"{self.spill_store_bytes} bytes of spill stores, {self.spill_load_bytes} of "
                f"loads, a {self.stack_bytes}-byte stack frame"
            )
        if self.wgmma_serialized:
            parts.append("its wgmma serialized (ptxas C7512)")
        return "; ".join(parts)


# ptxas's note when it serializes wgmma for lack of registers (other C7512 causes, such as
# wgmma across a function call, print other words but the same code)
_WGMMA_SERIALIZED = re.compile(r"\(C7512\)|wgmma\.mma_async instructions are serialized")

_FIELDS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_bytes": re.compile(r"(\d+) bytes (?:stack frame|cumulative stack size)"),
    "spill_store_bytes": re.compile(r"(\d+) bytes spill stores"),
    "spill_load_bytes": re.compile(r"(\d+) bytes spill loads"),
    "static_smem_bytes": re.compile(r"(\d+) bytes smem"),
}


def parse_resource_usage(log: str) -> Usage:
    """Read ptxas's ``-v`` / ``--resource-usage`` report (nvcc's output, or NVRTC's log with
    ``--ptxas-options=-v``). Each field is the largest over the functions reported: the
    kernel and any function it calls that was not inlined."""
    values: dict[str, int] = {}
    for line in log.splitlines():
        for field, pattern in _FIELDS.items():
            for match in pattern.finditer(line):
                values[field] = max(values.get(field, 0), int(match.group(1)))
    if "registers" not in values:
        raise ValueError(f"no 'Used N registers' line in the compiler's report:\n{log.strip()}")
    return Usage(**values, wgmma_serialized=bool(_WGMMA_SERIALIZED.search(log)))


def fadsl_headers() -> dict[str, str]:
    """fadsl's own CUDA headers by the names sources include them by: ``fadsl/params.cuh``
    ..., and the bare name too, for a header that includes another "next to" itself."""
    from ..codegen.render import HEADERS, read_header

    found = {}
    for name in HEADERS:
        text = read_header(name)
        found[name] = text
        found[name.rsplit("/", 1)[-1]] = text
    return found


@functools.cache
def _nvrtc():
    """cuda.bindings.nvrtc, or None when the wheel or its library is missing."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return None
    try:
        err, *_ = nvrtc.nvrtcVersion()
    except Exception:  # the library itself could not be loaded
        return None
    return nvrtc if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def nvrtc_available() -> bool:
    return _nvrtc() is not None


@functools.cache
def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    default = Path(home) / "bin" / "nvcc"
    return str(default) if default.exists() else None


@functools.cache
def compiler_id() -> str:
    """The compiler that builds kernels here and its version (part of the cache key)."""
    nvrtc = _nvrtc()
    if nvrtc is not None:
        _, major, minor = nvrtc.nvrtcVersion()
        return f"nvrtc {major}.{minor}"
    path = nvcc()
    if path is None:
        raise BuildError(
            "fadsl needs NVRTC to build kernels: pip install cuda-bindings "
            "'cuda-toolkit[nvrtc,cudart,cccl]' (or put nvcc on the PATH)"
        )
    out = subprocess.run([path, "--version"], capture_output=True, text=True)
    return "nvcc " + (out.stdout.strip().splitlines() or ["?"])[-1]


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Folders holding cuda_fp16.h / cuda_bf16.h and <cuda/std/...>: the wheels first,
    then a toolkit under $CUDA_HOME (or /usr/local/cuda) if there is one."""
    dirs: list[str] = []
    try:
        from cuda import pathfinder

        for lib in ("cudart", "cccl"):
            found = pathfinder.find_nvidia_header_directory(lib)
            if found:
                dirs.append(str(found))
    except (ImportError, AttributeError, RuntimeError):
        pass
    home = Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")
    for sub in ("include", "include/cccl"):
        if (home / sub).is_dir():
            dirs.append(str(home / sub))
    return tuple(dict.fromkeys(dirs))


def options(arch: str) -> list[str]:
    return [f"--gpu-architecture={arch}", *OPTIONS]


def compile_cubin(text: str, filename: str, kernel: str, arch: str, where: Path) -> Cubin:
    """Compile one translation unit to a cubin for ``arch`` (``sm_80``, ``sm_90a`` ...).

    ``where`` is a folder the source is written to when the compiler rejects it, so that the
    error can name a file a person can open.
    """
    nvrtc = _nvrtc()
    if nvrtc is not None:
        return _compile_nvrtc(nvrtc, text, filename, arch, where)
    if nvcc() is not None:
        return _compile_nvcc(text, filename, arch, where)
    compiler_id()  # raises the message that says what to install
    raise AssertionError("unreachable")


def _failed(text: str, filename: str, arch: str, where: Path, log: str, tool: str) -> BuildError:
    from ..atomic import write_atomic

    path = write_atomic(Path(where) / "failed" / filename, text)
    return BuildError(
        f"{tool} could not compile {filename} for {arch}; the generated source is {path}\n"
        f"{log.strip()}"
    )


def _compile_nvrtc(nvrtc, text: str, filename: str, arch: str, where: Path) -> Cubin:
    def check(result, what: str):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise BuildError(f"NVRTC {what} failed: {result[0]!r}")
        return result[1] if len(result) == 2 else None

    opts = options(arch) + [f"-I{d}" for d in cuda_include_dirs()]
    headers = fadsl_headers()  # passed in memory: nothing to write or find on disk
    program = check(
        nvrtc.nvrtcCreateProgram(
            text.encode(),
            filename.encode(),
            len(headers),
            [h.encode() for h in headers.values()],
            [n.encode() for n in headers],
        ),
        "create",
    )
    try:
        status = nvrtc.nvrtcCompileProgram(program, len(opts), [o.encode() for o in opts])[0]
        size = check(nvrtc.nvrtcGetProgramLogSize(program), "log size")
        log = b" " * size
        check(nvrtc.nvrtcGetProgramLog(program, log), "log")
        log_text = log.rstrip(b"\0 ").decode(errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise _failed(text, filename, arch, where, log_text, "NVRTC")
        size = check(nvrtc.nvrtcGetCUBINSize(program), "cubin size")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return Cubin(cubin, log_text, compiler_id())


def _compile_nvcc(text: str, filename: str, arch: str, where: Path) -> Cubin:
    gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
    from ..codegen.render import write_headers

    with tempfile.TemporaryDirectory() as tmp:
        write_headers(Path(tmp))
        cu = Path(tmp) / filename
        cu.write_text(text)
        cubin = Path(tmp) / "kernel.cubin"
        cmd = [nvcc(), "-std=c++17", "-O3", "-cubin", "-lineinfo", "--resource-usage", gencode]
        cmd += ["-I", tmp, "-o", str(cubin), str(cu)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise _failed(text, filename, arch, where, log, "nvcc")
        return Cubin(cubin.read_bytes(), log, compiler_id())
