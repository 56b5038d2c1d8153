"""fadsl: a compiler from a short declarative spec to FlashAttention kernels in CUDA.

The public API: ``attention`` (attention through a shipped spec for the GPU),
``attention_varlen`` and ``attention_with_kvcache`` (packed batches and KV caches through the
shipped serving specs, FlashAttention's conventions), ``append_kv``
(new tokens' keys and values into a KV cache, before a `kv_cache` kernel's call), ``load`` (a
spec's file or text -> a ``FlashAttention``, a torch operator), ``build_ahead``, ``block_table`` (a FlexAttention BlockMask as the table a spec's
`keep` reads), ``tune`` (a
spec's knobs searched on this GPU -> a ``TuneResult``), ``fp8`` (quantize and rotate FP8
inputs), the errors a spec or a build can raise, and the version.
"""

from ._version import __version__

from .errors import BuildError, Loc, SpecError
from .runtime.attention import FlashAttention, build_ahead, load
from .tools.tune import NoGPUError, TuneResult, tune

# The public calls import torch (fadsl/runtime/public.py): loaded on first use, so that
# `import fadsl` (and the CLI) stays quick.
_PUBLIC_CALLS = ("append_kv", "attention", "attention_varlen", "attention_with_kvcache")


def __getattr__(name: str):
    if name in _PUBLIC_CALLS:
        from .runtime import public

        return getattr(public, name)
    if name == "block_table":  # a FlexAttention BlockMask as a spec's table (issue 41)
        from .runtime.block_table import block_table

        return block_table
    if name == "fp8":  # fadsl.fp8.quantize, rotate: torch on first use, as the calls
        import importlib

        return importlib.import_module(".fp8", __name__)
    raise AttributeError(f"module 'fadsl' has no attribute {name!r}")


__all__ = [
    "__version__",
    "BuildError",
    "FlashAttention",
    "Loc",
    "NoGPUError",
    "SpecError",
    "TuneResult",
    "append_kv",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "block_table",
    "build_ahead",
    "fp8",
    "load",
    "tune",
]
