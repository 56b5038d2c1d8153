"""Build every example kernel for the local GPU, all dtypes in parallel (one process each)."""

import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(job: tuple[str, str]) -> str:
    import torch

    import fadsl
    from fadsl.ir import Dtype

    spec, dtype = job
    kern = fadsl.load(spec, verbose=False)
    kern.module(Dtype(dtype), torch.device("cuda"))
    return f"built {Path(spec).name} {dtype}"


if __name__ == "__main__":
    import fadsl

    specs = [Path(a) for a in sys.argv[1:]] or sorted((ROOT / "examples").glob("*.fa"))
    jobs = [(str(s), d.value) for s in specs for d in fadsl.load(s, verbose=False).config.dtypes]
    with ProcessPoolExecutor(max_workers=len(jobs)) as pool:
        for line in pool.map(build, jobs):
            print(line, flush=True)
