"""A compiled spec as a PyTorch operator: NVRTC builds the kernel, the driver API launches it.

``fadsl.load(spec)`` renders the kernel's CUDA (device code only) and returns a
``FlashAttention``. Its first call for a dtype on a device finds the cubin in an
ahead-of-time folder (``fadsl build``), else in the cache under ``$FADSL_CACHE_DIR``
(default ``~/.cache/fadsl``), else builds it with NVRTC (about a second) and caches it; see
fadsl/build/cache.py. Each kernel is also a ``torch.library.custom_op`` (fadsl/runtime/custom_op.py), so
``torch.compile(fullgraph=True)`` traces through it; its backward runs the spec's backward
kernels (fadsl/runtime/backward.py), or says the spec is forward-only.

Eager calls that need no autograd launch directly, without the dispatcher: the checks
(fadsl/runtime/arguments.py), the params struct (the target's launch, fadsl/targets) and one ``cuLaunchKernel`` on
the current stream.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from .. import targets
from ..build import cache
from ..build.nvrtc import compile_cubin
from ..codegen.render import Source, header_text, render, spec_hash
from ..ir import Dtype
from ..pipeline import Compiled, compile_file, compile_source
from ..targets import check_arch
from ..targets.archs import arch_for
from ..targets.launch import INPUT_SOURCES, Args, CallPlan, KernelStep, current_stream
from . import arguments, keep_classes
from .backward_calls import BackwardCalls
from .fp8_calls import Fp8Calls
from .modified_calls import ModifiedCalls
from .plain_calls import PlainCalls
from .plans import PlanCache
from .serving import ServingCalls
from .arguments import (
    accepts,
    check_bases,
    check_lse,
    check_scale,
    compiled_dtypes,
    explain_inputs,
    lse_shape,
)

log = logging.getLogger("fadsl")
PADDED_SOURCES = ("q", "k", "v", "out", "lse")  # a padded call's addresses, in a plan's order
FP8_SOURCES = PADDED_SOURCES + ("q_descale", "k_descale", "v_descale")  # an 8-bit kernel's


def cache_dir() -> Path:
    return cache.cache_dir()


def arch_of(device) -> str:
    """The architecture to build for on ``device`` (fadsl.targets.archs.arch_for)."""
    import torch

    return arch_for(torch.cuda.get_device_capability(device))


def runs_on(target: str, device) -> bool:
    """Whether the target's instructions run on ``device``'s GPU."""
    import torch

    return targets.get(target).capabilities.runs_on(torch.cuda.get_device_capability(device))


def check_device(target: str, kernel_name: str, device) -> None:
    """Refuse a GPU the spec's target cannot run on, before building anything."""
    import torch

    if not runs_on(target, device):
        capability = torch.cuda.get_device_capability(device)
        lowest, only = targets.get(target).capabilities.devices
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


