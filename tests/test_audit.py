"""NVML readings (devices/audit.py) and their judging (enforce/nvmlwatch.py) on the fake
NVML of tests/fakenvml (no GPU here: the library boundary is the only double)."""

import importlib
import os
import sys
import types

import pytest
from helpers import REPO

from krex.devices.audit import nvml_device, throttle_names
from krex.enforce.nvmlwatch import Managed, NvmlWatch


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("KREX_FAKE_NVML", str(tmp_path / "nvml.json"))
    monkeypatch.syspath_prepend(os.path.join(REPO, "tests", "fakenvml"))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    return importlib.import_module("pynvml")


class _Job:
    def __init__(self, *pids):
        self.pids = set(pids)

    def contains(self, pid):
        return pid in self.pids


def test_a_reading_has_the_state_and_every_process(fake):
    fake.update(processes=[{"pid": os.getpid(), "used_mib": 10},
                           {"pid": os.getpid(), "kind": "graphics"}, {"pid": 2**22 + 7}],
                throttle_reasons=0x1 | 0x4, unsupported=["power_mw"])
    reading = nvml_device("cuda:0").read()
    state = reading.state.to_dict()
    assert state["sm_clock_mhz"] == 1980 and state["mem_clock_mhz"] == 2619
    assert state["throttle_names"] == ["gpu_idle", "sw_power_cap"]
    assert reading.state.throttling == 0x4
    # a query the device does not support is named, the rest still read
    assert state["power_w"] is None and any("power_w" in e for e in state["errors"])
    me, gone = reading.processes
    assert me.kinds == ("compute", "graphics") and me.used_memory_mib == 10.0
    with open("/proc/self/cmdline", "rb") as f:  # this process (an xdist worker's too)
        mine = f.read().replace(b"\0", b" ").decode().strip()
    assert me.uid == os.getuid() and me.command and mine.startswith(me.command[:40])
    assert gone.uid is None and gone.command is None  # no such process here


def test_another_users_command_is_not_shown_to_the_holder(fake):
    fake.update(processes=[{"pid": os.getpid()}])
    (proc,) = nvml_device("cuda:0").read(viewer_uid=os.getuid() + 4321).processes
    assert proc.uid == os.getuid() and proc.command is None


def test_foreign_processes_are_those_no_job_of_the_daemon_holds(fake):
    fake.update(processes=[{"pid": 10}, {"pid": 11}, {"pid": 99}])
    watch = NvmlWatch.begin(nvml_device("cuda:0"), Managed.of([_Job(10), _Job(11)], [0]))
    fake.update(processes=[{"pid": 10}, {"pid": 77}])
    audit, reasons = watch.finish()
    assert audit.source == "nvml" and audit.foreign_pids == [77, 99]
    (reason,) = reasons
    assert {p["pid"]: p["seen_at"] for p in reason.evidence["processes"]} == {
        77: ["release"], 99: ["grant"]}
    # control: only what the daemon manages (its jobs and its own pids)
    fake.update(processes=[{"pid": 10}, {"pid": 11}])
    watch = NvmlWatch.begin(nvml_device("cuda:0"), Managed.of([_Job(10)], [11]))
    assert watch.finish()[1] == []


def test_no_device_without_nvml_or_on_other_devices(monkeypatch, fake):
    assert nvml_device("cpu") is None
    assert nvml_device("fakegpu:0") is None  # only with the daemon's --fakegpu-nvml hook
    assert nvml_device("fakegpu:0", fakegpu_nvml=0) is not None
    broken = types.ModuleType("pynvml")

    def fail():
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert nvml_device("cuda:0") is None


def test_throttle_names_name_unknown_bits():
    assert throttle_names(0x40 | 0x400) == ["hw_thermal_slowdown", "0x400"]


def test_a_clock_below_the_fraction_of_the_grants_is_throttling():
    from krex.devices.audit import DeviceState
    from krex.enforce.nvmlwatch import throttle_reason

    grant = DeviceState(sm_clock_mhz=2000, throttle_reasons=0x1)
    assert throttle_reason(grant, DeviceState(sm_clock_mhz=1850), 0.9) is None  # 92.5 %
    found = throttle_reason(grant, DeviceState(sm_clock_mhz=1750), 0.9)
    assert found is not None and found.evidence["clock_ratio"] == 0.875
    assert throttle_reason(grant, DeviceState(sm_clock_mhz=100), 0.0) is None  # 0: off
    # a throttle reason at grant counts too (the region ran throttled from its start);
    # an unreadable clock compares nothing
    hot = DeviceState(sm_clock_mhz=None, throttle_reasons=0x40)
    found = throttle_reason(hot, DeviceState(), 0.9)
    assert found is not None and found.evidence["throttling_at_grant"] == ["hw_thermal_slowdown"]


def test_throttle_reasons_fall_back_to_the_older_call(fake, monkeypatch):
    """nvidia-ml-py 12.5+ has ``...ClocksEventReasons``; a driver without that symbol
    raises, and the older ``...ClocksThrottleReasons`` answers."""
    fake.update(throttle_reasons=0x8)

    def missing(handle):
        raise fake.NVMLError("Function Not Found")

    monkeypatch.setattr(fake, "nvmlDeviceGetCurrentClocksEventReasons", missing, raising=False)
    state = nvml_device("cuda:0").read().state
    assert state.throttle_reasons == 0x8 and not state.errors


def test_sharing_is_read_and_a_device_that_cannot_do_mig_is_not_shared(fake):
    """MIG on and an MPS client are read as sharing; a device whose MIG and MPS queries
    are not supported (most are not) reads as not shared, with no error in its state."""
    fake.update(mig_mode=1, mps_processes=[4242])
    assert [(m.mode, m.pids) for m in nvml_device("cuda:0").read().sharing] == [
        ("mig", ()), ("mps", (4242,))]
    fake.update(mig_mode=0, mps_processes=[])
    assert nvml_device("cuda:0").read().sharing == []
    fake.update(mig_mode=1, mps_processes=[4242], unsupported=["mig_mode", "mps_processes"])
    reading = nvml_device("cuda:0").read()
    assert reading.sharing == [] and not reading.state.errors


def test_doctor_shows_each_devices_sharing_and_contexts(fake):
    """``krex doctor`` asks NVML for every cuda device: MPS or MIG, the processes with a
    context and clocks the running daemon did not lock fail their check, with the fix.
    Control: an idle, unshared device with locked clocks passes."""
    from krex.enforce.doctor import device_checks

    locked = [{"device": "cuda:0", "index": 0, "mode": "base", "sm_mhz": 1590}]
    quiet = device_checks(["cuda:0"], locked=locked)
    fake.update(mig_mode=1, processes=[{"pid": os.getpid(), "used_mib": 10}])
    busy = device_checks(["cuda:0"])
    assert [(c["check"], c["ok"]) for c in quiet] == [("cuda:0: not shared", True),
                                                       ("cuda:0: contexts", True),
                                                       ("cuda:0: clocks locked", True)]
    assert "1590 MHz (base)" in quiet[2]["detail"]
    shared, contexts, clocks = busy
    assert not clocks["ok"] and "--lock-clocks" in clocks["advice"]
    assert not shared["ok"] and "MIG" in shared["detail"] and "-mig 0" in shared["advice"]
    assert not contexts["ok"] and str(os.getpid()) in contexts["detail"]
    assert "krex run" in contexts["advice"]
