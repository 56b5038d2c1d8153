"""The GPU's SM clock, power draw and clock-limit reasons while a kernel runs (for `fadsl bench`).

A ratio to cuDNN measured on two machines of one kind can differ by 10 %: a kernel that draws
more power than the board's cap runs at a lower SM clock, and by how much depends on the
board. The bench samples the clock while each contender is timed, so that a result says
whether it was power-bound.

Read through NVML (libnvidia-ml, part of the driver) with ctypes: no Python package to
install on a GPU machine with no network. Without the library (no driver, CI) every
reading is None and the bench goes on without clocks.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

# nvmlClocksEventReasons (nvml.h): why the SM clock is below the maximum right now.
POWER_CAP = 0x4  # software power cap (the board's power limit)
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
LIMITED = POWER_CAP | HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE
_NVML_CLOCK_SM = 1

Reading = tuple[float, float, int]  # SM clock (MHz), power (W), clock-event reasons (bits)


@dataclass(frozen=True)
class ClockSummary:
    """What the samples taken during one timing say."""

    samples: int
    sm_mhz: float  # median SM clock
    power_w: float  # mean power draw
    power_capped: float  # share of the samples with the power cap holding the clock down
    limited: float  # share with any power or thermal limit

    def text(self) -> str:
        return f"{self.sm_mhz:.0f} MHz {self.power_w:.0f} W cap {100 * self.power_capped:.0f}%"


def summarize(readings: list[Reading]) -> ClockSummary | None:
    if not readings:
        return None
    n = len(readings)
    return ClockSummary(
        samples=n,
        sm_mhz=statistics.median(r[0] for r in readings),
        power_w=statistics.fmean(r[1] for r in readings),
        power_capped=sum(1 for r in readings if r[2] & POWER_CAP) / n,
        limited=sum(1 for r in readings if r[2] & LIMITED) / n,
    )


class Sampler:
    """Samples ``read()`` every ``interval`` seconds on a thread between ``start()`` and
    ``stop()``, which returns the readings (``summarize`` them)."""

    def __init__(self, read: Callable[[], Reading | None], interval: float = 0.002):
        self._read = read
        self._interval = interval
        self._readings: list[Reading] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._readings = []
        self._done.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> list[Reading]:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return list(self._readings)

    def _run(self) -> None:
        while not self._done.is_set():
            reading = self._read()
            if reading is not None:
                self._readings.append(reading)
            time.sleep(self._interval)


class _Nvml:
    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p):
        self._lib = lib
        self._handle = handle
        self._reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            lib, "nvmlDeviceGetCurrentClocksThrottleReasons"
        )

    def read(self) -> Reading | None:
        mhz, mw, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        ok = (
            self._lib.nvmlDeviceGetClockInfo(self._handle, _NVML_CLOCK_SM, ctypes.byref(mhz)) == 0
            and self._lib.nvmlDeviceGetPowerUsage(self._handle, ctypes.byref(mw)) == 0
            and self._reasons(self._handle, ctypes.byref(reasons)) == 0
        )
        return (float(mhz.value), mw.value / 1000.0, int(reasons.value)) if ok else None


def nvml_reader(pci_bus_id: str | None = None) -> Callable[[], Reading | None] | None:
    """A reader of the GPU with this PCI bus id ("0000:1b:00.0"; None: NVML's device 0), or
    None where NVML cannot be loaded or does not know the device."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        if pci_bus_id is not None:
            found = lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle))
        else:
            found = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))
        if found != 0:
            return None
        nvml = _Nvml(lib, handle)
        return nvml.read if nvml.read() is not None else None
    except (OSError, AttributeError):
        return None
