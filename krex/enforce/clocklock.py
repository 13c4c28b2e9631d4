"""GPU clocks locked for the daemon's lifetime (``krex serve --lock-clocks base|max``).

A kernel's time follows its SM clock, and a GPU left to itself boosts and falls back
with temperature and power: the same code reads differently from one region to the
next.  With ``--lock-clocks`` the daemon (root only: NVML's locked clocks are root's)
locks each NVIDIA device's SM clock at start, to its base clock (``base``: the default
applications clock, steady under load) or its maximum (``max``: fast, but a device at
its power or thermal limit still throttles, which ``throttled`` reports), and resets
it when it stops.  The reset is also leased to the guardian for the daemon's
lifetime, so a daemon that crashes or is killed leaves no device locked: the guardian
replays ``gpu_clocks_reset`` (:mod:`krex.enforce.undo`) as it does every other undo.

In: the devices' NVML handles (:class:`~krex.devices.audit.NvmlDevice`) and the
guardian.  Out: :class:`ClockLock` per device, in ``status`` and ``krex doctor``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from krex.devices.audit import NvmlDevice

MODES = ("base", "max")
LEASE_BASE = 1 << 41  # + the NVML index: the daemon's leases of locked clocks
LEASE_S = 10 * 365 * 86400.0  # as long as the daemon lives


@dataclass(frozen=True)
class ClockLock:
    device: str  # krex's name of it (cuda:N)
    index: int  # NVML's
    mode: str
    sm_mhz: int

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "index": self.index, "mode": self.mode,
                "sm_mhz": self.sm_mhz}

    def reset_record(self, nvml: Any) -> dict[str, Any]:
        """The guardian's undo: reset the locked clocks of NVML device ``index`` through
        the same ``pynvml`` module the daemon used."""
        return {"kind": "gpu_clocks_reset", "index": self.index,
                "module_dir": os.path.dirname(os.path.abspath(nvml.__file__))}


def lock(name: str, device: NvmlDevice, mode: str) -> ClockLock:
    """Lock ``device``'s SM clock at its ``mode`` clock; raises NVML's error if refused."""
    n, h = device.nvml, device.handle
    if mode == "max":
        mhz = int(n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM))
    else:
        mhz = int(n.nvmlDeviceGetDefaultApplicationsClock(h, n.NVML_CLOCK_SM))
    n.nvmlDeviceSetGpuLockedClocks(h, mhz, mhz)
    return ClockLock(name, device.index, mode, mhz)


def reset(device: NvmlDevice) -> None:
    device.nvml.nvmlDeviceResetGpuLockedClocks(device.handle)


class ClockLocks:
    """The daemon's locked devices: locked at start, reset at stop (and by the guardian)."""

    def __init__(self, guardian: Any) -> None:
        self.guardian = guardian
        self.locks: dict[str, tuple[ClockLock, NvmlDevice]] = {}
        self.errors: dict[str, str] = {}  # device -> why it could not be locked

    def lock_all(self, devices: dict[str, NvmlDevice], mode: str) -> None:
        for name, device in devices.items():
            try:
                locked = lock(name, device, mode)
            except Exception as exc:  # noqa: BLE001 - NVMLError_NoPermission, NotSupported...
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            self.guardian.lease(LEASE_BASE + locked.index, LEASE_S,
                                [locked.reset_record(device.nvml)])
            self.locks[name] = (locked, device)

    def reset_all(self) -> None:
        for name, (locked, device) in list(self.locks.items()):
            try:
                reset(device)
            except Exception:  # noqa: BLE001 - the guardian's lease still resets it
                continue
            self.guardian.end(LEASE_BASE + locked.index)
            del self.locks[name]

    def describe(self) -> dict[str, Any]:
        return {"locked": [locked.to_dict() for locked, _ in self.locks.values()],
                "errors": dict(self.errors)}
