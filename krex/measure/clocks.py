"""Clocks and throttle reasons at the start and end of a timed loop.

``cpu``: the mean core frequency from ``scaling_cur_freq`` (or the ``cpu
MHz`` lines of ``/proc/cpuinfo``).  ``cuda``: NVML (``nvidia-ml-py``,
imported lazily) SM clock, temperature and throttle-reason bits.  Devices
that report nothing give an empty dict; :func:`throttle_reason` then finds
nothing to complain about.
"""

from __future__ import annotations

import glob
from typing import Any

CPU_DROP_REL = 0.10  # a >10 % frequency drop across the loop counts as throttling
# NVML reasons that are not throttling: GPU idle (0x1) and the application clock
# setting (0x2); every other bit (power cap, thermal, HW slowdown) is.  From nvml.h.
NVML_BENIGN_REASONS = 0x1 | 0x2


def sample(device: str) -> dict[str, Any]:
    """Clocks the device reports now; {} when it reports none."""
    kind, _, ordinal = device.partition(":")
    if kind == "cpu":
        return _cpu_clocks()
    if kind == "cuda":
        return _nvml_clocks(int(ordinal or 0))
    return {}


def _cpu_clocks() -> dict[str, Any]:
    mhz = _scaling_mhz() or _cpuinfo_mhz()
    return {"cpu_mhz": sum(mhz) / len(mhz)} if mhz else {}


def _scaling_mhz() -> list[float]:
    out = []
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_cur_freq"):
        try:
            with open(path) as f:
                out.append(int(f.read()) / 1000.0)
        except (OSError, ValueError):
            continue
    return out


def _cpuinfo_mhz() -> list[float]:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.readlines()
    except OSError:
        return []
    return [float(line.split(":")[1]) for line in lines if line.startswith("cpu MHz")]


def _nvml_clocks(index: int) -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return {
            "sm_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            "throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)),
        }
    except Exception:  # noqa: BLE001 - no driver, no package, old NVML: it reports nothing
        return {}


def throttle_reason(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    """Why the device looks throttled across the loop, or None."""
    reasons = int(end.get("throttle_reasons", 0)) & ~NVML_BENIGN_REASONS
    if reasons:
        return f"device throttle reasons 0x{reasons:x} at the end of the loop"
    for key in ("cpu_mhz", "sm_mhz"):
        if key in start and key in end and start[key] > 0:
            drop = 1.0 - end[key] / start[key]
            if drop > CPU_DROP_REL:
                return f"{key} fell {drop:.0%} ({start[key]:.0f} -> {end[key]:.0f})"
    return None
