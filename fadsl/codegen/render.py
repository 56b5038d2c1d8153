"""Render a compiled kernel to CUDA: codegen takes (Kernel, Target) and knows no pass.

The target names its template (under emit/) and computes its slots from the
planned kernel; this module adds what every target's source shares (names, the
fadsl version, the spec's hash) and manages the CUDA headers: the target-neutral
ones under emit/common/include and each target's under emit/<package>/include,
all written side by side under ``fadsl/`` where ``-I <folder>`` finds them.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from importlib.abc import Traversable
from pathlib import Path
from typing import Any

import jinja2

from .._version import __version__
from .. import targets
from .._data import cache_dir, data_dir, join
from ..atomic import write_atomic
from ..ir import Dtype, Kernel
from ..ir.printer import format_kernel


@dataclass(frozen=True)
class Source:
    """One rendered translation unit: the kernel for one dtype."""

    kernel_name: str
    dtype: Dtype
    filename: str
    text: str


def _header_files(packages: tuple[str, ...] | None = None) -> dict[str, Traversable]:
    """Every header a generated source may include (of ``packages``' targets, default
    all): name (as included) -> file."""
    emit = data_dir("emit")
    found: dict[str, Traversable] = {}
    for folder in ("common", *(targets.packages() if packages is None else packages)):
        include = join(emit, f"{folder}/include/fadsl")
        for entry in sorted(include.iterdir(), key=lambda e: e.name):
            if entry.name.endswith(".cuh"):
                found[f"fadsl/{entry.name}"] = entry
    return found


# The CUDA headers generated sources include, as they are written next to them.
HEADERS: tuple[str, ...] = tuple(_header_files())


@functools.cache
def environment() -> jinja2.Environment:
    root = data_dir("emit")
    # Compiled templates are kept next to the cubins (compiling the template takes longer
    # than rendering it; a warm start pays neither).
    bytecode = cache_dir() / "jinja"
    try:
        bytecode.mkdir(parents=True, exist_ok=True)
        bytecode_cache = jinja2.FileSystemBytecodeCache(str(bytecode))
    except OSError:  # a read-only home: no cache, only slower
        bytecode_cache = None
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: join(root, name).read_text()),
        bytecode_cache=bytecode_cache,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def read_header(name: str) -> str:
    """The text of one of ``HEADERS``."""
    return _header_files()[name].read_text()


def header_text() -> str:
    """The headers' text, all of it (for cache keys)."""
    return "".join(read_header(name) for name in HEADERS)


def write_headers(root: Path, package: str | None = None) -> list[Path]:
    """Write the headers (the common ones and ``package``'s, default all) under ``root``
    (``root/fadsl/...``), where ``-I root`` finds them; each whole or not at all."""
    names = _header_files(None if package is None else (package,))
    return [write_atomic(root / name, read_header(name)) for name in names]


def spec_hash(kernel: Kernel) -> str:
    """A hash of the normalised spec: the final IR printed without source locations."""
    return hashlib.sha256(format_kernel(kernel).encode()).hexdigest()[:16]


def context(kernel: Kernel, target: targets.Target, spec_name: str, dtype: Dtype) -> dict[str, Any]:
    """Every slot of the target's template for one dtype."""
    return {
        "spec_name": spec_name,
        "spec_hash": spec_hash(kernel),
        "fadsl_version": __version__,
        "kernel_name": f"{kernel.config.name}_{dtype.value}",
        "dtype": dtype.value,
        **target.context(kernel, dtype),
    }


def render(kernel: Kernel, target: targets.Target, spec_name: str) -> tuple[Source, ...]:
    """One self-contained .cu per dtype of the spec; ``spec_name`` goes into its header."""
    template = environment().get_template(target.template)
    sources = []
    for dtype in kernel.config.dtypes:
        ctx = context(kernel, target, spec_name, dtype)
        text = template.render(**ctx)
        name = ctx["kernel_name"]
        sources.append(Source(name, dtype, f"{name}.cu", text))
    return tuple(sources)


def render_backward(kernel: Kernel, target: targets.Target, spec_name: str) -> tuple[Source, ...]:
    """The backward's translation units (one per dtype; the target's backward template),
    for a kernel with a backward block."""
    launcher = target.backward_launch
    template = environment().get_template(launcher.template)
    sources = []
    for dtype in kernel.config.dtypes:
        name = f"{kernel.config.name}_bwd_{dtype.value}"
        ctx = {
            **context(kernel, target, spec_name, dtype),
            "kernel_name": name,
            **launcher.context(kernel, dtype),
        }
        sources.append(Source(name, dtype, f"{name}.cu", template.render(**ctx)))
    return tuple(sources)


def write(kernel: Kernel, target: targets.Target, spec_name: str, out_dir: Path) -> list[Path]:
    """Write the .cu files (the backward's too, for a spec with a backward block) and the
    helper headers they include into ``out_dir`` (each file whole or not at all: a reader
    never sees a torn file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = write_headers(out_dir, target.package)
    sources = render(kernel, target, spec_name)
    if kernel.backward is not None:  # the backward's kernels, one more source per dtype
        sources += render_backward(kernel, target, spec_name)
    for source in sources:
        paths.append(write_atomic(out_dir / source.filename, source.text))
    return paths
