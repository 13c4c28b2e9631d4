"""A fake amdsmi (the names and shapes of amdsmi 7's Python interface) for tests.

A test puts this directory on ``PYTHONPATH`` (the daemon imports it as ``amdsmi``) and
``$KREX_FAKE_AMDSMI`` names the state file; every call reads it, so a test or a job
changes the device's state with :func:`update`, even inside a region.  State keys:
``processes`` (``[{"pid", "mem"}]``, bytes), ``gfx_mhz``, ``mem_mhz``, ``hotspot_c``,
``power_w``, ``violations`` (names of amdsmi's ``active_*`` flags set), ``perf_level``
(the last ``amdsmi_set_gpu_perf_level``'s name; ``STABLE_STD`` reads ``std_mhz`` as
its GFX clock), ``unsupported`` (functions that raise).
"""

from __future__ import annotations

import os
import sys
from enum import IntEnum
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fakenvml"))
from fakestate import StateFile  # tests/fakenvml's, found beside this folder

STATE_ENV = "KREX_FAKE_AMDSMI"
DEFAULT = {"processes": [], "gfx_mhz": 2100, "mem_mhz": 1300, "hotspot_c": 50, "power_w": 300,
           "violations": [], "unsupported": [], "perf_level": "AUTO", "std_mhz": 1700}
ACTIVE = ("active_prochot_thrm", "active_ppt_pwr", "active_socket_thrm", "active_vr_thrm",
          "active_hbm_thrm")


class AmdSmiLibraryException(Exception):
    pass


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    MEM = 4


class AmdSmiDevPerfLevel(IntEnum):
    AUTO = 0
    LOW = 1
    HIGH = 2
    MANUAL = 3
    STABLE_STD = 4
    STABLE_PEAK = 5
    STABLE_MIN_MCLK = 6
    STABLE_MIN_SCLK = 7
    DETERMINISM = 8


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0


_STATE = StateFile(STATE_ENV, DEFAULT)
load, update = _STATE.load, _STATE.update


def _state(call: str) -> dict[str, Any]:
    state = load()
    if call in state["unsupported"]:
        raise AmdSmiLibraryException(f"{call}: AMDSMI_STATUS_NOT_SUPPORTED")
    return state


def amdsmi_init(flag: int = 0) -> None:
    if not os.environ.get(STATE_ENV):
        raise AmdSmiLibraryException("libamd_smi.so: cannot open shared object file")


def amdsmi_get_processor_handles() -> list[str]:
    return ["gpu0"]


def amdsmi_get_clock_info(handle: str, clock_type: AmdSmiClkType) -> dict[str, Any]:
    state = _state("amdsmi_get_clock_info")
    gfx = state["std_mhz"] if state["perf_level"] == "STABLE_STD" else state["gfx_mhz"]
    mhz = state["mem_mhz"] if clock_type == AmdSmiClkType.MEM else gfx
    return {"clk": mhz, "min_clk": 500, "max_clk": 2100, "clk_locked": False,
            "clk_deep_sleep": 0}


def amdsmi_set_gpu_perf_level(handle: str, level: AmdSmiDevPerfLevel) -> None:
    _state("amdsmi_set_gpu_perf_level")
    update(perf_level=AmdSmiDevPerfLevel(level).name)


def amdsmi_get_temp_metric(handle: str, sensor: AmdSmiTemperatureType,
                           metric: AmdSmiTemperatureMetric) -> int:
    return _state("amdsmi_get_temp_metric")["hotspot_c"]


def amdsmi_get_power_info(handle: str) -> dict[str, Any]:
    watts = _state("amdsmi_get_power_info")["power_w"]
    return {"socket_power": watts, "current_socket_power": watts, "average_socket_power": watts,
            "gfx_voltage": "N/A", "soc_voltage": "N/A", "mem_voltage": "N/A",
            "power_limit": 750}


def amdsmi_get_violation_status(handle: str) -> dict[str, Any]:
    on = set(_state("amdsmi_get_violation_status")["violations"])
    return {name: name in on for name in ACTIVE}


def amdsmi_get_gpu_process_list(handle: str) -> list[dict[str, Any]]:
    return [{"name": "N/A", "pid": p["pid"], "mem": p.get("mem", 0),
             "engine_usage": {"gfx": 0, "enc": 0},
             "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": p.get("mem", 0)},
             "cu_occupancy": 0}
            for p in _state("amdsmi_get_gpu_process_list")["processes"]]
