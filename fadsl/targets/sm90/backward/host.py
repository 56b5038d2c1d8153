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
from typing import Any, Callable, NamedTuple

from ....ir import Kernel, Mask
from ...launch import INPUT_SOURCES, KernelLaunch, sm_count
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
    dq_counters,
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
MAIN_BYTES = 1152
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
# Then dK and dV's TMA store maps (boxes of 64 columns x 64 key rows), for 16-bit gradients
# of one K/V head per query head (zeros otherwise); the struct is 1152 bytes with them
DKV_MAPS_OFFSET = 896
DKV_BOX_ROWS = 64
# BwdPrepParams: 8 pointers, 8 int64 strides, 3 ints, the varlen pointer and int, then the
# varlen gradients to zero outside the sequences (4 pointers, 3 ints); 208 bytes.
PREP = struct.Struct("<8Q8q3i4xQi4x4Q3i4x")
# BwdConvertParams: 3 pointers (the counters: the deterministic writer's chains, else 0), 3
# int64 strides, 3 ints, a float, the varlen pointer and int; 80 bytes.
CONVERT = struct.Struct("<3Q3q3ifQi4x")
LOG2E = 1.4426950408889634
# The address fields of each struct by name, in packing order (prepare_call packs them, and a
# launch plan's slots are made from the same names: launch_plan.py): PREP's first 8 fields,
# the main kernel's four tensor maps and MAIN_FIELDS' first 6, CONVERT's first 3; then the
# modifiers' inputs (INPUT_SOURCES) at MODIFIERS_OFFSET and dq at FUSED_OFFSET.
PREP_ADDRESSES = ("out", "dout", "lse", "dlse", "lse_log2", "dpsum", "dq_accum", "semaphore")
MAIN_MAPS = ("q", "k", "v", "dout")
MAIN_ADDRESSES = ("lse_log2", "dpsum", "dq_accum", "dk", "dv", "semaphore")
CONVERT_ADDRESSES = ("dq_accum", "dq", "semaphore")
ADDRESS_NAMES = (*PREP_ADDRESSES, "q", "k", "v", "dq", "dk", "dv")


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
    call = padded_call(
        kernel, q, k, v, out, lse, dout, dlse, softmax_scale, inputs, input_grads, classes
    )
    return call.launched(launch, k, v)


