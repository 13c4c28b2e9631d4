"""In-region exclusivity through the real daemon: freeze, isolation, revocation, crash.

Every check is made from timestamps and placements the jobs record themselves.
"""

import json
import os
import signal
import time

import pytest
from helpers import (
    CONTENTION,
    PY,
    REPO,
    Daemon,
    clean_but_contention,
    krex,
    reap,
    wait_for,
    why_not,
)

from krex.enforce.cgroups import CgroupLayout
from krex.errors import KrexError

JOBS = os.path.join(REPO, "tests", "jobs")
LAYOUT = CgroupLayout.probe()
BACKENDS = [
    pytest.param("signal"),
    pytest.param("cgroup2", marks=pytest.mark.skipif(
        not LAYOUT.v2_writable, reason="no writable cgroup v2 freezer here")),
    pytest.param("cgroup1", marks=pytest.mark.skipif(
        not LAYOUT.freezer_writable, reason="no writable cgroup v1 freezer here")),
]


def stamps(path):
    with open(path) as f:
        return [int(x) for x in f.read().split()]


def start_sibling(tmp_path, name="sib"):
    out = tmp_path / f"{name}.txt"
    proc = krex("run", "--name", name, "--", PY, os.path.join(JOBS, "progress.py"), str(out))
    assert proc.stdout.readline().strip() == "running"
    wait_for(lambda: out.exists() and len(stamps(out)) > 20)
    return proc, out


def hold(tmp_path, hold_s, *extra):
    out = tmp_path / "holder.json"
    p = krex("run", "--name", "holder", "--", PY, os.path.join(JOBS, "hold_region.py"),
             str(out), str(hold_s), *map(str, extra))
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    with open(out) as f:
        return json.load(f)


@pytest.fixture
def backend_daemon(request, make_daemon):
    return make_daemon(*request.param)


@pytest.mark.parametrize("backend_daemon", [["--freeze", b.values[0]] for b in BACKENDS],
                         indirect=True, ids=[b.values[0] for b in BACKENDS])
def test_sibling_makes_no_progress_inside_a_region(backend_daemon, tmp_path):
    sib, out = start_sibling(tmp_path)
    try:
        seen = hold(tmp_path, 0.4)
        wait_for(lambda: stamps(out)[-1] > seen["t_out"], 5)  # it resumes afterwards
    finally:
        reap(sib)
    inside = [t for t in stamps(out) if seen["t_in"] < t < seen["t_out"]]
    assert inside == []
    host = seen["report"]["host"]
    assert clean_but_contention(seen["report"]), why_not(seen["report"])
    assert host["siblings_frozen"] == 1 and host["freeze_backend"].startswith(
        backend_daemon.extra[1])


