"""The cubin cache and ahead-of-time cubin folders.

An entry is two files named ``<kernel>.<arch>.<key>``: the ``.cubin`` and a ``.json`` with
what built it, the compiler's log and the cubin's SHA-256. Both are written to a temporary
file and renamed, the ``.json`` last, so an entry exists only once whole; an entry whose
cubin does not match its recorded hash is corrupt and is built again. Writers of one entry
take a file lock (``filelock``), so concurrent processes build it once.

Keys hash everything that changes the binary. The cache key covers the compiler and its
version; the key of an ahead-of-time cubin (``fadsl build``) leaves them out, since a
cubin built elsewhere by another compiler version still runs on a driver of its major
version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from filelock import FileLock

from .. import _data
from .._version import __version__
from ..atomic import write_atomic
from .nvrtc import OPTIONS, Cubin, compile_cubin, compiler_id

log = logging.getLogger("fadsl")


def cache_dir() -> Path:
    return _data.cache_dir()


def cubin_path() -> list[Path]:
    """Folders of ahead-of-time cubins from ``$FADSL_CUBIN_PATH`` (os.pathsep-separated)."""
    return [Path(p) for p in os.environ.get("FADSL_CUBIN_PATH", "").split(os.pathsep) if p]


@dataclass(frozen=True)
class Request:
    """What one cubin is built from."""

    kernel: str  # the CUDA kernel's name, e.g. fa2_kernel1_bf16
    filename: str
    text: str  # the rendered source
    headers: str  # fadsl's headers' text
    normalised: str  # the normalised spec (its hash)
    arch: str

    def key(self, with_compiler: bool) -> str:
        parts = [self.normalised, self.text, self.headers, self.arch, *OPTIONS, __version__]
        if with_compiler:
            parts.append(compiler_id())
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]

    def stem(self, with_compiler: bool) -> str:
        return f"{self.kernel}.{self.arch}.{self.key(with_compiler)}"


@dataclass(frozen=True)
class Entry:
    cubin: bytes
    log: str  # the compiler's log (ptxas's -v report among it)
    meta: dict
    path: Path  # the .cubin file


def read(folder: Path, stem: str) -> Entry | None:
    """The entry ``stem`` in ``folder``, or None if it is missing or corrupt."""
    meta_path, cubin_file = folder / f"{stem}.json", folder / f"{stem}.cubin"
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_file.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("sha256") != hashlib.sha256(cubin).hexdigest():
        return None
    return Entry(cubin, str(meta.get("log", "")), meta, cubin_file)


def write(folder: Path, stem: str, request: Request, compiled: Cubin, seconds: float) -> Entry:
    meta = {
        "kernel": request.kernel,
        "arch": request.arch,
        "compiler": compiled.compiler,
        "fadsl": __version__,
        "seconds": round(seconds, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "sha256": hashlib.sha256(compiled.cubin).hexdigest(),
        "ptxas": compiled.ptxas(),
        "log": compiled.log,
    }
    cubin_file = write_atomic(folder / f"{stem}.cubin", compiled.cubin)
    write_atomic(folder / f"{stem}.json", json.dumps(meta, indent=1))
    return Entry(compiled.cubin, compiled.log, meta, cubin_file)


def find_aot(request: Request, folders: Iterable[Path]) -> Entry | None:
    stem = request.stem(with_compiler=False)
    for folder in folders:
        entry = read(Path(folder), stem)
        if entry is not None:
            return entry
    return None


def get_or_build(
    request: Request,
    build: Callable[[], Cubin],
    announce: bool = True,
    rebuild: bool = False,
    folder: Path | None = None,
) -> Entry:
    """The cached cubin for ``request``, built (once across processes) if missing or corrupt.

    ``rebuild``: the cached entry was found but could not be loaded; build it again.
    ``folder``: the cache folder (default ``cache_dir()``).
    """
    folder = Path(folder) if folder is not None else cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stem = request.stem(with_compiler=True)
    if not rebuild:
        entry = read(folder, stem)
        if entry is not None:
            return entry
    with FileLock(str(folder / f"{stem}.lock")):
        if not rebuild:
            entry = read(folder, stem)  # another process may have built it while we waited
            if entry is not None:
                return entry
        if (folder / f"{stem}.json").exists():
            log.warning("fadsl: cache entry %s is corrupt; rebuilding it", folder / stem)
        start = time.monotonic()
        compiled = build()
        seconds = time.monotonic() - start
        entry = write(folder, stem, request, compiled, seconds)
        level = logging.INFO if announce else logging.DEBUG
        log.log(
            level,
            "fadsl: built %s for %s with %s in %.1f s (%s)",
            request.kernel,
            request.arch,
            compiled.compiler,
            seconds,
            entry.path,
        )
        return entry


def entries(folder: Path | None = None) -> list[dict]:
    """What ``fadsl cache list`` shows: one dict per entry."""
    folder = folder or cache_dir()
    rows = []
    for meta_path in sorted(folder.glob("*.json")):
        stem = meta_path.name[: -len(".json")]
        entry = read(folder, stem)
        cubin_file = folder / f"{stem}.cubin"
        rows.append(
            {
                "name": stem,
                "kernel": entry.meta.get("kernel") if entry else "?",
                "arch": entry.meta.get("arch") if entry else "?",
                "compiler": entry.meta.get("compiler") if entry else "?",
                "bytes": cubin_file.stat().st_size if cubin_file.exists() else 0,
                "ok": entry is not None,
            }
        )
    return rows


def clear(folder: Path | None = None) -> int:
    """Delete every entry, lock, failed source and compiled template in the cache; return the
    files deleted."""
    folder = folder or cache_dir()
    removed = 0
    if not folder.is_dir():
        return 0
    patterns = ("*.cubin", "*.json", "*.lock", ".*.tmp", "failed/*.cu", "jinja/*.cache")
    for pattern in patterns:
        for path in folder.glob(pattern):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


# What of emit/ a build reads (pyproject.toml's package data): headers, templates, sources.
EMIT_SUFFIXES = (".cuh", ".j2", ".cu")


def stale_emit(checkout: Path) -> list[str]:
    """The files of ``checkout``/emit (headers, templates) whose text the imported fadsl does
    not carry: where fadsl runs from an install (scripts/device.sh installs the tree it is
    given) and the checkout was patched after it, a build renders and compiles the old text.
    Empty where ``checkout`` has no emit/ folder or is the imported package's own."""
    tree = checkout / "emit"
    installed = _data.data_dir("emit")
    if not tree.is_dir() or (isinstance(installed, Path) and installed.resolve() == tree.resolve()):
        return []
    stale = []
    for path in sorted(tree.rglob("*")):
        if path.suffix not in EMIT_SUFFIXES or not path.is_file():
            continue
        name = path.relative_to(tree).as_posix()
        other = _data.join(installed, name)
        if not other.is_file() or other.read_text() != path.read_text():
            stale.append(name)
    return stale


