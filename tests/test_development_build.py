"""A development build refuses to run where the working folder is a checkout whose emit/
(headers, templates) the imported fadsl does not carry (fadsl/build/cache.py, stale_emit):
on the GPU machine fadsl runs from an install of the tree (scripts/device.sh), so a patch
applied after it would name defines the build never sees, and the old kernel would run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fadsl import _data
from fadsl.build import cache

WRITER = "sm90/include/fadsl/sm90_bwd_writer.cuh"


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of the imported package's emit/, as a checkout beside an install holds it."""
    root = tmp_path / "checkout"
    shutil.copytree(Path(str(_data.data_dir("emit"))), root / "emit")
    return root


def test_a_checkout_equal_to_the_install_is_current(checkout):
    assert cache.stale_emit(checkout) == []


def test_a_patched_header_or_template_is_named(checkout):
    writer = checkout / "emit" / WRITER
    writer.write_text(writer.read_text() + "#if defined(FADSL_EXP_X)\n#endif\n")
    template = checkout / "emit" / "sm90" / "backward.cu.j2"
    template.write_text(template.read_text() + "\n")
    (checkout / "emit" / "sm90" / "include" / "fadsl" / "sm90_new.cuh").write_text("#pragma once\n")
    assert cache.stale_emit(checkout) == [
        "sm90/backward.cu.j2",
        "sm90/include/fadsl/sm90_bwd_writer.cuh",
        "sm90/include/fadsl/sm90_new.cuh",
    ]


def test_files_a_build_does_not_read_are_ignored(checkout, tmp_path):
    (checkout / "emit" / "notes.md").write_text("not built\n")
    assert cache.stale_emit(checkout) == []
    assert cache.stale_emit(tmp_path / "no_checkout") == []  # no emit/ folder: nothing to compare


def test_the_development_build_refuses_a_stale_install(checkout, monkeypatch):
    writer = checkout / "emit" / WRITER
    writer.write_text(writer.read_text().replace("bulk_wait_all();", "/* patched */", 1))
    monkeypatch.chdir(checkout)
    request = cache.Request("k", "k.cu", "", "", "x", "sm_90a")
    with pytest.raises(RuntimeError, match="sm90_bwd_writer.cuh differ.*apply a patch before"):
        cache.development_build(request, {"FADSL_EXP_X": 1})
