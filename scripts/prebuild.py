"""Build every kernel the GPU tests need for the local GPU, in parallel (one process each):
the examples and the general-attention matrix of tests/gpu_specs.py."""

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def build(job: tuple[str, str]) -> str:
    import torch

    import fadsl
    from fadsl.ir import Dtype

    spec, dtype = job
    kern = fadsl.load(spec, verbose=False)
    kern.module(Dtype(dtype), torch.device("cuda"))
    return f"built {kern.config.name} {dtype}"


if __name__ == "__main__":
    import fadsl
    from gpu_specs import general_specs

    # Relative paths, as the tests load them: the spec's name is in the generated source,
    # and so in the cache key.
    specs = [str(s.relative_to(ROOT)) for s in sorted((ROOT / "examples").glob("*.fa"))]
    specs += list(general_specs().values())
    jobs = [(s, d.value) for s in specs for d in fadsl.load(s, verbose=False).config.dtypes]
    with ProcessPoolExecutor(max_workers=min(len(jobs), 16)) as pool:
        for line in pool.map(build, jobs):
            print(line, flush=True)
