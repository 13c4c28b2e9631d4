"""What an NVIDIA device says about itself, through NVML: its state, processes, sharing.

NVML samples utilisation over 1/6 s to 1 s, so this is evidence for the region
report, never a gate.  The daemon reads it at a region's grant and at its
release (:mod:`krex.enforce.nvmlwatch` judges the two readings): the device's
clocks, temperature, power and throttle reasons (:class:`DeviceState`), and the
processes with a compute or graphics context on it (:class:`DeviceProcess`),
with each one's user and command read from ``/proc`` by the daemon, and whether
MIG or an MPS server shares it (:class:`Sharing`).  Without
NVML (no driver, no ``cuda`` extra) there is no reading and the report says so.

In: a device name (``cuda:N``; or ``fakegpu:N`` mapped to NVML device N by the
daemon's test hook ``--fakegpu-nvml``).  Out: :class:`NvmlDevice`, whose reads
never raise: a query the device does not support is named in ``errors``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# Throttle (clock event) reasons from nvml.h.  Idle and the application clock setting
# are not throttling; every other bit is (krex.measure.clocks agrees).
THROTTLE_NAMES = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
                  0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
                  0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
                  0x100: "display_clock_setting"}
BENIGN_THROTTLE = 0x1 | 0x2
COMMAND_CHARS = 200  # a command line in the evidence, at most
MPS_SERVER_COMM = "nvidia-cuda-mps"  # nvidia-cuda-mps-server's comm (15 characters kept)
MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE


def throttle_names(bits: int) -> list[str]:
    """The names of the set reason bits (``0x..`` for bits nvml.h did not name then)."""
    return [THROTTLE_NAMES.get(1 << i, f"0x{1 << i:x}") for i in range(bits.bit_length())
            if bits >> i & 1]


@dataclass(frozen=True)
class DeviceState:
    """The device's state at one moment (None: the device did not say)."""

    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    throttle_reasons: int | None = None  # NVML's bit mask
    utilization_pct: int | None = None
    errors: tuple[str, ...] = ()  # queries that failed, "what: why"

    @property
    def throttling(self) -> int:
        """The reason bits that are throttling (idle and the clock setting are not)."""
        return (self.throttle_reasons or 0) & ~BENIGN_THROTTLE

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in vars(self).items() if k != "errors"}
        if self.throttle_reasons is not None:
            out["throttle_names"] = throttle_names(self.throttle_reasons)
        if self.errors:
            out["errors"] = list(self.errors)
        return out


@dataclass(frozen=True)
class DeviceProcess:
    """A process with a context on the device, as NVML lists it."""

    pid: int
    kinds: tuple[str, ...]  # compute, graphics
    used_memory_mib: float | None  # None: NVML does not say (no permission, MIG, ...)
    uid: int | None = None  # from /proc, read by the daemon (None: gone or hidden)
    command: str | None = None  # ... None unless the viewer may see it

    def to_dict(self, seen_at: list[str]) -> dict[str, Any]:
        return {"pid": self.pid, "uid": self.uid, "command": self.command,
                "used_memory_mib": self.used_memory_mib, "kinds": list(self.kinds),
                "seen_at": seen_at}


@dataclass(frozen=True)
class Sharing:
    """A way the device is shared with contexts krex cannot gate or drain: ``mig``
    (MIG is on: other GPU instances share its memory system, power and clocks) or
    ``mps`` (an MPS server holds the device: its clients' kernels share the SMs)."""

    mode: str  # mig | mps
    detail: str  # one line, for people
    pids: tuple[int, ...] = ()  # the MPS server and its clients, where NVML names them

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "detail": self.detail, "pids": list(self.pids)}


@dataclass
class NvmlReading:
    """The device's state, processes and sharing modes, read together."""

    state: DeviceState
    processes: list[DeviceProcess] = field(default_factory=list)
    sharing: list[Sharing] = field(default_factory=list)


class DeviceReader:
    """A device's management library, read by the daemon: NVML (:class:`NvmlDevice`) or
    amdsmi (:class:`krex.devices.amdaudit.AmdsmiDevice`).  Reads never raise: a query
    the device does not answer is named in the state's ``errors``, the rest still read."""

    source = ""  # the report's device_audit.source: nvml | amdsmi
    index = 0  # the library's index of the device

    def state(self) -> DeviceState:
        """The device's state alone (clocks, temperature, power, throttle reasons): what
        :mod:`krex.devices.sampler` reads between a region's grant and release."""
        errors: list[str] = []
        return _with_errors(self._state(errors), errors)

    def read(self, viewer_uid: int | None = None) -> NvmlReading:
        """State, processes (commands only where ``viewer_uid`` may see them), sharing."""
        errors: list[str] = []
        state = self._state(errors)
        processes = self._processes(errors, viewer_uid)
        return NvmlReading(_with_errors(state, errors), processes, self._sharing(processes))

    def _ask(self, what: str, call: Any, errors: list[str]) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - one missing query must not hide the others
            errors.append(f"{what}: {exc}")
            return None

    def _state(self, errors: list[str]) -> DeviceState:
        raise NotImplementedError

    def _processes(self, errors: list[str], viewer_uid: int | None) -> list[DeviceProcess]:
        raise NotImplementedError

    def _sharing(self, processes: list[DeviceProcess]) -> list[Sharing]:
        return []


