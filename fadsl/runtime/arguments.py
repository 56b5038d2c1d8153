"""The checks of a call's arguments (q, k, v, out, lse, softmax_scale) and the messages that
name what is wrong; fadsl/runtime/attention.py runs them before every launch.

``accepts`` is the one cheap test a call's q, k and v pass; ``explain_inputs`` runs only when
it fails and says why. None reads tensor memory: ``check_base``, ``check_bases`` and
``check_out`` read addresses (real tensors only), the others shapes, strides and dtypes (fake
tensors pass them).
"""

from __future__ import annotations

import math
import numbers

from .. import targets
from ..ir import Config, Dtype
from ..ir.expr import GRID_YZ_LIMIT, SEQLEN_LIMIT, Dim, ExprType, InputDecl, dim_size

# An input's elements are indexed with 32-bit ints (fadsl/targets/cuda_expr.py).
INPUT_ELEMENTS_LIMIT = 2**31


def modifier_inputs(decls: tuple[InputDecl, ...], given: dict, q, k, kernel: str) -> tuple:
    """The tensors a call passes for its spec's `input` lines (issue 41), by name, in declared
    order: each a contiguous tensor of the declared dtype (f32: torch.float32, i32:
    torch.int32) and shape (the sizes from q and k: batch, seqlen_q, heads from q; seqlen_k,
    heads_kv from k) on q's device; every error names the argument."""
    import torch

    unknown = [name for name in given if all(d.name != name for d in decls)]
    if unknown:
        declared = ", ".join(d.name for d in decls)
        raise TypeError(
            f"kernel '{kernel}' got an unexpected keyword argument '{unknown[0]}'; "
            + (f"its inputs are {declared}" if decls else "its spec declares no inputs")
        )
    sizes = {
        Dim.BATCH: q.shape[0],
        Dim.SEQLEN_Q: q.shape[1],
        Dim.HEADS: q.shape[2],
        Dim.SEQLEN_K: k.shape[1],
        Dim.HEADS_KV: k.shape[2],
    }
    dtypes = {ExprType.F32: torch.float32, ExprType.I32: torch.int32}
    found = []
    for decl in decls:
        name = decl.name
        if name not in given:
            raise TypeError(
                f"kernel '{kernel}' needs its input '{name}' ({decl.text()}): pass {name}=..."
            )
        t = given[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor ({decl.text()}), got {type(t).__name__}"
            )
        if t.dtype != dtypes[decl.dtype]:
            raise TypeError(f"{name} must be {dtypes[decl.dtype]} ({decl.text()}), got {t.dtype}")
        shape = tuple(dim_size(d, sizes) for d in decl.dims)
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must have shape {shape} ({decl.text()}, with q's and k's sizes), got "
                f"{tuple(t.shape)}"
            )
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if not t.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous (the kernel reads it row-major); pass {name}.contiguous()"
            )
        if t.numel() >= INPUT_ELEMENTS_LIMIT:
            raise ValueError(
                f"{name} has {t.numel()} elements; the kernel indexes at most 2^31 - 1"
            )
        found.append(t)
    return tuple(found)


def check_longest(m, q, k, kernel: str) -> None:
    """Refuses, naming q or k, a sequence longer than the spec's modifiers keep their values
    in range for (``Modifiers.longest``, check_modifiers' bound: e.g. '3 * q_idx' leaves the
    i32 range past 715,827,883 queries)."""
    if m is None or m.longest is None:
        return
    for name, t in (("q", q), ("k", k)):
        if t.shape[1] > m.longest:
            raise ValueError(
                f"{name}'s sequence length {t.shape[1]} is past {m.longest}, the longest at "
                f"which kernel '{kernel}''s {m.longest_why} stays within its type's range"
            )


