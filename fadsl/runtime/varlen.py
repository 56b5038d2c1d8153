"""Varlen calls of a `varlen on` spec: a packed batch of sequences of any lengths, in
FlashAttention's convention (``flash_attn_varlen_func``).

q is (tokens_q, heads_q, head_dim), k and v (tokens_k, heads_kv, head_dim); sequence b is
rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` of q and ``cu_seqlens_k[b] ..
cu_seqlens_k[b + 1] - 1`` of k and v (int32 prefix sums on q's device, sequences + 1 of
each). A causal mask aligns each sequence's diagonal to its bottom right. The output has q's
shape; the LSE is (heads_q, tokens_q), float32.

The host never reads cu_seqlens (that would wait for the GPU): the tile-list kernel checks
them on the device (non-negative, non-decreasing, within the tensors) and, if they are
not, fills the output and the LSE with NaN rather than return plausible numbers.
``max_seqlen_q`` and ``max_seqlen_k`` are accepted for FlashAttention's signature and
checked for type only: the kernels derive everything from cu_seqlens.
"""

from __future__ import annotations

from ..ir import Dtype
from .arguments import check_base, check_operand, torch_dtypes


def check_varlen(kern, q, k, v, cu_seqlens_q, cu_seqlens_k) -> Dtype:
    """Shapes, dtypes, strides and devices of a varlen call's tensors, each error naming
    the argument (no memory access: fake tensors pass)."""
    import torch

    cfg = kern.config
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be 3-D (tokens, heads, head_dim) for a varlen call, got shape "
                f"{tuple(t.shape)}"
            )
    for name, t in zip("qkv", (q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))):
        check_operand(name, t, q, cfg, head_axis=2)
        if t.device.type != "cuda" or t.device != q.device:
            raise ValueError(f"{name} must be on q's CUDA device, got {t.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q == 0 or heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(
            f"q's heads ({heads_q}) must be a multiple of k's and v's heads ({heads_kv})"
        )
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(
                f"{name} must be a 1-D int32 tensor of sequences + 1 prefix sums, got "
                f"{cu.dtype} of shape {tuple(cu.shape)}"
            )
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
        if cu.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous; pass {name}.contiguous()")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            f"cu_seqlens_k has {cu_seqlens_k.shape[0]} entries but cu_seqlens_q has "
            f"{cu_seqlens_q.shape[0]}: one prefix sum per sequence, plus one, in each"
        )
    limit = kern.serving.max_sequences
    if cu_seqlens_q.shape[0] - 1 > limit:
        raise ValueError(
            f"cu_seqlens_q holds {cu_seqlens_q.shape[0] - 1} sequences; a varlen call takes at "
            f"most {limit}: split the batch"
        )
    for name, t in (("q", q), ("k", k)):
        if t.shape[0] >= 2**30:
            raise ValueError(f"{name} has {t.shape[0]} tokens; at most 2^30 - 1")
    return torch_dtypes()[q.dtype]


def check_max_seqlen(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise TypeError(f"{name} must be a non-negative int or None, got {value!r}")


def varlen_lse_shape(q) -> tuple[int, int]:
    return (q.shape[1], q.shape[0])


def check_varlen_out(kern, out, q, k, v) -> None:
    """out: q's shape, dtype (an 8-bit spec's: its `output` type) and device, TMA's strides,
    memory of its own."""
    from .arguments import check_out

    if not hasattr(out, "dim") or out.dim() != 3:
        raise ValueError(
            f"out must be a 3-D tensor of q's shape {tuple(q.shape)}, got "
            f"{tuple(out.shape) if hasattr(out, 'shape') else type(out).__name__}"
        )
    dtype = kern.out_torch_dtype or q.dtype
    if out.shape != q.shape or out.dtype != dtype or out.device != q.device:
        raise ValueError(  # (before check_out, whose message has the batch of 1 it views)
            f"out must match q: shape {tuple(q.shape)}, {dtype}, {q.device}; got shape "
            f"{tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    check_out(
        out.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), kern.config.target,
        kern.out_torch_dtype,
    )  # fmt: skip


def run_varlen(kern, dtype: Dtype, q, k, v, cu_q, cu_k, out, lse, scale: float, descales=None):
    """Launch the target's varlen kernels on q's device's current stream; the plan they were
    launched by (``targets.launch.CallPlan``). ``descales``: an 8-bit kernel's, checked."""
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        check_base(name, t, kern.config.target)
    kernel = kern.compiled.kernel
    if descales is None and kern.is_fp8:  # (an 8-bit kernel always takes its second parameter)
        descales = (None, None, None)
    if descales is None:
        plan = kern.serving.varlen(kernel, q, k, v, cu_q, cu_k, out, lse, scale)
    else:
        plan = kern.serving.varlen(kernel, q, k, v, cu_q, cu_k, out, lse, scale, descales)
    launch = kern.launcher(dtype, q.device.index)
    for kl in plan.launches():
        launch(kl)
    return plan
