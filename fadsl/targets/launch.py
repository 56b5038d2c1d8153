"""The host side of a launch, common to every target: the call's arguments, a target's
``Launch`` (its params struct, grid and hooks), the ``fadsl::FwdParams`` every kernel takes
(emit/common/include/fadsl/params.cuh), the device's SM count and the current stream.

Each target's package has its own launch (targets/sm80/host.py, targets/sm90/host/) and its
``Target.launch`` names it.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from ..ir import Backward, Kernel


class Args(NamedTuple):
    """The tensors and scalars of one call, checked by the runtime (a NamedTuple: built on
    every call, and cheaper than a frozen dataclass)."""

    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any  # a float32 tensor (batch, heads_q, seqlen_q), or None
    softmax_scale: float
    # the spec's modifier inputs (issue 41), in declared order, checked; () without any
    inputs: tuple = ()
    # an 8-bit kernel's descales (issue 42): (q_descale, k_descale, v_descale), each a
    # checked float32 tensor or None (= 1); None for 16-bit kernels
    descales: tuple | None = None


class KernelLaunch(NamedTuple):
    """One kernel of a call: the rendered source's kernel + ``suffix``, its grid, block and
    params struct. ``dependent``: launched as a programmatic dependent of the kernel before it
    on the stream (PDL): its CTAs may be placed while that kernel still runs, and the kernel
    itself waits (``griddepcontrol.wait``) before it reads anything, so that only the launch
    latency is hidden, never an ordering lost."""

    suffix: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: bytes
    dependent: bool = False
    # a second by-value parameter (an 8-bit kernel's Fp8Descales), None: none
    second: bytes | None = None


# The sources of a call's modifier inputs in the slots (P.inputs[i]: the spec's inputs in
# declared order, then a keep's classes where the call passes or makes them)
INPUT_SOURCES = tuple(f"input{i}" for i in range(8))


class AddressSlot(NamedTuple):
    """Where a call's address lies in its params struct: ``offset`` bytes in, the address of
    the call's tensor ``source`` (a name the call kind lists: "q", "out", "cache_seqlens",
    a workspace's) plus ``delta`` bytes; ``tensor_map``: the offset is a CUtensorMap's and
    the address its global address, else an 8-byte field."""

    offset: int
    source: str
    delta: int = 0
    tensor_map: bool = False


class Workspace(NamedTuple):
    """Device memory a call's kernels use for that call alone (split pieces' partials, a
    tile list): ``elements`` of torch's ``dtype`` (its name: "float32", "int32"), named
    ``source`` in the slots; ``poison``: filled with NaN first (tests only)."""

    source: str
    elements: int
    dtype: str
    poison: bool = False


class KernelStep(NamedTuple):
    """One kernel of a planned call (the rendered source's kernel + ``suffix``), as
    KernelLaunch without the params; ``cluster``: CTAs per cluster (1: none)."""

    suffix: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    dependent: bool = False
    cluster: int = 1


class CallPlan(NamedTuple):
    """A call's kernels as a target plans them: ``params``, the struct every kernel of the
    call takes, packed for the call that was planned; ``kernels`` in launch order;
    ``slots``, every address in ``params``, so that a call of the same signature (shapes,
    strides, dtypes, devices, scalars: everything the plan read but the addresses) reuses
    the plan with its own addresses written in; ``workspaces``, made afresh for each call
    (``held``: the planned call's, in that order, then anything else the plan made for
    it, kept until it has launched); ``reusable``: False where the params hold something
    of the call's own that the slots do not name."""

    params: bytes
    kernels: tuple[KernelStep, ...]
    slots: tuple[AddressSlot, ...]
    workspaces: tuple[Workspace, ...] = ()
    held: tuple[Any, ...] = ()
    reusable: bool = True
    # the kernel's second by-value parameter (an 8-bit kernel's Fp8Descales), None: none;
    # its slots' offsets count from second_offset(len(params))
    second: bytes | None = None

    def launches(self) -> tuple[KernelLaunch, ...]:
        """The kernels' launches: ``second`` goes to the main kernel (suffix ""), the one
        that declares it; a tile list's or a combine's kernel has one parameter."""
        return tuple(KernelLaunch(s.suffix, s.grid, s.block, self.params, s.dependent,
                                  None if s.suffix else self.second)
                     for s in self.kernels)  # fmt: skip


@dataclass(frozen=True)
class ServingLaunch:
    """A target's serving calls (sm_90a: targets/sm90/host/varlen.py and kvcache.py). Each
    plans a call's kernels (``CallPlan``), allocating the workspaces the planned call needs,
    and the runtime loads and launches them on the current stream, or keeps the plan for
    the calls of the same signature:
    ``varlen(kernel, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, scale)``,
    ``kvcache(kernel, q, k_cache, v_cache, cache_seqlens, page_table, out, lse, scale,
    num_splits)``; ``max_sequences``: a varlen call's limit."""

    max_sequences: int
    varlen: Callable[..., CallPlan]
    kvcache: Callable[..., CallPlan]


@dataclass(frozen=True)
class Launch:
    """A target's launch: ``pack`` returns the params struct's bytes, ``grid`` the grid.

    The kernel of a rendered source ``NAME`` is the symbol ``NAME + kernel_suffix``; with
    ``launch_info``, the cubin also exports ``int <symbol>_launch_info[5]`` (threads,
    dynamic SMEM bytes, B_r, B_c, CTAs per cluster), which the runtime checks against the
    host's copy of the plan.
    """

    pack: Callable[[Kernel, Args], bytes]
    grid: Callable[[Kernel, Args], tuple[int, int, int]]
    kernel_suffix: str = "_kernel"
    launch_info: bool = False
    # clusters (None: none): the spec's CTAs per cluster (spec_cluster), and a launch's,
    # which may be fewer (cluster)
    spec_cluster_of: Callable[[Kernel], int] | None = None
    cluster_of: Callable[[Kernel, Args], int] | None = None
    # after loading: refuse a module that cannot run (kernel, registers per thread, threads)
    check_loaded: Callable[[Kernel, int, int], None] | None = None
    # a clustered launch's grid given the clusters that fit at once (CTAs)
    fit_grid: Callable[[Kernel, tuple[int, int, int], int], tuple[int, int, int]] | None = None
    # `varlen on` and `kv_cache` calls (None: the target has neither)
    serving: ServingLaunch | None = None
    # a kernel a padded forward call launches first, with the same params, and the tensors it
    # fills, passed as the call's inputs after the spec's (None, or a None answer: none;
    # sm_90a: a keep's tile classes, host/keep_classes.py)
    before: Callable[[Kernel, Any, Any], tuple[tuple, KernelStep] | None] | None = None
    # every address in pack's params (None, or a None answer: the params hold addresses of
    # their own, which a launch plan cannot rewrite)
    slots: Callable[[Kernel, Args], tuple[AddressSlot, ...] | None] | None = None
    # an 8-bit kernel's second parameter (the descales) from a call's Args.descales; None:
    # the target's kernels take one parameter
    pack_second: Callable[[Args], bytes] | None = None

    def symbol(self, source_name: str) -> str:
        return source_name + self.kernel_suffix

    def block(self, kernel: Kernel) -> tuple[int, int, int]:
        return (kernel.config.threads, 1, 1)

    def cluster(self, kernel: Kernel, a: Args) -> int:
        """CTAs per cluster of this launch (1: launched without clusters)."""
        return 1 if self.cluster_of is None else self.cluster_of(kernel, a)

    def spec_cluster(self, kernel: Kernel) -> int:
        """The spec's CTAs per cluster (a launch may use fewer)."""
        return 1 if self.spec_cluster_of is None else self.spec_cluster_of(kernel)


SECOND_ALIGN = 128  # (the first parameter's CUtensorMaps lie on 128 bytes)


def second_offset(params_bytes: int) -> int:
    """Where a kernel's second parameter starts in a launch plan's buffer (ParamsBuffer):
    after the first, on SECOND_ALIGN bytes; a slot of the second counts from it."""
    return -(-params_bytes // SECOND_ALIGN) * SECOND_ALIGN


# fadsl::FwdParams: 5 pointers, 14 int64 strides, 5 int sizes, the float scale; 176 bytes
# with no padding (tests/test_params.py checks every offset against the C++ struct).
@dataclass(frozen=True)
class BackwardLaunch:
    """A target's backward pass: its template (under emit/) and slots, and the host side.

    A rendered source ``NAME`` holds the kernels ``NAME + suffix`` for each of ``suffixes``,
    launched in that order by ``run(kernel, launch, q, k, v, out, lse, dout, scale)``,
    which returns (dq, dk, dv) and calls ``launch(KernelLaunch)`` for each kernel (the
    runtime loads it and launches it on the current stream); ``smem(kernel, suffix)`` is a
    kernel's dynamic SMEM bytes. The main kernel (suffix "") exports ``NAME_launch_info``.
    """

    template: str
    context: Callable[[Kernel, Any], dict[str, Any]]
    suffixes: tuple[str, ...]
    smem: Callable[[Kernel, str], int]
    threads: Callable[[Kernel], int]
    run: Callable[..., tuple[Any, Any, Any]]
    # a packed (`varlen on`) call: run_varlen(kernel, launch, q, k, v, out, lse, dout, dlse,
    # cu_seqlens_q, cu_seqlens_k, scale) -> (dq, dk, dv); None: the target has none
    run_varlen: Callable[..., tuple[Any, Any, Any]] | None = None
    # the suffixes of one kernel's source where they are not ``suffixes`` (a learnable
    # variant's extra kernel); None: always ``suffixes``
    suffixes_of: Callable[[Kernel], tuple[str, ...]] | None = None
    # the backward block's (setting, path) lines a learnable variant (Modifiers.learn) takes
    # in place of the spec's (rewrite_backward's), e.g. a smaller tile that fits its registers
    learn_lines: Callable[[Backward], tuple[dict[str, str], dict[str, str | None]]] | None = None
    # a keep that reads inputs per token: classes_only(kernel, launch, q, k, inputs) ->
    # (B_r, B_c, class bytes, ranges), made ahead for ``run``'s ``classes`` (reused over calls)
    classes_only: Callable[..., tuple] | None = None
    # a padded call's launch plan: plan(kernel, launch, q, k, v, out, lse, dout, dlse, scale,
    # inputs, classes) -> ((dq, dk, dv), its plan or None), launching as ``run`` does (sm_90a:
    # backward/launch_plan.py); None: the target's backward calls keep no plans
    plan: Callable[..., tuple] | None = None


FWD_PARAMS = struct.Struct("<5Q14q5if")
FWD_PARAMS_FIELDS = (
    *("q", "k", "v", "o", "lse"),
    *(f"{t}_{d}_stride" for t in "qkvo" for d in ("batch", "seq", "head")),
    *("lse_batch_stride", "lse_head_stride"),
    *("batch", "heads_q", "heads_kv", "seqlen_q", "seqlen_k", "softmax_scale"),
)


def fwd_pointer_slots(base: int, sources: tuple[str | None, ...]) -> tuple[AddressSlot, ...]:
    """FwdParams' pointers (q, k, v, o, lse: its first five fields, 8 bytes each) for a
    struct at ``base`` as the slots of the call's ``sources`` in that order (None: a pointer
    the call leaves 0)."""
    return tuple(AddressSlot(base + 8 * i, s) for i, s in enumerate(sources) if s is not None)


def pack_fwd_params(kernel: Kernel, a: Args) -> bytes:
    q, k, v, o, lse = a.q, a.k, a.v, a.out, a.lse
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
    return FWD_PARAMS.pack(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        o.data_ptr(),
        0 if lse is None else lse.data_ptr(),
        *qs[:3],
        *ks[:3],
        *vs[:3],
        *os_[:3],
        0 if lse is None else lse.stride(0),
        0 if lse is None else lse.stride(1),
        q.shape[0],
        q.shape[2],
        k.shape[2],
        q.shape[1],
        k.shape[1],
        a.softmax_scale,
    )


@functools.cache
def sm_count(device_index: int) -> int:
    """The device's streaming multiprocessors (torch caches the properties)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count


def current_stream(index: int) -> int:
    """The handle of PyTorch's current stream on device ``index`` (a CUDA graph capture's
    stream while capturing)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: faster
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
