"""Calls of an 8-bit (FP8) kernel (issue 42, research/fp8-forward.md §3.7): q, k and v in
torch.float8_e4m3fn or torch.float8_e5m2, their float32 descales, O in the spec's `output`
type (bf16 or fp16), no backward.

A descale is a float32 tensor of shape (batch, heads_kv) on q's device, at any strides (an
expanded scalar, strides 0, is one per-tensor descale), or None for a descale of 1. Query
head h takes the descale of its K/V head h // (heads_q // heads_kv). The checks read shapes,
strides, dtypes and devices only: a descale's values are not read on the host (a check of
finite-ness would wait for the device on every call). The kernel makes the rows of a
(batch, K/V head) NaN whose softmax_scale * q_descale * k_descale is not a positive normal
float32 (0, negative, inf, NaN, or a product out of range), but for a tile of rows that sees
no key at all (causal with seqlen_q > seqlen_k), written 0 with LSE -inf before the scale is
read, as in every other call; v_descale multiplies O as given
(inf and NaN propagate); see research/fp8-forward.md §3.5.

``Fp8Calls`` is FlashAttention's part for them (fadsl/runtime/attention.py): ``kern(q, k, v,
softmax_scale, q_descale=..., k_descale=..., v_descale=..., out=..., return_lse=...)``.
"""

from __future__ import annotations

from .arguments import check_bases, check_out, check_out_meta, lse_shape

DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
# The kernel indexes a descale with int arithmetic (batch * batch_stride + head * head_stride)
DESCALE_INDEX_LIMIT = 2**31


def fp8_dtypes() -> tuple:
    import torch

    return (torch.float8_e4m3fn, torch.float8_e5m2)


def out_dtypes() -> dict:
    """An 8-bit call's output types: the torch dtype -> the spec's `output` word."""
    import torch

    return {torch.bfloat16: "bf16", torch.float16: "fp16"}


def is_fp8(t) -> bool:
    """Whether ``t`` is a tensor of one of the 8-bit dtypes."""
    return getattr(t, "dtype", None) in fp8_dtypes()


def check_out_dtype(out_dtype):
    """An 8-bit call's output type: torch.bfloat16 for None, else torch.bfloat16 or
    torch.float16 (TypeError naming out_dtype)."""
    import torch

    if out_dtype is None:
        return torch.bfloat16
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in out_dtypes():
        raise TypeError(
            f"out_dtype must be torch.bfloat16 or torch.float16 (an 8-bit call's output type), "
            f"got {out_dtype!r}"
        )
    return out_dtype


def check_descales(descales, q, k, k_name: str = "k") -> tuple:
    """q_descale, k_descale and v_descale (``descales``, in that order) of a padded call (or
    a kv-cache call's: ``k`` the cache, ``k_name`` its name): each None or a float32 tensor of
    shape (batch, heads_kv) on q's device, whose elements the kernel's int index reaches;
    each error names the argument. Values are not read (module docstring)."""
    shape = (q.shape[0], k.shape[2])
    return check_descale_shapes(descales, shape, q, "batch", "q's batch", k_name)


def check_varlen_descales(descales, q, k, cu_seqlens_q) -> tuple:
    """check_descales for a varlen call: each descale (sequences, heads_kv), sequence b's
    row read by its tiles."""
    shape = (cu_seqlens_q.shape[0] - 1, k.shape[1])
    return check_descale_shapes(descales, shape, q, "sequences", "cu_seqlens_q's sequences")


