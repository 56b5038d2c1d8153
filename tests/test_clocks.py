"""The bench's clock and power sampling (fadsl/tools/clocks.py), against a stand-in for NVML."""

from __future__ import annotations

import ctypes
import time

import pytest

from fadsl.tools import bench, clocks as clocks
from fadsl.tools.clocks import POWER_CAP, SW_THERMAL, Sampler, summarize


def test_summary_takes_the_median_clock_mean_power_and_limit_shares():
    readings = [(1980.0, 500.0, 0), (1755.0, 700.0, POWER_CAP), (1700.0, 690.0, POWER_CAP)]
    readings.append((1600.0, 710.0, SW_THERMAL))
    summary = summarize(readings)
    assert summary.samples == 4
    assert summary.sm_mhz == pytest.approx((1755.0 + 1700.0) / 2)
    assert summary.power_w == pytest.approx(650.0)
    assert summary.power_capped == pytest.approx(0.5)
    assert summary.limited == pytest.approx(0.75)
    assert summary.text() == "1728 MHz 650 W cap 50%"
    assert summarize([]) is None


def test_sampler_reads_on_its_thread_until_stopped_and_skips_failed_reads():
    calls = []

    def read():
        calls.append(time.monotonic())
        return None if len(calls) % 2 else (1800.0, 600.0, 0)

    sampler = Sampler(read, interval=0.001)
    sampler.start()
    time.sleep(0.05)
    readings = sampler.stop()
    assert len(calls) >= 4 and readings
    assert len(readings) == len(calls) // 2
    assert set(readings) == {(1800.0, 600.0, 0)}
    count = len(calls)
    time.sleep(0.01)
    assert len(calls) == count  # stopped means stopped
    assert sampler.stop() == readings  # a second stop changes nothing
    sampler.start()  # a new timing starts from no readings
    assert len(sampler.stop()) <= 1


class _FakeNvml:
    """libnvidia-ml's entry points the reader uses, writing through ctypes.byref."""

    def __init__(self, init=0, bus_ids=("00000000:1B:00.0",), newer_reasons=True):
        self.init, self.bus_ids = init, bus_ids
        self.asked = []
        if newer_reasons:
            self.nvmlDeviceGetCurrentClocksEventReasons = self._reasons

    def nvmlInit_v2(self):
        return self.init

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus_id, handle):
        self.asked.append(bus_id.decode())
        if bus_id.decode().upper() not in self.bus_ids:
            return 2  # NVML_ERROR_NOT_FOUND... any non-zero
        handle._obj.value = 42
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 7
        return 0

    def nvmlDeviceGetClockInfo(self, handle, clock, out):
        assert clock == 1  # NVML_CLOCK_SM
        out._obj.value = 1755
        return 0

    def nvmlDeviceGetPowerUsage(self, handle, out):
        out._obj.value = 687_500  # milliwatts
        return 0

    def _reasons(self, handle, out):
        out._obj.value = POWER_CAP
        return 0

    nvmlDeviceGetCurrentClocksThrottleReasons = _reasons


def test_nvml_reader_reads_clock_power_and_reasons_of_the_device_by_pci_bus_id(monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: fake)
    read = clocks.nvml_reader("00000000:1b:00.0")
    assert read is not None and fake.asked == ["00000000:1b:00.0"]
    assert read() == (1755.0, 687.5, POWER_CAP)
    # an older driver: only the ThrottleReasons spelling
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _FakeNvml(newer_reasons=False))
    assert clocks.nvml_reader("00000000:1b:00.0")() == (1755.0, 687.5, POWER_CAP)


def test_nvml_reader_is_none_without_the_library_or_the_device(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    assert clocks.nvml_reader() is None
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _FakeNvml(init=9))  # nvmlInit fails
    assert clocks.nvml_reader() is None
    monkeypatch.setattr(ctypes, "CDLL", lambda name: _FakeNvml())
    assert clocks.nvml_reader("00000000:99:00.0") is None  # not this machine's GPU


def test_bench_table_lists_each_contenders_clocks_under_the_ratios():
    clocks = {
        "fadsl": {"samples": 60, "sm_mhz": 1650.0, "power_w": 695.0, "power_capped": 0.9,
                  "limited": 0.9},
        "cudnn": {"samples": 58, "sm_mhz": 1755.0, "power_w": 640.0, "power_capped": 0.1,
                  "limited": 0.1},
    }  # fmt: skip
    result = {
        "rows": [{"seqlen": 4096, "batch": 4, "tflops": {"fadsl": 500.0, "cudnn": 440.0},
                  "clocks": clocks},
                 {"seqlen": 8192, "batch": 2, "tflops": {"fadsl": 520.0, "cudnn": 450.0}}],
        "resources": {},
    }  # fmt: skip
    lines = bench.table(result).splitlines()
    assert len(lines) == 4  # header, two rows, one clock line (the second row has none)
    assert lines[3] == (
        "   4096 clocks: fadsl 1650 MHz 695 W cap 90%, cudnn 1755 MHz 640 W cap 10%"
    )
