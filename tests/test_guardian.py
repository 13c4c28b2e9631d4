"""The guardian: undo on daemon death (even SIGKILL), on lease expiry, from the journal."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
from enforce_support import Sibling, layout_or_skip, stamps_after
from helpers import PY, reap, spawn, wait_for

from krex.enforce.cgroups import CgroupLayout, instance_name
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.guardian import GuardianClient, sweep
from krex.enforce.job import JobTarget

# Stands in for the daemon: owns a guardian, freezes the sibling, then waits
# to be killed.  argv: backend, journal, sibling pid, cgroup dir or "".
DAEMON = r"""
import json, sys, time
from krex.enforce.cgroups import CgroupLayout, JobCgroups
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.guardian import GuardianClient
from krex.enforce.job import JobTarget
from krex.enforce.process import ProcessGroup, ProcessRef
backend, journal, pid, cg = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
guardian = GuardianClient()
guardian.start("standin", journal)
cgroups = JobCgroups(v2=cg or None) if backend == "cgroup2" else JobCgroups(freezer=cg or None)
sibling = JobTarget(2, root=ProcessRef.of(pid), group=ProcessGroup.led_by(pid),
                    cgroups=cgroups if cg else None)
enforcer = Enforcer(EnforceConfig(freeze=backend, isolate=False), CgroupLayout.probe(), guardian)
enforcer.enter(JobTarget(1), [sibling], max_hold_s=60)
print(json.dumps({"guardian": guardian.pid, "frozen_at": time.monotonic()}), flush=True)
time.sleep(600)
"""


@pytest.fixture
def instance():
    # Unique, and alive to any daemon's sweep: the name must end in this process's
    # pid-starttime (a trailing "-<ns>" made it look dead, and other daemons removed it).
    name = instance_name(f"g{time.monotonic_ns()}x")
    yield name
    CgroupLayout.probe().remove_instance(name)


def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    wait_for(
        lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie",
        timeout_s=timeout_s,
    )


@pytest.mark.parametrize("backend", ["signal", "cgroup2", "cgroup1"])
def test_sigkill_of_daemon_thaws_siblings_within_a_second(backend, tmp_path, instance):
    layout = layout_or_skip(backend)
    cg = None if backend == "signal" else layout.create_job(instance, 2)
    cg_dir = "" if cg is None else (cg.v2 if backend == "cgroup2" else cg.freezer)
    sib = daemon = None
    try:
        sib = Sibling(str(tmp_path), 2, cg)
        journal = str(tmp_path / "journal.json")
        daemon = spawn([PY, "-c", DAEMON, backend, journal, str(sib.proc.pid), cg_dir])
        info = json.loads(daemon.stdout.readline())
        time.sleep(0.3)
        assert not stamps_after(sib.path, info["frozen_at"]), "sibling ran while frozen"
        assert os.path.exists(journal)
        killed_at = time.monotonic()
        daemon.kill()
        wait_for(lambda: sib.progressed_after(killed_at), timeout_s=10)
        resumed_at = stamps_after(sib.path, killed_at)[0]
        assert resumed_at - killed_at < 1.0, f"thawed {resumed_at - killed_at:.3f} s after SIGKILL"
        _wait_gone(info["guardian"])  # the guardian undid everything and left
        assert not os.path.exists(journal)
    finally:
        if daemon:
            reap(daemon)
        if sib:
            sib.kill()


def test_lease_expiry_thaws_and_marks_region_revoked(tmp_path):
    sib = Sibling(str(tmp_path), 2)
    guardian = GuardianClient()
    try:
        guardian.start("t", str(tmp_path / "j.json"))
        config = EnforceConfig(freeze="signal", isolate=False, lease_margin_s=0.2)
        region = Enforcer(config, CgroupLayout.none(), guardian).enter(
            JobTarget(1), [sib.target], max_hold_s=0.2
        )
        frozen_at = time.monotonic()
        wait_for(lambda: sib.progressed_after(frozen_at + 0.3), timeout_s=10)
        first = stamps_after(sib.path, frozen_at)[0]
        assert first - frozen_at >= 0.3, "thawed before the lease (0.4 s) expired"
        wait_for(lambda: region.lease_id in guardian.expired(), timeout_s=5)
        region.exit()
        codes = [r.code.value for r in region.reasons]
        assert codes == ["mechanism_disabled", "lease_expired"]  # isolate=False, then the lease
    finally:
        guardian.stop()
        sib.kill()


def test_stop_with_active_lease_undoes_it(tmp_path):
    sib = Sibling(str(tmp_path), 2)
    guardian = GuardianClient()
    try:
        guardian.start("t", str(tmp_path / "j.json"))
        config = EnforceConfig(freeze="signal", isolate=False)
        Enforcer(config, CgroupLayout.none(), guardian).enter(
            JobTarget(1), [sib.target], max_hold_s=60
        )
        assert sib.target.root.state() == "T"
        t = time.monotonic()
        guardian.stop()
        wait_for(lambda: sib.progressed_after(t), timeout_s=5)
    finally:
        guardian.stop()
        sib.kill()


def test_guardian_ignores_sighup_and_journal_sweep_undoes_after_double_crash(tmp_path):
    sib = Sibling(str(tmp_path), 2)
    guardian = GuardianClient()
    journal = str(tmp_path / "j.json")
    try:
        guardian.start("t", journal)
        os.kill(guardian.pid, signal.SIGHUP)
        time.sleep(0.1)
        assert guardian.alive()
        config = EnforceConfig(freeze="signal", isolate=False)
        Enforcer(config, CgroupLayout.none(), guardian).enter(
            JobTarget(1), [sib.target], max_hold_s=60
        )
        wait_for(lambda: os.path.exists(journal), timeout_s=5)
        os.kill(guardian.pid, signal.SIGKILL)  # guardian and daemon both gone
        guardian.proc.wait()
        time.sleep(0.1)
        assert sib.target.root.state() == "T"
        t = time.monotonic()
        assert sweep(journal) == []
        wait_for(lambda: sib.progressed_after(t), timeout_s=5)
        assert not os.path.exists(journal)
    finally:
        guardian.stop()
        sib.kill()


def test_the_journal_is_rewritten_only_when_what_a_sweep_replays_changes(tmp_path):
    """A handoff (a new lease with the old one's undo records, the old one ended) leaves
    the journal as it is: a sweep of it replays exactly the same records.  Control: a
    lease with other records rewrites it (a new file, renamed in) within seconds; and
    the guardian runs at SCHED_BATCH (no wake-up preemption of the daemon)."""
    journal = tmp_path / "j.json"
    guardian = GuardianClient()
    same, other = [{"op": "noop", "n": 1}], [{"op": "noop", "n": 2}]

    def replayed() -> list:
        return [v["undo"] for v in json.loads(journal.read_text())["leases"].values()]

    try:
        guardian.start("t", str(journal))
        assert os.sched_getscheduler(guardian.pid) == os.SCHED_BATCH
        guardian.lease(1, 60.0, same)
        wait_for(lambda: journal.exists(), timeout_s=5)
        first = journal.stat().st_ino
        with guardian.batch():  # what lease_handed sends at a handoff
            guardian.lease(2, 60.0, same)
            guardian.end(1)
        time.sleep(0.5)
        assert journal.stat().st_ino == first and replayed() == [same]
        guardian.lease(3, 60.0, other)  # control: other records are journaled
        wait_for(lambda: journal.stat().st_ino != first, timeout_s=5)
        assert replayed() == [same, other]
        assert set(json.loads(journal.read_text())["leases"]) == {"2", "3"}
        guardian.end(2)
        guardian.end(3)
        wait_for(lambda: not journal.exists(), timeout_s=5)
    finally:
        guardian.stop()


def test_the_guardian_imports_nothing_from_the_daemons_working_directory(tmp_path,
                                                                          monkeypatch):
    """The daemon's working directory (wherever it was started) may be writable by
    others: a module planted there is not imported by the guardian (``-I``, cwd ``/``).
    Control: the same planted module is imported by a plain ``python -c`` run there."""
    import subprocess

    cwd, marker = tmp_path / "cwd", tmp_path / "imported"
    cwd.mkdir()
    (cwd / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                 "raise ImportError('planted')\n")
    subprocess.run([PY, "-c", "import json"], cwd=cwd, capture_output=True, timeout=60)
    assert marker.exists()  # the trap works
    marker.unlink()
    monkeypatch.chdir(cwd)
    guardian = GuardianClient()
    try:
        guardian.start("t", str(tmp_path / "j.json"))
        assert guardian.alive()
    finally:
        guardian.stop()
    assert not marker.exists(), "the guardian imported a module from its cwd"