def check_descale_shapes(descales, shape, q, rows: str, whose: str, k_name: str = "k") -> tuple:
    """The descales' checks against ``shape`` = (``rows``, heads_kv) (``whose``: where the
    rows come from, ``k_name``: the tensor whose heads are heads_kv, for the message)."""
    import torch

    for name, t in zip(DESCALE_NAMES, descales):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor (float32, shape ({rows}, heads_kv)) or None, "
                f"got {type(t).__name__}"
            )
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape ({rows}, heads_kv) = {shape} ({whose}, {k_name}'s "
                f"heads); got {tuple(t.shape)}; one descale for the tensor: "
                f"torch.tensor([s], device=q.device).expand{shape}"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        reach = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
        if reach >= DESCALE_INDEX_LIMIT:
            raise ValueError(
                f"{name}'s strides {t.stride()} reach element {reach}; the kernel indexes at "
                "most 2^31 - 1: pass a contiguous descale"
            )
    return tuple(descales)


def refuse_gradients(what: str, named) -> None:
    """A call needing gradients: RuntimeError naming the first argument that requires grad
    (the FP8 forward has no backward)."""
    import torch

    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise RuntimeError(
                f"{what}: {name} requires grad, but the 8-bit (FP8) forward has no backward "
                f"(issue 42); call it under torch.no_grad() or pass {name}.detach()"
            )


class Fp8Calls:
    """FlashAttention's calls of an 8-bit spec (mixed in; uses its config, checks, launch)."""

    @property
    def is_fp8(self) -> bool:
        """Whether the spec's dtypes are 8-bit (`dtype e4m3`, `e5m2`)."""
        return self.config.dtypes[0].is_8bit

    @property
    def out_torch_dtype(self):
        """O's torch dtype: the spec's `output` for an 8-bit spec, else None (q's). A plain
        property: torch.compile traces it (a cached_property's lock breaks the graph)."""
        if not self.is_fp8:
            return None
        return {w: t for t, w in out_dtypes().items()}[self.config.out_dtype.value]

    def _call_fp8(self, q, k, v, scale: float, out, return_lse: bool, keywords: dict):
        """``kern(q, k, v, softmax_scale, q_descale=, k_descale=, v_descale=, out=,
        return_lse=)`` (the scale and return_lse checked): eager calls launch directly,
        torch.compile traces the kernel's op (fadsl/runtime/fp8_ops.py)."""
        import torch

        name = self.config.name
        for key in keywords:
            if key not in DESCALE_NAMES:
                raise TypeError(
                    f"kernel '{name}' got an unexpected keyword argument '{key}'; an 8-bit "
                    "kernel takes q_descale, k_descale and v_descale (float32, (batch, heads_kv))"
                )
        descales = tuple(keywords.get(n) for n in DESCALE_NAMES)
        named = (("q", q), ("k", k), ("v", v), *zip(DESCALE_NAMES, descales))
        refuse_gradients(f"fadsl kernel '{name}'", named)
        if torch.compiler.is_compiling():
            if out is not None:  # as eager's check_out, less the address checks (fake tensors)
                check_out_meta(out, q, self.config.target, self.out_torch_dtype)
            o, lse = self._ops(q, k, v, *descales, scale, return_lse)
            if out is not None:
                out.copy_(o)
                o = out
            return (o, lse) if return_lse else o
        return self.fp8_forward(q, k, v, scale, descales, out, return_lse)

    def check_fp8_call(self, q, k, v, descales):
        """Every check of an 8-bit call's inputs and descales (no memory access: fake
        tensors pass); q's ``Dtype``."""
        dtype = self.check_inputs(q, k, v)
        check_descales(descales, q, k)
        return dtype

    def fp8_forward(self, q, k, v, scale: float, descales, out=None, return_lse=False):
        """Check, allocate what is missing (O of the spec's output type) and launch."""
        import torch

        dtype = self.check_fp8_call(q, k, v, descales)
        if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
            check_bases(q, k, v, self.config.target)
        if out is None:
            out = torch.empty(q.shape, dtype=self.out_torch_dtype, device=q.device)
        else:
            check_out(out, q, k, v, self.config.target, self.out_torch_dtype)
        lse = None
        if return_lse:
            lse = torch.empty(lse_shape(q), device=q.device, dtype=torch.float32)
        self.launch(dtype, q, k, v, out, lse, scale, (), tuple(descales))
        return (out, lse) if return_lse else out
