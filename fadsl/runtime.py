"""Build a compiled spec with torch.utils.cpp_extension and call it from PyTorch.

Builds are cached on disk under ``$FADSL_CACHE_DIR`` (default ``~/.cache/fadsl``),
one folder per (kernel, dtype) keyed by a hash of everything that changes the
binary: the normalised spec, the rendered source, the nvcc version, the GPU
architecture, and the fadsl and torch versions. A file lock makes concurrent
builds of one entry safe; an entry that fails to import is rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import math
import numbers
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Iterator

from . import __version__
from .codegen import Source, header_text, write_headers, render, spec_hash
from .ir import Dtype
from .pipeline import Compiled, compile_file, compile_source

GRID_YZ_LIMIT = 65535


def cache_dir() -> Path:
    return Path(os.environ.get("FADSL_CACHE_DIR", Path.home() / ".cache" / "fadsl"))


def _nvcc_version() -> str:
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = Path(CUDA_HOME or "/usr/local/cuda") / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as err:
        raise RuntimeError(f"fadsl needs nvcc to build kernels; running {nvcc} failed: {err}")
    return out.stdout.strip().splitlines()[-1]


def arch_of(device) -> str:
    """The nvcc architecture for a device: sm_90a on Hopper (wgmma, setmaxnreg), else sm_XY."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import(name: str, so_path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, so_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so_path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(source: Source, normalised: str, arch: str, verbose: bool = True) -> ModuleType:
    """Build (or fetch from the cache) the extension for one rendered source."""
    import torch
    from torch.utils import cpp_extension

    key = hashlib.sha256(
        "\0".join(
            [
                normalised,
                source.text,
                header_text(),
                _nvcc_version(),
                arch,
                __version__,
                torch.__version__,
            ]
        ).encode()
    ).hexdigest()
    name = f"fadsl_{source.kernel_name}_{key[:12]}"
    entry = cache_dir() / name
    so_path = entry / f"{name}.so"
    done = entry / "BUILT"
    with _locked(cache_dir() / f"{name}.lock"):
        if done.exists() and so_path.exists():
            try:
                return _import(name, so_path)
            except ImportError as err:
                print(f"fadsl: cache entry {entry} is corrupt ({err}); rebuilding", file=sys.stderr)
        shutil.rmtree(entry, ignore_errors=True)
        entry.mkdir(parents=True)
        write_headers(entry)
        cu = entry / source.filename
        cu.write_text(source.text)
        if verbose:
            print(
                f"fadsl: compiling {source.kernel_name} for {arch} (not in the cache {cache_dir()}; "
                "about a minute)",
                file=sys.stderr,
                flush=True,
            )
        start = time.monotonic()
        gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
        module = cpp_extension.load(
            name=name,
            sources=[str(cu)],
            extra_cflags=["-O3", "-DFADSL_WITH_TORCH"],
            extra_cuda_cflags=["-O3", "-std=c++17", "-DFADSL_WITH_TORCH", gencode, "-lineinfo"],
            build_directory=str(entry),
            verbose=False,
        )
        done.write_text(f"{key}\n")
        if verbose:
            print(
                f"fadsl: built {source.kernel_name} in {time.monotonic() - start:.1f} s",
                file=sys.stderr,
            )
        return module


