"""Load cubins and launch kernels through the CUDA driver API (cuda.bindings), on the
tensors' device and PyTorch's current stream.

A cubin is loaded once as a context-independent library (``cuLibraryLoadData``); its kernel
is prepared once per device (the dynamic SMEM opt-in above 48 KiB) and launched in the
device's primary context, which PyTorch makes current.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Callable

from ..cudadriver import DriverError  # noqa: F401 (the runtime catches it from here)
from ..cudadriver import check as _check
from ..cudadriver import driver as _driver
from ..targets.launch import second_offset

_CONTEXTS: dict[int, object] = {}  # device index -> its primary context, retained


def _primary(driver, device_index: int):
    """The device's primary context (the one PyTorch uses), retained once for the process."""
    context = _CONTEXTS.get(device_index)
    if context is None:
        device = _check(driver, driver.cuDeviceGet(device_index), "cuDeviceGet")
        context = _CONTEXTS[device_index] = _check(
            driver, driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain"
        )
    return context


@contextlib.contextmanager
def _device_context(driver, device_index: int):
    """A context of the device current on this thread for the block: the current one if it
    is the device's, else the device's primary context (the one PyTorch uses; retained once,
    for the process), pushed for the block and popped after it. The occupancy and attribute
    queries need one, and the first of them may come before PyTorch has touched the device."""
    current = _check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(current) != 0:
        if int(_check(driver, driver.cuCtxGetDevice(), "cuCtxGetDevice")) == device_index:
            yield
            return
    _check(driver, driver.cuCtxPushCurrent(_primary(driver, device_index)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        _check(driver, driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


_THREAD = threading.local()  # the device whose context this thread was found to have current


def ensure_context(device_index: int) -> None:
    """Make the device's primary context current on this thread where no context of the
    device is. PyTorch's autograd engine runs a backward on a worker thread of its own, on
    which the CUDA runtime makes the context current lazily, at the thread's first runtime
    call: a driver launch before any (the caching allocator can serve every tensor without
    one) fails with CUDA_ERROR_INVALID_CONTEXT (H200, 2026-11-30, the first backward of a
    process through fadsl/runtime/eager_grad.py). Checked once per thread and device."""
    if getattr(_THREAD, "device", None) == device_index:
        return
    driver = _driver()
    current = _check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    same = int(current) != 0 and (
        int(_check(driver, driver.cuCtxGetDevice(), "cuCtxGetDevice")) == device_index
    )
    if not same:
        _check(driver, driver.cuCtxSetCurrent(_primary(driver, device_index)), "cuCtxSetCurrent")
    _THREAD.device = device_index


class Module:
    """One loaded cubin and its kernel ``name``."""

    def __init__(self, cubin: bytes, name: str, smem_bytes: int, threads: int) -> None:
        driver = _driver()
        self._driver = driver
        self.name = name
        self.smem_bytes = smem_bytes
        self.threads = threads
        self._library = _check(
            driver,
            driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0),
            f"loading the cubin of {name} (cuLibraryLoadData)",
        )
        kernel = _check(
            driver, driver.cuLibraryGetKernel(self._library, name.encode()), "cuLibraryGetKernel"
        )
        self._kernel = kernel
        self._function = driver.CUfunction(int(kernel))  # a CUkernel launches as a CUfunction
        self._ready: set[int] = set()
        self._configs: dict[tuple, object] = {}  # cluster launches' CUlaunchConfig by shape
        self._lock = threading.Lock()

    def prepare(self, device_index: int) -> None:
        """Opt into the dynamic SMEM the kernel needs on this device (once per device)."""
        if device_index in self._ready:
            return
        driver = self._driver
        with self._lock:
            device = _check(driver, driver.cuDeviceGet(device_index), "cuDeviceGet")
            if self.smem_bytes > 48 * 1024:
                attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _check(
                    driver,
                    driver.cuKernelSetAttribute(attr, self.smem_bytes, self._kernel, device),
                    f"raising {self.name}'s dynamic SMEM limit to {self.smem_bytes} bytes",
                )
            self._ready.add(device_index)

    def _attribute(self, which, device_index: int) -> int:
        """One CU_FUNC_ATTRIBUTE of the kernel on the device (no context needed)."""
        driver = self._driver
        device = _check(driver, driver.cuDeviceGet(device_index), "cuDeviceGet")
        found = driver.cuKernelGetAttribute(which, self._kernel, device)
        return int(_check(driver, found, "cuKernelGetAttribute"))

    def registers(self, device_index: int) -> int:
        """Registers a thread of the kernel launches with (the cubin's count)."""
        return self._attribute(
            self._driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, device_index
        )

    def _global(self, name: str) -> tuple[object, int]:
        driver = self._driver
        ptr, size = _check(
            driver, driver.cuLibraryGetGlobal(self._library, name.encode()), f"global {name}"
        )
        return ptr, int(size)

    def zero_global(self, name: str) -> None:
        """Zero the module's ``__device__`` variable ``name`` in the current context."""
        ptr, size = self._global(name)
        _check(self._driver, self._driver.cuMemsetD8(ptr, 0, size), f"zeroing {name}")

    def read_global(self, name: str) -> bytes:
        """The bytes of the module's ``__device__`` variable ``name`` in the current context
        (after the work queued before has finished)."""
        ptr, size = self._global(name)
        host = ctypes.create_string_buffer(size)
        _check(
            self._driver,
            self._driver.cuMemcpyDtoH(ctypes.addressof(host), ptr, size),
            f"reading {name}",
        )
        return host.raw

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        params: bytes,
        stream: int,
        cluster: int = 1,
        dependent: bool = False,
        second: bytes | None = None,
    ) -> None:
        """Launch with one by-value argument, the params struct ``params`` (and ``second``,
        a second one: an 8-bit kernel's descales), on ``stream``; with ``cluster`` > 1, in
        clusters of that many CTAs along x; ``dependent``: as a programmatic dependent of
        the stream's previous kernel (the kernel must execute griddepcontrol.wait before it
        reads that kernel's results). Either uses cuLaunchKernelEx."""
        buffer = ctypes.create_string_buffer(params, len(params))
        if second is None:
            pointers = (ctypes.c_void_p * 1)(ctypes.addressof(buffer))
        else:
            extra = ctypes.create_string_buffer(second, len(second))
            pointers = (ctypes.c_void_p * 2)(ctypes.addressof(buffer), ctypes.addressof(extra))
        argument = ctypes.addressof(pointers)
        if cluster > 1 or dependent:
            self._launch_ex(grid, block, stream, cluster, dependent)(argument)
            return
        driver = self._driver
        err = driver.cuLaunchKernel(
            self._function, *grid, *block, self.smem_bytes, driver.CUstream(stream), argument, 0
        )[0]
        if err != driver.CUresult.CUDA_SUCCESS:
            _check(driver, (err,), f"launching {self.name} (grid {grid}, block {block})")

    def prepared(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        stream: int,
        cluster: int = 1,
        dependent: bool = False,
    ) -> Callable[[int], None]:
        """``launch`` with everything but the params decided: a function of the address of
        the kernel's argument array (``ParamsBuffer.argument``) that launches, with one
        driver call and nothing built per launch (a launch plan keeps it)."""
        if cluster > 1 or dependent:
            return self._launch_ex(grid, block, stream, cluster, dependent)
        driver = self._driver
        success = driver.CUresult.CUDA_SUCCESS
        function = self._function
        launch_kernel = driver.cuLaunchKernel
        shape = (*grid, *block, self.smem_bytes, driver.CUstream(stream))

        def launch(argument: int) -> None:
            err = launch_kernel(function, *shape, argument, 0)[0]
            if err != success:
                _check(driver, (err,), f"launching {self.name} (grid {grid}, block {block})")

        return launch

    def _launch_ex(self, grid, block, stream: int, cluster: int, dependent: bool):
        """A launch through cuLaunchKernelEx (clusters, programmatic dependents) as a
        function of the argument array's address; its CUlaunchConfig kept per shape
        (building one costs about 4 us of Python)."""
        driver = self._driver
        key = (grid, block, cluster, dependent, stream)
        config = self._configs.get(key)
        if config is None:
            if len(self._configs) >= 64:
                self._configs.clear()
            config = self._configs[key] = self._launch_config(
                grid, block, cluster, stream, dependent
            )
        success = driver.CUresult.CUDA_SUCCESS
        function, launch_ex = self._function, driver.cuLaunchKernelEx

        def launch(argument: int) -> None:
            err = launch_ex(config, function, argument, 0)[0]
            if err != success:
                how = [f"clusters of {cluster}"] if cluster > 1 else []
                how += ["a programmatic dependent"] if dependent else []
                where = f"grid {grid}, block {block}, {', '.join(how)}"
                _check(driver, (err,), f"launching {self.name} ({where})")

        return launch

    def _launch_config(self, grid, block, cluster: int, stream: int = 0, dependent: bool = False):
        """A CUlaunchConfig: the cluster dimension (cluster, 1, 1) where cluster > 1, and
        programmatic stream serialization where ``dependent``."""
        driver = self._driver
        attributes = []
        if cluster > 1:
            attribute = driver.CUlaunchAttribute()
            attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attribute.value.clusterDim.x = cluster
            attribute.value.clusterDim.y = 1
            attribute.value.clusterDim.z = 1
            attributes.append(attribute)
        if dependent:
            attribute = driver.CUlaunchAttribute()
            attribute.id = (
                driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            )
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = self.smem_bytes
        config.hStream = driver.CUstream(stream)
        config.attrs = attributes
        config.numAttrs = len(attributes)
        return config

    def max_active_clusters(self, device_index: int, cluster: int) -> int:
        """How many clusters of ``cluster`` CTAs of this kernel can run at once on the device
        (cuOccupancyMaxActiveClusters; in the current context, else the device's primary one)."""
        self.prepare(device_index)
        config = self._launch_config((cluster, 1, 1), (self.threads, 1, 1), cluster)
        with _device_context(self._driver, device_index):
            found = _check(
                self._driver,
                self._driver.cuOccupancyMaxActiveClusters(self._function, config),
                f"cuOccupancyMaxActiveClusters for {self.name}",
            )
        return int(found)

    def attributes(self, device_index: int) -> dict[str, int]:
        """Registers, local memory, SMEM and CTAs per SM of the kernel on this device (in the
        current context, else the device's primary one)."""
        driver = self._driver
        self.prepare(device_index)
        attr = driver.CUfunction_attribute

        def get(which) -> int:
            return self._attribute(which, device_index)

        with _device_context(driver, device_index):
            function = _check(
                driver, driver.cuKernelGetFunction(self._kernel), "cuKernelGetFunction"
            )
            ctas = _check(
                driver,
                driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    function, self.threads, self.smem_bytes
                ),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor",
            )
        return {
            "registers": self.registers(device_index),
            "local_bytes": get(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
            "smem_bytes": self.smem_bytes + get(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
            "threads": self.threads,
            "ctas_per_sm": int(ctas),
        }


# A CUtensorMap is 64-byte aligned in memory (its C type says so); the params structs start
# their maps at offset 0 in steps of 128 bytes, so a buffer aligned to 128 bytes holds each
# map where the driver may rewrite it in place (cuTensorMapReplaceAddress).
PARAMS_ALIGN = 128


class ParamsBuffer:
    """A params struct's bytes in host memory that stays put between launches: a launch plan
    writes each call's addresses into it (``view``, for struct.pack_into; ``tensor_map``,
    for a descriptor's address) and launches with ``argument``, the address of the kernel's
    argument array. The driver copies a kernel's params when the launch call returns, so
    the buffer may be rewritten at once (a plan holds a lock from the writes to the launch,
    so that two threads never interleave)."""

    __slots__ = ("size", "address", "argument", "view", "second", "_storage", "_pointers")

    def __init__(self, raw: bytes, second: bytes | None = None) -> None:
        self.size = len(raw)
        # a second parameter (an 8-bit kernel's descales) lies after the first, at
        # second_offset: the view spans both, so that a slot's offset says which
        self.second = None if second is None else (second_offset(self.size), len(second))
        end = self.size if second is None else self.second[0] + self.second[1]
        self._storage = ctypes.create_string_buffer(end + PARAMS_ALIGN)
        start = ctypes.addressof(self._storage)
        self.address = start + (-start % PARAMS_ALIGN)
        ctypes.memmove(self.address, raw, self.size)
        if second is None:
            self._pointers = (ctypes.c_void_p * 1)(self.address)
        else:
            ctypes.memmove(self.address + self.second[0], second, len(second))
            self._pointers = (ctypes.c_void_p * 2)(self.address, self.address + self.second[0])
        self.view = (ctypes.c_char * end).from_address(self.address)
        self.argument = ctypes.addressof(self._pointers)

    def raw(self) -> bytes:
        """The bytes a launch would pass now (the first parameter's)."""
        return ctypes.string_at(self.address, self.size)

    def raw_second(self) -> bytes | None:
        """The second parameter's bytes a launch would pass now (None: no second)."""
        if self.second is None:
            return None
        return ctypes.string_at(self.address + self.second[0], self.second[1])

    def tensor_map_address(self, offset: int) -> Callable[[int], None]:
        """A function that points the CUtensorMap at ``offset`` bytes in (a 64-byte multiple)
        at another global address (cuTensorMapReplaceAddress, in place: the map's dimensions,
        strides and box stay; the address must be aligned as the encoded one was)."""
        if offset % 64:
            raise ValueError(f"a CUtensorMap lies on 64 bytes; offset {offset} does not")
        driver = _driver()
        tensor_map = driver.CUtensorMap(_ptr=self.address + offset)
        replace, success = driver.cuTensorMapReplaceAddress, driver.CUresult.CUDA_SUCCESS

        def point_at(address: int) -> None:
            err = replace(tensor_map, address)[0]
            if err != success:
                _check(driver, (err,), f"pointing a TMA descriptor at {address:#x}")

        return point_at
