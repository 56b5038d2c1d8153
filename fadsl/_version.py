"""The package version (the cache keys and generated headers name it)."""

__version__ = "0.1.0"
