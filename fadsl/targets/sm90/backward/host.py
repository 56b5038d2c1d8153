"""The host side of sm_90a's backward: the three kernels' parameters, grids and workspace.

A backward call runs, on the current stream (emit/sm90/include/fadsl/sm90_bwd.cuh):
  ``<name>_preprocess``  D, LSE in log2 units, dQ's accumulator zeroed;
  ``<name>``             the main kernel: dK, dV (under GQA in fp32: added per K/V head, or
                         with `deterministic on` per query head), dQ's accumulator by
                         reduce-adds;
  ``<name>_convert_dq``  dQ in the input dtype (not where the main kernel converts it:
                         `fused_convert on`, fuses_convert);
  ``<name>_learn``       (a learnable variant's only) the inputs' correction for D's
                         rounding, from the main kernel's per-row sums (learn_rows_buffer);
then, under GQA, dK and dV cast to the input dtype (with `deterministic on` first summed over
each K/V head's query heads in a fixed order: torch's sum over the group dimension).

Every buffer comes from PyTorch's caching allocator on the call's stream, so a CUDA graph
captures the whole backward (the accumulator is zeroed by the preprocess kernel, inside
the graph).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable

from ....ir import Kernel, Mask
from ...launch import KernelLaunch, sm_count
from ..host.keep_classes import (
    CLASSES_SUFFIX,
    CLASSES_THREADS,
    classes_per_call,
    plan_backward_classes,
)
from ..host.tma import tensor_map
from ..learn import learn_row_floats
from .emit import (
    AUX_THREADS,
    FUSED_CONVERT_MAX_QUERIES,
    convert_ctas,
    dq_semaphores,
    prep_rows_per_cta,
    smem_bytes,
)

PANEL_COLS = 64
# BwdParamsSm90: four 128-byte tensor maps, then (sm90_bwd.cuh's order) 6 pointers, 6 int64
# strides, 7 ints, 2 floats, the varlen fields (2 pointers, an int); 668 bytes, rounded to
# the struct's 128-byte alignment.
# BwdParamsSm90::dkv_store (sm90_bwd.cuh's DkvStore)
DKV_STORE_T, DKV_STORE_PARTIAL, DKV_ADD_FP32 = 0, 1, 2
MAIN_FIELDS = struct.Struct("<6Q6q7i2fi2Qi")
MAIN_BYTES = 896
# Then the score and mask modifiers' fields (issue 41): the spec's input pointers in declared
# order, zeros past them, and the batch size, at the offsets sm90_bwd.cuh's static_assert
# names (packed only for a spec with modifiers; zeros otherwise, as before they existed).
# ... batch, input_grads (kLearn's buffer, at 744), learn_rows (its per-row sums, at 752)
MODIFIERS = struct.Struct("<8Qi4xQQ")
MODIFIERS_OFFSET = 672
# Then `fused_convert on`'s: dQ's pointer and its 3 int64 strides (zeros: convert_dq converts);
# the struct is 896 bytes with them (its 128-byte alignment, the tensor maps')
FUSED = struct.Struct("<Q3q")
FUSED_OFFSET = 760
# BwdPrepParams: 8 pointers, 8 int64 strides, 3 ints, the varlen pointer and int, then the
# varlen gradients to zero outside the sequences (4 pointers, 3 ints); 208 bytes.
PREP = struct.Struct("<8Q8q3i4xQi4x4Q3i4x")
# BwdConvertParams: 2 pointers, 3 int64 strides, 3 ints, a float, the varlen pointer and int.
CONVERT = struct.Struct("<2Q3q3ifQi4x")
LOG2E = 1.4426950408889634


SUFFIXES = ("_preprocess", "", "_convert_dq")
# A learnable variant's fourth kernel (kLearn): the inputs' correction for D's rounding
LEARN_SUFFIX = "_learn"
LEARN_ROWS_PER_CTA = 256  # sm90_bwd_learn.cuh's bwd_learn_fix: a query row per thread


def suffixes(kernel: Kernel) -> tuple[str, ...]:
    """The kernels of ``kernel``'s backward source: with learnable inputs, ``_learn`` too;
    with a keep that reads inputs per token, ``_keep_classes``."""
    found = SUFFIXES + ((LEARN_SUFFIX,) if _learns(kernel) else ())
    return found + ((CLASSES_SUFFIX,) if classes_per_call(kernel) else ())


def _learns(kernel: Kernel) -> bool:
    m = kernel.config.modifiers
    return m is not None and bool(m.learn)


def threads(kernel: Kernel) -> int:
    return kernel.backward.threads


def dynamic_smem(kernel: Kernel, suffix: str) -> int:
    return smem_bytes(kernel.backward, kernel.config.head_dim) if suffix == "" else 0


def _strides3(t) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a (batch, seqlen, heads, head_dim) tensor."""
    s = t.stride()
    return s[0], s[1], s[2]


