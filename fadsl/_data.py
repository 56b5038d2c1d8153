"""Where the grammar (grammar/), the templates and headers (emit/) and the example specs
(examples/, the specs fadsl.attention ships) are, and the cache folder.

An installed fadsl carries them as the subpackages ``fadsl.grammar``, ``fadsl.emit`` and
``fadsl.examples``
(pyproject.toml maps the folders there); a source checkout imported as it is (the
repository root on sys.path) has them beside the package.
"""

from __future__ import annotations

import os
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path


def data_dir(name: str) -> Traversable:
    """``grammar``, ``emit`` or ``examples``: the installed subpackage, else the checkout's
    folder."""
    try:
        return resources.files(f"fadsl.{name}")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / name


def join(root: Traversable, path: str) -> Traversable:
    """``root/path``, one part at a time (older Traversables take one part per call)."""
    for part in path.split("/"):
        root = root.joinpath(part)
    return root


def cache_dir() -> Path:
    """The cache folder: $FADSL_CACHE_DIR, or ~/.cache/fadsl where it is unset or empty (the
    cubins, ptxas's reports and the compiled templates live under it)."""
    return Path(os.environ.get("FADSL_CACHE_DIR") or Path.home() / ".cache" / "fadsl")
