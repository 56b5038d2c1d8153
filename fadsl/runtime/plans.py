"""Launch plans (issue 45): a call's checks and its launch planning done once per signature.

A call's *signature* is everything its checks and its planning read except the tensors'
addresses and what lives on the device (lengths, page tables, cu_seqlens): each tensor's
shape, strides, dtype and device, each Python argument with its type (so that True never
passes for 1, nor a list of floats for a window), the current stream and device. Two
calls of one signature pass or fail the same shape, stride and dtype checks, choose the
same kernel and plan the same launches: the params differ only in the addresses. So a
signature's calls run every check and plan their kernels as before, and the second keeps a
``Prepared`` plan: the params struct in a buffer that stays put, where each address goes
(``targets.launch.AddressSlot``), the kernels' launches built. A later call of the same
signature only allocates its outputs and workspaces, checks what depends on the addresses
(16-byte alignment), writes the addresses that changed since the plan's last call (a field
by struct.pack_into, a TMA descriptor by cuTensorMapReplaceAddress) and launches. An
argument outside the signature's checks cannot reach a plan: its signature differs from
every one that passed (and an argument whose signature cannot be formed, a non-tensor, an
unhashable value, takes the checked path and its named error).

The plans of each call kind are kept in a bounded dict (``PlanCache``); the public calls
use them for eager calls without gradients (fadsl/runtime/public.py).
"""

from __future__ import annotations

import struct
import threading
from typing import Any, Callable

import torch

from ..targets.launch import CallPlan, current_stream
from .arguments import check_bases
from .driver import ParamsBuffer

_ADDRESS = struct.Struct("<Q")
PLAN_LIMIT = 256  # plans kept per call kind; the oldest goes first


_UNSEEN, _REFUSED = object(), object()  # (PlanCache._seen: absent, and refused a plan)


# The public calls' module-level PlanCaches (``shared``: fadsl/runtime/planned.py's and
# fp8_planned.py's), so that clear_all forgets them all without those modules importing each
# other. A kernel object's own caches are not listed (they go with the object).
_CACHES: list = []


def clear_all() -> None:
    """Forget every plan and signature of the shared PlanCaches."""
    for cache in _CACHES:
        cache.clear()


class PlanCache:
    """Plans by signature, at most ``limit``, the oldest dropped first. A signature gets a
    plan at its second call (``worth_planning``): making one costs about half a call's
    checked path, which a signature met once (a varlen batch whose token count does not
    come again) would pay for nothing; the signatures seen once are kept, 4 x ``limit``
    at most, the same way."""

    def __init__(self, limit: int = PLAN_LIMIT, shared: bool = False) -> None:
        self.limit = limit
        self._plans: dict[tuple, Any] = {}
        self._seen: dict[tuple, None] = {}
        self.get = self._plans.get
        if shared:
            _CACHES.append(self)  # (clear_all's)

    def put(self, key: tuple, plan) -> None:
        _bounded_put(self._plans, key, plan, self.limit)

    def worth_planning(self, key: tuple | None) -> bool:
        """Whether ``key`` (None: a call with no signature) has been called before and not
        refused; its call is remembered."""
        if key is None:
            return False
        seen = self._seen.get(key, _UNSEEN)
        if seen is _UNSEEN:
            _bounded_put(self._seen, key, None, 4 * self.limit)
            return False
        return seen is not _REFUSED

    def refuse(self, key: tuple | None) -> None:
        """``key``'s calls keep no plan (the kernel's ``prepare`` found none: a split
        workspace, a varlen kernel's padded call): its later calls do not try again."""
        if key is not None:
            self._seen[key] = _REFUSED

    def clear(self) -> None:
        self._plans.clear()
        self._seen.clear()

    def __len__(self) -> int:
        return len(self._plans)


def _bounded_put(table: dict, key, value, limit: int) -> None:
    while len(table) >= limit:
        try:
            del table[next(iter(table))]
        except (KeyError, RuntimeError, StopIteration):  # (another thread's eviction)
            break
    table[key] = value


