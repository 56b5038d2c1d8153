"""Host time of the public calls' Python path on a machine without a GPU: the calls of
scripts/host_profile.py (fadsl/tools/bench_calls.py's tiny shapes) with the CUDA driver
replaced by a stub library whose every entry point returns CUDA_SUCCESS at once, so that
cuda.bindings' own Python work per launch and per TMA descriptor is timed with fadsl's, and
only the driver's C work (about 2-4 us a launch on the GPU host) is missing.

What stands in for the GPU (the calls run on CPU tensors): torch.Tensor's ``device``,
``is_cuda`` and ``get_device`` say cuda:0, ``torch.empty`` and ``torch.zeros`` drop a
``device=`` argument, the device queries (capability 9.0, 132 SMs, the current device and
stream) answer without CUDA, and each kernel's module is a driver Module loaded from nothing
(the stub) instead of a cubin. Nothing is written to a cache or a GPU. The figures are for
comparing two versions of the host path on one machine, not for comparing with SDPA: the
lead's figure is scripts/host_profile.py's on the GPU machine.

    python3 -P scripts/host_time_cpu.py [--loops N] [--repeat R] [--profile CALL]

needs gcc (to build the stub) and cuda-bindings; prints the median microseconds per call
(and the fastest loop's).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

# A libcuda.so.1 whose entry points all succeed at once: cuda.bindings finds each through
# cuGetProcAddress, so one function stands in for every call but the version query.
STUB_SOURCE = r"""
#include <string.h>
typedef unsigned long long u64;
static int ok(void) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuInit(unsigned flags) { return 0; }
int cuGetProcAddress_v2(const char *symbol, void **pfn, int version, u64 flags, int *status) {
  *pfn = strcmp(symbol, "cuDriverGetVersion") == 0 ? (void *)cuDriverGetVersion : (void *)ok;
  if (status) *status = 1;
  return 0;
}
int cuGetProcAddress(const char *symbol, void **pfn, int version, u64 flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, 0);
}
"""


def load_stub_driver() -> None:
    """Build the stub driver and load it under libcuda's soname, before cuda.bindings looks
    for the driver (it takes a library of that name that is already loaded)."""
    folder = Path(tempfile.mkdtemp(prefix="fadsl_stub_cuda_"))
    (folder / "stub.c").write_text(STUB_SOURCE)
    library = folder / "libcuda.so.1"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(library),
         str(folder / "stub.c")],
        check=True,
    )  # fmt: skip
    ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL)


def pretend_cuda() -> None:
    """CPU tensors that say they are on cuda:0, and the device queries answered (see the
    module's docstring)."""
    import torch

    cuda = torch.device("cuda", 0)
    torch.Tensor.device = property(lambda self: cuda)
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.Tensor.get_device = lambda self: 0
    real_empty, real_zeros = torch.empty, torch.zeros

    def empty(*args, device=None, **kwargs):
        return real_empty(*args, **kwargs)

    def zeros(*args, device=None, **kwargs):
        return real_zeros(*args, **kwargs)

    torch.empty, torch.zeros = empty, zeros
    # torch.cuda.current_device itself runs, as it does on the GPU host (its lazy-init test)
    torch.cuda._initialized = True
    torch.cuda._is_in_bad_fork = lambda: False
    torch._C._cuda_getDevice = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(
        multi_processor_count=132
    )
    torch.cuda.is_current_stream_capturing = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda index: 0


def stub_modules(kern) -> None:
    """Every kernel a FlashAttention launches on device 0, as driver Modules of the stub
    (no cubin is built or read)."""
    from fadsl.ir import Dtype
    from fadsl.runtime.driver import Module
    from fadsl.targets.sm90.host.kvcache import COMBINE_SUFFIX, COMBINE_THREADS
    from fadsl.targets.sm90.host.varlen import TILES_SUFFIX, TILES_THREADS

    for variant in kern.variants:
        name = variant.request(Dtype.BF16, "sm_90a").kernel
        threads = variant.config.threads
        smem = variant.compiled.kernel.smem_bytes
        variant._modules[Dtype.BF16, 0] = Module(b"", name, smem, threads)
        for suffix, more in ((COMBINE_SUFFIX, COMBINE_THREADS), (TILES_SUFFIX, TILES_THREADS)):
            variant._more_modules[Dtype.BF16, 0, suffix] = Module(b"", name + suffix, 0, more)
        variant._co_resident[Dtype.BF16, 0] = 132


def calls() -> dict:
    """scripts/host_profile.py's calls (fadsl/tools/bench_calls.py's host_contenders) on
    CPU tensors, each a function of no argument."""
    import torch

    from fadsl.runtime import append, dispatch
    from fadsl.runtime import public as fadsl
    from fadsl.runtime.driver import Module

    bf, d = torch.bfloat16, 128
    q, k, v = (torch.randn(1, 128, 1, d, dtype=bf) for _ in range(3))
    packed = [torch.randn(256, 4, d, dtype=bf) for _ in range(3)]
    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    batch, pages, page = 2, 8, 64
    q1 = torch.randn(batch, 1, 32, d, dtype=bf)
    paged = [torch.randn(pages * batch, page, 8, d, dtype=bf) for _ in range(2)]
    table = torch.arange(pages * batch, dtype=torch.int32).view(batch, pages)
    seqlens = torch.tensor([300, 17], dtype=torch.int32)
    new = [torch.randn(batch, 1, 8, d, dtype=bf) for _ in range(2)]
    contiguous = [torch.randn(batch, 512, 8, d, dtype=bf) for _ in range(2)]
    found = {
        "attention": lambda: fadsl.attention(q, k, v),
        "attention_varlen": lambda: fadsl.attention_varlen(*packed, cu, cu, 156, 156),
        "attention_with_kvcache paged": lambda: fadsl.attention_with_kvcache(
            q1, *paged, seqlens, page_table=table, causal=True
        ),
        "attention_with_kvcache paged + 1 new": lambda: fadsl.attention_with_kvcache(
            q1, *paged, seqlens, *new, page_table=table, causal=True
        ),
        "attention_with_kvcache contiguous": lambda: fadsl.attention_with_kvcache(
            q1, *contiguous, seqlens
        ),
        "append_kv paged": lambda: fadsl.append_kv(*paged, *new, seqlens, table),
    }
    # the kernels each call chooses, loaded (not built) and given stub modules
    kernels = [
        dispatch.attention_kernel(q, False),
        dispatch.varlen_kernel(packed[0], False, (-1, -1), 0, 156),
        dispatch.kvcache_kernel(q1, paged[0], table, True, (-1, -1), 0),
        dispatch.kvcache_kernel(q1, contiguous[0], None, False, (-1, -1), 0),
    ]
    for kern in kernels:
        stub_modules(kern)
    append._MODULES[0] = Module(b"", append.KERNEL, 0, append.THREADS)
    return found


def first_calls(fn):
    """``fn`` with every launch plan forgotten before it (a version without plans: ``fn``)."""
    try:
        from fadsl.runtime import planned
    except ImportError:
        return fn

    def call():
        planned.clear()
        return fn()

    return call


def per_call_us(fn, loops: int, repeat: int) -> tuple[float, float]:
    """The median and the fastest of ``repeat`` loops of ``loops`` calls, in microseconds
    of this process's CPU time per call (the host path is all CPU work here, and CPU time
    does not count what other processes of a shared machine take; the fastest loop is the
    steadier figure still)."""
    samples = []
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(loops):
            fn()
        samples.append((time.process_time() - start) / loops * 1e6)
    return statistics.median(samples), min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", type=int, default=2000, help="calls per timed loop")
    parser.add_argument("--repeat", type=int, default=15, help="loops; the median is printed")
    parser.add_argument("--profile", metavar="CALL", help="cProfile one call (a name printed)")
    parser.add_argument(
        "--first",
        action="store_true",
        help="time each call as the first of its signature (the launch plans forgotten before "
        "each call: the checked path, which keeps no plan)",
    )
    args = parser.parse_args()
    load_stub_driver()
    pretend_cuda()
    found = calls()
    if args.first:
        found = {name: first_calls(fn) for name, fn in found.items()}
    for fn in found.values():  # warm up: kernels chosen, descriptors encoded, plans made
        for _ in range(50):
            fn()
    if args.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.loops):
            found[args.profile]()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    for name, fn in found.items():
        median, best = per_call_us(fn, args.loops, args.repeat)
        print(f"host us/call {name}: {median:.1f} (fastest loop {best:.1f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
