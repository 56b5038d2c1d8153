"""fadsl: a compiler from a short declarative spec to a FlashAttention forward kernel."""

__version__ = "0.1.0"

from .errors import Loc, SpecError  # noqa: E402
from .runtime import FlashAttention, load  # noqa: E402

__all__ = ["__version__", "FlashAttention", "Loc", "SpecError", "load"]
