"""A compiled spec as a PyTorch operator: NVRTC builds the kernel, the driver API launches it.

``fadsl.load(spec)`` renders the kernel's CUDA (device code only) and returns a
``FlashAttention``. Its first call for a dtype on a device finds the cubin in an
ahead-of-time folder (``fadsl build``), else in the cache under ``$FADSL_CACHE_DIR``
(default ``~/.cache/fadsl``), else builds it with NVRTC (about a second) and caches it; see
fadsl/cache.py. Each kernel is also a ``torch.library.custom_op`` (fadsl/op.py), so
``torch.compile(fullgraph=True)`` traces through it, and its backward says it is forward-only.

Eager calls that need no autograd launch directly, without the dispatcher: the checks, the
params struct (fadsl/params.py) and one ``cuLaunchKernel`` on the current stream.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from . import cache
from .codegen import Source, header_text, render, spec_hash
from .compiler import compile_cubin
from .ir import Dtype
from .params import Args, cluster_size, launch_for
from .pipeline import Compiled, compile_file, compile_source

GRID_YZ_LIMIT = 65535
# The kernels index rows with 32-bit ints and add two sequence lengths: both stay below 2^30.
SEQLEN_LIMIT = 2**30

log = logging.getLogger("fadsl")


def cache_dir() -> Path:
    return cache.cache_dir()


def arch_of(device) -> str:
    """The architecture to build for: sm_90a on Hopper (wgmma, setmaxnreg), else sm_XY."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


# The GPUs each target's instructions run on: (lowest compute capability, that one only).
TARGET_DEVICES = {"sm_80": ((8, 0), False), "sm_90a": ((9, 0), True)}


def runs_on(target: str, device) -> bool:
    """Whether the target's instructions run on ``device``'s GPU."""
    import torch

    capability = torch.cuda.get_device_capability(device)
    lowest, only = TARGET_DEVICES[target]
    return capability == lowest if only else capability >= lowest


def check_device(target: str, kernel_name: str, device) -> None:
    """Refuse a GPU the spec's target cannot run on, before building anything."""
    import torch

    if not runs_on(target, device):
        capability = torch.cuda.get_device_capability(device)
        lowest, only = TARGET_DEVICES[target]
        needs = f"compute capability {lowest[0]}.{lowest[1]}" + ("" if only else " or newer")
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"kernel '{kernel_name}' targets {target}, which needs {needs}; "
            f"{device} is {name} (compute capability {capability[0]}.{capability[1]})"
        )


