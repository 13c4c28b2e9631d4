"""The amdsmi account of a region (devices/amdaudit.py) through a real daemon on fakegpu.

No AMD GPU here: the daemon's test hook ``--fakegpu-amdsmi 0`` audits ``fakegpu:0``
through amdsmi's device 0, and ``amdsmi`` is a fake (tests/fakeamdsmi, amdsmi 7's
names and shapes) put on the daemon's path: the library boundary, the only double.
The reasons are NVML's, in the same place of the report: one judge reads both.
Each has its control: the same region without the disturbance.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import PY, REPO, krex, reap, spawn, status_clocks, wait_for

from krex.devices import fakegpu

pytestmark = pytest.mark.skipif(not fakegpu.available(), reason="fakegpu was not built")
FAKE = os.path.join(REPO, "tests", "fakeamdsmi")
JOB = os.path.join(REPO, "tests", "jobs", "amdsmi_region.py")


@pytest.fixture
def amd_daemon(make_daemon, tmp_path, monkeypatch):
    monkeypatch.setenv("KREX_FAKE_AMDSMI", str(tmp_path / "amdsmi.json"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [FAKE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    return make_daemon("--fakegpu-amdsmi", "0", "--device-sample-ms", "2")


def _region(**plan) -> dict:
    p = krex("run", "--device", "fakegpu:0", "--", PY, JOB, json.dumps(plan))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _reason(report: dict, code: str) -> dict | None:
    return next((r for r in report["reasons"] if r["code"] == code), None)


def test_amdsmi_names_a_foreign_process_and_a_power_cap(amd_daemon):
    """A process krex does not manage in amdsmi's list: ``foreign_device_process``; the
    power-cap violation set inside the region: ``throttled`` (``sw_power_cap``).
    Control: an empty list and no violation -- clean of both, the account still there."""
    stranger = spawn([PY, "-c", "import time; print('s', flush=True); time.sleep(60)"])
    try:
        assert stranger.stdout.readline().strip() == "s"
        control = _region()
        shared = _region(processes=[stranger.pid])
        capped = _region(mid={"violations": ["active_ppt_pwr"], "gfx_mhz": 1500})
    finally:
        reap(stranger)
    assert control["device_audit"]["source"] == "fakegpu+amdsmi"
    assert control["device_audit"]["start"]["sm_clock_mhz"] == 2100
    assert control["device_audit"]["start"]["temperature_c"] == 50
    assert _reason(control, "foreign_device_process") is None, control["reasons"]
    assert _reason(control, "throttled") is None, control["reasons"]
    found = _reason(shared, "foreign_device_process")
    assert found is not None and not shared["clean"], shared["reasons"]
    (proc,) = found["evidence"]["processes"]
    assert proc["pid"] == stranger.pid and proc["used_memory_mib"] == 64.0
    found = _reason(capped, "throttled")
    assert found is not None, capped["reasons"]
    assert found["evidence"]["throttling_at_release"] == ["sw_power_cap"]
    assert found["evidence"]["clock_ratio"] == pytest.approx(1500 / 2100, abs=1e-3)


@pytest.mark.parametrize("end", ["stop", "kill", "control"])
def test_locked_amd_clocks_are_reset_when_the_daemon_stops_or_dies(make_daemon, tmp_path,
                                                                   monkeypatch, end):
    """``--lock-clocks base`` sets an AMD device's performance level to ``STABLE_STD``
    while the daemon runs (status shows its clock) and back to ``AUTO`` when the daemon
    stops -- or, killed, by its guardian's lease.  Control: a daemon without the flag
    leaves another's level (``HIGH``) alone."""
    state = tmp_path / "amdsmi.json"
    monkeypatch.setenv("KREX_FAKE_AMDSMI", str(state))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [FAKE, *filter(None, [os.environ.get("PYTHONPATH")])]))
    state.write_text(json.dumps({"perf_level": "HIGH"}))
    flags = [] if end == "control" else ["--lock-clocks", "base"]
    d = make_daemon("--fakegpu-amdsmi", "0", *flags)

    def level() -> str:
        return json.loads(state.read_text())["perf_level"]

    if end == "control":
        assert status_clocks() == {"locked": [], "errors": {}}
        d.stop()
        assert level() == "HIGH"
        return
    wait_for(lambda: level() == "STABLE_STD", 10)  # locked while the daemon starts
    locked = status_clocks()["locked"]  # rocm:0 too: the fake answers for amdsmi's device 0
    assert {"device": "fakegpu:0", "index": 0, "mode": "base", "sm_mhz": 1700,
            "library": "amdsmi"} in locked, locked
    if end == "stop":
        d.stop()
    else:
        d.proc.kill()
        d.proc.wait(10)
    wait_for(lambda: level() == "AUTO", 15)


def test_a_query_amdsmi_does_not_answer_is_named_and_the_rest_still_read(monkeypatch, tmp_path):
    import importlib
    import sys

    monkeypatch.setenv("KREX_FAKE_AMDSMI", str(tmp_path / "amdsmi.json"))
    monkeypatch.syspath_prepend(FAKE)
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    smi = importlib.import_module("amdsmi")
    from krex.devices.amdaudit import amdsmi_device

    smi.update(unsupported=["amdsmi_get_violation_status"], hotspot_c=71)
    device = amdsmi_device("rocm:0")
    assert device is not None and device.source == "amdsmi"
    state = device.read().state
    assert state.throttle_reasons is None and state.temperature_c == 71
    assert any(e.startswith("throttle_reasons:") for e in state.errors)
    assert amdsmi_device("cuda:0") is None and amdsmi_device("fakegpu:0") is None


def test_doctor_says_whether_an_amd_devices_clocks_are_locked():
    from krex.enforce.doctor import clock_check

    lock = {"device": "rocm:0", "index": 0, "mode": "base", "sm_mhz": 1700, "library": "amdsmi"}
    check = clock_check("rocm:0", [lock])
    assert check["ok"] and "STABLE_STD" in check["detail"] and "1700" in check["detail"]
    control = clock_check("rocm:0", [])  # the control: no lock, the advice says how
    assert not control["ok"] and "--lock-clocks" in control["advice"]
