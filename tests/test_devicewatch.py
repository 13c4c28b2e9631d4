"""The fake device's own account of a region, through the real daemon (devicewatch.py).

fakegpu's device is a host thread pinned to a core of its own.  What disturbs it
there — another task on its core, another process's work on the device — never
shows in the holder's counters, so the daemon asks the device: the kernel's run
delay of the execution thread, and the server's per-context busy time.  Each
reason has its negative control: the same holder without the disturbance.
"""

from __future__ import annotations

import json
import os
import subprocess

import psutil
import pytest
from helpers import PY, REPO, Daemon, krex, reap, spawn, wait_for

from krex.devices import fakegpu

pytestmark = [pytest.mark.skipif(not fakegpu.available(), reason="fakegpu was not built"),
              pytest.mark.skipif(os.geteuid() != 0, reason="nice -10 needs root")]
JOBS = os.path.join(REPO, "tests", "jobs")
DEVICE_CORE = 0  # --fakegpu-core: the device's execution thread keeps to it
# The hog takes the device's core at the device's own priority: half of it.  Both run at
# nice -10, ahead of whatever else the machine runs (a CPU loop beside the suite), so that
# the control measures the device undisturbed by anything but that (root: CAP_SYS_NICE).
NICE = -10
HOG = ("import os; os.sched_setaffinity(0, {%d}); os.nice(%d); print('hog', flush=True)\n"
       "while 1: pass")


@pytest.fixture
def device_daemon(make_daemon):
    """A daemon whose fake device runs on ``DEVICE_CORE``."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores: one for the device, one reserved for the holder")
    return make_daemon("--fakegpu-core", str(DEVICE_CORE))


def _device_server(d: Daemon) -> str:
    """Start the daemon's fakegpu server (a fakegpu job's registration does) and give
    its socket."""
    p = krex("run", "--device", "fakegpu:0", "--", PY, "-c", "pass")
    assert p.wait(60) == 0, p.stderr.read()
    sock = os.path.join(d.runtime_dir, "fakegpu.sock")
    wait_for(lambda: os.path.exists(sock), 10)
    server = next(p for p in psutil.Process(d.proc.pid).children()
                  if p.name().startswith("krex-fakegpu"))
    for thread in server.threads():
        os.setpriority(os.PRIO_PROCESS, thread.id, NICE)
    return sock


def _measure() -> dict:
    p = krex("run", "--device", "fakegpu:0", "--name", "gpu-holder", "--", PY,
             os.path.join(JOBS, "gpu_measure.py"))
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    seen = json.loads(out.strip().splitlines()[-1])
    assert "error" not in seen, seen
    return seen["report"]


def _reason(report: dict, code: str) -> dict | None:
    return next((r for r in report["reasons"] if r["code"] == code), None)


def _delay_share(report: dict) -> float:
    """The device thread's run delay over the region, as a share of its span."""
    found = _reason(report, "device_preempted")
    if found is None:
        return 0.0
    return found["evidence"]["run_delay_ms"] / found["evidence"]["span_ms"]


def _hog_on_device_core() -> subprocess.Popen:
    hog = spawn([PY, "-c", HOG % (DEVICE_CORE, NICE)])
    assert hog.stdout.readline().strip() == "hog"
    return hog


def test_a_hog_on_the_devices_core_makes_the_region_not_clean(device_daemon):
    """A busy loop pinned to the device's core takes about half of it from the fake
    device: the region says ``device_preempted`` with the run delay as evidence.  Control:
    the same holder without the hog has no such reason (a CPU loop beside the suite may
    wander onto the device's core: then a reason with a far smaller share)."""
    _device_server(device_daemon)
    control = _measure()
    hog = _hog_on_device_core()
    try:
        disturbed = _measure()
    finally:
        reap(hog)
    found = _reason(disturbed, "device_preempted")
    assert found is not None, disturbed["reasons"]
    assert not disturbed["clean"]
    assert found["evidence"]["run_delay_ms"] > found["evidence"]["threshold_ms"]
    assert disturbed["device_audit"]["source"] == "fakegpu"
    print("device run delay share: hog", _delay_share(disturbed), "control", _delay_share(control))
    assert _delay_share(disturbed) > 0.3, found
    assert _delay_share(control) < 0.15, _reason(control, "device_preempted")


def test_another_process_on_the_device_makes_the_region_not_clean(device_daemon):
    """A process krex does not manage keeps 5 ms kernels queued on the daemon's device:
    nothing gates or drains it, so the device time-slices it with the holder, and the
    region names it (``foreign_device_work``, its pid).  Control: the holder alone."""
    sock = _device_server(device_daemon)
    control = _measure()
    env = dict(os.environ, KREX_FAKEGPU_SOCKET=sock, LD_LIBRARY_PATH=str(
        fakegpu.fakegpu_lib_dir()))
    foreign = spawn([PY, os.path.join(JOBS, "gpu_sibling.py"), "1000"], env=env)
    try:
        assert foreign.stdout.readline().strip() == "batch 1", foreign.stderr.read()
        shared = _measure()
    finally:
        reap(foreign)
    found = _reason(shared, "foreign_device_work")
    assert found is not None, shared["reasons"]
    assert foreign.pid in found["evidence"]["pids"], found
    assert found["evidence"]["busy_ms"] > 1.0
    assert shared["device_audit"]["foreign_pids"] == found["evidence"]["pids"]
    assert _reason(control, "foreign_device_work") is None, control["reasons"]