def development_build(request: Request, defines: dict[str, int]) -> Entry:
    """``request``'s source built with ``defines`` (#define NAME VALUE before it), outside the
    cache, which stays untouched: what a kernel's ``use_development_build`` runs in its place
    (scripts/tile_trace.py; research/probes/: energy_probe.py, probe_decode_layout.py, probe_backward.py).
    Refused where the working folder is a checkout whose emit/ the imported fadsl does not
    carry (stale_emit): the defines of a patch applied after the install would then name code
    that is not built, and the build would silently run the old kernel (as the deterministic
    writer's releaser and ticket experiments did until 2026-12-06: research/backward-dq-writer.md).
    """
    import tempfile

    stale = stale_emit(Path.cwd())
    if stale:
        shown = ", ".join(stale[:4]) + (f" and {len(stale) - 4} more" if len(stale) > 4 else "")
        raise RuntimeError(
            f"the imported fadsl ({_data.data_dir('emit')}) does not carry this checkout's "
            f"emit/ ({shown} differ): install the checkout again after patching it (apply a "
            "patch before scripts/device.sh), or a development build runs the old code"
        )

    head = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    with tempfile.TemporaryDirectory() as where:
        built = compile_cubin(
            head + request.text, request.filename, request.kernel, request.arch, Path(where)
        )
    return Entry(built.cubin, built.log, {}, Path(where) / "dev")
