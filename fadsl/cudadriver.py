"""The CUDA driver API (cuda.bindings' ``driver``), initialised once, and its results checked:
the one low-level module for driver calls, below the targets (their host side builds TMA
descriptors with it) and the runtime (which loads and launches cubins with it)."""

from __future__ import annotations

import functools


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


@functools.cache
def driver():
    """cuda.bindings' driver module, cuInit done."""
    from cuda.bindings import driver as api

    check(api, api.cuInit(0), "cuInit")
    return api


def check(driver, result, what: str):
    """The value of a driver call's ``(CUresult, value...)`` tuple, or DriverError naming
    ``what`` and the driver's error."""
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        text = text.decode() if isinstance(text, bytes) else text
        raise DriverError(f"{what} failed: {name}: {text}")
    return result[1] if len(result) == 2 else result[1:]
