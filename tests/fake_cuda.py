"""A CPU stand-in for one CUDA device, enough for the public calls' host path to run here
(tests/test_launch_plans.py): CPU tensors that say they are on cuda:0, the device queries
answered (capability 9.0, 132 SMs, the current device and stream), each kernel's module a
recorder of its launches (the params bytes each launch passes, read back from the buffer a
plan launches with), TMA descriptors encoded as their address and a digest of the rest, and
outputs and workspaces from a deterministic allocator: the n-th tensor of a shape, strides
and dtype that a call allocates is the same memory in every call of one ``generation``, so
that two calls with the same inputs pass byte-identical params whichever path they take."""

from __future__ import annotations

import ctypes
import hashlib
import struct
from types import SimpleNamespace
from typing import NamedTuple

import torch

from fadsl.runtime import append, dispatch, driver, eager_grad, planned
from fadsl.targets import launch as common_launch
from fadsl.targets.sm90.host import launch as sm90_launch
from fadsl.targets.sm90.host import fp8 as fp8_host
from fadsl.targets.sm90.host import tma
from fadsl.targets.sm90.host.keep_classes import CLASSES_SUFFIX, CLASSES_THREADS
from fadsl.targets.sm90.host.kvcache import COMBINE_SUFFIX, COMBINE_THREADS
from fadsl.targets.sm90.host.varlen import TILES_SUFFIX, TILES_THREADS

CUDA0 = torch.device("cuda", 0)


class Launched(NamedTuple):
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: int
    dependent: bool
    params: bytes
    second: bytes | None = None  # an 8-bit kernel's second parameter (Fp8Descales)


class FakeModule:
    """A loaded kernel that records its launches (``params_bytes``: its struct's size;
    ``second_bytes``: its second parameter's, 0 for none)."""

    def __init__(
        self, name: str, params_bytes: int, log: list, threads: int = 128, second_bytes: int = 0
    ) -> None:
        self.name, self.size, self.log, self.threads = name, params_bytes, log, threads
        self.second_size = second_bytes

    def launch(self, grid, block, params, stream, cluster=1, dependent=False, second=None):
        assert len(params) == self.size, (self.name, len(params))
        assert (second is None) == (self.second_size == 0), (self.name, second)
        assert second is None or len(second) == self.second_size, (self.name, len(second))
        second = None if second is None else bytes(second)
        self.log.append(Launched(self.name, grid, block, cluster, dependent, bytes(params), second))

    def prepared(self, grid, block, stream, cluster=1, dependent=False):
        def launch(argument: int) -> None:
            address = ctypes.c_void_p.from_address(argument).value
            params = ctypes.string_at(address, self.size)
            second = None
            if self.second_size:
                at = ctypes.c_void_p.from_address(argument + ctypes.sizeof(ctypes.c_void_p))
                second = ctypes.string_at(at.value, self.second_size)
            self.log.append(Launched(self.name, grid, block, cluster, dependent, params, second))

        return launch


def fake_encode(
    ptr, dtype, dims, byte_strides, box_cols, box_rows, box=None, streamed=False
) -> bytes:
    """A descriptor's stand-in: its global address, then a digest of everything else."""
    rest = repr((dtype, tuple(dims), tuple(byte_strides), box or (box_cols, box_rows), streamed))
    digest = hashlib.sha256(rest.encode()).digest() * 4
    return struct.pack("<Q", ptr) + digest[: tma.MAP_BYTES - 8]


def fake_tensor_map_address(self, offset: int):
    """cuTensorMapReplaceAddress on fake_encode's descriptors: the address's 8 bytes."""
    assert offset % 64 == 0 and self.address % 64 == 0
    view = self.view
    return lambda address: struct.pack_into("<Q", view, offset, address)