def padded_call(
    kernel: Kernel, q, k, v, out, lse, dout, dlse, softmax_scale: float, inputs=(),
    input_grads=None, classes=None,
) -> PackedCall:  # fmt: skip
    """``run``'s kernels, packed and not launched, and the tensors they write."""
    bwd = kernel.backward
    layout = _Layout(
        rows=-(-q.shape[1] // bwd.block_m) * bwd.block_m,
        key_ctas=-(-k.shape[1] // bwd.block_n),
        lse_batch_stride=lse.stride(0),
        lse_head_stride=lse.stride(1),
    )
    tensors = (q, k, v, out, dout)
    return prepare_call(
        kernel, layout, tensors, None, lse, dlse, softmax_scale,
        inputs=inputs, input_grads=input_grads, classes=classes,
    )  # fmt: skip


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
    call = prepare_call(
        kernel,
        layout,
        packed,
        tuple(g.unsqueeze(0) for g in grads),
        lse,
        dlse,
        softmax_scale,
        zero_partials=True,
    )
    dq, dk, dv = call.launched(launch, k, v)
    return dq[0], dk[0], dv[0]


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


class Sizes(NamedTuple):
    """What a call's shapes (its signature) decide beyond the kernel: the sizes its params
    hold, how dK and dV are stored, whether the main kernel converts dQ, the leading dQ rows
    the host zeroes, and the workspace's parts (name, byte offset) in one fp32 tensor of
    ``workspace_floats``: D, the LSE in log2 units, dQ's accumulator, the semaphores (the
    preprocess writes or zeroes each before the main kernel reads it)."""

    batch: int
    seqlen_q: int
    heads_q: int
    seqlen_k: int
    heads_kv: int
    rows: int
    m_blocks: int
    dkv_store: int
    fused: bool
    keyless: int
    parts: tuple[tuple[str, int], ...]
    workspace_floats: int


def sizes(kernel: Kernel, layout: _Layout, q, k) -> Sizes:
    bwd, head_dim = kernel.backward, kernel.config.head_dim
    batch, seqlen_q, heads_q = q.shape[0], q.shape[1], q.shape[2]
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    group, rows = heads_q // heads_kv, layout.rows
    m_blocks = rows // bwd.block_m
    fused = fuses_convert(kernel, layout, seqlen_q)
    # GQA (sm90_bwd.cuh's DkvStore): the group's dK and dV added in fp32 per K/V head, or with
    # `deterministic on` stored per query head and summed over the group by finish
    dkv_store = DKV_STORE_T
    if group > 1:
        dkv_store = DKV_STORE_PARTIAL if bwd.deterministic else DKV_ADD_FP32
    # `deterministic on`: one int per (batch, head, m-block, chain, share), zeroed by the
    # preprocess; `fused_convert on` counts each m-block's n-blocks done in share 0's
    semaphores = 0
    if bwd.deterministic or fused:
        semaphores = batch * heads_q * m_blocks * dq_counters(bwd, head_dim)
    per_row = batch * heads_q * rows
    parts, floats = [], 0
    for name, count in (
        ("lse_log2", per_row),
        ("dpsum", per_row),
        ("dq_accum", per_row * head_dim * bwd.dq_chains),  # `dq_chains N`: N per m-block
        ("semaphore", semaphores),
    ):
        if count:
            parts.append((name, 4 * floats))
            floats += -(-count // WORKSPACE_ALIGN) * WORKSPACE_ALIGN
    # rows no CTA converts (their gradient is 0; packed: the preprocess zeroes them)
    keyless = 0 if not fused or layout.cu_q else keyless_queries(kernel, seqlen_q, seqlen_k)
    return Sizes(
        batch, seqlen_q, heads_q, seqlen_k, heads_kv, rows, m_blocks, dkv_store, fused,
        keyless, tuple(parts), floats,
    )  # fmt: skip


WORKSPACE_ALIGN = 32  # floats: each part of the workspace starts on 128 bytes


def make(s: Sizes, head_dim: int, q, k, v, grads=None, zero_partials: bool = False) -> tuple:
    """A call's tensors in MADE's order: dq, dk, dv (``grads``' where given; fp32 under GQA,
    zeroed for the adds, or where ``zero_partials``) and the workspace."""
    import torch

    dq, dk, dv = grads or (torch.empty_like(q), None, None)
    if s.dkv_store == DKV_STORE_T:
        if dk is None:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
    else:
        heads = s.heads_q if s.dkv_store == DKV_STORE_PARTIAL else s.heads_kv
        shape = (s.batch, s.seqlen_k, heads, head_dim)
        dk, dv = (torch.empty(shape, device=q.device, dtype=torch.float32) for _ in "kv")
        if zero_partials or s.dkv_store == DKV_ADD_FP32:
            dk.zero_()
            dv.zero_()
    workspace = torch.empty(s.workspace_floats, device=q.device, dtype=torch.float32)
    return dq, dk, dv, workspace


MADE = ("dq", "dk", "dv", "workspace")  # make's tensors, as a launch plan names them


def finish(s: Sizes, dtypes, made: tuple) -> tuple[Any, Any, Any]:
    """dq, dk, dv from a call's tensors after its kernels (``dtypes``: k's and v's): the rows
    no CTA converts zeroed, GQA's fp32 dK and dV summed over the group where stored per query
    head, and cast."""
    dq, dk, dv, _ = made
    if s.keyless:
        dq[:, : s.keyless].zero_()
    if s.dkv_store == DKV_STORE_PARTIAL:
        shape = (s.batch, s.seqlen_k, s.heads_kv, s.heads_q // s.heads_kv, dk.shape[-1])
        dk = dk.view(shape).sum(dim=3)
        dv = dv.view(shape).sum(dim=3)
    if dk.dtype == dtypes[0] and dv.dtype == dtypes[1]:
        return dq, dk, dv
    return dq, dk.to(dtypes[0]), dv.to(dtypes[1])


def stores_dkv_by_tma(kernel: Kernel, s: Sizes) -> bool:
    """Whether the call's params hold dK and dV's TMA store maps: the spec's paths say so
    (padded batches: validate.py) and the gradients are stored per K/V head in the input
    dtype (under GQA the group's fp32 sums go from registers: sm90_bwd_lag.cuh)."""
    return kernel.backward.dkv_tma and s.dkv_store == DKV_STORE_T


class PackedCall(NamedTuple):
    """One call's kernels as packed (``prepare_call``): ``launches`` in order, the tensors it
    made (``made``, MADE's order), ``addresses``: each address field's value by name (0: none),
    ``plannable``: whether a launch plan may replay it with other addresses (no classing pass,
    no learnable buffers, no packed sequences); ``dkv_maps``: whether the main kernel's
    params hold dK's and dV's TMA store maps (at DKV_MAPS_OFFSET)."""

    sizes: Sizes
    launches: tuple[KernelLaunch, ...]
    made: tuple
    addresses: dict
    plannable: bool
    dkv_maps: bool = False

    def result(self, k, v) -> tuple[Any, Any, Any]:
        return finish(self.sizes, (k.dtype, v.dtype), self.made)

    def launched(self, launch: Callable[[KernelLaunch], None], k, v) -> tuple[Any, Any, Any]:
        """The kernels launched through ``launch``, then ``result``."""
        for kl in self.launches:
            launch(kl)
        return self.result(k, v)


def prepare_call(
    kernel: Kernel,
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
) -> PackedCall:
    """The kernels of one call over (batch, seqlen, heads, head_dim) views: ``tensors`` q, k, v,
    out, dout; ``grads`` dq, dk, dv to write (None: made here; dk and dv replaced by fp32
    partials under GQA, zeroed first where ``zero_partials``); ``inputs``: the modifiers'
    tensors."""
    q, k, v, out, dout = tensors
    bwd, head_dim = kernel.backward, kernel.config.head_dim
    s = sizes(kernel, layout, q, k)
    made = make(s, head_dim, q, k, v, grads, zero_partials)
    dq, dk, dv, workspace = made
    base = workspace.data_ptr()
    addresses = dict.fromkeys(ADDRESS_NAMES, 0)
    addresses.update((name, base + offset) for name, offset in s.parts)
    for name, t in (("out", out), ("dout", dout), ("lse", lse), ("dlse", dlse)):
        addresses[name] = 0 if t is None else t.data_ptr()
    addresses.update(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr())
    addresses.update(dq=dq.data_ptr(), dk=dk.data_ptr(), dv=dv.data_ptr())
    a = addresses
    prep = PREP.pack(
        *(a[name] for name in PREP_ADDRESSES),
        *_strides3(out),
        *_strides3(dout),
        layout.lse_batch_stride,
        layout.lse_head_stride,
        s.seqlen_q,
        s.rows,
        s.heads_q,
        layout.cu_q,
        layout.sequences,
        *_zeroed_outside(layout, dq, dk, dv, s.dkv_store),
    )
    prep_grid = (-(-s.rows // prep_rows_per_cta(head_dim)), s.heads_q, s.batch)
    launches = [KernelLaunch("_preprocess", prep_grid, (AUX_THREADS, 1, 1), prep)]
    maps = b"".join(
        tensor_map(t, PANEL_COLS, bwd.block_m if name in ("q", "dout") else bwd.block_n)
        for name, t in zip(MAIN_MAPS, (q, k, v, dout))
    )
    fields = MAIN_FIELDS.pack(
        *(a[name] for name in MAIN_ADDRESSES),
        *_strides3(dk),
        *_strides3(dv),
        s.seqlen_q,
        s.seqlen_k,
        s.rows,
        s.m_blocks,
        s.heads_q,
        s.heads_q // s.heads_kv,
        s.dkv_store,
        softmax_scale * LOG2E,
        softmax_scale,
        int(_in_visit_order(kernel, layout.key_ctas, q.device)),
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
        learn_rows = learn_rows_buffer(kernel, s.batch, s.heads_q, s.rows, dlse, q.device)
    # (`scheduler persistent` reads the batch there too: bwd_tiles)
    if kernel.config.modifiers is not None or bwd.persistent:
        extra = modifier_fields(inputs, s.batch, input_grads, learn_rows)
        main += bytes(MODIFIERS_OFFSET - len(main)) + extra
    if s.fused:
        main += bytes(FUSED_OFFSET - len(main)) + FUSED.pack(a["dq"], *_strides3(dq))
    dkv_maps = stores_dkv_by_tma(kernel, s)
    if dkv_maps:
        main += bytes(DKV_MAPS_OFFSET - len(main))
        main += tensor_map(dk, PANEL_COLS, DKV_BOX_ROWS) + tensor_map(dv, PANEL_COLS, DKV_BOX_ROWS)
    main += bytes(MAIN_BYTES - len(main))
    if classes_grid is not None:  # (with the main kernel's params, before it)
        launches.append(KernelLaunch(CLASSES_SUFFIX, classes_grid, (CLASSES_THREADS, 1, 1), main))
    grid = main_grid(bwd, layout.key_ctas, s.heads_q, s.batch, q.device)
    launches.append(KernelLaunch("", grid, (threads(kernel), 1, 1), main))
    if not s.fused:  # convert_dq: dQ = the accumulator times softmax_scale in the input dtype
        convert = CONVERT.pack(
            *(a[name] for name in CONVERT_ADDRESSES),
            *_strides3(dq),
            s.seqlen_q,
            s.m_blocks,
            s.heads_q,
            softmax_scale,
            layout.cu_q,
            layout.sequences,
        )
        grid = (convert_ctas(s.m_blocks, bwd.block_m), s.heads_q, s.batch)
        launches.append(KernelLaunch("_convert_dq", grid, (AUX_THREADS, 1, 1), convert))
    if learn_rows is not None and s.seqlen_q > 0:  # after the main kernel: every row's sums
        grid = (-(-s.seqlen_q // LEARN_ROWS_PER_CTA), s.heads_q, s.batch)
        launches.append(KernelLaunch(LEARN_SUFFIX, grid, (LEARN_ROWS_PER_CTA, 1, 1), main))
    for i, t in enumerate(inputs):
        addresses[INPUT_SOURCES[i]] = t.data_ptr()
    plannable = classes_grid is None and input_grads is None and not layout.cu_q
    return PackedCall(s, tuple(launches), made, addresses, plannable, dkv_maps)


def _keep_classes(kernel: Kernel, q, k, made) -> tuple[tuple, tuple | None]:
    """The tile classes the main kernel reads after the spec's inputs (none where its keep
    needs none) and the grid of the pass that fills them first (None: no pass): ``made``
    ahead (``classes_only``'s) where its tiles are this kernel's, else this call's own."""
    bwd = kernel.backward
    if made is not None and tuple(made[:2]) == (bwd.block_m, bwd.block_n):
        return tuple(made[2:]), None
    planned = plan_backward_classes(kernel, q, k)
    return ((), None) if planned is None else planned