@dataclass(frozen=True)
class _Layout:
    """What the three kernels see of a call beyond the (batch, seqlen, heads, head_dim)
    tensors (varlen: one batch of the packed rows, whose sequences the kernels find in
    cu_seqlens, query rows padded per sequence in the LSE, D and dQ's accumulator)."""

    rows: int  # padded query rows per (batch, head): the LSE's, D's, the accumulator's
    key_ctas: int  # the main kernel's grid x
    lse_batch_stride: int
    lse_head_stride: int
    cu_q: int = 0  # device pointers (varlen), else 0
    cu_k: int = 0
    sequences: int = 0


def run(
    kernel: Kernel,
    launch: Callable[[KernelLaunch], None],
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
) -> tuple[Any, Any, Any]:
    """dq, dk, dv for one call: allocates the workspace, launches the three kernels through
    ``launch`` (which loads and launches a KernelLaunch on the current stream) and sums
    GQA's per-head dK and dV. ``dlse``: the LSE's gradient (strides of ``lse``) or None;
    ``inputs``: the score and mask modifiers' tensors (checked, in declared order);
    ``input_grads``: the learnable variant's fp32 gradient buffer, zeroed, or None;
    ``classes``: (B_r, B_c, class bytes, ranges) made before for these q, k and inputs
    (``classes_only``), used where B_r and B_c are this kernel's (else its pass runs)."""
    import torch

    bwd = kernel.backward
    layout = _Layout(
        rows=-(-q.shape[1] // bwd.block_m) * bwd.block_m,
        key_ctas=-(-k.shape[1] // bwd.block_n),
        lse_batch_stride=lse.stride(0),
        lse_head_stride=lse.stride(1),
    )
    grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    return _launch_all(
        kernel,
        launch,
        layout,
        (q, k, v, out, dout),
        grads,
        lse,
        dlse,
        softmax_scale,
        inputs=inputs,
        input_grads=input_grads,
        classes=classes,
    )


def classes_only(kernel: Kernel, launch: Callable[[KernelLaunch], None], q, k, inputs) -> tuple:
    """The backward's tile classes of a keep that reads inputs per token, made ahead for
    calls on these q, k (shapes) and ``inputs`` (the spec's, checked): (B_r, B_c, class bytes,
    ranges), for ``run``'s ``classes``. Launches the classing kernel alone, with params that
    hold only what it reads (sizes, the inputs, the batch)."""
    bwd = kernel.backward
    (cls, ranges), grid = plan_backward_classes(kernel, q, k)
    batch, seqlen_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    m_blocks = -(-seqlen_q // bwd.block_m)
    group = heads_q // k.shape[2]  # (an expression's heads_kv is heads_q / group)
    fields = MAIN_FIELDS.pack(
        *[0] * 12, seqlen_q, k.shape[1], m_blocks * bwd.block_m, m_blocks, heads_q, group, 0,
        0.0, 0.0, 0, 0, 0, 0,
    )  # fmt: skip
    main = bytes(4 * 128) + fields
    main += bytes(MODIFIERS_OFFSET - len(main)) + modifier_fields(
        tuple(inputs) + (cls, ranges), batch
    )
    main += bytes(MAIN_BYTES - len(main))
    launch(KernelLaunch(CLASSES_SUFFIX, grid, (CLASSES_THREADS, 1, 1), main))
    return bwd.block_m, bwd.block_n, cls, ranges


def run_varlen(
    kernel: Kernel,
    launch: Callable[[KernelLaunch], None],
    q,
    k,
    v,
    out,
    lse,
    dout,
    dlse,
    cu_seqlens_q,
    cu_seqlens_k,
    softmax_scale: float,
) -> tuple[Any, Any, Any]:
    """dq, dk, dv of a packed call: q, out, dout (tokens_q, heads_q, head_dim), k, v
    (tokens_k, heads_kv, head_dim), lse and dlse (heads_q, tokens_q) float32, cu_seqlens
    int32 (sequences + 1) on the device, never read here. Rows outside every sequence get
    zero gradients (FlashAttention-3 leaves them unwritten)."""
    import torch

    bwd = kernel.backward
    sequences = cu_seqlens_q.shape[0] - 1
    tokens_q, tokens_k = q.shape[0], k.shape[0]
    if tokens_q == 0 or tokens_k == 0 or sequences == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # contiguous rows: the preprocess zeroes those outside every sequence (bwd_zero_outside),
    # the later kernels write the rest
    grads = tuple(torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))
    r = bwd.block_m
    layout = _Layout(
        # each sequence starts a chunk of r rows of its own: at most r rows more each
        rows=-(-(tokens_q + sequences * r) // r) * r,
        key_ctas=-(-tokens_k // bwd.block_n) + sequences,
        lse_batch_stride=0,
        lse_head_stride=lse.stride(0),
        cu_q=cu_seqlens_q.data_ptr(),
        cu_k=cu_seqlens_k.data_ptr(),
        sequences=sequences,
    )
    packed = tuple(t.unsqueeze(0) for t in (q, k, v, out, dout))
    dq, dk, dv = _launch_all(
        kernel,
        launch,
        layout,
        packed,
        tuple(g.unsqueeze(0) for g in grads),
        lse,
        dlse,
        softmax_scale,
        zero_partials=True,
    )
    return dq[0], dk[0], dv[0]


def _zeroed_outside(layout: _Layout, dq, dk, dv, dkv_store: int) -> tuple[int, ...]:
    """BwdPrepParams' last fields: with packed sequences the gradients whose rows outside
    every sequence the preprocess zeroes (dk and dv only where the main kernel stores them
    in place, not into fp32 accumulators), cu_seqlens_k, the keys' rows and the bytes of a
    row of dq and of dk; nothing otherwise."""
    if not layout.cu_q:
        return (0, 0, 0, 0, 0, 0, 0)
    in_place = dkv_store == DKV_STORE_T
    return (
        dq.data_ptr(),
        dk.data_ptr() if in_place else 0,
        dv.data_ptr() if in_place else 0,
        layout.cu_k,
        dk.shape[1],
        dq[0, 0].numel() * dq.element_size(),
        dk[0, 0].numel() * dk.element_size() if in_place else 0,
    )


def _in_visit_order(kernel: Kernel, key_ctas: int, device) -> bool:
    """`deterministic on`: whether an m-block's ordered dQ adds may follow the order in which
    the n-blocks reach it (sm90_bwd_block.cuh, bwd_dq_place) rather than the n-block order.
    There a CTA waits on larger n-blocks: causal, those launch before it (bwd_block_at launches
    a (batch, head)'s n-blocks last first), at any length; without a mask they launch after
    it, so every n-block of a (batch, head) must fit on the GPU at once (one CTA per SM). Not
    with packed sequences, a window or longest_first (whose launch order interleaves the
    pairs)."""
    cfg, bwd = kernel.config, kernel.backward
    if not bwd.deterministic or cfg.features.varlen or cfg.window or bwd.longest_first:
        return False
    return cfg.mask is Mask.CAUSAL or key_ctas <= sm_count(device.index)


def fuses_convert(kernel: Kernel, layout: _Layout, seqlen_q: int) -> bool:
    """Whether the main kernel converts dQ this call (`fused_convert on`), not convert_dq:
    where no sequence has more than FUSED_CONVERT_MAX_QUERIES queries (emit.py says why):
    padded calls by their length, packed ones by their tokens (their sequences' lengths are
    on the device; the call's max_seqlen_q would say more, but does not reach the backward)."""
    return kernel.backward.fused_convert and seqlen_q <= FUSED_CONVERT_MAX_QUERIES


def dq_contributors(kernel: Kernel, seqlen_q: int, seqlen_k: int, m: int) -> int:
    """The n-blocks that visit m-block m of a padded call: sm90_bwd_block.cuh's
    bwd_dq_contributors (tests/test_backward_fused_convert.py holds the two to bwd_block)."""
    bwd, cfg = kernel.backward, kernel.config
    n_blocks = -(-seqlen_k // bwd.block_n)
    d = seqlen_k - seqlen_q
    window = cfg.window
    right = 0 if cfg.mask is Mask.CAUSAL else (window.right if window else None)
    last = n_blocks - 1
    if right is not None:
        x = (m + 1) * bwd.block_m - 1 + d + right
        last = -1 if x < 0 else min(x // bwd.block_n, n_blocks - 1)
    first = 0
    if window:
        first_key = m * bwd.block_m + d - window.left
        first = first_key // bwd.block_n if first_key > 0 else 0
    return max(last - first + 1, 0)


def keyless_queries(kernel: Kernel, seqlen_q: int, seqlen_k: int) -> int:
    """`fused_convert on`: the leading queries in m-blocks that no n-block visits (a right
    edge left of every key: causal or a window with seqlen_q > seqlen_k), whose dQ rows no
    CTA converts, so the host zeroes them; only leading m-blocks can be such (a query i < seqlen_q
    sees key i + d - left < seqlen_k, so a later m-block has a key if an earlier one has)."""
    if 0 < seqlen_q <= seqlen_k:  # (every query's right edge reaches a key: d >= 0)
        return 0
    m_blocks = -(-seqlen_q // kernel.backward.block_m)
    m = 0
    while m < m_blocks and dq_contributors(kernel, seqlen_q, seqlen_k, m) == 0:
        m += 1
    return min(m * kernel.backward.block_m, seqlen_q)


def main_grid(bwd, key_ctas: int, heads_q: int, batch: int, device) -> tuple[int, int, int]:
    """The main kernel's grid: a CTA per (n-block, head, batch) tile, or with `scheduler
    persistent` min(tiles, SMs) CTAs (one CTA fits an SM: __launch_bounds__(threads, 1) and
    the SMEM plan), each looping over the tiles (sm90_bwd_persistent.cuh)."""
    if not bwd.persistent:
        return (key_ctas, heads_q, batch)
    return (max(1, min(key_ctas * heads_q * batch, sm_count(device.index))), 1, 1)


def modifier_fields(inputs: tuple, batch: int, input_grads=None, learn_rows=None) -> bytes:
    """BwdParamsSm90's modifier fields: the inputs' pointers (zeros past them), the batch,
    the learnable inputs' gradient buffer and its per-row sums (0 without)."""
    pointers = [t.data_ptr() for t in inputs]
    grads = 0 if input_grads is None else input_grads.data_ptr()
    rows = 0 if learn_rows is None else learn_rows.data_ptr()
    return MODIFIERS.pack(*pointers, *[0] * (8 - len(pointers)), batch, grads, rows)


def learn_rows_buffer(kernel: Kernel, batch: int, heads_q: int, rows: int, dlse, device):
    """The learnable variant's per-row sums (sm90_bwd_learn.cuh), fp32 (batch, heads_q,
    rows, learn_row_floats): zeros, the row's sum of dS' starting at -dLSE, so that it ends
    as D's rounding's eps (dLSE: (batch, heads_q, seqlen_q) or None)."""
    import torch

    floats = learn_row_floats(kernel.config.modifiers)
    found = torch.zeros((batch, heads_q, rows, floats), device=device, dtype=torch.float32)
    if dlse is not None:
        found[:, :, : dlse.shape[2], 0] = -dlse
    return found


def _launch_all(
    kernel: Kernel,
    launch: Callable[[KernelLaunch], None],
    layout: _Layout,
    tensors,
    grads,
    lse,
    dlse,
    softmax_scale: float,
    zero_partials: bool = False,
    inputs: tuple = (),
    input_grads=None,
    classes=None,
) -> tuple[Any, Any, Any]:
    """The three kernels over (batch, seqlen, heads, head_dim) views: ``tensors`` q, k, v,
    out, dout; ``grads`` dq, dk, dv to write (dk and dv replaced by fp32 partials under GQA,
    zeroed first where ``zero_partials``); ``inputs``: the modifiers' tensors."""
    import torch

    q, k, v, out, dout = tensors
    dq, dk, dv = grads
    bwd = kernel.backward
    head_dim = kernel.config.head_dim
    batch, seqlen_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    rows = layout.rows
    m_blocks = rows // bwd.block_m
    device = q.device
    f32 = dict(device=device, dtype=torch.float32)
    lse_log2 = torch.empty((batch, heads_q, rows), **f32)
    dpsum = torch.empty((batch, heads_q, rows), **f32)
    dq_accum = torch.empty((batch, heads_q, rows * head_dim), **f32)
    # `deterministic on`: one int per (batch, head, m-block, share), zeroed by the preprocess;
    # `fused_convert on` counts each m-block's n-blocks done in share 0's
    fused = fuses_convert(kernel, layout, seqlen_q)
    shares = dq_semaphores(bwd, head_dim)
    semaphore = (
        torch.empty((batch, heads_q, m_blocks, shares), device=device, dtype=torch.int32)
        if bwd.deterministic or fused
        else None
    )
    semaphore_ptr = 0 if semaphore is None else semaphore.data_ptr()
    # GQA (sm90_bwd.cuh's DkvStore): the group's dK and dV added in fp32 per K/V head, or with
    # `deterministic on` stored per query head and summed over the group below in a fixed order
    dkv_store = DKV_STORE_T
    if group > 1 and bwd.deterministic:
        dkv_store = DKV_STORE_PARTIAL
        partial = torch.zeros if zero_partials else torch.empty
        dk = partial((batch, seqlen_k, heads_q, head_dim), **f32)
        dv = partial((batch, seqlen_k, heads_q, head_dim), **f32)
    elif group > 1:
        dkv_store = DKV_ADD_FP32
        dk = torch.zeros((batch, seqlen_k, heads_kv, head_dim), **f32)
        dv = torch.zeros((batch, seqlen_k, heads_kv, head_dim), **f32)

    launch(
        KernelLaunch(
            "_preprocess",
            (-(-rows // prep_rows_per_cta(head_dim)), heads_q, batch),
            (AUX_THREADS, 1, 1),
            PREP.pack(
                out.data_ptr(),
                dout.data_ptr(),
                lse.data_ptr(),
                0 if dlse is None else dlse.data_ptr(),
                lse_log2.data_ptr(),
                dpsum.data_ptr(),
                dq_accum.data_ptr(),
                semaphore_ptr,
                *_strides3(out),
                *_strides3(dout),
                layout.lse_batch_stride,
                layout.lse_head_stride,
                seqlen_q,
                rows,
                heads_q,
                layout.cu_q,
                layout.sequences,
                *_zeroed_outside(layout, dq, dk, dv, dkv_store),
            ),
        )
    )
    maps = b"".join(
        (
            tensor_map(q, PANEL_COLS, bwd.block_m),
            tensor_map(k, PANEL_COLS, bwd.block_n),
            tensor_map(v, PANEL_COLS, bwd.block_n),
            tensor_map(dout, PANEL_COLS, bwd.block_m),
        )
    )
    fields = MAIN_FIELDS.pack(
        lse_log2.data_ptr(),
        dpsum.data_ptr(),
        dq_accum.data_ptr(),
        dk.data_ptr(),
        dv.data_ptr(),
        semaphore_ptr,
        *_strides3(dk),
        *_strides3(dv),
        seqlen_q,
        seqlen_k,
        rows,
        m_blocks,
        heads_q,
        group,
        dkv_store,
        softmax_scale * LOG2E,
        softmax_scale,
        int(_in_visit_order(kernel, layout.key_ctas, device)),
        layout.cu_q,
        layout.cu_k,
        layout.sequences,
    )
    main = maps + fields
    # a keep that reads inputs per token: its tiles' classes, the inputs after the spec's
    hidden, classes_grid = _keep_classes(kernel, q, k, classes)
    inputs = tuple(inputs) + hidden
    learn_rows = None
    if input_grads is not None and _learns(kernel):
        learn_rows = learn_rows_buffer(kernel, batch, heads_q, rows, dlse, device)
    # (`scheduler persistent` reads the batch there too: bwd_tiles)
    if kernel.config.modifiers is not None or bwd.persistent:
        extra = modifier_fields(inputs, batch, input_grads, learn_rows)
        main += bytes(MODIFIERS_OFFSET - len(main)) + extra
    if fused:
        main += bytes(FUSED_OFFSET - len(main)) + FUSED.pack(dq.data_ptr(), *_strides3(dq))
        # rows no CTA converts (their gradient is 0; packed: the preprocess zeroes them)
        keyless = 0 if layout.cu_q else keyless_queries(kernel, seqlen_q, seqlen_k)
        if keyless:
            dq[:, :keyless].zero_()
    main += bytes(MAIN_BYTES - len(main))
    grid = main_grid(bwd, layout.key_ctas, heads_q, batch, device)
    if classes_grid is not None:  # (with the main kernel's params, before it)
        launch(KernelLaunch(CLASSES_SUFFIX, classes_grid, (CLASSES_THREADS, 1, 1), main))
    launch(KernelLaunch("", grid, (threads(kernel), 1, 1), main))
    if not fused:
        _launch_convert(
            launch, layout, bwd, dq_accum, dq, seqlen_q, m_blocks, heads_q, batch, softmax_scale
        )
    if learn_rows is not None and seqlen_q > 0:  # after the main kernel: every row's sums
        learn_ctas = -(-seqlen_q // LEARN_ROWS_PER_CTA)
        grid = (learn_ctas, heads_q, batch)
        launch(KernelLaunch(LEARN_SUFFIX, grid, (LEARN_ROWS_PER_CTA, 1, 1), main))
    if dkv_store == DKV_STORE_PARTIAL:
        shape = (batch, seqlen_k, heads_kv, group, head_dim)
        dk = dk.view(shape).sum(dim=3)
        dv = dv.view(shape).sum(dim=3)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


def _keep_classes(kernel: Kernel, q, k, made) -> tuple[tuple, tuple | None]:
    """The tile classes the main kernel reads after the spec's inputs (none where its keep
    needs none) and the grid of the pass that fills them first (None: no pass): ``made``
    ahead (``classes_only``'s) where its tiles are this kernel's, else this call's own."""
    bwd = kernel.backward
    if made is not None and tuple(made[:2]) == (bwd.block_m, bwd.block_n):
        return tuple(made[2:]), None
    planned = plan_backward_classes(kernel, q, k)
    return ((), None) if planned is None else planned


def _launch_convert(
    launch, layout: _Layout, bwd, dq_accum, dq, seqlen_q, m_blocks, heads_q, batch, scale
):
    """convert_dq: dQ = the accumulator times softmax_scale in the input dtype."""
    launch(
        KernelLaunch(
            "_convert_dq",
            (convert_ctas(m_blocks, bwd.block_m), heads_q, batch),
            (AUX_THREADS, 1, 1),
            CONVERT.pack(
                dq_accum.data_ptr(),
                dq.data_ptr(),
                *_strides3(dq),
                seqlen_q,
                m_blocks,
                heads_q,
                scale,
                layout.cu_q,
                layout.sequences,
            ),
        )
    )
