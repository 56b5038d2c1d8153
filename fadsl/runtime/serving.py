"""The serving calls of a compiled spec (a mixin of ``FlashAttention``): ``varlen`` for a
`varlen on` spec (fadsl/runtime/varlen.py), ``kvcache`` for a `kv_cache` spec
(fadsl/runtime/kvcache.py), a padded call on a varlen spec, and the launcher that loads and
launches a call's kernels as the target's ``ServingLaunch`` plans them.
"""

from __future__ import annotations

from ..ir import Dtype
from ..targets.archs import arch_for
from ..targets.launch import current_stream
from .arguments import backward_operands, check_lse, check_scale, lse_shape
from .fp8_calls import DESCALE_NAMES


class ServingCalls:
    """Needs of its host class: ``config``, ``compiled``, ``_launch``, ``_block``,
    ``_modules``, ``_more_modules``, ``_varlen_op``, ``_kvcache_op``, ``module``, ``cubin``,
    ``_check_out``."""

    # ------------------------------------------------------------------ serving
    @property
    def serving(self):
        """The target's varlen and kv-cache launches (``targets.launch.ServingLaunch``)."""
        if self._launch.serving is None:
            raise RuntimeError(f"target {self.config.target} has no varlen or kv-cache calls")
        return self._launch.serving

    def kernel_module(self, dtype: Dtype, index: int, suffix: str = "", threads: int = 0):
        """The loaded kernel of the rendered source + ``suffix`` (a call's other kernels:
        varlen's tile list, splits' combine, of ``threads`` a CTA) on device ``index``,
        loaded once."""
        import torch

        from .driver import Module

        main = self._modules.get((dtype, index)) or self.module(dtype, index)
        if not suffix:
            return main
        key = (dtype, index, suffix)
        module = self._more_modules.get(key)
        if module is None:
            entry = self.cubin(dtype, arch_for(torch.cuda.get_device_capability(index)))
            with torch.cuda.device(index):
                module = Module(entry.cubin, main.name + suffix, 0, threads)
                module.prepare(index)
            self._more_modules[key] = module
        return module

    def prepared(self, dtype: Dtype, index: int, stream: int, plan, sources, addresses):
        """A plan of this kernel's launches (``targets.launch.CallPlan``) ready to launch
        again on ``stream`` (``plans.Prepared``; ``sources`` names the call's ``addresses``)."""
        from .plans import Prepared

        modules = [self.kernel_module(dtype, index, s.suffix, s.block[0]) for s in plan.kernels]
        return Prepared(plan, sources, addresses, modules, stream, index)

    def launcher(self, dtype: Dtype, index: int):
        """``launch(KernelLaunch)`` for the serving calls: the source's kernel + suffix, loaded
        once per device, launched on the device's current stream."""
        import torch

        stream = current_stream(index)
        elsewhere = index != torch.cuda.current_device()  # (a context switch costs host time)

        main = self._modules.get((dtype, index)) or self.module(dtype, index)

        def launch(kl) -> None:
            module = self.kernel_module(dtype, index, kl.suffix, kl.block[0]) if kl.suffix else main
            if elsewhere:
                with torch.cuda.device(index):
                    module.launch(
                        kl.grid,
                        kl.block,
                        kl.params,
                        stream,
                        dependent=kl.dependent,
                        second=kl.second,
                    )
            else:
                module.launch(
                    kl.grid, kl.block, kl.params, stream, dependent=kl.dependent, second=kl.second
                )

        return launch

    def _through_op(self, tensors, out) -> bool:
        """Whether a serving call goes through its functional op (torch.compile tracing, or
        inputs that require grad): then out= is refused."""
        import torch

        through = torch.compiler.is_compiling() or (
            torch.is_grad_enabled()
            and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
        )
        if through and out is not None:
            raise RuntimeError(
                f"fadsl kernel '{self.config.name}': out= is for eager calls without "
                "gradients; call it without out="
            )
        return through

    def varlen(
        self,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        softmax_scale: float | None = None,
        *,
        out=None,
        return_lse: bool = False,
        q_descale=None,
        k_descale=None,
        v_descale=None,
    ):
        """Attention over a packed batch of sequences (FlashAttention's varlen convention,
        fadsl/runtime/varlen.py): q (tokens_q, heads_q, head_dim), k and v (tokens_k,
        heads_kv, head_dim), sequence b at rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1
        of q and likewise of k and v (int32 on q's device). Returns the output (q's shape),
        or ``(output, lse)`` with the LSE (heads_q, tokens_q), float32. The spec must say
        `varlen on`. Gradients flow through q, k and v (and the LSE) when the spec has a
        backward block. An 8-bit spec takes q_descale, k_descale and v_descale, each None
        or float32 (sequences, heads_kv) (fadsl/runtime/fp8_calls.py), and returns O in
        the spec's `output` type, without gradients."""
        import torch

        from .fp8_calls import refuse_gradients
        from .varlen import check_max_seqlen

        if not self.is_varlen:
            raise RuntimeError(
                f"kernel '{self.config.name}' takes padded batches; a varlen call needs a spec "
                "with 'varlen on'"
            )
        check_max_seqlen("max_seqlen_q", max_seqlen_q)
        check_max_seqlen("max_seqlen_k", max_seqlen_k)
        scale = check_scale(softmax_scale, self.config.head_dim)
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        descales = (q_descale, k_descale, v_descale)
        if self.is_fp8:
            named = (("q", q), ("k", k), ("v", v), *zip(DESCALE_NAMES, descales))
            refuse_gradients(f"fadsl kernel '{self.config.name}'", named)
            if torch.compiler.is_compiling():
                if out is not None:
                    raise RuntimeError(
                        f"fadsl kernel '{self.config.name}': out= is for eager calls; call it "
                        "without out= under torch.compile"
                    )
                args = (q, k, v, cu_seqlens_q, cu_seqlens_k, *descales, scale, return_lse)
                o, lse = self._varlen_op(*args)
                return (o, lse) if return_lse else o
            return self.varlen_forward(
                q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out, return_lse, descales=descales
            )
        self._refuse_descales(descales)
        if self._through_op((q, k, v), out):
            if self.has_backward and not torch.compiler.is_compiling():
                from . import eager_grad  # (eagerly: the varlen kernels without the dispatcher)

                o, lse = eager_grad.varlen(self, scale, q, k, v, cu_seqlens_q, cu_seqlens_k)
                return (o, lse) if return_lse else o
            # with a backward the op always makes the LSE (its autograd saves it)
            with_lse = return_lse or self.has_backward
            o, lse = self._varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, with_lse)
            return (o, lse) if return_lse else o
        return self.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out, return_lse)

    def varlen_forward(
        self, q, k, v, cu_seqlens_q, cu_seqlens_k, scale, out, return_lse, lse=None,
        descales=None,
    ):  # fmt: skip
        """Check a varlen call's arguments, allocate what is missing and launch (``lse``: a
        float32 (heads_q, tokens_q) tensor to write the LSE into, with ``return_lse``;
        ``descales``: an 8-bit spec's three, each None or a tensor, checked here)."""
        import torch

        from .varlen import check_varlen_out, run_varlen, varlen_lse_shape

        dtype = self.check_varlen_call(q, k, v, cu_seqlens_q, cu_seqlens_k, descales)
        if out is None:
            out = torch.empty_like(q, dtype=self.out_torch_dtype)  # (an 8-bit spec's output)
        else:
            check_varlen_out(self, out, q, k, v)
        if not return_lse:
            lse = None
        elif lse is None:
            lse = torch.empty(varlen_lse_shape(q), device=q.device, dtype=torch.float32)
        elif (
            lse.shape != varlen_lse_shape(q)
            or lse.dtype != torch.float32
            or not lse.is_contiguous()
        ):
            raise ValueError(
                f"lse must be a contiguous float32 tensor of shape {varlen_lse_shape(q)}, got "
                f"{lse.dtype} of shape {tuple(lse.shape)}"
            )
        run_varlen(self, dtype, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, scale, descales)
        return (out, lse) if return_lse else out

    def check_varlen_call(self, q, k, v, cu_seqlens_q, cu_seqlens_k, descales=None) -> Dtype:
        """Every check of a varlen call's tensors (and an 8-bit spec's descales); q's
        ``Dtype``. No memory access: fake tensors pass."""
        from .fp8_calls import check_varlen_descales
        from .varlen import check_varlen

        dtype = check_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k)
        if self.is_fp8:
            check_varlen_descales(descales or (None, None, None), q, k, cu_seqlens_q)
        return dtype

    def varlen_backward(self, q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, scale):
        """(dq, dk, dv) of a varlen call's loss whose gradient on the output is ``dout`` (and
        on the LSE ``dlse``, or None), from the forward's tensors; rows outside every
        sequence get zero gradients."""
        import torch

        from .varlen import check_varlen, varlen_lse_shape

        dtype = check_varlen(self, q, k, v, cu_seqlens_q, cu_seqlens_k)
        dout, lse, dlse = backward_operands(out, lse, dout, dlse, varlen_lse_shape(q), q.device)
        arch = arch_for(torch.cuda.get_device_capability(q.device.index))
        return self._backward_kernels().varlen(
            dtype, arch, q, k, v, out, lse, dout, dlse, cu_seqlens_q, cu_seqlens_k, scale
        )

    def backward_padded_as_varlen(self, q, k, v, out, lse, dout, dlse, scale):
        """(dq, dk, dv) of a padded call on a `varlen on` kernel: its sequences packed end to
        end (as ``_launch_padded_as_varlen``), the LSE (batch, heads, seqlen) as (heads,
        tokens), the gradients reshaped back."""
        import torch

        batch, seqlen_q, heads_q, head_dim = q.shape
        seqlen_k = k.shape[1]
        device = q.device
        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, (batch + 1) * seqlen_k, seqlen_k, dtype=torch.int32, device=device)

        def packed(t):
            return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])

        def heads_first(t):
            return None if t is None else t.permute(1, 0, 2).reshape(heads_q, batch * seqlen_q)

        dq, dk, dv = self.varlen_backward(
            packed(q), packed(k), packed(v), packed(out), heads_first(lse), packed(dout),
            heads_first(dlse), cu_q, cu_k, scale,
        )  # fmt: skip
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)

    def _launch_padded_as_varlen(
        self, dtype: Dtype, q, k, v, out, lse, scale: float, descales=None
    ) -> None:
        """A padded batch on a `varlen on` kernel: its sequences packed end to end (a view
        where the strides allow, else a copy), cu_seqlens every seqlen rows (an 8-bit
        kernel's ``descales``, (batch, heads_kv), are then per sequence as they stand)."""
        import torch

        from .varlen import run_varlen

        batch, seqlen_q, heads_q, head_dim = q.shape
        seqlen_k = k.shape[1]
        limit = self.serving.max_sequences
        if batch > limit:
            raise ValueError(
                f"q has batch {batch}; a `varlen on` kernel takes at most {limit} sequences a "
                "call: split the batch"
            )

        def packed(t):
            return t.reshape(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])

        cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (batch + 1) * seqlen_k, seqlen_k, dtype=torch.int32, device=q.device)
        flat_out = packed(out)
        into = flat_out if flat_out.data_ptr() == out.data_ptr() and out.is_contiguous() else None
        result = into
        if result is None:
            result = torch.empty(packed(q).shape, dtype=out.dtype, device=q.device)
        flat_lse = None
        if lse is not None:
            flat_lse = torch.empty(
                (heads_q, batch * seqlen_q), device=q.device, dtype=torch.float32
            )
        run_varlen(
            self, dtype, packed(q), packed(k), packed(v), cu_q, cu_k, result, flat_lse, scale,
            descales,
        )  # fmt: skip
        if into is None:
            out.copy_(result.view(batch, seqlen_q, heads_q, head_dim))
        if lse is not None:
            lse.copy_(flat_lse.view(heads_q, batch, seqlen_q).permute(1, 0, 2))

    # ------------------------------------------------------------------ kv cache
    def kvcache(
        self,
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        page_table=None,
        softmax_scale: float | None = None,
        *,
        num_splits: int | None = None,
        out=None,
        return_lse: bool = False,
        q_descale=None,
        k_descale=None,
        v_descale=None,
    ):
        """Attention of q over each batch's first cache_seqlens[b] keys of a cache
        (FlashAttention's flash_attn_with_kvcache convention; fadsl/runtime/kvcache.py): q
        (batch, seqlen_q, heads_q, head_dim); a contiguous cache (batch, capacity, heads_kv,
        head_dim) or a paged one (pages, page_size, heads_kv, head_dim) with page_table
        (batch, max_pages) int32. Returns the output (q's shape), or ``(output, lse)`` with
        the LSE (batch, heads_q, seqlen_q). ``fadsl.append_kv`` writes new tokens first.
        An 8-bit spec takes 8-bit q and caches with q_descale, k_descale and v_descale, each
        None or float32 (batch, heads_kv) (a page read by several batches needs the same
        descales in each), and returns O in the spec's `output` type."""
        descales = (q_descale, k_descale, v_descale)
        scale, dtype = self.check_kvcache_call(
            q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, num_splits, return_lse,
            descales,
        )  # fmt: skip
        if self._through_op((q, k_cache, v_cache), out):
            o, lse = self._kvcache_op(
                q, k_cache, v_cache, cache_seqlens, page_table, scale, num_splits or 0, return_lse,
                *descales,
            )  # fmt: skip
            return (o, lse) if return_lse else o
        return self.kvcache_forward(
            q, k_cache, v_cache, cache_seqlens, page_table, scale, num_splits, out, return_lse,
            dtype=dtype, descales=descales,
        )  # fmt: skip

    def check_kvcache_call(
        self, q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, num_splits,
        return_lse, descales=(None, None, None),
    ) -> tuple[float, Dtype]:  # fmt: skip
        """Every check of a kv-cache call, each error naming the argument, before anything is
        written or launched (fadsl.attention_with_kvcache runs it before appending); the
        scale to launch with and the dtype. ``descales``: (q_descale, k_descale, v_descale),
        an 8-bit spec's (checked against (batch, heads_kv)); given to a 16-bit spec, refused."""
        from .fp8_calls import check_descales, refuse_gradients
        from .kvcache import check_kvcache

        if not self.is_kvcache:
            raise RuntimeError(
                f"kernel '{self.config.name}' has no KV cache; a kvcache call needs a spec with "
                "'kv_cache contiguous' or 'kv_cache paged(N)'"
            )
        scale = check_scale(softmax_scale, self.config.head_dim)
        if num_splits is not None and (
            isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0
        ):
            raise TypeError(f"num_splits must be a non-negative int or None, got {num_splits!r}")
        if (num_splits or 0) > 1 and not self.config.features.split_all:
            raise ValueError(
                f"num_splits={num_splits}: kernel '{self.config.name}' runs whole tiles; split "
                "pieces need a spec with 'splits auto'"
            )
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        self._refuse_descales(descales)
        dtype = check_kvcache(self, q, k_cache, v_cache, cache_seqlens, page_table)
        if self.is_fp8:
            named = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache))
            named += tuple(zip(DESCALE_NAMES, descales))
            refuse_gradients(f"fadsl kernel '{self.config.name}'", named)
            check_descales(descales, q, k_cache, "k_cache")
        return scale, dtype

    def _refuse_descales(self, descales) -> None:
        """Descales given to a 16-bit spec's call: TypeError naming the first."""
        if self.is_fp8:
            return
        for name, t in zip(DESCALE_NAMES, descales):
            if t is not None:
                raise TypeError(
                    f"{name}: kernel '{self.config.name}' takes {self.config.dtypes[0].value} "
                    "inputs; descales are for an 8-bit spec (dtype e4m3 or e5m2)"
                )

    def kvcache_forward(
        self, q, k_cache, v_cache, cache_seqlens, page_table, scale, num_splits, out, return_lse,
        lse=None, dtype=None, descales=None,
    ):  # fmt: skip
        """Check a kv-cache call's arguments (unless ``dtype`` says check_kvcache_call has),
        allocate what is missing and launch (``descales``: an 8-bit spec's three, each None
        or a tensor)."""
        import torch

        from .fp8_calls import check_descales
        from .kvcache import check_kvcache, run_kvcache

        if dtype is None:
            dtype = check_kvcache(self, q, k_cache, v_cache, cache_seqlens, page_table)
            self._refuse_descales(descales or (None, None, None))
            if self.is_fp8:
                check_descales(descales or (None, None, None), q, k_cache, "k_cache")
        if out is None:
            out = torch.empty_like(q, dtype=self.out_torch_dtype)  # (an 8-bit spec's output)
        else:
            self._check_out(out, q, k_cache, v_cache)
        if not return_lse:
            lse = None
        elif lse is None:
            lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
        else:
            check_lse(lse, q)
        run_kvcache(
            self, dtype, q, k_cache, v_cache, cache_seqlens, page_table, out, lse, scale,
            num_splits or None, descales,
        )  # fmt: skip
        return (out, lse) if return_lse else out
