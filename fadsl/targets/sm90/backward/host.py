"""The host side of sm_90a's backward: the three kernels' parameters, grids and workspace.

A backward call runs, on the current stream (emit/sm90/include/fadsl/sm90_bwd.cuh):
  ``<name>_preprocess``  D, LSE in log2 units, dQ's accumulator zeroed;
  ``<name>``             the main kernel: dK, dV (per query head in fp32 under GQA), dQ's
                         accumulator by reduce-adds;
  ``<name>_convert_dq``  dQ in the input dtype;
then, under GQA, dK and dV summed over each K/V head's query heads in a fixed order
(torch's sum over the group dimension: deterministic) and cast to the input dtype.

Every buffer comes from PyTorch's caching allocator on the call's stream, so a CUDA graph
captures the whole backward (the accumulator is zeroed by the preprocess kernel, inside
the graph).
"""

from __future__ import annotations

import struct
from typing import Any, Callable

from ....ir import Kernel
from ...launch import KernelLaunch
from ..host.tma import tensor_map
from .emit import AUX_THREADS, convert_ctas, prep_rows_per_cta, smem_bytes

PANEL_COLS = 64
# BwdParamsSm90: four 128-byte tensor maps, then (sm90_bwd.cuh's order) 6 pointers, 6 int64
# strides, 7 ints, 2 floats; 644 bytes, rounded to the struct's 128-byte alignment.
MAIN_FIELDS = struct.Struct("<6Q6q7i2f")
MAIN_BYTES = 768
# BwdPrepParams: 8 pointers, 8 int64 strides, 3 ints; 140 bytes, 8-byte aligned.
PREP = struct.Struct("<8Q8q3i4x")
# BwdConvertParams: 2 pointers, 3 int64 strides, 3 ints, a float.
CONVERT = struct.Struct("<2Q3q3if")
LOG2E = 1.4426950408889634


SUFFIXES = ("_preprocess", "", "_convert_dq")


def threads(kernel: Kernel) -> int:
    return kernel.backward.threads


def dynamic_smem(kernel: Kernel, suffix: str) -> int:
    return smem_bytes(kernel.backward, kernel.config.head_dim) if suffix == "" else 0


def _strides3(t) -> tuple[int, int, int]:
    """(batch, row, head) strides in elements of a (batch, seqlen, heads, head_dim) tensor."""
    s = t.stride()
    return s[0], s[1], s[2]


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
) -> tuple[Any, Any, Any]:
    """dq, dk, dv for one call: allocates the workspace, launches the three kernels through
    ``launch`` (which loads and launches a KernelLaunch on the current stream) and sums
    GQA's per-head dK and dV. ``dlse``: the LSE's gradient (strides of ``lse``) or None."""
    import torch

    bwd = kernel.backward
    head_dim = kernel.config.head_dim
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    m_blocks = -(-seqlen_q // bwd.block_m)
    rounded = m_blocks * bwd.block_m
    device = q.device
    f32 = dict(device=device, dtype=torch.float32)
    lse_log2 = torch.empty((batch, heads_q, rounded), **f32)
    dpsum = torch.empty((batch, heads_q, rounded), **f32)
    dq_accum = torch.empty((batch, heads_q, rounded * head_dim), **f32)
    # `deterministic on`: one int per (batch, head, m-block), zeroed by the preprocess
    semaphore = (
        torch.empty((batch, heads_q, m_blocks), device=device, dtype=torch.int32)
        if bwd.deterministic
        else None
    )
    semaphore_ptr = 0 if semaphore is None else semaphore.data_ptr()
    dq = torch.empty_like(q)
    if group == 1:
        dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:  # per query head, fp32; summed over the group below
        dk = torch.empty((batch, seqlen_k, heads_q, head_dim), **f32)
        dv = torch.empty((batch, seqlen_k, heads_q, head_dim), **f32)

    launch(
        KernelLaunch(
            "_preprocess",
            (-(-rounded // prep_rows_per_cta(head_dim)), heads_q, batch),
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
                lse.stride(0),
                lse.stride(1),
                seqlen_q,
                rounded,
                heads_q,
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
        rounded,
        m_blocks,
        heads_q,
        group,
        int(group > 1),
        softmax_scale * LOG2E,
        softmax_scale,
    )
    main = maps + fields
    main += bytes(MAIN_BYTES - len(main))
    launch(
        KernelLaunch(
            "", (-(-seqlen_k // bwd.block_n), heads_q, batch), (threads(kernel), 1, 1), main
        )
    )
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
                softmax_scale,
            ),
        )
    )
    if group > 1:
        shape = (batch, seqlen_k, heads_kv, group, head_dim)
        dk = dk.view(shape).sum(dim=3).to(k.dtype)
        dv = dv.view(shape).sum(dim=3).to(v.dtype)
    return dq, dk, dv