def test_holder_threads_on_reserved_cores_others_off(runtime_dir, monkeypatch, tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("CPU isolation needs at least 2 cores")
    d = Daemon(str(runtime_dir), "--freeze", "off").start()  # so the sibling must be moved
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    sib, _ = start_sibling(tmp_path)
    try:
        with d.client() as c:
            sib_pid = [j["root_pid"] for j in c.status()["jobs"] if j["name"] == "sib"][0]
            reserved = set(c.status()["enforcement"]["measure_cores"])
        seen = hold(tmp_path, 0.3, 4, sib_pid)
        sibling_after = {tid: sorted(os.sched_getaffinity(int(tid)))
                         for tid in os.listdir(f"/proc/{sib_pid}/task")}
    finally:
        reap(sib)
        d.stop()
    assert len(seen["inside"]) >= 4  # every thread of the holder ...
    assert all(set(cpus) <= reserved for cpus in seen["inside"].values())  # ... is moved
    assert all(not set(cpus) & reserved for cpus in seen["inside_sibling"].values()), seen
    assert seen["after"] == seen["before"]  # placement restored exactly
    assert all(set(c) & reserved for c in sibling_after.values())


def test_revoked_region_thaws_siblings_and_is_not_clean(daemon, tmp_path):
    sib, out = start_sibling(tmp_path)
    try:
        seen = hold(tmp_path, 1.5, 1, 0, 0.3)
    finally:
        reap(sib)
    rep = seen["report"]
    assert rep["outcome"] == "revoked" and not rep["clean"]
    assert [r["code"] for r in rep["reasons"] if r["code"] not in CONTENTION] == ["revoked"]
    # Frozen right after the grant, running again well before the holder let go.
    ts = stamps(out)
    assert [t for t in ts if seen["t_in"] < t < seen["t_in"] + 0.25e9] == []
    assert [t for t in ts if seen["t_in"] + 0.6e9 < t < seen["t_out"]] != []


def test_daemon_sigkill_thaws_siblings_within_1s(runtime_dir, monkeypatch, tmp_path):
    d = Daemon(str(runtime_dir)).start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    sib, out = start_sibling(tmp_path)
    holder = krex("run", "--", PY, os.path.join(JOBS, "hold_forever.py"))
    try:
        assert holder.stdout.readline().strip() == "inside"
        time.sleep(0.2)
        n = len(stamps(out))
        time.sleep(0.2)
        assert len(stamps(out)) == n  # frozen
        killed = time.monotonic_ns()
        d.proc.send_signal(signal.SIGKILL)
        wait_for(lambda: stamps(out)[-1] > killed, 5)
        resumed = min(t for t in stamps(out) if t > killed)
        assert (resumed - killed) / 1e9 < 1.0
        d.proc.wait()
        d.proc = None
        # A new daemon starts cleanly on the same runtime directory and serves.
        d2 = Daemon(str(runtime_dir)).start()
        try:
            with d2.client() as c:
                job = c.register()["job_id"]
                rid = c.acquire(job)["region"]
                assert c.release(rid)["report"]["region"] == rid
        finally:
            d2.stop()
    finally:
        reap(holder)
        reap(sib)
        d.stop()


def test_first_sigterm_lets_the_holder_finish_second_forces(runtime_dir, monkeypatch, tmp_path):
    d = Daemon(str(runtime_dir)).start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    sib, out = start_sibling(tmp_path)
    holder = krex("run", "--", PY, os.path.join(JOBS, "hold_region.py"),
                  str(tmp_path / "h.json"), "0.8")
    try:
        wait_for(lambda: _held(d) == 1, 20)
        d.proc.send_signal(signal.SIGTERM)  # stop admitting; the region may finish
        _, err = holder.communicate(timeout=30)
        assert holder.returncode == 0, err  # its release was still served
        seen = json.loads((tmp_path / "h.json").read_text())
        assert clean_but_contention(seen["report"]), why_not(seen["report"])
        assert d.proc.wait(15) == 0
        wait_for(lambda: stamps(out)[-1] > seen["t_out"], 5)  # thawed at the end
        # A second signal exits at once, still thawing.
        d2 = Daemon(str(runtime_dir)).start()
        monkeypatch.setenv("KREX_SOCKET", d2.socket)
        holder2 = krex("run", "--", PY, os.path.join(JOBS, "hold_forever.py"))
        assert holder2.stdout.readline().strip() == "inside"
        d2.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # two signals sent back to back would be delivered as one
        forced = time.monotonic()
        d2.proc.send_signal(signal.SIGTERM)
        d2.proc.wait(15)
        assert time.monotonic() - forced < 3  # not the 10 s grace of the first signal
        mark = time.monotonic_ns()
        wait_for(lambda: stamps(out)[-1] > mark, 5)
        reap(holder2)
        d2.stop()
    finally:
        reap(holder)
        reap(sib)
        d.stop()


def _held(d):
    try:
        with d.client() as c:
            return 1 if c.status()["scheduler"].get("cpu", {}).get("holder") else 0
    except (KrexError, OSError):  # the daemon is stopping: no holder
        return 0


@pytest.mark.parametrize("scope", ["device", "node"])
def test_freeze_scope(runtime_dir, monkeypatch, tmp_path, scope):
    from krex.devices import fakegpu

    if not fakegpu.available():
        pytest.skip("needs a second device (fakegpu was not built)")
    d = Daemon(str(runtime_dir), "--freeze-scope", scope).start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    out = tmp_path / "other.txt"
    other = krex("run", "--device", "fakegpu:0", "--", PY, os.path.join(JOBS, "progress.py"),
                 str(out))
    try:
        assert other.stdout.readline().strip() == "running"
        wait_for(lambda: out.exists() and len(stamps(out)) > 20)
        seen = hold(tmp_path, 0.4)  # a region on cpu
    finally:
        reap(other)
        d.stop()
    inside = [t for t in stamps(out) if seen["t_in"] < t < seen["t_out"]]
    if scope == "node":
        assert inside == []  # every job on the node is frozen
    else:
        assert len(inside) > 50  # a job on another device keeps running
