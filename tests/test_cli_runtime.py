"""Runtime-facing checks that need no GPU: an old GPU is refused before any build, and
`fadsl bench --plot` without matplotlib fails before the run, not after it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fadsl
from conftest import ROOT
from fadsl.ir import Dtype

FADSL = str(Path(sys.executable).parent / "fadsl")


def test_a_gpu_older_than_the_target_is_refused_before_building(monkeypatch):
    kern = fadsl.load(ROOT / "examples" / "fa2_kernel1.fa", verbose=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")

    def no_build(*args, **kwargs):
        raise AssertionError("built for a GPU that cannot run the kernel")

    monkeypatch.setattr(kern, "cubin", no_build)
    with pytest.raises(RuntimeError) as info:
        kern.module(Dtype.BF16, 0)
    message = str(info.value)
    assert "targets sm_80, which needs compute capability 8.0 or newer" in message
    assert "cuda:0 is Tesla T4 (compute capability 7.5)" in message


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed"
)
def test_bench_plot_without_matplotlib_fails_first(tmp_path):
    proc = subprocess.run(
        [FADSL, "bench", "examples/fa2_kernel1.fa", "--plot", str(tmp_path / "p.png")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 1 and "--plot needs matplotlib" in proc.stderr
    assert "Traceback" not in proc.stderr
