"""The NVML account of a region through a real daemon on fakegpu (nvmlwatch.py).

No GPU here: the daemon's test hook ``--fakegpu-nvml 0`` audits ``fakegpu:0`` through
NVML device 0, and ``pynvml`` is a fake (tests/fakenvml) put on the daemon's path: the
library boundary, the only double.  The daemon's code from there on is the one that
runs on a GPU.  Every reason has its negative control: the same region without the
disturbance.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest
from helpers import PY, REPO, krex, reap, run_krex, spawn, status_clocks, wait_for

from krex.devices import fakegpu

pytestmark = pytest.mark.skipif(not fakegpu.available(), reason="fakegpu was not built")
FAKE_NVML = os.path.join(REPO, "tests", "fakenvml")
JOB = os.path.join(REPO, "tests", "jobs", "nvml_region.py")


def _nvml_daemon(make_daemon, tmp_path, monkeypatch, *flags: str):
    """A daemon auditing fakegpu:0 through the fake NVML, its fakegpu server started."""
    monkeypatch.setenv("KREX_FAKE_NVML", str(tmp_path / "nvml.json"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [FAKE_NVML, *filter(None, [os.environ.get("PYTHONPATH")])]))
    d = make_daemon("--fakegpu-nvml", "0", *flags)
    p = krex("run", "--device", "fakegpu:0", "--", PY, "-c", "pass")
    assert p.wait(60) == 0, p.stderr.read()
    wait_for(lambda: _server_pid(d) is not None, 10)
    return d


@pytest.fixture
def nvml_daemon(make_daemon, tmp_path, monkeypatch):
    return _nvml_daemon(make_daemon, tmp_path, monkeypatch)


def _server_pid(d) -> int | None:
    return next((p.pid for p in psutil.Process(d.proc.pid).children()
                 if p.name().startswith("krex-fakegpu")), None)


def _region(**plan) -> dict:
    p = krex("run", "--device", "fakegpu:0", "--name", "nvml-holder", "--", PY, JOB,
             json.dumps(plan))
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _reason(report: dict, code: str) -> dict | None:
    return next((r for r in report["reasons"] if r["code"] == code), None)


@pytest.fixture
def stranger():
    """A process krex does not manage (it would have a context on the GPU)."""
    proc = spawn([PY, "-c", "import time; print('stranger', flush=True); time.sleep(60)"])
    assert proc.stdout.readline().strip() == "stranger"
    try:
        yield proc
    finally:
        reap(proc)


def test_an_unmanaged_process_on_the_device_makes_the_region_not_clean(nvml_daemon, stranger):
    """NVML lists a process that is no job of the daemon's: ``foreign_device_process``
    names it (pid, uid, command, memory; seen at grant and release).  Control: the list
    holds only what the daemon manages — the holder, the daemon, its fakegpu server."""
    d = nvml_daemon
    control = _region(also=[d.proc.pid, _server_pid(d)])
    shared = _region(also=[stranger.pid])
    assert _reason(control, "foreign_device_process") is None, control["reasons"]
    assert control["device_audit"]["source"] == "fakegpu+nvml"
    assert control["device_audit"]["foreign_pids"] == []
    found = _reason(shared, "foreign_device_process")
    assert found is not None, shared["reasons"]
    assert not shared["clean"]
    (proc,) = found["evidence"]["processes"]
    assert proc["pid"] == stranger.pid and proc["uid"] == os.getuid()
    assert "stranger" in proc["command"] and proc["used_memory_mib"] == 64.0
    assert proc["seen_at"] == ["grant", "release"]
    assert shared["device_audit"]["foreign_pids"] == [stranger.pid]
    assert shared["device_audit"]["start"]["sm_clock_mhz"] == 1980
    # krex status says what the device's last region saw, until a region sees nothing
    shown = run_krex("status", timeout=30).stdout
    assert f"fakegpu:0: its last region saw processes krex does not manage with a " \
           f"context on it: {stranger.pid} (uid {os.getuid()}, 64.0 MiB)" in shown, shown
    _region(also=[d.proc.pid, _server_pid(d)])
    assert "its last region saw" not in run_krex("status", timeout=30).stdout


def test_a_process_that_appears_during_the_region_is_seen_at_release(nvml_daemon, stranger):
    found = _reason(_region(mid_pids=[stranger.pid]), "foreign_device_process")
    assert found is not None
    assert [p["seen_at"] for p in found["evidence"]["processes"]] == [["release"]]


def test_throttling_during_the_region_makes_it_not_clean(nvml_daemon):
    """A thermal throttle reason set inside the region, or the SM clock falling below
    0.9 of the grant's: ``throttled``, with both samples as evidence.  Control: steady
    clocks, with only the reasons that are not throttling (idle, applications clocks)."""
    control = _region(mid={"throttle_reasons": 0x1 | 0x2, "sm_clock_mhz": 1900})
    thermal = _region(mid={"throttle_reasons": 0x20})
    slowed = _region(mid={"sm_clock_mhz": 1500})
    assert _reason(control, "throttled") is None, control["reasons"]
    found = _reason(thermal, "throttled")
    assert found is not None, thermal["reasons"]
    assert not thermal["clean"]
    ev = found["evidence"]
    assert ev["throttling_at_grant"] == [] and ev["throttling_at_release"] == [
        "sw_thermal_slowdown"]
    assert ev["grant"]["throttle_reasons"] == 0x1 and ev["release"]["throttle_reasons"] == 0x20
    assert thermal["device_audit"]["end"]["throttle_names"] == ["sw_thermal_slowdown"]
    found = _reason(slowed, "throttled")
    assert found is not None, slowed["reasons"]
    assert found["evidence"]["clock_ratio"] == pytest.approx(1500 / 1980, abs=1e-3)
    assert found["evidence"]["min_clock_frac"] == 0.9


@pytest.fixture
def mps_server():
    """A process named like an MPS server (``nvidia-cuda-mps-server``; the kernel keeps 15
    characters of a name), as NVML would list it with a context on the device."""
    proc = spawn([PY, "-c", "open('/proc/self/comm', 'w').write('nvidia-cuda-mps-server'); "
                  "import time; print('server', flush=True); time.sleep(60)"])
    assert proc.stdout.readline().strip() == "server"
    try:
        yield proc
    finally:
        reap(proc)


def test_mig_or_an_mps_server_makes_the_device_shared(nvml_daemon, mps_server):
    """MIG switched on inside the region, an MPS server's process listed, or an MPS
    client named by NVML's MPS query: ``shared_device`` (a gap), with the modes, their
    pids and when each was seen.  Control: the same region, MIG off and no MPS."""
    control = _region()
    mig = _region(mid={"mig_mode": 1})
    served = _region(also=[mps_server.pid])
    client = _region(mid={"mps_processes": [4242]})
    assert _reason(control, "shared_device") is None, control["reasons"]
    assert "sharing" not in control["device_audit"]["end"]
    found = _reason(mig, "shared_device")
    assert found is not None and not mig["clean"], mig["reasons"]
    assert [(m["mode"], m["seen_at"]) for m in found["evidence"]["modes"]] == [
        ("mig", ["release"])]
    assert mig["device_audit"]["start"]["sharing"] == []
    assert [m["mode"] for m in mig["device_audit"]["end"]["sharing"]] == ["mig"]
    found = _reason(served, "shared_device")
    assert found is not None, served["reasons"]
    (mode,) = found["evidence"]["modes"]
    assert mode["mode"] == "mps" and mode["pids"] == [mps_server.pid]
    assert mode["seen_at"] == ["grant", "release"]
    assert _reason(served, "foreign_device_process") is not None  # its server is no job
    found = _reason(client, "shared_device")
    assert found is not None, client["reasons"]
    assert [(m["mode"], m["pids"]) for m in found["evidence"]["modes"]] == [("mps", [4242])]


STEADY = {"throttle_reasons": 0x1, "sm_clock_mhz": 1980}


def test_throttling_that_ends_before_release_is_seen_by_the_sampler(make_daemon, tmp_path,
                                                                     monkeypatch):
    """A thermal throttle, or an SM clock dip, that starts and ends inside the region
    (100 ms): the readings at grant and at release are both steady, the daemon's sampler
    (every 2 ms here) saw it between them -- ``throttled``, with the samples.  Controls:
    a steady region (no reason, samples taken), and the same throttle with the sampler
    off (``--device-sample-ms 0``), which two readings alone cannot see."""
    _nvml_daemon(make_daemon, tmp_path, monkeypatch, "--device-sample-ms", "2")
    steady = _region()
    thermal = _region(mid={"throttle_reasons": 0x20}, restore=STEADY, mid_s=0.1)
    dipped = _region(mid={"sm_clock_mhz": 1400}, restore=STEADY, mid_s=0.1)
    assert _reason(steady, "throttled") is None, steady["reasons"]
    assert steady["device_audit"]["end"]["between"]["samples"] >= 5
    found = _reason(thermal, "throttled")
    assert found is not None and not thermal["clean"], thermal["reasons"]
    ev = found["evidence"]
    assert ev["throttling_at_grant"] == ev["throttling_at_release"] == []
    assert ev["throttling_between"] == ["sw_thermal_slowdown"]
    assert ev["between"]["first_throttled"]["throttle_reasons"] == 0x20
    assert 10 <= ev["between"]["first_throttled"]["at_ms"] <= 1000
    found = _reason(dipped, "throttled")
    assert found is not None, dipped["reasons"]
    assert found["evidence"]["clock_ratio"] == 1.0
    assert found["evidence"]["min_clock_ratio_between"] == pytest.approx(1400 / 1980, abs=1e-3)


def test_without_the_sampler_two_readings_miss_a_throttle_inside_the_region(
        make_daemon, tmp_path, monkeypatch):
    _nvml_daemon(make_daemon, tmp_path, monkeypatch, "--device-sample-ms", "0")
    thermal = _region(mid={"throttle_reasons": 0x20}, restore=STEADY, mid_s=0.1)
    assert _reason(thermal, "throttled") is None, thermal["reasons"]
    assert "between" not in thermal["device_audit"]["end"]


def _set_state(tmp_path, **changes) -> None:
    """Change the fake NVML's state as its own ``update`` does: atomically (the daemon
    reads the file every few ms; half a file would read as a device that says nothing)."""
    state = tmp_path / "nvml.json"
    (tmp_path / "nvml.json.new").write_text(json.dumps({**json.loads(state.read_text()),
                                                        **changes}))
    os.replace(tmp_path / "nvml.json.new", state)


def _cooling() -> dict:
    from krex.client.connection import Client

    with Client(autostart=False) as client:
        return client.status()["enforcement"]["cooling"]


def test_a_grant_waits_for_the_device_to_cool_and_not_past_its_timeout(make_daemon, tmp_path,
                                                                      monkeypatch):
    """``--cool-below-c 70``: a region asked for on a device at 85 C is granted once it
    reads 60 C (the wait in its report, and in ``status`` while it lasts); one on a
    device that stays throttled is granted at the timeout, saying it was not cooled.
    Control: a device at 45 C is granted at once."""
    _nvml_daemon(make_daemon, tmp_path, monkeypatch, "--cool-below-c", "70",
                 "--cool-timeout-s", "3")
    cool = _region()
    p = krex("run", "--device", "fakegpu:0", "--", PY, JOB,
             json.dumps({"state": {"temperature_c": 85}}))
    try:
        wait_for(lambda: "fakegpu:0" in _cooling(), 30)
        seen = _cooling()["fakegpu:0"]
        shown = run_krex("status", timeout=30).stdout
        time.sleep(0.3)
        _set_state(tmp_path, temperature_c=60)
        out, err = p.communicate(timeout=60)
    finally:
        reap(p)
    assert p.returncode == 0, err
    hot = json.loads(out.strip().splitlines()[-1])
    stuck = _region(state={"throttle_reasons": 0x20})
    waited = cool["device_audit"]["start"]["cool_down"]
    assert waited["cooled"] and waited["waited_s"] < 0.5, waited
    assert seen["temperature_c"] == 85 and seen["below_c"] == 70, seen
    assert "fakegpu:0: job" in shown and "waits for the device to cool: 85 C" in shown, shown
    assert "s at the latest" in shown and "queued behind it" in shown, shown
    waited = hot["device_audit"]["start"]["cool_down"]
    assert waited["cooled"] and waited["temperature_c"] == 60, waited
    assert waited["waited_s"] >= 0.3, waited
    waited = stuck["device_audit"]["start"]["cool_down"]
    assert not waited["cooled"] and waited["throttling"] == ["sw_thermal_slowdown"], waited
    assert 3.0 <= waited["waited_s"] < 10, waited
    assert _reason(stuck, "throttled") is not None and not stuck["clean"]
    assert _cooling() == {}


def _locked(tmp_path) -> list[int] | None:
    return json.loads((tmp_path / "nvml.json").read_text()).get("locked_clocks")


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_locked_clocks_are_reset_when_the_daemon_stops_or_dies(make_daemon, tmp_path,
                                                               monkeypatch, end):
    """``--lock-clocks max`` locks the device's SM clock at its maximum while the daemon
    runs (status says so) and resets it when the daemon stops -- or, killed, by its
    guardian's lease (the daemon cannot).  Control: a daemon without the flag leaves
    the clocks alone."""
    d = _nvml_daemon(make_daemon, tmp_path, monkeypatch, "--lock-clocks", "max")
    assert _locked(tmp_path) == [1980, 1980]
    assert status_clocks()["locked"] == [{"device": "fakegpu:0", "index": 0, "mode": "max",
                                          "sm_mhz": 1980, "library": "nvml"}]
    if end == "stop":
        d.stop()
    else:
        d.proc.kill()
        d.proc.wait(10)
    wait_for(lambda: _locked(tmp_path) is None, 15)


def test_a_daemon_without_lock_clocks_leaves_them_alone(make_daemon, tmp_path, monkeypatch):
    state = tmp_path / "nvml.json"
    state.write_text(json.dumps({"locked_clocks": [1410, 1410]}))  # someone else's lock
    d = _nvml_daemon(make_daemon, tmp_path, monkeypatch)
    assert status_clocks() == {"locked": [], "errors": {}}
    d.stop()
    assert _locked(tmp_path) == [1410, 1410]


def test_a_grant_waits_for_the_locked_clock_with_min_clock_frac(make_daemon, tmp_path,
                                                                 monkeypatch):
    """``--lock-clocks max --min-clock-frac 0.9``: a region asked for while the device
    reads 990 MHz (half its locked 1980) is granted once it reads 1980, the wait in its
    report.  Control: ``--min-clock-frac`` without a lock is refused at start, saying why
    (an idle clock is no reading to wait on)."""
    refused = run_krex("serve", "--runtime-dir", str(tmp_path / "refused"),
                       "--min-clock-frac", "0.9", timeout=30)
    assert refused.returncode != 0 and "needs --lock-clocks" in refused.stderr, refused
    _nvml_daemon(make_daemon, tmp_path, monkeypatch, "--lock-clocks", "max",
                 "--min-clock-frac", "0.9", "--cool-timeout-s", "20")
    p = krex("run", "--device", "fakegpu:0", "--", PY, JOB,
             json.dumps({"state": {"sm_clock_mhz": 990}}))
    try:
        wait_for(lambda: "fakegpu:0" in _cooling(), 30)
        seen = _cooling()["fakegpu:0"]
        time.sleep(0.3)
        _set_state(tmp_path, sm_clock_mhz=1980)
        out, err = p.communicate(timeout=60)
    finally:
        reap(p)
    assert p.returncode == 0, err
    waited = json.loads(out.strip().splitlines()[-1])["device_audit"]["start"]["cool_down"]
    assert seen["sm_clock_mhz"] == 990 and seen["min_clock_mhz"] == 1782, seen
    assert waited["cooled"] and waited["sm_clock_mhz"] == 1980 and waited["waited_s"] >= 0.3
    assert waited["below_c"] is None and waited["min_clock_mhz"] == 1782
