"""What an AMD device says about itself, through amdsmi: the same readings as NVML's.

The daemon reads an AMD device (``rocm:N``) as it reads an NVIDIA one
(:mod:`krex.devices.audit`), so a region's ``device_audit`` and its reasons
(``foreign_device_process``, ``throttled``) have one shape on both: the GFX and memory
clocks, the hotspot temperature, the socket power, the processes with memory on the
device (``amdsmi_get_gpu_process_list``: pid, name, memory; each one's user and
command read from ``/proc`` by the daemon), and the active violations
(``amdsmi_get_violation_status``), written with NVML's throttle bits so one judge
reads both:

==========================  ===========================  =====
amdsmi                      NVML name                    bit
==========================  ===========================  =====
``active_ppt_pwr``          ``sw_power_cap``             0x4
``active_prochot_thrm``     ``hw_slowdown``              0x8
``active_socket_thrm``      ``sw_thermal_slowdown``      0x20
``active_hbm_thrm``         ``hw_thermal_slowdown``      0x40
``active_vr_thrm``          ``hw_power_brake_slowdown``  0x80
==========================  ===========================  =====

Sharing (compute partitions) is not read yet.  In: ``rocm:N`` (or ``fakegpu:N`` with
the daemon's test hook ``--fakegpu-amdsmi N``).  Out: :class:`AmdsmiDevice`, whose
reads never raise (a query the device does not answer is named in ``errors``).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

from krex.devices.audit import DeviceProcess, DeviceReader, DeviceState, described

VIOLATION_BITS = {"active_ppt_pwr": 0x4, "active_prochot_thrm": 0x8,
                  "active_socket_thrm": 0x20, "active_hbm_thrm": 0x40, "active_vr_thrm": 0x80}


def amdsmi_device(device: str, fakegpu_amdsmi: int | None = None) -> AmdsmiDevice | None:
    """The amdsmi handle of ``rocm:N`` (or ``fakegpu:N`` with the test hook: amdsmi's
    device N, whatever module ``amdsmi`` is) when amdsmi answers, else None."""
    kind, _, index = device.partition(":")
    if kind == "fakegpu" and fakegpu_amdsmi is not None:
        index = str(fakegpu_amdsmi)
    elif kind != "rocm":
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # amdsmi prints on import
            import amdsmi

            amdsmi.amdsmi_init()
            handle = amdsmi.amdsmi_get_processor_handles()[int(index or 0)]
    except Exception:  # noqa: BLE001 - KeyError, AmdSmiLibraryException, IndexError: no audit
        return None
    return AmdsmiDevice(amdsmi, handle, int(index or 0))


class AmdsmiDevice(DeviceReader):
    """One AMD device's amdsmi handle, read like :class:`~krex.devices.audit.NvmlDevice`."""

    source = "amdsmi"

    def __init__(self, smi: Any, handle: Any, index: int = 0) -> None:
        self.smi = smi
        self.handle = handle
        self.index = index

    def _state(self, errors: list[str]) -> DeviceState:
        s, h = self.smi, self.handle
        gfx = self._ask("sm_clock_mhz", lambda: s.amdsmi_get_clock_info(h, s.AmdSmiClkType.GFX),
                        errors)
        mem = self._ask("mem_clock_mhz", lambda: s.amdsmi_get_clock_info(h, s.AmdSmiClkType.MEM),
                        errors)
        power = self._ask("power_w", lambda: s.amdsmi_get_power_info(h), errors)
        violations = self._ask("throttle_reasons", lambda: s.amdsmi_get_violation_status(h),
                               errors)
        return DeviceState(
            sm_clock_mhz=_number(gfx, "clk"), mem_clock_mhz=_number(mem, "clk"),
            temperature_c=self._ask("temperature_c", lambda: s.amdsmi_get_temp_metric(
                h, s.AmdSmiTemperatureType.HOTSPOT, s.AmdSmiTemperatureMetric.CURRENT), errors),
            power_w=_number(power, "current_socket_power"),
            throttle_reasons=None if violations is None else sum(
                bit for key, bit in VIOLATION_BITS.items() if violations.get(key) is True))

    def _processes(self, errors: list[str], viewer_uid: int | None) -> list[DeviceProcess]:
        listed = self._ask("compute_processes",
                           lambda: self.smi.amdsmi_get_gpu_process_list(self.handle), errors)
        processes = []
        for info in listed or []:
            mem = info.get("mem")
            mib = round(int(mem) / 2**20, 1) if isinstance(mem, int) else None
            processes.append(described(int(info["pid"]), ("compute",), mib, viewer_uid))
        return sorted(processes, key=lambda p: p.pid)


def _number(info: Any, key: str) -> Any:
    """A field of an amdsmi dict, None where it says ``N/A`` (or the dict is missing)."""
    value = info.get(key) if isinstance(info, dict) else None
    return value if isinstance(value, int | float) else None