class Allocator:
    """torch.empty / torch.empty_like / torch.zeros / torch.full without a device argument, each call's
    n-th tensor of one (shape, strides, dtype) the same memory within a generation."""

    def __init__(self, monkeypatch) -> None:
        self.generation = 0
        self._counts: dict = {}
        self._tensors: dict = {}
        real_empty, real_like, real_zeros = torch.empty, torch.empty_like, torch.zeros
        real_full = torch.full

        def tensor(kind, shape, strides, dtype, make):
            key = (self.generation, kind, tuple(shape), strides, dtype)
            n = self._counts.get(key, 0)
            self._counts[key] = n + 1
            found = self._tensors.get((key, n))
            if found is None:
                found = self._tensors[key, n] = make()
            return found

        def empty(*size, dtype=None, device=None, **kwargs):
            shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            dtype = dtype or torch.get_default_dtype()
            return tensor("empty", shape, None, dtype, lambda: real_empty(shape, dtype=dtype))

        def empty_like(t, dtype=None, **kwargs):
            assert not kwargs, kwargs
            dtype = dtype or t.dtype
            made = real_like(t, dtype=dtype)  # (torch's strides: t's where t is dense)
            return tensor("like", t.shape, made.stride(), dtype, lambda: made)

        def zeros(*size, device=None, **kwargs):
            return real_zeros(*size, **kwargs)

        def full(size, value, device=None, **kwargs):
            return real_full(size, value, **kwargs)

        def contiguous(t, **kwargs):  # (a copy where it is needed, from the allocator)
            if t.is_contiguous() or kwargs:
                return real_contiguous(t, **kwargs)
            copy = tensor(
                "copy", t.shape, None, t.dtype, lambda: real_empty(t.shape, dtype=t.dtype)
            )
            return copy.copy_(t)

        real_contiguous = torch.Tensor.contiguous
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "empty_like", empty_like)
        monkeypatch.setattr(torch, "zeros", zeros)
        monkeypatch.setattr(torch, "full", full)
        monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)

    def next_call(self, generation: int) -> None:
        """The next call allocates from ``generation``'s tensors, from the first on."""
        self.generation = generation
        self._counts.clear()


_INSTALLED: list = []  # (dict, key) of every recorder module given to a kernel


def _recorders(log: list):
    """FlashAttention.module's stand-in: the kernel (and its cluster-free variant, and its
    other kernels: a split's combine, varlen's tile list, a keep's classes) given recorder
    modules."""

    def module(kern, dtype, device):
        size = sm90_launch.SM90_PARAMS_BYTES
        if kern.config.target != "sm_90a":
            size = common_launch.FWD_PARAMS.size
        name = kern.config.name
        second = fp8_host.DESCALES.size if kern.is_fp8 else 0
        found = FakeModule(name, size, log, second_bytes=second)
        entries = [(kern._modules, (dtype, 0), found), (kern._co_resident, (dtype, 0), 132)]
        others = ((COMBINE_SUFFIX, COMBINE_THREADS), (TILES_SUFFIX, TILES_THREADS))
        for suffix, threads in others + ((CLASSES_SUFFIX, CLASSES_THREADS),):
            more = FakeModule(name + suffix, size, log, threads)
            entries.append((kern._more_modules, (dtype, 0, suffix), more))
        for table, key, value in entries:
            table[key] = value
            _INSTALLED.append((table, key))
        return found

    return module


def install(monkeypatch):
    """The stand-in device, for one test (monkeypatch undoes it; ``uninstall`` after it);
    returns (launch log, allocator)."""
    from fadsl.runtime.attention import FlashAttention

    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: CUDA0))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    properties = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    common_launch.sm_count.cache_clear()
    monkeypatch.setattr(dispatch, "_CAPABILITY", {})
    monkeypatch.setattr(tma, "_encode_dims", fake_encode)
    monkeypatch.setattr(tma, "_encoded", {})
    monkeypatch.setattr(sm90_launch, "_SM90_PACKED", {})
    monkeypatch.setattr(driver.ParamsBuffer, "tensor_map_address", fake_tensor_map_address)
    # (no driver, no context: the eager autograd Functions' backward thread needs none here)
    monkeypatch.setattr(eager_grad, "ensure_context", lambda index: None)
    planned.clear()
    log: list[Launched] = []
    allocator = Allocator(monkeypatch)
    monkeypatch.setattr(append, "_MODULES", {0: FakeModule(append.KERNEL, append.PARAMS.size, log)})
    monkeypatch.setattr(FlashAttention, "module", _recorders(log))
    return log, allocator


def install_backward(monkeypatch, log: list) -> None:
    """The backward's kernels on the stand-in device too (after ``install``): each launch of
    the preprocess, the main kernel, dQ's conversion and a keep's classing kernel recorded in
    ``log``, with its params' size checked."""
    import contextlib

    from fadsl.runtime.backward import BackwardKernels
    from fadsl.targets.sm90.backward import host

    sizes = {
        "_preprocess": host.PREP.size,
        "": host.MAIN_BYTES,
        "_convert_dq": host.CONVERT.size,
        CLASSES_SUFFIX: host.MAIN_BYTES,
    }

    def modules(self, dtype, index, arch):
        name = self._sources[dtype].kernel_name
        return {s: FakeModule(name + s, n, log) for s, n in sizes.items()}

    monkeypatch.setattr(BackwardKernels, "modules", modules)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())


def uninstall() -> None:
    """What monkeypatch does not undo: the recorder modules given to kernels (which the
    dispatcher keeps), the plans and the SM count made on the stand-in."""
    while _INSTALLED:
        table, key = _INSTALLED.pop()
        table.pop(key, None)
    planned.clear()
    common_launch.sm_count.cache_clear()
