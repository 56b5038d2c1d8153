"""The backward pass of a compiled spec: its kernels built, loaded and launched.

A spec's ``backward { ... }`` block gives the target's backward kernels (sm_90a's:
preprocess, main, convert_dq; docs/backward.md). They are rendered from the target's
backward template, built by NVRTC into one cubin per dtype and cached like the forward's,
and launched on the current stream by the target's host code (``BackwardLaunch.run``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from pathlib import Path

from .. import targets
from ..build import cache
from ..build.nvrtc import compile_cubin
from ..codegen.render import Source, header_text, render_backward, spec_hash
from ..ir import Dtype
from ..targets.launch import current_stream
from .backward_plans import BackwardPlan
from .plans import PlanCache

log = logging.getLogger("fadsl")


class BackwardKernels:
    """The backward kernels of one compiled spec (``FlashAttention.backward`` calls them)."""

    def __init__(self, compiled, verbose: bool, cubin_dirs: list[Path]) -> None:
        self.kernel = compiled.kernel
        self.verbose = verbose
        self.cubin_dirs = cubin_dirs
        target = targets.get(self.kernel.config.target)
        self.launcher = target.backward_launch
        canonical = replace(compiled, file=f"{self.kernel.config.name}.fa")
        sources = render_backward(canonical.kernel, target, canonical.file)
        self._sources: dict[Dtype, Source] = {s.dtype: s for s in sources}
        self._modules: dict[tuple[Dtype, int], dict[str, object]] = {}
        self._development: dict[tuple[Dtype, str], cache.Entry] = {}
        self.plans = PlanCache()  # padded calls' launch plans by signature (backward_plans.py)

    def use_development_build(self, dtype: Dtype, arch: str, defines: dict[str, int]) -> None:
        """Build ``dtype``'s backward kernels for ``arch`` with ``defines`` (#define NAME VALUE
        before the source) and run them in this process instead of the cached cubin, which
        stays untouched (research/probes/probe_backward.py). Before the kernels' first call."""
        self._development[dtype, arch] = cache.development_build(self.request(dtype, arch), defines)

    def source(self, dtype: Dtype) -> str:
        return self._sources[dtype].text

    def request(self, dtype: Dtype, arch: str) -> cache.Request:
        source = self._sources[dtype]
        return cache.Request(
            kernel=source.kernel_name,
            filename=source.filename,
            text=source.text,
            headers=header_text(),
            normalised=spec_hash(self.kernel) + ":backward" + self._learn_key(),
            arch=arch,
        )

    def _learn_key(self) -> str:
        m = self.kernel.config.modifiers
        return f":learn={','.join(m.learn)}" if m is not None and m.learn else ""

    def cubin(self, dtype: Dtype, arch: str) -> cache.Entry:
        if (dtype, arch) in self._development:
            return self._development[dtype, arch]
        request = self.request(dtype, arch)
        entry = cache.find_aot(request, self.cubin_dirs + cache.cubin_path())
        if entry is None:

            def build():
                return compile_cubin(
                    request.text, request.filename, request.kernel, arch, cache.cache_dir()
                )

            entry = cache.get_or_build(request, build, announce=self.verbose)
        return entry

    def modules(self, dtype: Dtype, index: int, arch: str) -> dict[str, object]:
        """The loaded kernels for ``dtype`` on device ``index`` (architecture ``arch``), by
        suffix."""
        found = self._modules.get((dtype, index))
        if found is not None:
            return found
        import torch

        from ..build.elf import read_ints
        from .driver import Module

        entry = self.cubin(dtype, arch)
        name = self._sources[dtype].kernel_name
        launcher = self.launcher
        threads = launcher.threads(self.kernel)
        smem = launcher.smem(self.kernel, "")
        built = read_ints(entry.cubin, f"{name}_launch_info", 5)
        bwd = self.kernel.backward
        expected = (threads, smem, bwd.block_m, bwd.block_n, 1)
        if built != expected:
            raise RuntimeError(
                f"{name}'s cubin says (threads, SMEM bytes, B_r, B_c, cluster) = {built} but "
                f"the spec's backward compiled to {expected}; the generator and the header "
                "disagree"
            )
        found = {}
        with torch.cuda.device(index):
            kernels = launcher.suffixes_of or (lambda kernel: launcher.suffixes)
            for suffix in kernels(self.kernel):
                module = Module(entry.cubin, name + suffix, launcher.smem(self.kernel, suffix), 0)
                module.prepare(index)
                found[suffix] = module
        self._modules[dtype, index] = found
        return found

    def __call__(
        self,
        dtype: Dtype,
        arch: str,
        q,
        k,
        v,
        out,
        lse,
        dout,
        dlse,
        softmax_scale: float,
        inputs: tuple = (),
        input_grads=None,
        classes=None,
        key: tuple | None = None,
    ):
        """(dq, dk, dv), launched on q's device (architecture ``arch``) and its current
        stream; ``inputs``: the score and mask modifiers' tensors, checked, in declared
        order (none without modifiers); ``input_grads``: a learnable variant's fp32
        gradient buffer, zeroed (fadsl/runtime/learnable.py); ``classes``: a keep's tile
        classes made ahead (``classes_only``; used where their tiles are this kernel's);
        ``key``: the call's signature (backward_plans.signature), whose second call keeps
        a launch plan in ``plans`` (None: none)."""
        if (
            input_grads is None
            and self.launcher.plan is not None
            and self.plans.worth_planning(key)
        ):
            return self._planning(dtype, arch, key, (q, k, v, out, lse, dout, dlse),
                                  softmax_scale, tuple(inputs), classes)  # fmt: skip
        run = self.launcher.run
        if inputs:
            run = functools.partial(run, inputs=tuple(inputs))
        if input_grads is not None:
            run = functools.partial(run, input_grads=input_grads)
        if classes is not None:
            run = functools.partial(run, classes=classes)
        return self._run(run, dtype, arch, q, (k, v, out, lse, dout, dlse), softmax_scale)

    def _planning(
        self, dtype: Dtype, arch: str, key: tuple, tensors, scale: float, inputs, classes
    ):
        """``__call__``'s launches through the target's ``plan``, keeping its plan for the
        signature ``key`` (or refusing the signature where the call has none)."""
        q = tensors[0]
        found = self._launching(
            dtype,
            arch,
            q,
            lambda launch: self.launcher.plan(
                self.kernel, launch, *tensors, scale, inputs, classes
            ),
        )
        grads, spec = found
        if spec is None:
            self.plans.refuse(key)
            return grads
        read = inputs + (tuple(classes[2:]) if classes is not None else ())
        dlse = tensors[6]
        addresses = tuple(t.data_ptr() for t in tensors[:6])
        addresses += (0 if dlse is None else dlse.data_ptr(),)
        addresses += tuple(t.data_ptr() for t in (*spec.held, *read))
        index = q.device.index
        modules = self.modules(dtype, index, arch)
        self.plans.put(key, BackwardPlan(spec, modules, addresses, len(read), key[-2], index))
        return grads

    def classes_only(self, dtype: Dtype, arch: str, q, k, inputs: tuple) -> tuple:
        """A keep's tile classes at this backward's tiles for calls on q, k and ``inputs``
        (the target's ``classes_only``), made on q's device and current stream."""
        return self._launching(
            dtype,
            arch,
            q,
            lambda launch: self.launcher.classes_only(self.kernel, launch, q, k, tuple(inputs)),
        )

    def varlen(
        self,
        dtype: Dtype,
        arch: str,
        q,
        k,
        v,
        out,
        lse,
        dout,
        dlse,
        cu_q,
        cu_k,
        softmax_scale: float,
    ):
        """(dq, dk, dv) of a packed call (``BackwardLaunch.run_varlen``), as ``__call__``."""
        args = (k, v, out, lse, dout, dlse, cu_q, cu_k)
        return self._run(self.launcher.run_varlen, dtype, arch, q, args, softmax_scale)

    def _run(self, run, dtype: Dtype, arch: str, q, args, softmax_scale: float):
        return self._launching(
            dtype, arch, q, lambda launch: run(self.kernel, launch, q, *args, softmax_scale)
        )

    def _launching(self, dtype: Dtype, arch: str, q, call):
        """``call(launch)`` on q's device, ``launch`` loading and launching each KernelLaunch
        of this backward's source on the device's current stream."""
        import torch

        index = q.device.index
        modules = self.modules(dtype, index, arch)
        stream = current_stream(index)

        def launch(kl) -> None:
            modules[kl.suffix].launch(kl.grid, kl.block, kl.params, stream)

        with torch.cuda.device(index):
            return call(launch)