class FlashAttention(ServingCalls, Fp8Calls, ModifiedCalls, PlainCalls, BackwardCalls):
    """A compiled spec; call it on CUDA tensors shaped (batch, seqlen, heads, head_dim); a
    serving spec also takes ``varlen`` or ``kvcache`` calls (fadsl/runtime/serving.py), an
    8-bit one the descales (fadsl/runtime/fp8_calls.py)."""

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
        self._launch = targets.launch_for(self.config.target)
        self._block = self._launch.block(compiled.kernel)
        self._cluster = self._launch.spec_cluster(compiled.kernel)  # a launch may use fewer
        # The launches that do not pair run this cluster-free variant (fadsl.targets.sm90.alone).
        self.alone: FlashAttention | None = (
            FlashAttention(compiled.alone, verbose, cubin_dirs) if compiled.alone else None
        )
        self._co_resident: dict[tuple[Dtype, int], int] = {}  # CTAs in co-resident clusters
        self._modules: dict[tuple[Dtype, int], object] = {}
        self._entries: dict[tuple[Dtype, str], cache.Entry] = {}
        self._backward = None  # built on the first backward call (fadsl/runtime/backward.py)
        # a call's other kernels (varlen's tile list, splits' combine), by (dtype, device, suffix)
        self._more_modules: dict[tuple[Dtype, int, str], object] = {}
        self.op_name = f"{self.config.name}_{spec_hash(compiled.kernel)[:12]}"
        self._plans = PlanCache()  # plain eager calls' launch plans (fadsl/runtime/plain_calls.py)
        from .custom_op import kvcache_op_for, ops_for, varlen_op_for
        from .fp8_ops import fp8_op_for, fp8_varlen_op_for
        from .modified_op import modified_op_for

        # Registered now, not on first use: torch.compile cannot trace a registration.
        self._ops = fp8_op_for(self) if self.is_fp8 else ops_for(self)
        self._varlen_op = None
        if self.is_varlen:
            self._varlen_op = fp8_varlen_op_for(self) if self.is_fp8 else varlen_op_for(self)
        self._kvcache_op = kvcache_op_for(self) if self.is_kvcache else None
        # score and mask modifiers (issue 41): their inputs are the op's arguments
        self._modified_op = modified_op_for(self) if self.config.modifiers is not None else None

    @property
    def is_varlen(self) -> bool:
        """Whether the spec says `varlen on` (packed sequences: ``varlen``)."""
        return self.config.features.varlen

    @property
    def is_kvcache(self) -> bool:
        """Whether the spec reads K/V from a cache (`kv_cache`: ``kvcache``)."""
        return self.config.features.kv_cache >= 0

    @property
    def variants(self) -> tuple[FlashAttention, ...]:
        """This kernel, then the cluster-free variant its unpaired launches run (if any)."""
        return (self,) if self.alone is None else (self, self.alone)

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
        research/probes/energy_probe.py), the cluster-free variant's too. Before the kernel's first
        call on a device."""
        if self.alone is not None:
            self.alone.use_development_build(dtype, arch, defines)
        self._entries[dtype, arch] = cache.development_build(self.request(dtype, arch), defines)

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
            if self._launch.check_loaded is not None:
                self._launch.check_loaded(
                    self.compiled.kernel, module.registers(index), self._block[0]
                )
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
        from ..build.elf import read_ints

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

    @staticmethod
    def arch(index: int) -> str:
        """The architecture to build for on device ``index`` (arch_of)."""
        return arch_of(index)

    # ------------------------------------------------------------------ calling
    def __call__(
        self,
        q,
        k,
        v,
        softmax_scale: float | None = None,
        *,
        out=None,
        return_lse: bool = False,
        **inputs,
    ):
        """Attention of q over (k, v): softmax(q k^T * softmax_scale [+ mask]) v.

        q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim)
        with heads_q a multiple of heads_kv (GQA/MQA): query head h reads KV head
        h // (heads_q // heads_kv). A causal spec aligns the diagonal to the bottom right
        (query i sees key j when j <= i + seqlen_k - seqlen_q), as FlashAttention does; a
        sliding window (`mask window(L, R)`) likewise: i + d - L <= j <= i + d + R, d =
        seqlen_k - seqlen_q. A spec's score and mask modifiers (`input`, `score`, `keep`)
        take their inputs as keyword arguments named as the spec declares them
        (``kern(q, k, v, slopes=slopes)``), each contiguous on q's device.
        ``out``, if given, receives the result (q's shape, dtype and device; memory of its
        own). Returns the output, or ``(output, lse)`` with ``return_lse=True``: the
        natural-log log-sum-exp of each row's scaled scores, shape (batch, heads_q,
        seqlen_q), float32, -inf for a row that sees no key. Gradients flow through
        q, k and v (and the LSE) when the spec has a ``backward`` block; without one, a
        backward through the call raises.
        """
        import torch

        scale = check_scale(softmax_scale, self.config.head_dim)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if self.is_fp8:  # (issue 42: the descales are its keywords, no backward)
            return self._call_fp8(q, k, v, scale, out, return_lse, inputs)
        if inputs or self.config.modifiers is not None:  # (issue 41: their own op)
            return self._call_modified(q, k, v, scale, out, return_lse, inputs)
        if torch.compiler.is_compiling():
            return self._call_op(q, k, v, scale, out, return_lse)
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)
        ):
            if out is not None:
                raise RuntimeError(
                    f"fadsl kernel '{self.config.name}': out= does not support automatic "
                    "differentiation; call it without out=, under torch.no_grad(), or "
                    "with q, k and v detached"
                )
            if self.has_backward:  # (eagerly: the kernels without the dispatcher)
                from . import eager_grad

                o, lse = eager_grad.attention(self, scale, q, k, v)
                return (o, lse) if return_lse else o
            return self._call_op(q, k, v, scale, None, return_lse)
        if out is None:  # (a signature's later calls: its launch plan)
            return self._call_planned(q, k, v, scale, return_lse)
        return self.forward(q, k, v, scale, out, return_lse)

    def _call_op(self, q, k, v, scale: float, out, return_lse: bool):
        import torch

        functional, with_out = self._ops
        if out is None:
            # with a backward, the LSE is saved for it whether or not the caller asked
            o, lse = functional(q, k, v, scale, return_lse or self.has_backward)
            return (o, lse) if return_lse else o
        lse = None
        if return_lse:
            lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
        with_out(q, k, v, out, lse, scale)
        return (out, lse) if return_lse else out

    def forward(
        self, q, k, v, scale: float, out=None, return_lse: bool = False, inputs=(), dtype=None
    ):
        """Check the arguments, allocate what is missing and launch (no dispatcher).
        ``inputs``: the modifiers' tensors, checked (modifier_inputs); ``dtype``: q's, where
        the caller has checked q, k and v already."""
        import torch

        if self.is_fp8:  # (O of the spec's output type; descales of 1)
            return self.fp8_forward(q, k, v, scale, (None, None, None), out, return_lse)
        if dtype is None:
            dtype = self.check_inputs(q, k, v)
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
            check_bases(q, k, v, self.config.target)
        if out is None:
            out = torch.empty_like(q)
        else:
            self._check_out(out, q, k, v)
        lse = None
        if return_lse:
            lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
        self.launch(dtype, q, k, v, out, lse, scale, inputs)
        return (out, lse) if return_lse else out

    def forward_into(self, q, k, v, out, lse, scale: float) -> None:
        """Check the arguments and launch, writing ``out`` and ``lse`` (if not None)."""
        scale = check_scale(scale, self.config.head_dim)
        dtype = self.check_inputs(q, k, v)
        check_bases(q, k, v, self.config.target)
        self._check_out(out, q, k, v)
        if lse is not None:
            check_lse(lse, q)
        self.launch(dtype, q, k, v, out, lse, scale)

    def launch(
        self, dtype: Dtype, q, k, v, out, lse, scale: float, inputs=(), descales=None
    ) -> None:
        """Launch on q's device and that device's current stream (arguments checked;
        ``inputs``: the modifiers'; ``descales``: an 8-bit kernel's three, checked)."""
        if descales is None and self.is_fp8:  # (every launch passes its second parameter)
            descales = (None, None, None)
        if self.is_varlen:
            self._launch_padded_as_varlen(dtype, q, k, v, out, lse, scale, descales)
            return
        if self.is_kvcache:
            raise RuntimeError(
                f"kernel '{self.config.name}' reads K/V from a cache ('kv_cache'): call "
                "kvcache(q, k_cache, v_cache, cache_seqlens, ...)"
            )
        first = None  # a kernel launched first (a keep's tile classes: inputs after the spec's)
        made = None
        if self.config.modifiers is not None:  # (counted; classes made ahead split off)
            inputs, made, _ = keep_classes.split(self, inputs)
        if made is not None:
            inputs += made
        elif self._launch.before is not None:
            found = self._launch.before(self.compiled.kernel, q, k)
            if found is not None:
                hidden, first = found
                inputs = tuple(inputs) + hidden
        args = Args(q, k, v, out, lse, scale, tuple(inputs), descales)
        cluster = self._launch.cluster(self.compiled.kernel, args)
        if cluster == 1 and self.alone is not None:
            self.alone.launch_args(dtype, args, 1, first)  # the cluster-free variant
        else:
            self.launch_args(dtype, args, cluster, first)

    def prepare(
        self, dtype: Dtype, q, k, v, out, lse, scale: float, stream: int, descales=None, inputs=()
    ):
        """This call's launch kept for the later calls of its signature (``plans.Prepared``,
        its sources PADDED_SOURCES, then an 8-bit kernel's DESCALE_SOURCES or the modifiers'
        INPUT_SOURCES, one for each of ``inputs``: P.inputs as the kernel reads them, the
        spec's inputs and then the forward's classes made ahead; not yet launched), or None
        where the params hold an address a plan cannot rewrite (a split workspace, a keep's
        classes made by the call: ``inputs`` without them) or the kernel is not a padded one
        (then ``launch``)."""
        if self.is_varlen or self.is_kvcache or self._launch.slots is None:
            return None
        if self.config.modifiers is not None:
            rule, count = self.config.modifiers.rule, len(self.config.modifiers.inputs)
            if rule is not None and rule.by_pass and len(inputs) == count:
                return None  # (classed by the call's own pass, into workspaces of its own)
        if descales is None and self.is_fp8:
            descales = (None, None, None)
        args = Args(q, k, v, out, lse, scale, tuple(inputs), descales)
        cluster = self._launch.cluster(self.compiled.kernel, args)
        if cluster == 1 and self.alone is not None:
            return self.alone._prepare_args(dtype, args, 1, stream)  # the cluster-free variant
        return self._prepare_args(dtype, args, cluster, stream)

    def _prepare_args(self, dtype: Dtype, args: Args, cluster: int, stream: int):
        kernel = self.compiled.kernel
        slots = self._launch.slots(kernel, args)
        if slots is None:
            return None
        index = args.q.device.index
        params = self._launch.pack(kernel, args)
        grid = self._launch.grid(kernel, args)
        self._modules.get((dtype, index)) or self.module(dtype, index)  # (its co-residency)
        if cluster > 1 and self._launch.fit_grid is not None:
            grid = self._launch.fit_grid(kernel, grid, self._co_resident[dtype, index])
        second = None if args.descales is None else self._launch.pack_second(args)
        step = KernelStep("", grid, self._block, False, cluster)
        plan = CallPlan(params, (step,), slots, second=second)
        q, k, v, out, lse = args.q, args.k, args.v, args.out, args.lse
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        addresses += (0 if lse is None else lse.data_ptr(),)
        if args.descales is None:
            addresses += tuple(t.data_ptr() for t in args.inputs)
            sources = PADDED_SOURCES + INPUT_SOURCES[: len(args.inputs)]
            return self.prepared(dtype, index, stream, plan, sources, addresses)
        addresses += tuple(0 if t is None else t.data_ptr() for t in args.descales)
        return self.prepared(dtype, index, stream, plan, FP8_SOURCES, addresses)

    def launch_args(self, dtype: Dtype, args: Args, cluster: int, first=None) -> None:
        """Launch with ``args`` in clusters of ``cluster`` CTAs (1: without clusters);
        ``first``: a KernelStep of the source launched before, with the same params (the
        target's ``Launch.before``)."""
        import torch

        index = args.q.device.index
        kernel = self.compiled.kernel
        params = self._launch.pack(kernel, args)
        grid = self._launch.grid(kernel, args)
        module = self._modules.get((dtype, index)) or self.module(dtype, index)
        if cluster > 1 and self._launch.fit_grid is not None:
            grid = self._launch.fit_grid(kernel, grid, self._co_resident[dtype, index])
        # an 8-bit kernel's second parameter: the descales (Fp8Descales)
        second = None if args.descales is None else self._launch.pack_second(args)
        before = (
            None
            if first is None
            else self.kernel_module(dtype, index, first.suffix, first.block[0])
        )

        def go(stream: int) -> None:
            if before is not None:  # (on the same stream, before the kernel)
                before.launch(first.grid, first.block, params, stream)
            module.launch(grid, self._block, params, stream, cluster, second=second)

        if index == torch.cuda.current_device():
            go(current_stream(index))
        else:
            with torch.cuda.device(index):
                go(current_stream(index))

    # ------------------------------------------------------------------ checks
    # The checks themselves are in fadsl/runtime/arguments.py; these pass them the spec's config.
    def check_inputs(self, q, k, v) -> Dtype:
        """Types, dtypes, shapes, strides and devices of q, k, v (no memory access: fake
        tensors pass). One cheap test first; the checks that name what is wrong run only when
        it fails (a call's host time is a few microseconds)."""
        try:
            dtype = accepts(q, k, v, self._dtypes, self.config.head_dim)
        except Exception:  # anything unexpected (not tensors, symbolic sizes): the full checks
            dtype = None
        return dtype if dtype is not None else explain_inputs(q, k, v, self.config)

    @functools.cached_property
    def _dtypes(self) -> dict:
        return compiled_dtypes(self.config.dtypes)

    def check_out_meta(self, out, q) -> None:
        arguments.check_out_meta(out, q, self.config.target)

    def _check_out(self, out, q, k, v) -> None:
        arguments.check_out(out, q, k, v, self.config.target, self.out_torch_dtype)


def build_ahead(compiled: Compiled, archs: Iterable[str], out_dir: Path) -> list[Path]:
    """Compile every dtype of a spec for each architecture into ``out_dir`` (no GPU needed);
    ``fadsl.load(..., cubin_dirs=[out_dir])`` or ``$FADSL_CUBIN_PATH`` finds them."""
    import time

    kern = FlashAttention(compiled, verbose=False)
    archs = list(archs)
    for arch in archs:
        check_arch(kern.config.target, arch)
    written = []
    # `cluster 2`: the cluster-free variant its unpaired launches run, too
    for variant, dtype in ((v, d) for v in kern.variants for d in v.config.dtypes):
        for arch in archs:
            request = variant.request(dtype, arch)
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
