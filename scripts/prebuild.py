"""Build every cubin the GPU tests need, in parallel (one process each; NVRTC needs no GPU):
the examples, the general-attention matrix, the numerics suite's kernels and the capped and
windowed specs of tests/gpu_specs.py, for the local GPU's
architecture (or the one given: python3 scripts/prebuild.py sm_90a).

``python3 scripts/prebuild.py --backward [NAME ...]`` builds instead the forward and backward
cubins of tests/test_gpu_backward.py's training specs (tests/training_specs.py's names: every one
the tests and scripts/sanitize_backward.py load, and the NAMEs given, e.g. the variants a
backward bench times); ``--backward-only NAME ...`` builds the NAMEs alone."""

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


def build_training(job: tuple[str, str, str]) -> str:
    from training_specs import training_spec

    import fadsl
    from fadsl.ir import Dtype

    name, dtype, arch = job
    kern = fadsl.load(training_spec(name), verbose=False)
    start = time.monotonic()
    kern.variants[0].cubin(Dtype(dtype), arch)
    kern._backward_kernels().cubin(Dtype(dtype), arch)
    return f"{name} {dtype} {arch} (forward and backward): {time.monotonic() - start:.1f} s"


def prebuild_backward(names: list[str], only: bool = False) -> None:
    import torch
    from test_gpu_backward import DETERMINISTIC, FORWARDS, PLAIN, VARIANTS

    from fadsl.runtime.attention import arch_of

    arch = arch_of(torch.cuda.current_device())
    every = () if only else FORWARDS + PLAIN + VARIANTS + DETERMINISTIC
    wanted = dict.fromkeys(every + tuple(names))
    jobs = [(n, d, arch) for n in wanted for d in ("bf16", "fp16")]
    with ProcessPoolExecutor(max_workers=min(len(jobs), 16)) as pool:
        for line in pool.map(build_training, jobs):
            print(line, flush=True)


def fp8_specs() -> list[str]:
    """The FP8 kernels (issue 42) the GPU tests and scripts/sanitize_fp8.py run: the 8-bit
    examples, their `output fp16` variants (fadsl.attention's out_dtype=torch.float16) and
    the 8-bit test specs that build without spills."""
    from fadsl.frontend.rewrite import rewrite

    found = []
    for path in sorted((ROOT / "examples").glob("fa3_fp8*.fa")):
        found.append(str(path.relative_to(ROOT)))
        found.append(rewrite(path.read_text(), {"output": "fp16"}, {}, f"{path.stem}_out_fp16"))
    for path in sorted((ROOT / "tests" / "specs" / "fp8").glob("*.fa")):
        found.append(str(path.relative_to(ROOT)))
    return found


if __name__ == "__main__":
    import fadsl

    if sys.argv[1:2] in (["--backward"], ["--backward-only"]):
        prebuild_backward(sys.argv[2:], only=sys.argv[1] == "--backward-only")
        sys.exit(0)
    if sys.argv[1:2] == ["--fp8"]:  # the FP8 kernels alone (scripts/device.sh fp8)
        import torch

        from fadsl.runtime.attention import arch_of

        arch = arch_of(torch.cuda.current_device())
        jobs = [
            (s, d.value, arch)
            for s in fp8_specs()
            for d in fadsl.load(s, verbose=False).config.dtypes
        ]
        with ProcessPoolExecutor(max_workers=min(len(jobs), 16)) as pool:
            for line in pool.map(build, jobs):
                print(line, flush=True)
        sys.exit(0)
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
    specs += [s for s in fp8_specs() if not s.startswith("examples")]
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
