"""A fake NVML (``pynvml``-shaped) for tests: the device's state lives in a JSON file.

A test puts this directory on ``PYTHONPATH`` (the daemon imports it as ``pynvml``) and
``$KREX_FAKE_NVML`` names the state file; every call reads the file, so a test or a
job changes the device's state with :func:`update`, even in the middle of a region.
State keys: ``processes`` (``[{"pid", "used_mib", "kind": compute|graphics}]``),
``sm_clock_mhz``, ``mem_clock_mhz``, ``temperature_c``, ``power_mw``,
``throttle_reasons``, ``utilization_pct``, ``mig_mode`` (current: 0 off, 1 on),
``mps_processes`` (pids of MPS clients), ``max_sm_clock_mhz``, ``base_sm_clock_mhz``,
``locked_clocks`` (``[min, max]`` MHz while locked, else None), ``unsupported`` (calls
that raise).
"""

from __future__ import annotations

import os
import types
from typing import Any

from fakestate import StateFile

STATE_ENV = "KREX_FAKE_NVML"
NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0
DEFAULT = {"processes": [], "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "temperature_c": 45,
           "power_mw": 120000, "throttle_reasons": 0x1, "utilization_pct": 0, "mig_mode": 0,
           "mps_processes": [], "max_sm_clock_mhz": 1980, "base_sm_clock_mhz": 1590,
           "locked_clocks": None, "unsupported": []}


class NVMLError(Exception):
    pass


_STATE = StateFile(STATE_ENV, DEFAULT)
load, update = _STATE.load, _STATE.update


def _get(key: str) -> Any:
    state = load()
    if key in state["unsupported"]:
        raise NVMLError("Not Supported")
    return state[key]


def nvmlInit() -> None:
    if not os.environ.get(STATE_ENV):
        raise NVMLError("NVML Shared Library Not Found")


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return 0  # it stands for fakegpu:0 (--fakegpu-nvml 0): discovery finds no cuda device


def nvmlDeviceGetHandleByIndex(index: int) -> str:
    return f"gpu{index}"


def nvmlDeviceGetClockInfo(handle: str, kind: int) -> int:
    return _get("sm_clock_mhz" if kind == NVML_CLOCK_SM else "mem_clock_mhz")


def nvmlDeviceGetTemperature(handle: str, kind: int) -> int:
    return _get("temperature_c")


def nvmlDeviceGetPowerUsage(handle: str) -> int:
    return _get("power_mw")


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: str) -> int:
    return _get("throttle_reasons")


def nvmlDeviceGetUtilizationRates(handle: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(gpu=_get("utilization_pct"), memory=0)


def _processes(kind: str) -> list[types.SimpleNamespace]:
    return [types.SimpleNamespace(pid=p["pid"], usedGpuMemory=p.get("used_mib", 0) * 2**20)
            for p in _get("processes") if p.get("kind", "compute") == kind]


def nvmlDeviceGetComputeRunningProcesses(handle: str) -> list[types.SimpleNamespace]:
    return _processes("compute")


def nvmlDeviceGetGraphicsRunningProcesses(handle: str) -> list[types.SimpleNamespace]:
    return _processes("graphics")


def nvmlDeviceGetMigMode(handle: str) -> list[int]:
    return [_get("mig_mode"), _get("mig_mode")]  # current, pending


def nvmlDeviceGetMPSComputeRunningProcesses(handle: str) -> list[types.SimpleNamespace]:
    return [types.SimpleNamespace(pid=pid, usedGpuMemory=0) for pid in _get("mps_processes")]


def nvmlDeviceGetMaxClockInfo(handle: str, kind: int) -> int:
    return _get("max_sm_clock_mhz")


def nvmlDeviceGetDefaultApplicationsClock(handle: str, kind: int) -> int:
    return _get("base_sm_clock_mhz")


def nvmlDeviceSetGpuLockedClocks(handle: str, low: int, high: int) -> None:
    _get("locked_clocks")  # raises where "unsupported" says so
    update(locked_clocks=[low, high])


def nvmlDeviceResetGpuLockedClocks(handle: str) -> None:
    update(locked_clocks=None)