def _ensure_log_handler() -> None:
    """Show the one-line build messages by default, unless the program set up logging."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)


class FlashAttention:
    """A compiled spec; call it on CUDA tensors shaped (batch, seqlen, heads, head_dim)."""

    def __init__(
        self, compiled: Compiled, verbose: bool = True, cubin_dirs: Iterable[os.PathLike] = ()
    ) -> None:
        self.compiled = compiled
        self.config = compiled.kernel.config
        self.verbose = verbose
        self.cubin_dirs = [Path(d) for d in cubin_dirs]
        # Rendered under the kernel's name rather than the path it was loaded by, so that the
        # cache key (which hashes the source) does not depend on how the spec was reached.
        canonical = replace(compiled, file=f"{self.config.name}.fa")
        sources = render(canonical.kernel, canonical.target, canonical.file)
        self._sources = {s.dtype: s for s in sources}
        self._launch = launch_for(self.config.target)
        self._block = self._launch.block(compiled.kernel)
        self._cluster = cluster_size(compiled.kernel)  # the spec's; a launch may use fewer
        # The launches that do not pair run this cluster-free variant (fadsl.targets.sm90.alone).
        self.alone: FlashAttention | None = (
            FlashAttention(compiled.alone, verbose, cubin_dirs) if compiled.alone else None
        )
        self._co_resident: dict[tuple[Dtype, int], int] = {}  # CTAs in co-resident clusters
        self._modules: dict[tuple[Dtype, int], object] = {}
        self._entries: dict[tuple[Dtype, str], cache.Entry] = {}
        self.op_name = f"{self.config.name}_{spec_hash(compiled.kernel)[:12]}"
        from .op import ops_for

        # Registered now, not on first use: torch.compile cannot trace a registration.
        self._ops = ops_for(self)

    def __repr__(self) -> str:
        cfg = self.config
        return (
            f"<fadsl kernel {cfg.name}: {'/'.join(d.value for d in cfg.dtypes)}, "
            f"head_dim {cfg.head_dim}, B_r {cfg.block_r}, B_c {cfg.block_c}, {cfg.warps} warps>"
        )

    def source(self, dtype: str) -> str:
        return self._sources[Dtype(dtype)].text

    # ------------------------------------------------------------------ building
    def request(self, dtype: Dtype, arch: str) -> cache.Request:
        source: Source = self._sources[dtype]
        return cache.Request(
            kernel=self._launch.symbol(source.kernel_name),
            filename=source.filename,
            text=source.text,
            headers=header_text(),
            normalised=spec_hash(self.compiled.kernel),
            arch=arch,
        )

    def cubin(self, dtype: Dtype, arch: str, rebuild: bool = False) -> cache.Entry:
        """The cubin for ``dtype`` on ``arch``: ahead-of-time folders first, then the cache
        (built there if missing). Needs no GPU."""
        if not rebuild and (dtype, arch) in self._entries:
            return self._entries[dtype, arch]
        request = self.request(dtype, arch)
        entry = None if rebuild else cache.find_aot(request, self.cubin_dirs + cache.cubin_path())
        if entry is None:
            if self.verbose:
                _ensure_log_handler()

            def build():
                return compile_cubin(
                    request.text, request.filename, request.kernel, arch, cache.cache_dir()
                )

            entry = cache.get_or_build(request, build, announce=self.verbose, rebuild=rebuild)
        self._entries[dtype, arch] = entry
        return entry

    def use_development_build(self, dtype: Dtype, arch: str, defines: dict[str, int]) -> None:
        """Build ``dtype``'s kernel for ``arch`` with ``defines`` (#define NAME VALUE before
        the source: FADSL_TILE_TRACE, FADSL_TMA_LOADS) and run that cubin in this process
        instead of the cached one, which stays untouched (scripts/tile_trace.py,
        scripts/energy_probe.py), the cluster-free variant's too. Before the kernel's first
        call on a device."""
        import tempfile

        if self.alone is not None:
            self.alone.use_development_build(dtype, arch, defines)

        request = self.request(dtype, arch)
        head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
        with tempfile.TemporaryDirectory() as where:
            built = compile_cubin(
                head + request.text, request.filename, request.kernel, arch, Path(where)
            )
        self._entries[dtype, arch] = cache.Entry(built.cubin, built.log, {}, Path(where) / "dev")

    def module(self, dtype: Dtype, device):
        """The loaded kernel for ``dtype`` on ``device`` (a torch.device or index)."""
        import torch

        from .driver import DriverError, Module

        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        found = self._modules.get((dtype, index))
        if found is not None:
            return found
        check_device(self.config.target, self.config.name, torch.device("cuda", index))
        arch = arch_of(index)
        name = self.request(dtype, arch).kernel
        entry = self.cubin(dtype, arch)
        smem = self._smem_bytes(entry.cubin, name)
        with torch.cuda.device(index):
            try:
                module = Module(entry.cubin, name, smem, self._block[0])
            except DriverError as err:
                log.warning("fadsl: %s does not load (%s); building it again", entry.path, err)
                entry = self.cubin(dtype, arch, rebuild=True)
                module = Module(entry.cubin, name, smem, self._block[0])
            module.prepare(index)
            if self._cluster > 1:
                # the pairs that run at once (cuOccupancyMaxActiveClusters): a persistent
                # grid of more CTAs would run its last ones in a second wave
                self._co_resident[dtype, index] = self._cluster * module.max_active_clusters(
                    index, self._cluster
                )
        self._modules[dtype, index] = module
        return module

    def _smem_bytes(self, cubin: bytes, name: str) -> int:
        """The dynamic SMEM to launch with: the plan's, checked against the launch info the
        cubin exports (threads, SMEM, B_r, B_c, CTAs per cluster) where the target has one."""
        smem = self.compiled.kernel.smem_bytes
        if not self._launch.launch_info:
            return smem
        from .elf import read_ints

        built = read_ints(cubin, f"{name}_launch_info", 5)
        expected = (self._block[0], smem, self.config.block_r, self.config.block_c, self._cluster)
        if built != expected:
            raise RuntimeError(
                f"{name}'s cubin says (threads, SMEM bytes, B_r, B_c, cluster) = {built} but "
                f"the spec compiled to {expected}; the generator and the header disagree"
            )
        return smem

    def resources(self, dtype: str, device=None) -> dict:
        """What the kernel uses on ``device`` (default: the current one): registers per
        thread, local (spill) bytes, SMEM per CTA and CTAs per SM from the driver, and
        ptxas's report (spill stores/loads, stack) from the build log."""
        import torch

        device = torch.device(device if device is not None else "cuda")
        index = device.index if device.index is not None else torch.cuda.current_device()
        module = self.module(Dtype(dtype), index)
        with torch.cuda.device(index):
            found = module.attributes(index)
        ptxas = self.cubin(Dtype(dtype), arch_of(index)).meta.get("ptxas", {})
        for key in ("spill_store_bytes", "spill_load_bytes", "stack_bytes"):
            found[key] = int(ptxas.get(key, 0))
        return found

    # ------------------------------------------------------------------ calling
    def __call__(
        self, q, k, v, softmax_scale: float | None = None, *, out=None, return_lse: bool = False
    ):
        """Attention of q over (k, v): softmax(q k^T * softmax_scale [+ mask]) v.

        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim)
        with heads_q a multiple of heads_kv (GQA/MQA): query head h reads KV head
        h // (heads_q // heads_kv). A causal spec aligns the diagonal to the bottom right
        (query i sees key j when j <= i + seqlen_k - seqlen_q), as FlashAttention does.
        ``out``, if given, receives the result (q's shape, dtype and device; memory of its
        own). Returns the output, or ``(output, lse)`` with ``return_lse=True``: the
        natural-log log-sum-exp of each row's scaled scores, shape (batch, heads_q,
        seqlen_q), float32, -inf for a row that sees no key. Forward only: a backward
        through it raises.
        """
        import torch

        scale = self._scale(softmax_scale)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if torch.compiler.is_compiling():
            return self._call_op(q, k, v, scale, out, return_lse)
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)
        ):
            if out is not None:
                raise RuntimeError(
                    f"fadsl kernel '{self.config.name}' is forward-only and out= does not "
                    "support automatic differentiation; call it under torch.no_grad() or "
                    "pass q, k and v detached"
                )
            return self._call_op(q, k, v, scale, None, return_lse)
        return self.forward(q, k, v, scale, out, return_lse)

    def _call_op(self, q, k, v, scale: float, out, return_lse: bool):
        import torch

        functional, with_out = self._ops
        if out is None:
            o, lse = functional(q, k, v, scale, return_lse)
            return (o, lse) if return_lse else o
        lse = None
        if return_lse:
            lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
        with_out(q, k, v, out, lse, scale)
        return (out, lse) if return_lse else out

    def forward(self, q, k, v, scale: float, out=None, return_lse: bool = False):
        """Check the arguments, allocate what is missing and launch (no dispatcher)."""
        import torch

        dtype = self.check_inputs(q, k, v)
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
            for name, t in (("q", q), ("k", k), ("v", v)):
                _check_base(name, t, self.config.target)
        if out is None:
            out = torch.empty_like(q)
        else:
            self._check_out(out, q, k, v)
        lse = None
        if return_lse:
            lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
        self.launch(dtype, q, k, v, out, lse, scale)
        return (out, lse) if return_lse else out

    def forward_into(self, q, k, v, out, lse, scale: float) -> None:
        """Check the arguments and launch, writing ``out`` and ``lse`` (if not None)."""
        scale = self._scale(scale)
        dtype = self.check_inputs(q, k, v)
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_base(name, t, self.config.target)
        self._check_out(out, q, k, v)
        if lse is not None:
            check_lse(lse, q)
        self.launch(dtype, q, k, v, out, lse, scale)

    def launch(self, dtype: Dtype, q, k, v, out, lse, scale: float) -> None:
        """Launch on q's device and that device's current stream (arguments checked)."""
        import torch

        index = q.device.index
        args = Args(q, k, v, out, lse, scale)
        kernel = self.compiled.kernel
        cluster = self._launch.cluster(kernel, args)
        if cluster == 1 and self.alone is not None:
            self.alone.launch(dtype, q, k, v, out, lse, scale)
            return
        params = self._launch.pack(kernel, args)
        grid = self._launch.grid(kernel, args)
        module = self._modules.get((dtype, index)) or self.module(dtype, index)
        if cluster > 1 and kernel.config.hopper.persistent:
            grid = (min(grid[0], self._co_resident[dtype, index]), 1, 1)
        if index == torch.cuda.current_device():
            module.launch(grid, self._block, params, _current_stream(index), cluster)
        else:
            with torch.cuda.device(index):
                module.launch(grid, self._block, params, _current_stream(index), cluster)

    # ------------------------------------------------------------------ checks
    def _scale(self, softmax_scale) -> float:
        if softmax_scale is None:
            return 1.0 / math.sqrt(self.config.head_dim)
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
            raise TypeError(
                f"softmax_scale must be a real number, got {type(softmax_scale).__name__}"
            )
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")
        return float(softmax_scale)

    def check_inputs(self, q, k, v) -> Dtype:
        """Types, dtypes, shapes, strides and devices of q, k, v (no memory access: fake
        tensors pass). One cheap test first; the checks that name what is wrong run only when
        it fails (a call's host time is a few microseconds)."""
        try:
            dtype = self._accepts(q, k, v)
        except Exception:  # anything unexpected (not tensors, symbolic sizes): the full checks
            dtype = None
        return dtype if dtype is not None else self._explain_inputs(q, k, v)

    def _accepts(self, q, k, v) -> Dtype | None:
        dtype = self._dtypes.get(q.dtype)
        qs, ks, qst, kst, vst = q.shape, k.shape, q.stride(), k.stride(), v.stride()
        d = self.config.head_dim
        device = q.get_device()
        ok = (
            dtype is not None
            and k.dtype == q.dtype
            and v.dtype == q.dtype
            and len(qs) == 4
            and ks == v.shape
            and len(ks) == 4
            and qs[3] == d
            and ks[3] == d
            and ks[0] == qs[0]
            and 0 < ks[2] <= qs[2] <= GRID_YZ_LIMIT
            and qs[2] % ks[2] == 0
            and 0 < qs[0] <= GRID_YZ_LIMIT
            and 0 < qs[1] < SEQLEN_LIMIT
            and 0 < ks[1] < SEQLEN_LIMIT
            and qst[3] == kst[3] == vst[3] == 1
            and not any(st % 8 for st in (*qst[:3], *kst[:3], *vst[:3]))
            and device >= 0
            and k.get_device() == device
            and v.get_device() == device
            and q.device.type == "cuda"
        )
        return dtype if ok else None

    @functools.cached_property
    def _dtypes(self) -> dict:
        import torch

        torch_dtypes = {torch.bfloat16: Dtype.BF16, torch.float16: Dtype.FP16}
        return {t: d for t, d in torch_dtypes.items() if d in self.config.dtypes}

    def _explain_inputs(self, q, k, v) -> Dtype:
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
            _check_strides(name, t, cfg.target)
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
            if n >= SEQLEN_LIMIT:
                raise ValueError(
                    f"{name}'s sequence length {n} must be below 2^30 (the kernel's int32 "
                    "index arithmetic)"
                )
        if not (1 <= batch <= GRID_YZ_LIMIT and 1 <= heads_q <= GRID_YZ_LIMIT):
            raise ValueError(
                f"batch ({batch}) and heads ({heads_q}) must be between 1 and {GRID_YZ_LIMIT}"
            )
        for name, t in zip(names, (q, k, v)):
            if t.device.type != "cuda":
                raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        return torch_dtypes[q.dtype]

    def check_out_meta(self, out, q) -> None:
        import torch

        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must match q: shape {tuple(q.shape)}, {q.dtype}, {q.device}; got shape "
                f"{tuple(out.shape)}, {out.dtype}, {out.device}"
            )
        _check_strides("out", out, self.config.target)

    def _check_out(self, out, q, k, v) -> None:
        self.check_out_meta(out, q)
        _check_base("out", out, self.config.target)
        # A contiguous out (the usual case) has no overlapping elements: skip the walk.
        if not out.is_contiguous() and _overlaps_itself(out):
            raise ValueError(
                f"out's elements must not overlap (got strides {out.stride()} for shape "
                f"{tuple(out.shape)}); pass a tensor such as torch.empty_like(q)"
            )
        out_first, out_end = _span(out)
        for name, t in (("q", q), ("k", k), ("v", v)):
            first, end = _span(t)
            if first < out_end and out_first < end:
                raise ValueError(
                    f"out shares memory with {name}; the kernel reads {name} while it writes "
                    "out, so out must have memory of its own"
                )


