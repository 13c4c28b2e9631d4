"""Audit of foreign device activity during a region (NVIDIA, through NVML).

NVML samples utilisation over 1/6 s to 1 s, so this is evidence for the region
report, never a gate: at region start and end it records the processes using
the GPU (those outside the holder's job are *foreign*), utilisation, clocks,
temperature and throttle reasons.  Without NVML (no driver, no ``cuda``
extra) there is no audit and the report says so.
"""

from __future__ import annotations

from typing import Any

from krex.protocol.report import DeviceAudit


def nvml_audit(device: str) -> NvmlAudit | None:
    """An audit for ``cuda:N`` when NVML answers here, else None."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(index or 0))
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...: no audit
        return None
    return NvmlAudit(pynvml, handle)


class NvmlAudit:
    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self.start: dict[str, Any] = {}

    def sample(self, holder_pids: set[int]) -> dict[str, Any]:
        n, h = self.nvml, self.handle
        out: dict[str, Any] = {}
        for key, call in (("utilization_pct", lambda: n.nvmlDeviceGetUtilizationRates(h).gpu),
                          ("sm_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                          ("temperature_c", lambda: n.nvmlDeviceGetTemperature(
                              h, n.NVML_TEMPERATURE_GPU)),
                          ("throttle_reasons", lambda: int(
                              n.nvmlDeviceGetCurrentClocksThrottleReasons(h))),
                          ("foreign_pids", lambda: sorted(
                              p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)
                              if p.pid not in holder_pids))):
            try:
                out[key] = call()
            except Exception as exc:  # noqa: BLE001 - one missing query must not hide the others
                out[key] = None
                out.setdefault("errors", []).append(f"{key}: {exc}")
        return out

    def begin(self, holder_pids: set[int]) -> None:
        self.holder_pids = holder_pids
        self.start = self.sample(holder_pids)

    def finish(self) -> DeviceAudit:
        end = self.sample(self.holder_pids)
        foreign = sorted(set(self.start.get("foreign_pids") or []) |
                         set(end.get("foreign_pids") or []))
        return DeviceAudit("nvml", self.start, end, foreign)
