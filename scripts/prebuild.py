"""Build every cubin the GPU tests need, in parallel (one process each; NVRTC needs no GPU):
the examples, the general-attention matrix, the numerics suite's kernels and the capped and
windowed specs of tests/gpu_specs.py, for the local GPU's
architecture (or the one given: python3 scripts/prebuild.py sm_90a)."""

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def build(job: tuple[str, str, str]) -> str:
    import fadsl
    from fadsl.ir import Dtype

    spec, dtype, arch = job
    kern = fadsl.load(spec, verbose=False)
    start = time.monotonic()
    for built in kern.variants:  # `cluster 2`: its cluster-free variant too
        built.cubin(Dtype(dtype), arch)
    return f"{kern.config.name} {dtype} {arch}: {time.monotonic() - start:.1f} s"


if __name__ == "__main__":
    import fadsl

    if len(sys.argv) > 1:
        arch = sys.argv[1]
    else:
        import torch

        from fadsl.runtime.attention import arch_of

        arch = arch_of(torch.cuda.current_device())
    from gpu_specs import general_specs, numerics_specs, sm90_specs, softcap_specs, window_specs

    from fadsl.targets import check_arch

    # Relative paths, as the tests load them (the runtime renders every spec under its
    # kernel's name, so the path does not change the cache key).
    specs = [str(s.relative_to(ROOT)) for s in sorted((ROOT / "examples").glob("*.fa"))]
    specs += list(general_specs().values())
    specs += [t for n, t in sm90_specs().items() if not (ROOT / "examples" / f"{n}.fa").exists()]
    known = {fadsl.load(s, verbose=False).config.name for s in specs}
    specs += [t for n, t in numerics_specs().items() if n not in known]
    specs += list(softcap_specs().values())
    specs += list(window_specs().values())
    jobs = []
    for spec in specs:
        config = fadsl.load(spec, verbose=False).config
        try:
            check_arch(config.target, arch)
        except ValueError:  # (an sm_90a spec on an older GPU: its tests skip)
            continue
        jobs += [(spec, d.value, arch) for d in config.dtypes]
    with ProcessPoolExecutor(max_workers=min(len(jobs), 16)) as pool:
        for line in pool.map(build, jobs):
            print(line, flush=True)
