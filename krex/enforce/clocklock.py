"""GPU clocks locked for the daemon's lifetime (``krex serve --lock-clocks base|max``).

A kernel's time follows its SM clock, and a GPU left to itself boosts and falls back
with temperature and power: the same code reads differently from one region to the
next.  With ``--lock-clocks`` the daemon (root only: locked clocks are root's) locks
each device's clock at start and resets it when it stops:

- NVIDIA (NVML): the SM clock at its base clock (``base``: the default applications
  clock, steady under load) or its maximum (``max``: fast, but a device at its power
  or thermal limit still throttles, which ``throttled`` reports); reset with
  ``nvmlDeviceResetGpuLockedClocks``.
- AMD (amdsmi): the performance level ``STABLE_STD`` (``base``: fixed clocks for
  profiling) or ``STABLE_PEAK`` (``max``); reset to ``AUTO``.

The reset is also leased to the guardian for the daemon's lifetime, so a daemon that
crashes or is killed leaves no device locked: the guardian replays
``gpu_clocks_reset`` or ``amd_perf_level_reset`` (:mod:`krex.enforce.undo`) as it
does every other undo.

In: the devices' readers (:class:`~krex.devices.audit.NvmlDevice`,
:class:`~krex.devices.amdaudit.AmdsmiDevice`) and the guardian.  Out:
:class:`ClockLock` per device, in ``status`` and ``krex doctor``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from krex.devices.amdaudit import AmdsmiDevice
from krex.devices.audit import NvmlDevice

MODES = ("base", "max")
LEASE_BASE = 1 << 41  # + the library's index (+ AMD_LEASES): the daemon's locked clocks
AMD_LEASES = 1 << 20
AMD_LEVELS = {"base": "STABLE_STD", "max": "STABLE_PEAK"}  # amdsmi's AmdSmiDevPerfLevel
Locker = NvmlDevice | AmdsmiDevice
LEASE_S = 10 * 365 * 86400.0  # as long as the daemon lives


@dataclass(frozen=True)
class ClockLock:
    device: str  # krex's name of it (cuda:N, rocm:N)
    index: int  # the library's
    mode: str
    sm_mhz: int | None  # the clock locked (AMD: as read once its level is set)
    library: str = "nvml"  # nvml | amdsmi

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "index": self.index, "mode": self.mode,
                "sm_mhz": self.sm_mhz, "library": self.library}

    @property
    def lease(self) -> int:
        return LEASE_BASE + (AMD_LEASES if self.library == "amdsmi" else 0) + self.index

    def reset_record(self, module: Any) -> dict[str, Any]:
        """The guardian's undo: reset device ``index``'s clocks through the same library
        module (``pynvml``, ``amdsmi``) the daemon used."""
        kind = "amd_perf_level_reset" if self.library == "amdsmi" else "gpu_clocks_reset"
        return {"kind": kind, "index": self.index,
                "module_dir": os.path.dirname(os.path.abspath(module.__file__))}


def lock(name: str, device: Locker, mode: str) -> ClockLock:
    """Lock ``device``'s clock at its ``mode`` clock; raises the library's error if refused."""
    if isinstance(device, AmdsmiDevice):
        s = device.smi
        s.amdsmi_set_gpu_perf_level(device.handle, getattr(s.AmdSmiDevPerfLevel,
                                                           AMD_LEVELS[mode]))
        return ClockLock(name, device.index, mode, device.state().sm_clock_mhz, "amdsmi")
    n, h = device.nvml, device.handle
    if mode == "max":
        mhz = int(n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM))
    else:
        mhz = int(n.nvmlDeviceGetDefaultApplicationsClock(h, n.NVML_CLOCK_SM))
    n.nvmlDeviceSetGpuLockedClocks(h, mhz, mhz)
    return ClockLock(name, device.index, mode, mhz)


def reset(device: Locker) -> None:
    if isinstance(device, AmdsmiDevice):
        device.smi.amdsmi_set_gpu_perf_level(device.handle, device.smi.AmdSmiDevPerfLevel.AUTO)
    else:
        device.nvml.nvmlDeviceResetGpuLockedClocks(device.handle)


def _module(device: Locker) -> Any:
    return device.smi if isinstance(device, AmdsmiDevice) else device.nvml


class ClockLocks:
    """The daemon's locked devices: locked at start, reset at stop (and by the guardian)."""

    def __init__(self, guardian: Any) -> None:
        self.guardian = guardian
        self.locks: dict[str, tuple[ClockLock, Locker]] = {}
        self.errors: dict[str, str] = {}  # device -> why it could not be locked

    def lock_all(self, devices: dict[str, Locker], mode: str) -> None:
        for name, device in devices.items():
            try:
                locked = lock(name, device, mode)
            except Exception as exc:  # noqa: BLE001 - NVMLError_NoPermission, NotSupported...
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            self.guardian.lease(locked.lease, LEASE_S, [locked.reset_record(_module(device))])
            self.locks[name] = (locked, device)

    def reset_all(self) -> None:
        for name, (locked, device) in list(self.locks.items()):
            try:
                reset(device)
            except Exception:  # noqa: BLE001 - the guardian's lease still resets it
                continue
            self.guardian.end(locked.lease)
            del self.locks[name]

    def describe(self) -> dict[str, Any]:
        return {"locked": [locked.to_dict() for locked, _ in self.locks.values()],
                "errors": dict(self.errors)}
