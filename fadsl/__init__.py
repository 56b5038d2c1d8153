"""fadsl: a compiler from a short declarative spec to a FlashAttention forward kernel."""

__version__ = "0.1.0"

from pathlib import Path as _Path

# Installed, the grammar and the templates are the subpackages fadsl.grammar and fadsl.emit
# (pyproject.toml maps grammar/ and emit/ there). Imported from a source checkout (the
# repository root on sys.path, after a plain `pip install .` too), they are the folders
# beside this one: let the package find them there.
_root = _Path(__file__).resolve().parent.parent
if (
    not (_Path(__file__).parent / "grammar").is_dir()
    and (_root / "grammar" / "fadsl.lark").is_file()
):
    __path__.append(str(_root))  # type: ignore[name-defined]  # noqa: F821

from .compiler import BuildError  # noqa: E402
from .errors import Loc, SpecError  # noqa: E402
from .runtime import FlashAttention, build_ahead, load  # noqa: E402

__all__ = ["__version__", "BuildError", "FlashAttention", "Loc", "SpecError", "build_ahead", "load"]
