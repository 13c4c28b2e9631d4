"""The NVML audit's logic, on a stand-in for NVML (no GPU here: the only double)."""

import sys
import types

from krex.devices.audit import nvml_audit


class _Proc:
    def __init__(self, pid):
        self.pid = pid


def fake_nvml(pids_over_time):
    calls = iter(pids_over_time)
    mod = types.ModuleType("pynvml")
    mod.NVML_CLOCK_SM, mod.NVML_TEMPERATURE_GPU = 1, 0
    mod.nvmlInit = lambda: None
    mod.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87)
    mod.nvmlDeviceGetClockInfo = lambda h, kind: 1980
    mod.nvmlDeviceGetTemperature = lambda h, kind: 51

    def throttle(h):
        raise RuntimeError("not supported")

    mod.nvmlDeviceGetCurrentClocksThrottleReasons = throttle
    mod.nvmlDeviceGetComputeRunningProcesses = lambda h: [_Proc(p) for p in next(calls)]
    return mod


def test_foreign_processes_are_those_outside_the_holder(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([[10, 11, 99], [10, 77]]))
    audit = nvml_audit("cuda:0")
    audit.begin({10, 11})
    report = audit.finish()
    assert report.source == "nvml" and report.foreign_pids == [77, 99]
    assert report.start["utilization_pct"] == 87 and report.end["sm_clock_mhz"] == 1980
    # A query the device does not support is recorded, the rest still reported.
    assert report.start["throttle_reasons"] is None
    assert any("throttle_reasons" in e for e in report.start["errors"])


def test_no_audit_without_nvml_or_on_other_devices(monkeypatch):
    assert nvml_audit("cpu") is None
    assert nvml_audit("fakegpu:0") is None
    broken = types.ModuleType("pynvml")

    def fail():
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert nvml_audit("cuda:0") is None
