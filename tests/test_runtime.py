"""The runtime's argument checks and spec loading, on the CPU (no GPU needed)."""

from pathlib import Path

import pytest
import torch

import fadsl
from fadsl.codegen import spec_hash
from conftest import ROOT

SPEC = ROOT / "examples" / "fa2_kernel1.fa"


@pytest.fixture(scope="module")
def kern():
    return fadsl.load(SPEC)


def qkv(shape=(2, 128, 4, 128), dtype=torch.bfloat16, kv_shape=None):
    kv_shape = kv_shape or shape
    return (
        torch.randn(shape, dtype=dtype),
        torch.randn(kv_shape, dtype=dtype),
        torch.randn(kv_shape, dtype=dtype),
    )


def test_load_accepts_a_path_a_string_path_and_spec_text():
    by_path = fadsl.load(SPEC)
    by_str = fadsl.load(str(SPEC))
    by_text = fadsl.load(SPEC.read_text())
    assert by_path.source("bf16") == by_str.source("bf16")
    assert spec_hash(by_text.compiled.kernel) == spec_hash(by_path.compiled.kernel)
    # The path a spec was loaded by is not part of the source, so not of the cache key.
    assert by_text.source("bf16") == by_path.source("bf16")
    assert "fa2_kernel1_bf16_kernel" in by_text.source("bf16")


def test_load_reports_spec_errors_with_location():
    with pytest.raises(fadsl.SpecError, match=r"<spec>:3:12: warps = 3 is not a power of two"):
        fadsl.load("kernel x {\n  target sm_80\n  warps    3\n}\n")


def test_load_missing_file_names_it():
    with pytest.raises(FileNotFoundError, match="nope.fa"):
        fadsl.load("nope.fa")


@pytest.mark.parametrize(
    "mutate, error, message",
    [
        (lambda q, k, v: ([1], k, v), TypeError, r"q must be a torch.Tensor, got list"),
        (
            lambda q, k, v: (q.float(), k, v),
            TypeError,
            r"q has dtype torch.float32; kernel 'fa2_kernel1' was compiled for torch.bfloat16, torch.float16",
        ),
        (
            lambda q, k, v: (q, k.half(), v),
            TypeError,
            r"k has dtype torch.float16 but q has torch.bfloat16",
        ),
        (
            lambda q, k, v: (q[0], k, v),
            ValueError,
            r"q must be 4-D \(batch, seqlen, heads, head_dim\), got shape \(128, 4, 128\)",
        ),
        (
            lambda q, k, v: (q[..., :64], k, v),
            ValueError,
            r"q.shape\[3\] is the head_dim, which the spec fixes at 128, got 64",
        ),
        (
            lambda q, k, v: (q, k.transpose(1, 3).contiguous().transpose(1, 3), v),
            ValueError,
            r"k must be contiguous in its last dimension",
        ),
        (lambda q, k, v: (q, k, v[:, :64]), ValueError, r"k and v must have the same shape"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, r"k has batch 1 but q has batch 2"),
        (
            lambda q, k, v: (q, k[:, :, :3], v[:, :, :3]),
            ValueError,
            r"q's heads \(4\) must be a multiple of k's and v's heads \(3\)",
        ),
        (
            lambda q, k, v: (q[:, :0], k, v),
            ValueError,
            r"q's sequence length must be at least 1, got 0",
        ),
        (
            lambda q, k, v: (q, k[:, :0], v[:, :0]),
            ValueError,
            r"k's sequence length must be at least 1, got 0",
        ),
        (lambda q, k, v: (q, k, v), ValueError, r"q must be on a CUDA device, got cpu"),
    ],
)
def test_bad_tensors_are_named(kern, mutate, error, message):
    with pytest.raises(error, match=message):
        kern(*mutate(*qkv()))


def test_gqa_and_ragged_shapes_pass_the_shape_checks(kern):
    q, k, v = qkv((1, 113, 8, 128), kv_shape=(1, 203, 2, 128))
    with pytest.raises(ValueError, match="CUDA device"):  # only the device is wrong
        kern(q, k, v)


@pytest.mark.parametrize(
    "scale, error",
    [("0.1", TypeError), (True, TypeError), (float("nan"), ValueError), (-1.0, ValueError)],
)
def test_bad_softmax_scale(kern, scale, error, monkeypatch):  # noqa: D103
    monkeypatch.setattr(type(kern), "_validate", lambda self, q, k, v: fadsl.ir.Dtype.BF16)
    with pytest.raises(error, match="softmax_scale"):
        kern(*qkv(), softmax_scale=scale)


def test_cache_rebuilds_a_corrupt_entry(tmp_path, monkeypatch, capsys):
    """An entry whose shared object no longer imports is deleted and built again."""
    from torch.utils import cpp_extension

    from fadsl import runtime

    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(runtime, "_nvcc_version", lambda: "nvcc test")
    builds = []

    def fake_load(name, sources, build_directory, **kwargs):
        builds.append(name)
        Path(build_directory, f"{name}.so").write_bytes(b"\x7fELF but truncated")
        return f"module {name}"

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    source = fadsl.load(SPEC, verbose=False)._sources[fadsl.ir.Dtype.BF16]
    assert runtime.build(source, "spec", "sm_90a") == f"module {builds[0]}"
    assert (tmp_path / builds[0] / "BUILT").exists()
    # The entry exists but its .so is garbage: the next load must rebuild it, and say so.
    assert runtime.build(source, "spec", "sm_90a") == f"module {builds[0]}"
    assert len(builds) == 2
    assert "is corrupt" in capsys.readouterr().err
    # A different arch is a different entry.
    runtime.build(source, "spec", "sm_80")
    assert len(set(builds)) == 2


def test_cache_lock_serialises_builders(tmp_path):
    import threading

    from fadsl.runtime import _locked

    order = []
    lock = tmp_path / "x.lock"
    inside = threading.Event()

    def second():
        inside.wait()
        with _locked(lock):
            order.append("second")

    thread = threading.Thread(target=second)
    thread.start()
    with _locked(lock):
        inside.set()
        thread.join(timeout=0.3)
        assert thread.is_alive(), "the second builder entered while the first held the lock"
        order.append("first")
    thread.join()
    assert order == ["first", "second"]
