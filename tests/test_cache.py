"""The cubin cache and ahead-of-time builds, on the CPU: atomic writes, concurrent writers,
corrupt entries, `fadsl build` without a GPU, and `fadsl cache list|clear`."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import fadsl
from conftest import ROOT
from fadsl.build import cache
from fadsl.atomic import write_atomic
from fadsl.build.nvrtc import Cubin, nvrtc_available
from fadsl.ir import Dtype

SPEC = ROOT / "examples" / "fa2_kernel1.fa"
FADSL = str(Path(sys.executable).parent / "fadsl")
needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC (cuda-bindings)")


def request(arch: str = "sm_90a", text: str = "// kernel\n") -> cache.Request:
    return cache.Request("k_bf16_kernel", "k_bf16.cu", text, "// headers", "spec", arch)


def fake_build(tag: bytes = b"cubin"):
    return lambda: Cubin(b"\x7fELF " + tag, "ptxas info    : Used 96 registers", "fake 1.0")


def test_write_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a" / "file.bin"
    write_atomic(path, b"first")
    write_atomic(path, "second")
    assert path.read_text() == "second"
    assert os.listdir(path.parent) == ["file.bin"]


def test_write_atomic_leaves_nothing_when_the_write_fails(tmp_path):
    with pytest.raises(TypeError):
        write_atomic(tmp_path / "x", 42)  # type: ignore[arg-type]
    assert os.listdir(tmp_path) == []


def test_readers_never_see_a_torn_file(tmp_path):
    """A reader racing a writer of large files sees one whole version or the other."""
    path = tmp_path / "entry"
    versions = [bytes([i]) * 2_000_000 for i in range(2)]
    write_atomic(path, versions[0])
    stop = threading.Event()
    seen = []

    def reader():
        while not stop.is_set():
            data = path.read_bytes()
            seen.append(data in versions)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(20):
        write_atomic(path, versions[i % 2])
    stop.set()
    thread.join()
    assert seen and all(seen)


def test_entry_is_built_once_and_then_read(tmp_path, monkeypatch):
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    builds = []

    def build():
        builds.append(1)
        return fake_build()()

    first = cache.get_or_build(request(), build)
    second = cache.get_or_build(request(), build)
    assert len(builds) == 1 and first.cubin == second.cubin == b"\x7fELF cubin"
    assert second.meta["ptxas"]["registers"] == 96 and second.meta["compiler"] == "fake 1.0"
    cache.get_or_build(request("sm_80"), build)  # another architecture: another entry
    assert len(builds) == 2 and len(list(tmp_path.glob("*.cubin"))) == 2


@pytest.mark.parametrize("damage", ["truncate", "empty_json", "no_cubin"])
def test_a_corrupt_entry_is_rebuilt(tmp_path, monkeypatch, caplog, damage):
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    entry = cache.get_or_build(request(), fake_build(b"one"))
    stem = entry.path.name[: -len(".cubin")]
    match damage:
        case "truncate":
            entry.path.write_bytes(entry.cubin[:3])
        case "empty_json":
            (tmp_path / f"{stem}.json").write_text("")
        case "no_cubin":
            entry.path.unlink()
        case _:
            raise AssertionError(damage)
    assert cache.read(tmp_path, stem) is None
    rebuilt = cache.get_or_build(request(), fake_build(b"two"))
    assert rebuilt.cubin == b"\x7fELF two" and cache.read(tmp_path, stem) is not None
    assert "is corrupt; rebuilding it" in caplog.text


def _build_in_process(args) -> bytes:
    folder, counter = args
    os.environ["FADSL_CACHE_DIR"] = folder

    def build():
        with open(counter, "a") as handle:  # O_APPEND: one line per build, from any process
            handle.write("built\n")
        import time

        time.sleep(0.3)  # long enough for the other writers to arrive and wait on the lock
        return fake_build(b"shared")()

    return cache.get_or_build(request(), build).cubin


def test_four_concurrent_writers_build_once(tmp_path):
    counter = tmp_path / "builds.txt"
    folder = tmp_path / "cache"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(_build_in_process, [(str(folder), str(counter))] * 4)
    assert results == [b"\x7fELF shared"] * 4
    assert counter.read_text().count("built") == 1
    assert not list(folder.glob(".*.tmp")), "a temporary file was left behind"


def test_cache_list_and_clear(tmp_path, monkeypatch):
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    cache.get_or_build(request(), fake_build())
    listed = subprocess.run([FADSL, "cache", "list"], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert f"{tmp_path}: 1 entries" in listed.stdout and "k_bf16_kernel" in listed.stdout
    cleared = subprocess.run([FADSL, "cache", "clear"], capture_output=True, text=True)
    assert cleared.returncode == 0 and "removed" in cleared.stdout
    assert cache.entries(tmp_path) == [] and not list(tmp_path.glob("*.cubin"))


def test_keys_cover_what_changes_the_binary():
    base = request()
    changed = [
        request(text="// other kernel\n"),
        request(arch="sm_80"),
        cache.Request(**{**base.__dict__, "headers": "// other headers"}),
        cache.Request(**{**base.__dict__, "normalised": "other spec"}),
    ]
    for with_compiler in (True, False):
        keys = {r.key(with_compiler) for r in [base, *changed]}
        assert len(keys) == 1 + len(changed)


@needs_nvrtc
def test_aot_build_without_a_gpu_is_found_first(tmp_path, monkeypatch):
    """`fadsl build` writes cubins with no GPU; `fadsl.load` finds them before any build."""
    out = tmp_path / "cubins"
    proc = subprocess.run(
        [FADSL, "build", "examples/fa2_pipelined.fa", "--arch", "sm_90a", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    cubins = sorted(out.glob("*.cubin"))
    assert [c.name.split(".")[:2] for c in cubins] == [
        ["fa2_pipelined_bf16_kernel", "sm_90a"],
        ["fa2_pipelined_fp16_kernel", "sm_90a"],
    ]
    assert all(c.read_bytes()[:4] == b"\x7fELF" for c in cubins)
    meta = json.loads(cubins[0].with_suffix(".json").read_text())
    assert meta["ptxas"]["registers"] > 0 and meta["ptxas"]["spill_store_bytes"] == 0

    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path / "cache"))

    def no_build(*args, **kwargs):
        raise AssertionError("built although an ahead-of-time cubin was there")

    monkeypatch.setattr(fadsl.runtime.attention, "compile_cubin", no_build)
    kern = fadsl.load(ROOT / "examples" / "fa2_pipelined.fa", cubin_dirs=[out])
    assert kern.cubin(Dtype.BF16, "sm_90a").path == cubins[0]
    monkeypatch.setenv("FADSL_CUBIN_PATH", str(out))
    kern = fadsl.load(ROOT / "examples" / "fa2_pipelined.fa")
    assert kern.cubin(Dtype.FP16, "sm_90a").path == cubins[1]


def test_aot_build_refuses_a_bad_architecture(tmp_path):
    proc = subprocess.run(
        [FADSL, "build", str(SPEC), "--arch", "sm_75", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "target sm_80 needs sm_80 or newer, not sm_75" in proc.stderr
    proc = subprocess.run(
        [FADSL, "build", str(SPEC), "--arch", "hopper", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and "bad architecture 'hopper'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_architecture_names_with_three_digits():
    from fadsl.targets import check_arch

    check_arch("sm_80", "sm_100")  # Blackwell runs sm_80 code: capability (10, 0), not (1, 0)
    with pytest.raises(ValueError, match="runs only on sm_90a, not sm_100a"):
        check_arch("sm_90a", "sm_100a")


@needs_nvrtc
def test_aot_build_defaults_to_the_architectures_of_the_spec_target(tmp_path):
    """An sm_90a spec builds for sm_90a alone (sm_80 cannot run it), with no --arch."""
    spec = ROOT / "examples" / "fa3_hdim64.fa"  # (fa3_hopper's cluster variant: test_alone.py)
    proc = subprocess.run(
        [FADSL, "build", str(spec), "-o", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    cubins = sorted(p.name for p in tmp_path.glob("*.cubin"))
    assert len(cubins) == 2 and all("sm_90a" in name for name in cubins), cubins


@needs_nvrtc
def test_build_error_shows_the_compiler_message_and_the_source_path(tmp_path, monkeypatch):
    from fadsl.build.nvrtc import compile_cubin
    from fadsl.errors import BuildError

    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    bad = 'extern "C" __global__ void k() { undeclared_thing(); }\n'
    with pytest.raises(BuildError) as info:
        compile_cubin(bad, "k_bf16.cu", "k", "sm_80", tmp_path)
    message = str(info.value)
    assert "undeclared_thing" in message and "identifier" in message
    path = tmp_path / "failed" / "k_bf16.cu"
    assert str(path) in message and path.read_text() == bad


@needs_nvrtc
def test_a_real_build_logs_one_line(tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path))
    kern = fadsl.load(SPEC)
    with caplog.at_level(logging.INFO, logger="fadsl"):
        entry = kern.cubin(Dtype.BF16, "sm_80")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("fadsl: built fa2_kernel1_bf16_kernel for sm_80")
    assert entry.meta["ptxas"]["registers"] > 0
    quiet = fadsl.load(SPEC, verbose=False)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fadsl"):
        quiet.cubin(Dtype.FP16, "sm_80")
    assert not caplog.records


@pytest.mark.parametrize("value", [None, ""])
def test_every_cache_lives_under_one_folder(monkeypatch, tmp_path, value):
    """The cubins, ptxas's reports and the compiled templates share _data.cache_dir():
    $FADSL_CACHE_DIR, or ~/.cache/fadsl where it is unset or empty."""
    from fadsl.build.resources import usage_cache

    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("FADSL_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("FADSL_CACHE_DIR", value)
    default = tmp_path / ".cache" / "fadsl"
    assert cache.cache_dir() == default and usage_cache() == default / "ptxas"
    monkeypatch.setenv("FADSL_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert cache.cache_dir() == tmp_path / "elsewhere"
    assert usage_cache() == tmp_path / "elsewhere" / "ptxas"