class FlashAttention:
    """A compiled spec; call it on CUDA tensors shaped (batch, seqlen, heads, head_dim)."""

    def __init__(self, compiled: Compiled, verbose: bool = True) -> None:
        self.compiled = compiled
        self.config = compiled.kernel.config
        self.verbose = verbose
        # Rendered under the kernel's name rather than the path it was loaded by, so that the
        # cache key (which hashes the source) does not depend on how the spec was reached.
        canonical = replace(compiled, file=f"{self.config.name}.fa")
        sources = render(canonical.kernel, canonical.target, canonical.file)
        self._sources = {s.dtype: s for s in sources}
        self._modules: dict[tuple[Dtype, str], ModuleType] = {}

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"<fadsl kernel {cfg.name}: {'/'.join(d.value for d in cfg.dtypes)}, "
            f"head_dim {cfg.head_dim}, B_r {cfg.block_r}, B_c {cfg.block_c}, {cfg.warps} warps>"
        )

    def source(self, dtype: str) -> str:
        return self._sources[Dtype(dtype)].text

    def module(self, dtype: Dtype, device) -> ModuleType:
        arch = arch_of(device)
        if (dtype, arch) not in self._modules:
            normalised = spec_hash(self.compiled.kernel)
            self._modules[dtype, arch] = build(self._sources[dtype], normalised, arch, self.verbose)
        return self._modules[dtype, arch]

    def resources(self, dtype: str, device=None) -> dict:
        """Registers per thread, local (spill) bytes, SMEM per CTA and CTAs per SM, as built."""
        import torch

        device = device if device is not None else torch.device("cuda")
        return dict(self.module(Dtype(dtype), device).attributes())

    def __call__(
        self, q, k, v, softmax_scale: float | None = None, *, out=None, return_lse: bool = False
    ):
        """Attention of q over (k, v): softmax(q k^T * softmax_scale [+ mask]) v.

        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim)
        with heads_q a multiple of heads_kv (GQA/MQA): query head h reads KV head
        h // (heads_q // heads_kv). A causal spec aligns the diagonal to the bottom right
        (query i sees key j when j <= i + seqlen_k - seqlen_q), as FlashAttention does.
        ``out``, if given, receives the result (q's shape, dtype and device). Returns the
        output, or ``(output, lse)`` with ``return_lse=True``: the natural-log log-sum-exp
        of each row's scaled scores, shape (batch, heads_q, seqlen_q), float32, -inf for
        a row that sees no key.
        """
        import torch

        dtype = self._validate(q, k, v)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.config.head_dim)
        elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(
                f"softmax_scale must be a real number, got {type(softmax_scale).__name__}"
            )
        elif not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if out is None:
            out = torch.empty_like(q)
        else:
            self._validate_out(out, q)
        lse = None
        if return_lse:
            batch, seqlen_q, heads_q, _ = q.shape
            lse = torch.empty(batch, heads_q, seqlen_q, device=q.device, dtype=torch.float32)
        self.module(dtype, q.device).forward(q, k, v, out, lse, float(softmax_scale))
        return (out, lse) if return_lse else out

    @staticmethod
    def _validate_out(out, q) -> None:
        import torch

        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must match q: shape {tuple(q.shape)}, {q.dtype}, {q.device}; got shape "
                f"{tuple(out.shape)}, {out.dtype}, {out.device}"
            )
        _check_layout("out", out)

    def _validate(self, q, k, v) -> Dtype:
        import torch

        cfg = self.config
        names = ("q", "k", "v")
        for name, t in zip(names, (q, k, v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        torch_dtypes = {torch.bfloat16: Dtype.BF16, torch.float16: Dtype.FP16}
        allowed = ", ".join(
            f"torch.{'bfloat16' if d is Dtype.BF16 else 'float16'}" for d in cfg.dtypes
        )
        for name, t in zip(names, (q, k, v)):
            if torch_dtypes.get(t.dtype) not in cfg.dtypes:
                raise TypeError(
                    f"{name} has dtype {t.dtype}; kernel '{cfg.name}' was compiled for {allowed}"
                )
            if t.dtype != q.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
            if t.dim() != 4:
                raise ValueError(
                    f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}"
                )
            if t.shape[3] != cfg.head_dim:
                raise ValueError(
                    f"{name}.shape[3] is the head_dim, which the spec fixes at {cfg.head_dim}, "
                    f"got {t.shape[3]}"
                )
            _check_layout(name, t)
        batch, seqlen_q, heads_q, _ = q.shape
        if k.shape != v.shape:
            raise ValueError(
                f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if k.shape[0] != batch:
            raise ValueError(f"k has batch {k.shape[0]} but q has batch {batch}")
        heads_kv, seqlen_k = k.shape[2], k.shape[1]
        if heads_kv == 0 or heads_q % heads_kv:
            raise ValueError(
                f"q's heads ({heads_q}) must be a multiple of k's and v's heads ({heads_kv})"
            )
        for name, n in (("q", seqlen_q), ("k", seqlen_k)):
            if n == 0:
                raise ValueError(f"{name}'s sequence length must be at least 1, got 0")
            if n >= 2**31:
                raise ValueError(
                    f"{name}'s sequence length {n} does not fit the kernel's int32 indices"
                )
        if batch > GRID_YZ_LIMIT or heads_q > GRID_YZ_LIMIT or batch == 0:
            raise ValueError(
                f"batch ({batch}) and heads ({heads_q}) must be between 1 and {GRID_YZ_LIMIT}"
            )
        for name, t in zip(names, (q, k, v)):
            if t.device.type != "cuda":
                raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        return torch_dtypes[q.dtype]


def _check_layout(name: str, t) -> None:
    """The kernel moves 16-byte vectors: last dimension contiguous, base and strides aligned."""
    if t.stride(3) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides "
            f"{t.stride()}; pass {name}.contiguous()"
        )
    if t.data_ptr() % 16 or any(st % 8 for st, n in zip(t.stride()[:3], t.shape[:3]) if n > 1):
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of 8 "
            f"elements (16-byte vector loads), got strides {t.stride()}"
        )


def load(spec: str | os.PathLike, verbose: bool = True) -> FlashAttention:
    """Compile a spec (a path to a .fa file, or the spec text itself) into a callable kernel."""
    if isinstance(spec, os.PathLike) or ("\n" not in spec and "{" not in spec):
        return FlashAttention(compile_file(Path(spec)), verbose)
    return FlashAttention(compile_source(spec, "<spec>"), verbose)
