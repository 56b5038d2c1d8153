"""Whole-file writes that a reader never sees half done, and a crash never leaves behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write ``data`` to a temporary file next to ``path``, then rename it over ``path``.

    The rename is atomic on one file system, so a concurrent reader sees the old file or the
    new one, never a torn one; a failed write removes its temporary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        os.chmod(tmp, 0o644)  # (mkstemp's 0600 would hide a shared cache from other users)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