def _current_stream(index: int) -> int:
    """The handle of PyTorch's current stream on device ``index`` (a CUDA graph capture's
    stream while capturing)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: faster
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


# Why the strides and the base must be 16-byte aligned, per target (the rule is the same).
ALIGNMENT_REASON = {
    "sm_80": "16-byte vector loads",
    "sm_90a": "TMA descriptors need every stride but the last a multiple of 16 bytes and a "
    "16-byte aligned base",
}


def _check_strides(name: str, t, target: str = "sm_80") -> None:
    """The kernel moves 16-byte vectors (sm_80) or TMA boxes (sm_90a): last dimension
    contiguous, the others' strides multiples of 16 bytes (a size-1 dimension's is free)."""
    if t.stride(3) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides "
            f"{t.stride()}; pass {name}.contiguous()"
        )
    if any(st % 8 for st, n in zip(t.stride()[:3], t.shape[:3]) if n > 1):
        in_bytes = tuple(st * t.element_size() for st in t.stride())
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of 8 "
            f"elements ({ALIGNMENT_REASON[target]}), got strides {t.stride()} "
            f"({in_bytes} bytes) for shape {tuple(t.shape)}; pass {name}.contiguous()"
        )


def _check_base(name: str, t, target: str = "sm_80") -> None:
    if t.data_ptr() % 16:
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of 8 "
            f"elements ({ALIGNMENT_REASON[target]}), got an address {t.data_ptr() % 16} bytes "
            "past a 16-byte boundary"
        )


def lse_shape(q) -> tuple[int, int, int]:
    batch, seqlen_q, heads_q, _ = q.shape
    return (batch, heads_q, seqlen_q)


def check_lse(lse, q) -> None:
    import torch

    expected = lse_shape(q)
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if (
        tuple(lse.shape) != expected
        or lse.dtype != torch.float32
        or lse.device != q.device
        or (expected[2] > 1 and lse.stride(2) != 1)
    ):
        raise ValueError(
            f"lse must be float32 of shape {expected} on {q.device} with its last dimension "
            f"contiguous; got {tuple(lse.shape)}, {lse.dtype}, {lse.device}"
        )


def _span(t) -> tuple[int, int]:
    """The byte range [first, last + 1) that a tensor's elements lie in."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlaps_itself(t) -> bool:
    """Whether two elements of ``t`` may share memory: the dims sorted by stride must each
    step past everything the smaller ones span (sufficient for no overlap)."""
    reach = 1  # elements spanned by the dims seen so far, plus one
    for stride, n in sorted(
        (st, n) for st, n in zip(t.stride(), t.shape) if n > 1
    ):  # (a stride 0 fails at once)
        if stride < reach:
            return True
        reach += (n - 1) * stride
    return False