def check_scale(softmax_scale, head_dim: int) -> float:
    """The scale to launch with: 1 / sqrt(head_dim) for None, else a finite positive real."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a real number, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be finite and positive, got {softmax_scale}")
    return float(softmax_scale)


def torch_dtypes() -> dict:
    """The torch dtypes a spec may compile for, with their ``Dtype``."""
    import torch

    return {
        torch.bfloat16: Dtype.BF16,
        torch.float16: Dtype.FP16,
        torch.float8_e4m3fn: Dtype.E4M3,
        torch.float8_e5m2: Dtype.E5M2,
    }


def torch_dtype_of(dtype: Dtype | str):
    """``dtype``'s torch dtype (a ``Dtype`` or its spec name: bf16, fp16, e4m3, e5m2)."""
    return {d: t for t, d in torch_dtypes().items()}[Dtype(dtype)]


def torch_name(dtype: Dtype) -> str:
    """How a message names ``dtype``'s torch dtype (torch.bfloat16, torch.float8_e4m3fn)."""
    return {d: f"{t}" for t, d in torch_dtypes().items()}[dtype]


def compiled_dtypes(dtypes: tuple[Dtype, ...]) -> dict:
    """The torch dtypes of ``dtypes`` (a spec's), with their ``Dtype``: ``accepts``'s table."""
    return {t: d for t, d in torch_dtypes().items() if d in dtypes}


def accepts(q, k, v, dtypes: dict, head_dim: int) -> Dtype | None:
    """q's ``Dtype`` if q, k and v pass every check, else None (one expression, no messages;
    ``dtypes`` is ``compiled_dtypes``'s table). May raise on what is not a tensor."""
    dtype = dtypes.get(q.dtype)
    qs, ks, qst, kst, vst = q.shape, k.shape, q.stride(), k.stride(), v.stride()
    device = q.get_device()
    ok = (
        dtype is not None
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and len(qs) == 4
        and ks == v.shape
        and len(ks) == 4
        and qs[3] == head_dim
        and ks[3] == head_dim
        and ks[0] == qs[0]
        and 0 < ks[2] <= qs[2] <= GRID_YZ_LIMIT
        and qs[2] % ks[2] == 0
        and 0 < qs[0] <= GRID_YZ_LIMIT
        and 0 < qs[1] < SEQLEN_LIMIT
        and 0 < ks[1] < SEQLEN_LIMIT
        and qst[3] == kst[3] == vst[3] == 1
        and not any(st % (16 // dtype.nbytes) for st in (*qst[:3], *kst[:3], *vst[:3]))
        and device >= 0
        and k.get_device() == device
        and v.get_device() == device
        and q.device.type == "cuda"
    )
    return dtype if ok else None


def explain_inputs(q, k, v, cfg: Config) -> Dtype:
    """The checks of ``accepts`` one at a time, raising on the first that fails with a message
    that names the tensor and what is wrong; q's ``Dtype`` if all pass."""
    import torch

    names = ("q", "k", "v")
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in zip(names, (q, k, v)):
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}"
            )
        check_operand(name, t, q, cfg)
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
    return torch_dtypes()[q.dtype]


def check_operand(name: str, t, q, cfg: Config, head_axis: int = 3) -> None:
    """One 4-D operand of a call (a padded (batch, rows, heads, head_dim) tensor or a cache;
    a packed one viewed with a batch of 1, its head_dim at ``head_axis`` as the caller sees
    it): a dtype the spec compiles, q's dtype, the spec's head_dim last, and strides the
    target's loads take; each error names ``name``."""
    if torch_dtypes().get(t.dtype) not in cfg.dtypes:
        allowed = ", ".join(torch_name(d) for d in cfg.dtypes)
        raise TypeError(
            f"{name} has dtype {t.dtype}; kernel '{cfg.name}' was compiled for {allowed}"
        )
    if t.dtype != q.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    if t.shape[3] != cfg.head_dim:
        raise ValueError(
            f"{name}.shape[{head_axis}] is the head_dim, which the spec fixes at {cfg.head_dim}, "
            f"got {t.shape[3]}"
        )
    check_strides(name, t, cfg.target)


