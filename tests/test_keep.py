"""A lone job's enforcement is kept between its back-to-back regions (krex.daemon.keep).

Through a real daemon (root, cgroups): the second of two back-to-back regions starts
on what the first set up and says so (every step ``kept``, nothing applied), is as
clean, and keeps the holder on its reserved cores; the kept enforcement is undone
once its time is over (the holder gets every core back).  Negative controls: a job
that registers between the regions makes the next one set up anew; a task that lands
on the holder's core between kept regions makes the kept region not clean, as it
would any other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import (
    Daemon,
    clean_but_contention,
    reap,
    skip_if_another_daemon_owns_the_shield,
    wait_for,
    why_not,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, the shield)")

KEEP_MS = 300  # long enough for a loaded machine's next acquire, short for the test


@pytest.fixture
def daemon(runtime_dir, monkeypatch):
    skip_if_another_daemon_owns_the_shield()
    monkeypatch.setenv("KREX_KEEP_MS", str(KEEP_MS))
    monkeypatch.setenv("KREX_SHIELD", "on")  # as root by default (the suite turns it off)
    d = Daemon(str(runtime_dir)).start()
    yield d
    d.stop()


def _region(c, job: int, spin_s: float = 0.0) -> dict:
    region = c.acquire(job)["region"]
    cores = os.sched_getaffinity(0)
    end = time.monotonic() + spin_s
    while time.monotonic() < end:
        pass
    report = c.release(region)["report"]
    report["_cores_inside"] = cores
    return report


def _keep(c) -> dict:
    return c.status()["daemon"]["keep"]


def test_back_to_back_regions_keep_the_enforcement_then_let_it_go(daemon):
    everything = os.sched_getaffinity(0)
    with daemon.client() as c:
        job = c.register(name="lone", device="cpu")["job_id"]
        first = _region(c, job)
        second = _region(c, job)
        assert first["clean"] and second["clean"], (why_not(first), why_not(second))
        assert not first["host"]["kept"] and any(s["apply_ms"] for s in first["host"]["steps"])
        host = second["host"]
        assert host["kept"] and host["steps"], host
        assert all(s["kept"] and s["apply_ms"] == 0.0 for s in host["steps"]), host["steps"]
        assert [s["name"] for s in host["steps"]] == [s["name"] for s in first["host"]["steps"]]
        # the holder was on its reserved cores in both, not on every core
        assert second["_cores_inside"] == first["_cores_inside"] != everything
        assert set(host["holder_cores"]) == second["_cores_inside"]
        # once its time is over nothing is left: every core back, counted as undone
        wait_for(lambda: os.sched_getaffinity(0) == everything, 5)
        wait_for(lambda: _keep(c)["kept"] == [], 5)
        kept = _keep(c)
        assert kept["reused"] >= 1 and kept["undone"] >= 1, kept


LATECOMER = """
import os, sys, time
from krex.client.connection import Client
c = Client(os.environ["KREX_SOCKET"], autostart=False)
print("started", flush=True)
sys.stdin.readline()  # (started before the lone job's first region: no start-up between)
# a managed job (its processes come later): the node's jobs change, and nothing of it
# lands in the kept region's frozen device subtree (a process registered there would
# stay frozen until the kept enforcement's time is over)
c.create_job(name="latecomer", device="cpu", mode="region")
print("ready", flush=True)
time.sleep(60)
"""


def test_a_job_that_comes_between_the_regions_makes_the_next_one_set_up_anew(daemon):
    late = subprocess.Popen([sys.executable, "-c", LATECOMER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "KREX_SOCKET": daemon.socket})
    with daemon.client() as c:
        job = c.register(name="lone", device="cpu")["job_id"]
        try:
            assert late.stdout.readline().strip() == "started"
            _region(c, job)
            late.stdin.write("go\n")
            late.stdin.flush()
            assert late.stdout.readline().strip() == "ready"  # the node changed
            after = _region(c, job)
        finally:
            reap(late)
        assert not after["host"]["kept"], after["host"]
        assert after["host"]["siblings_frozen"] == 1, after["host"]  # it is frozen now
        kept = _keep(c)
        assert kept["reused"] == 0 and kept["undone"] == 1, kept


HOLDER = """
import json, os, sys, time
from krex.client.connection import Client
c = Client(os.environ["KREX_SOCKET"], autostart=False)
job = c.register(name="holder", device="cpu")["job_id"]
for line in sys.stdin:
    region = c.acquire(job)["region"]
    end = time.monotonic() + float(line)
    while time.monotonic() < end:
        pass
    report = c.release(region)["report"]
    print(json.dumps(report), flush=True)
"""


def test_a_task_on_the_holders_core_between_kept_regions_is_seen(daemon):
    """A task that lands on a kept region's reserved core (as one started in the root
    cpuset by something else would) competes with the holder: the region is not clean.
    The control, the region before it on the same kept enforcement, is clean."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "KREX_SOCKET": daemon.socket})
    hog = None

    def region(spin_s: float) -> dict:
        holder.stdin.write(f"{spin_s}\n")
        holder.stdin.flush()
        return json.loads(holder.stdout.readline())

    try:
        region(0.0)
        control = region(0.3)
        if not control["clean"] and clean_but_contention(control):
            # beside a CPU loop (a fresh clone's suite, 2026-12-07) the control once
            # waited 5.96 ms for core 1 against a 3.3 ms threshold: judged elsewhere
            pytest.skip(f"the machine is not quiet: {why_not(control)}")
        assert control["host"]["kept"] and control["clean"], why_not(control)
        core = max(control["host"]["holder_cores"])
        hog = subprocess.Popen(["sh", "-c", "while :; do :; done"])
        with open("/sys/fs/cgroup/cpuset/cgroup.procs", "w") as f:  # the root cpuset
            f.write(str(hog.pid))
        os.sched_setaffinity(hog.pid, {core})
        hit = region(0.3)
        assert hit["host"]["kept"], hit["host"]
        assert not hit["clean"], hit["host"]
        codes = {r["code"] for r in hit["reasons"]}
        assert codes & {"holder_preempted", "foreign_task"}, why_not(hit)
        assert hog.pid in hit["host"]["shield"]["late"], hit["host"]["shield"]  # named too
    finally:
        if hog is not None:
            reap(hog)
        holder.stdin.close()
        reap(holder)