ARCH_PATTERN = re.compile(r"sm_(\d+)(\d)([af]?)")  # sm_90a: (9, 0); sm_100: (10, 0)


def check_arch(target: str, arch: str) -> None:
    """Refuse an architecture name that is malformed or that the target cannot run on."""
    match = ARCH_PATTERN.fullmatch(arch)
    if match is None:
        raise ValueError(f"bad architecture '{arch}': expected a name such as sm_80 or sm_90a")
    capability = (int(match.group(1)), int(match.group(2)))
    lowest, only = TARGET_DEVICES[target]
    if only and arch != target:
        raise ValueError(f"target {target} runs only on {target}, not {arch}")
    if capability < lowest:
        raise ValueError(f"target {target} needs {target} or newer, not {arch}")


def build_ahead(compiled: Compiled, archs: Iterable[str], out_dir: Path) -> list[Path]:
    """Compile every dtype of a spec for each architecture into ``out_dir`` (no GPU needed);
    ``fadsl.load(..., cubin_dirs=[out_dir])`` or ``$FADSL_CUBIN_PATH`` finds them."""
    import time

    kern = FlashAttention(compiled, verbose=False)
    archs = list(archs)
    for arch in archs:
        check_arch(kern.config.target, arch)
    written = []
    if kern.alone is not None:  # the variant the launches that do not pair run
        written += build_ahead(compiled.alone, archs, out_dir)
    for dtype in kern.config.dtypes:
        for arch in archs:
            request = kern.request(dtype, arch)
            start = time.monotonic()
            built = compile_cubin(request.text, request.filename, request.kernel, arch, out_dir)
            seconds = time.monotonic() - start
            entry = cache.write(out_dir, request.stem(with_compiler=False), request, built, seconds)
            log.info("fadsl: built %s for %s in %.1f s", request.kernel, arch, seconds)
            written.append(entry.path)
    return written


def load(
    spec: str | os.PathLike, verbose: bool = True, cubin_dirs: Iterable[os.PathLike] = ()
) -> FlashAttention:
    """Compile a spec (a path to a .fa file, or the spec text itself) into a callable kernel.

    ``cubin_dirs``: folders of ahead-of-time cubins (``fadsl build``), searched before
    ``$FADSL_CUBIN_PATH`` and the cache. ``verbose=False`` keeps builds quiet.
    """
    if isinstance(spec, os.PathLike) or ("\n" not in spec and "{" not in spec):
        compiled = compile_file(Path(spec))
    else:
        compiled = compile_source(spec, "<spec>")
    return FlashAttention(compiled, verbose, cubin_dirs)