def check_strides(name: str, t, target: str) -> None:
    """The kernel moves 16-byte vectors (sm_80) or TMA boxes (sm_90a): last dimension
    contiguous, the others' strides multiples of 16 bytes (a size-1 dimension's is free)."""
    if t.stride(3) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides "
            f"{t.stride()}; pass {name}.contiguous()"
        )
    per = 16 // t.element_size()  # elements in 16 bytes: 8 at 16 bits, 16 at 8 (FP8)
    if any(st % per for st, n in zip(t.stride()[:3], t.shape[:3]) if n > 1):
        in_bytes = tuple(st * t.element_size() for st in t.stride())
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of {per} "
            f"elements ({_alignment(target)}), got strides {t.stride()} "
            f"({in_bytes} bytes) for shape {tuple(t.shape)}; pass {name}.contiguous()"
        )


def check_base(name: str, t, target: str) -> None:
    """The tensor's address must be 16-byte aligned, as its strides are."""
    if t.data_ptr() % 16:
        raise ValueError(
            f"{name} must be 16-byte aligned with strides that are multiples of "
            f"{16 // t.element_size()} elements ({_alignment(target)}), got an address "
            f"{t.data_ptr() % 16} bytes past a 16-byte boundary"
        )


def check_bases(q, k, v, target: str) -> None:
    """``check_base`` of q, k and v, in that order."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_base(name, t, target)


def check_out_meta(out, q, target: str, dtype=None) -> None:
    """``out`` must be a tensor of q's shape, dtype (``dtype`` where given: an 8-bit call's
    output type) and device with strides the kernel takes (no memory access: fake tensors
    pass)."""
    import torch

    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    dtype = q.dtype if dtype is None else dtype
    if out.shape != q.shape or out.dtype != dtype or out.device != q.device:
        raise ValueError(
            f"out must match q: shape {tuple(q.shape)}, {dtype}, {q.device}; got shape "
            f"{tuple(out.shape)}, {out.dtype}, {out.device}"
        )
    check_strides("out", out, target)


def check_out(out, q, k, v, target: str, dtype=None) -> None:
    """``check_out_meta``, then out's address: aligned, no two elements in one place, and no
    byte shared with q, k or v (which the kernel reads while it writes out)."""
    check_out_meta(out, q, target, dtype)
    check_base("out", out, target)
    # A contiguous out (the usual case) has no overlapping elements: skip the walk.
    if not out.is_contiguous() and overlaps_itself(out):
        raise ValueError(
            f"out's elements must not overlap (got strides {out.stride()} for shape "
            f"{tuple(out.shape)}); pass a tensor such as torch.empty_like(q)"
        )
    out_first, out_end = span(out)
    for name, t in (("q", q), ("k", k), ("v", v)):
        first, end = span(t)
        if first < out_end and out_first < end:
            raise ValueError(
                f"out shares memory with {name}; the kernel reads {name} while it writes "
                "out, so out must have memory of its own"
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


def backward_operands(out, lse, dout, dlse, lse_shape_, device):
    """A backward's dout, lse and dlse checked against the forward's output and its LSE's
    shape ``lse_shape_`` on ``device`` (ValueError saying which), made as the kernels read
    them: dout contiguous (TMA reads it; d(out.sum()) is a broadcast), the LSEs contiguous
    float32."""
    import torch

    if dout.shape != out.shape or dout.dtype != out.dtype or dout.device != out.device:
        raise ValueError(
            f"the output's gradient has shape {tuple(dout.shape)}, {dout.dtype} on "
            f"{dout.device}; expected the output's {tuple(out.shape)}, {out.dtype} on {out.device}"
        )
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and (tuple(t.shape) != lse_shape_ or t.device != device):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} on {t.device}; expected the forward's "
                f"LSE's {lse_shape_} on {device}"
            )
    if lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 (the forward's), got {lse.dtype}")
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    return dout.contiguous(), lse.contiguous(), dlse


def span(t) -> tuple[int, int]:
    """The byte range [first, last + 1) that a tensor's elements lie in."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlaps_itself(t) -> bool:
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


def _alignment(target: str) -> str:
    """Why the target's kernels need 16-byte aligned strides and bases."""
    return targets.get(target).capabilities.alignment