def stream_and_device(index: int) -> tuple[int, int]:
    """The current stream of device ``index`` and the current device: a plan's launches are
    built for one stream, and switch devices where the call's is not the current one.
    (torch._C's queries, as torch.cuda's functions make them after their lazy-init test,
    which these C functions make themselves; a build without CUDA lacks them.)"""
    try:
        return torch._C._cuda_getCurrentRawStream(index), torch._C._cuda_getDevice()
    except AttributeError:
        return current_stream(index), torch.cuda.current_device()


class Prepared:
    """A target's ``CallPlan`` ready for repeated launches on one stream: the params in a
    ``ParamsBuffer``, a writer per address slot, the kernels' launches built (``modules``:
    each kernel's loaded module, in the plan's order).

    ``sources`` names the call's addresses in the order ``launch`` takes them (the
    workspaces' come after, made by ``launch``); ``addresses`` are the planned call's."""

    def __init__(self, plan: CallPlan, sources, addresses, modules, stream: int, index: int):
        self.buffer = ParamsBuffer(plan.params, plan.second)
        names = (*sources, *(w.source for w in plan.workspaces))
        writers: list[list[Callable[[int], None]]] = [[] for _ in names]
        for slot in plan.slots:
            writers[names.index(slot.source)].append(self._writer(slot))
        self._writers = writers
        made = plan.held[: len(plan.workspaces)]
        self._addresses = (*addresses, *(t.data_ptr() for t in made))
        self._workspaces = tuple(
            (w.elements, getattr(torch, w.dtype), w.poison) for w in plan.workspaces
        )
        self._device = made[0].device if made else None
        self._launches = tuple(
            module.prepared(step.grid, step.block, stream, step.cluster, step.dependent)
            for module, step in zip(modules, plan.kernels, strict=True)
        )
        self._elsewhere = index != stream_and_device(index)[1]
        self._index = index
        self._lock = threading.Lock()

    def _writer(self, slot) -> Callable[[int], None]:
        delta = slot.delta
        if slot.tensor_map:
            point_at = self.buffer.tensor_map_address(slot.offset)
            return lambda address: point_at(address + delta)
        view, offset, pack_into = self.buffer.view, slot.offset, _ADDRESS.pack_into
        return lambda address: pack_into(view, offset, address + delta)

    def launch(self, addresses: tuple[int, ...]) -> None:
        """Launch the planned kernels with the call's ``addresses`` (in ``sources``' order),
        its workspaces made now (and kept until the launches are queued)."""
        if self._workspaces:
            workspaces = self._make_workspaces()  # (alive until this call returns)
            addresses += tuple([t.data_ptr() for t in workspaces])
        with self._lock:
            if addresses != self._addresses:
                try:
                    for writers, new, old in zip(self._writers, addresses, self._addresses):
                        if new != old:
                            for write in writers:
                                write(new)
                except BaseException:  # the buffer half written: every address rewritten next
                    self._addresses = (None,) * len(self._addresses)
                    raise
                self._addresses = addresses
            argument = self.buffer.argument
            if self._elsewhere:
                with torch.cuda.device(self._index):
                    for launch in self._launches:
                        launch(argument)
            else:
                for launch in self._launches:
                    launch(argument)

    def _make_workspaces(self) -> list:
        device, empty = self._device, torch.empty
        made = [empty(n, dtype=dtype, device=device) for n, dtype, _ in self._workspaces]
        for t, (_, _, poison) in zip(made, self._workspaces):
            if poison:
                t.fill_(float("nan"))
        return made


class AttentionPlan:
    """A padded call's plan: out (and the LSE) allocated, the addresses checked and
    written, one launch (fadsl.attention's, and a loaded kernel's plain call)."""

    def __init__(self, prepared, target: str, return_lse: bool, lse_shape_, device) -> None:
        self.launch, self.target, self.device = prepared.launch, target, device
        self.return_lse, self.lse_shape = return_lse, lse_shape_

    def __call__(self, q, k, v, inputs=()):
        """The call on q, k, v (``inputs``: a modified call's tensors, its plan's INPUT_SOURCES:
        checked by the caller)."""
        out = torch.empty_like(q)
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
        if (addresses[0] | addresses[1] | addresses[2]) % 16:
            check_bases(q, k, v, self.target)  # (the checked path's error)
        more = tuple(t.data_ptr() for t in inputs)
        if not self.return_lse:
            self.launch((*addresses, 0, *more))
            return out
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        self.launch((*addresses, lse.data_ptr(), *more))
        return out, lse
