"""What one kernel launch costs the host, by the way it is made: cuda-bindings'
cuLaunchKernel (what ``Module.prepared`` calls), the same entry point of libcuda through
ctypes, and cuda-bindings' cuLaunchKernelEx with a kept config (programmatic dependents,
clusters). A no-op kernel built by NVRTC takes one 8-byte argument; the GPU is held busy by a
sleep queued first, so that no launch waits; 400 launches a way, the median of 9 rounds.

Usage (a GPU): python3 -P research/probes/launch_cost.py"""

from __future__ import annotations

import ctypes
import statistics
import time

import torch
from cuda.bindings import driver, nvrtc

SOURCE = (
    b'extern "C" __global__ void noop(const long long x) { if (x == 1) asm volatile("trap;"); }'
)


def check(result):
    err = result[0]
    assert int(err) == 0, err
    return result[1:] if len(result) > 2 else (result[1] if len(result) > 1 else None)


def build() -> bytes:
    program = check(nvrtc.nvrtcCreateProgram(SOURCE, b"noop.cu", 0, [], []))
    major, minor = torch.cuda.get_device_capability()
    check(nvrtc.nvrtcCompileProgram(program, 1, [f"--gpu-architecture=sm_{major}{minor}".encode()]))
    size = check(nvrtc.nvrtcGetCUBINSize(program))
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(program, cubin))
    return cubin


def host_us(launch, calls: int = 400, rounds: int = 9) -> float:
    found = []
    for _ in range(rounds):
        torch.cuda._sleep(100_000_000)
        start = time.perf_counter()
        for _ in range(calls):
            launch()
        found.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(found)


def main() -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # (the primary context, current)
    module = check(driver.cuModuleLoadData(build()))
    function = check(driver.cuModuleGetFunction(module, b"noop"))
    stream = torch.cuda.current_stream().cuda_stream
    value = ctypes.c_longlong(0)
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(value))
    argument = ctypes.addressof(pointers)
    cu_stream = driver.CUstream(stream)

    def bindings():
        driver.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, cu_stream, argument, 0)

    libcuda = ctypes.CDLL("libcuda.so.1")
    raw = libcuda.cuLaunchKernel
    raw.restype = ctypes.c_int
    raw.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    handle = int(function)

    def through_ctypes():
        raw(handle, 1, 1, 1, 32, 1, 1, 0, stream, argument, None)

    config = driver.CUlaunchConfig()
    config.gridDimX = config.gridDimY = config.gridDimZ = 1
    config.blockDimX, config.blockDimY, config.blockDimZ = 32, 1, 1
    config.sharedMemBytes = 0
    config.hStream = cu_stream
    config.numAttrs = 0

    def bindings_ex():
        driver.cuLaunchKernelEx(config, function, argument, 0)

    for name, launch in (
        ("cuda-bindings cuLaunchKernel", bindings),
        ("ctypes cuLaunchKernel", through_ctypes),
        ("cuda-bindings cuLaunchKernelEx (kept config)", bindings_ex),
    ):
        print(f"{name}: {host_us(launch):.2f} us a launch", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