def _with_errors(state: DeviceState, errors: list[str]) -> DeviceState:
    return DeviceState(**{**vars(state), "errors": tuple(errors)}) if errors else state


def nvml_device(device: str, fakegpu_nvml: int | None = None) -> NvmlDevice | None:
    """The NVML device for ``cuda:N`` (or ``fakegpu:N`` with the ``--fakegpu-nvml`` test
    hook: NVML device N, whatever module ``pynvml`` is) when NVML answers, else None."""
    kind, _, index = device.partition(":")
    if kind == "fakegpu" and fakegpu_nvml is not None:
        index = str(fakegpu_nvml)
    elif kind != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(index or 0))
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, ...: no audit
        return None
    return NvmlDevice(pynvml, handle, int(index or 0))


class NvmlDevice(DeviceReader):
    """One device's NVML handle; :meth:`read` gives its state, processes, sharing now."""

    source = "nvml"

    def __init__(self, nvml: Any, handle: Any, index: int = 0) -> None:
        self.nvml = nvml
        self.handle = handle
        self.index = index

    def _state(self, errors: list[str]) -> DeviceState:
        n, h = self.nvml, self.handle
        power_mw = self._ask("power_w", lambda: n.nvmlDeviceGetPowerUsage(h), errors)
        util = self._ask("utilization_pct", lambda: n.nvmlDeviceGetUtilizationRates(h), errors)
        return DeviceState(
            sm_clock_mhz=self._ask("sm_clock_mhz",
                                   lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM), errors),
            mem_clock_mhz=self._ask("mem_clock_mhz",
                                    lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM), errors),
            temperature_c=self._ask("temperature_c", lambda: n.nvmlDeviceGetTemperature(
                h, n.NVML_TEMPERATURE_GPU), errors),
            power_w=None if power_mw is None else round(power_mw / 1000.0, 1),
            throttle_reasons=self._ask("throttle_reasons", self._throttle, errors),
            utilization_pct=None if util is None else util.gpu)

    def _throttle(self) -> int:
        """The clock event (throttle) reasons: NVML 12.5+ names the call ``...EventReasons``;
        older bindings, and drivers without that symbol, only ``...ThrottleReasons``."""
        n = self.nvml
        newer = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if newer is not None:
            try:
                return int(newer(self.handle))
            except Exception:  # noqa: BLE001, S110 - NVMLError_FunctionNotFound: an older driver
                pass
        return int(n.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle))

    def _processes(self, errors: list[str], viewer_uid: int | None) -> list[DeviceProcess]:
        n, h = self.nvml, self.handle
        found: dict[int, tuple[list[str], float | None]] = {}
        for kind, call in (("compute", n.nvmlDeviceGetComputeRunningProcesses),
                           ("graphics", n.nvmlDeviceGetGraphicsRunningProcesses)):
            for info in self._ask(f"{kind}_processes", lambda c=call: c(h), errors) or []:
                kinds, mib = found.setdefault(int(info.pid), ([], _mib(info)))
                kinds.append(kind)
        return [described(pid, tuple(kinds), mib, viewer_uid)
                for pid, (kinds, mib) in sorted(found.items())]


    def _sharing(self, processes: list[DeviceProcess]) -> list[Sharing]:
        """MIG on, or an MPS server on the device.  A device that cannot do MIG, or
        bindings without the MPS query, answer with an error: that is not sharing (and
        not an error of the reading: most devices cannot)."""
        n, h, out = self.nvml, self.handle, []
        try:
            current = n.nvmlDeviceGetMigMode(h)[0]
        except Exception:  # noqa: BLE001 - NVMLError_NotSupported, no such call: not MIG
            current = None
        if current == MIG_ENABLED:
            out.append(Sharing("mig", "MIG is on: other GPU instances share the device's "
                               "memory system, power and clocks"))
        servers = [p.pid for p in processes if _comm(p.pid) == MPS_SERVER_COMM]
        try:
            clients = [int(i.pid) for i in n.nvmlDeviceGetMPSComputeRunningProcesses(h)]
        except Exception:  # noqa: BLE001 - bindings or a driver without the query
            clients = []
        if servers or clients:
            out.append(Sharing("mps", "an MPS server holds the device: its clients' kernels "
                               "share the SMs", tuple(sorted(set(servers + clients)))))
        return out


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _mib(info: Any) -> float | None:
    used = getattr(info, "usedGpuMemory", None)
    if used is None or int(used) >= 2**63 - 1:  # NVML_VALUE_NOT_AVAILABLE
        return None
    return round(int(used) / 2**20, 1)


def described(pid: int, kinds: tuple[str, ...], mib: float | None,
               viewer_uid: int | None) -> DeviceProcess:
    """The process with its user, and its command where ``viewer_uid`` may see it (the
    same user, or root; None: the daemon's own view)."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return DeviceProcess(pid, kinds, mib)  # gone, or in another pid namespace
    command = None
    if viewer_uid in (None, 0, uid):
        command = _command(pid)
    return DeviceProcess(pid, kinds, mib, uid, command)


def _command(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(COMMAND_CHARS * 4)
    except OSError:
        return None
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    return text[:COMMAND_CHARS] or None
