"""The per-device cgroup layout: one write freezes a device, latecomers frozen from birth,
the holder in its slot, undo after crashes (issue 18, issue 11 item 1)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import pytest
from enforce_support import (
    Sibling,
    assert_frozen_then_resumes,
    hold,
    layout_or_skip,
    stamps_after,
    start_holder,
)
from helpers import PY, reap, spawn, wait_for

from krex.enforce import freeze as freeze_mod
from krex.enforce.cgroups import CgroupLayout, _procs, instance_name, read
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.job import JobTarget
from krex.enforce.process import ProcessGroup, ProcessRef
from krex.enforce.undo import replay

CGROUP_BACKENDS = ["cgroup2", "cgroup1"]
KIND = {"cgroup2": "v2", "cgroup1": "freezer"}

# Writes its first instruction's time (monotonic) to PATH, then exits.
FIRST = "import sys, time; open(sys.argv[1], 'w').write(repr(time.monotonic()))"


@pytest.fixture
def instance():
    name = instance_name(f"s{time.monotonic_ns()}x")
    yield name
    CgroupLayout.probe().remove_instance(name)


def _holder(layout: CgroupLayout, instance: str):
    proc = start_holder(threads=1)
    cg = layout.create_job(instance, 1)
    assert cg.adopt(ProcessRef.of(proc.pid))
    return proc, JobTarget(1, root=ProcessRef.of(proc.pid), group=ProcessGroup.led_by(proc.pid),
                           cgroups=cg)


def _end(sibs: list, holder) -> None:
    for sib in sibs:
        if sib:
            sib.kill()
    if holder:
        reap(holder)


def _region_with_a_sibling(layout: CgroupLayout, backend: str, tmp_path, instance: str):
    holder, target = _holder(layout, instance)
    sib = Sibling(str(tmp_path), 2, layout.create_job(instance, 2))
    region = Enforcer(EnforceConfig(freeze=backend), layout, None).enter(
        target, [sib.target], max_hold_s=5)
    return holder, target, sib, region


def _cgroup_of(pid: int, kind: str) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            n, names, path = line.strip().split(":", 2)
            if (kind == "v2" and n == "0") or kind in names.split(","):
                return path
    return ""


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
@pytest.mark.parametrize("subtree", [True, False], ids=["subtree", "per-job"])
def test_freezing_a_device_is_one_write_whatever_the_siblings(backend, subtree, tmp_path,
                                                               instance, monkeypatch):
    """One write freezes 6 siblings; the per-job layout (negative control) needs 6."""
    layout = layout_or_skip(backend)
    sibs, holder = [], None
    writes: list[str] = []
    real = freeze_mod.write
    monkeypatch.setattr(freeze_mod, "write", lambda p, v: (writes.append(p), real(p, v)))
    try:
        holder, target = _holder(layout, instance)
        if not subtree:
            target.cgroups = None  # no device subtree: the per-job freezers
        sibs = [Sibling(str(tmp_path), i, layout.create_job(instance, i)) for i in range(2, 8)]
        enforcer = Enforcer(EnforceConfig(freeze=backend, isolate=False), layout, None)
        region = enforcer.enter(target, [s.target for s in sibs], max_hold_s=5)
        frozen_writes = list(writes)
        frozen_at, thawed_at = hold(0.3)
        report = region.exit()
        for sib in sibs:
            assert_frozen_then_resumes(sib, frozen_at, thawed_at)
        assert len(frozen_writes) == (1 if subtree else 6), frozen_writes
        assert report.processes_frozen == 6 and report.siblings_frozen == 6
        assert all(s.ok for s in report.steps), report.steps
    finally:
        _end(sibs, holder)


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_holder_runs_in_its_slot_and_goes_back_with_its_children(backend, tmp_path, instance):
    layout = layout_or_skip(backend)
    kind = KIND[backend]
    holder = sib = None
    try:
        holder, target, sib, region = _region_with_a_sibling(layout, backend, tmp_path, instance)
        try:
            during = _cgroup_of(holder.pid, kind)
            child = spawn(["sleep", "30"])  # stands in for a fork of the holder: joins its slot
            slot = target.cgroups.device.slot[kind]
            with open(slot + "/cgroup.procs", "w") as f:
                f.write(str(child.pid))
            frozen_at, thawed_at = hold(0.2)
        finally:
            report = region.exit()
        assert during.endswith("/hold-cpu"), during
        assert _cgroup_of(holder.pid, kind).endswith("/dev-cpu/job-1")
        assert child.pid in _procs(getattr(target.cgroups, kind))
        assert _procs(slot) == []
        assert_frozen_then_resumes(sib, frozen_at, thawed_at)
        assert [s.name for s in report.steps] == ["slot", "freeze", "isolate"]
        reap(child)
    finally:
        _end([sib], holder)


def _start_latecomer(cgroups, path: str) -> tuple[threading.Thread, list]:
    """Start a job process in ``cgroups`` from a thread: a frozen child blocks its
    parent's Popen until it may exec, like ``krex run``'s wrapper."""
    box: list = []

    def start() -> None:
        box.append(spawn([PY, "-c", FIRST, path], start_new_session=True,
                         preexec_fn=cgroups.join_self))

    th = threading.Thread(target=start)
    th.start()
    return th, box


@pytest.mark.parametrize("backend", CGROUP_BACKENDS + ["off"])
def test_a_job_created_during_a_region_runs_no_instruction_until_it_ends(backend, tmp_path,
                                                                       instance):
    """The latecomer rule by construction; with freezing off (negative control) it runs."""
    layout = layout_or_skip(backend)
    holder = None
    path = str(tmp_path / "first")
    th, box = None, []
    try:
        holder, target = _holder(layout, instance)
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        region = enforcer.enter(target, [], max_hold_s=5)
        try:
            entered_at = time.monotonic()
            late = layout.create_job(instance, 9)  # created while the device is held
            th, box = _start_latecomer(late, path)
            time.sleep(0.4)
        finally:
            released_at = time.monotonic()
            region.exit()
        th.join(10)
        wait_for(lambda: os.path.exists(path) and os.path.getsize(path) > 0, timeout_s=10)
        first = float(open(path).read())
        if backend == "off":
            assert entered_at < first < released_at, "control: the latecomer ran meanwhile"
        else:
            assert first > released_at, f"latecomer ran {released_at - first:.3f} s in region"
    finally:
        if th is not None:
            th.join(10)
        for p in box:
            reap(p)
        if holder:
            reap(holder)


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_isolation_is_the_slot_and_one_write_per_other_device(backend, tmp_path, instance):
    layout = layout_or_skip(backend)
    if not layout.cpuset_writable:
        pytest.skip(f"no writable cpuset: {layout.reasons}")
    all_cores = sorted(os.sched_getaffinity(0))
    if len(all_cores) < 2:
        pytest.skip("needs 2 cores")
    holder = other = None
    try:
        holder, target = _holder(layout, instance)
        other = Sibling(str(tmp_path), 3, layout.create_job(instance, 3, "fakegpu:0"))
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        cores = enforcer.cores()
        region = enforcer.enter(target, [], max_hold_s=5, others=[other.target])
        try:
            mine = os.sched_getaffinity(holder.pid)
            theirs = os.sched_getaffinity(other.proc.pid)
            records = [r for op in region.applied for r in op.undo_records()]
        finally:
            region.exit()
        assert sorted(mine) == cores
        assert not set(theirs) & set(cores)
        assert sorted(os.sched_getaffinity(other.proc.pid)) == all_cores
        slot = target.cgroups.device.slot["cpuset"]
        assert {"kind": "cpuset", "path": slot, "cpus": ",".join(map(str, all_cores))} in records
    finally:
        _end([other], holder)


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_undo_records_alone_thaw_the_device_and_unpin_the_holder(backend, tmp_path, instance):
    """What the guardian replays when the daemon is gone (no revert runs)."""
    layout = layout_or_skip(backend)
    holder = sib = None
    try:
        holder, target, sib, region = _region_with_a_sibling(layout, backend, tmp_path, instance)
        records = [r for op in reversed(region.applied) for r in op.undo_records()]
        frozen_at, replayed_at = hold(0.2)
        assert replay(records) == []
        assert_frozen_then_resumes(sib, frozen_at, replayed_at)
        if layout.cpuset_writable:
            assert sorted(os.sched_getaffinity(holder.pid)) == sorted(os.sched_getaffinity(0))
        region.exit()
    finally:
        _end([sib], holder)


# Stands in for the daemon: guardian, the new layout, a region held, then waits to be
# killed.  argv: backend, journal, instance, sibling pid, holder pid.
DAEMON = r"""
import json, sys, time
from krex.enforce.cgroups import CgroupLayout
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.guardian import GuardianClient
from krex.enforce.job import JobTarget
from krex.enforce.process import ProcessGroup, ProcessRef
backend, journal, instance, sib, hold = sys.argv[1:3] + [sys.argv[3]] + list(map(int, sys.argv[4:]))
layout = CgroupLayout.probe()
guardian = GuardianClient()
guardian.start("standin", journal)
def job(i, pid):
    cg = layout.create_job(instance, i)
    cg.adopt(ProcessRef.of(pid))
    return JobTarget(i, root=ProcessRef.of(pid), group=ProcessGroup.led_by(pid), cgroups=cg)
sibling, holder = job(2, sib), job(1, hold)
enforcer = Enforcer(EnforceConfig(freeze=backend), layout, guardian)
enforcer.enter(holder, [sibling], max_hold_s=60)
print(json.dumps({"guardian": guardian.pid, "frozen_at": time.monotonic()}), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_sigkill_of_daemon_thaws_the_device_subtree_within_a_second(backend, tmp_path,
                                                                    instance):
    layout = layout_or_skip(backend)
    sib = daemon = holder = None
    try:
        holder = start_holder(threads=1)
        sib = Sibling(str(tmp_path), 2)
        journal = str(tmp_path / "journal.json")
        daemon = spawn([PY, "-c", DAEMON, backend, journal, instance, str(sib.proc.pid),
                        str(holder.pid)])
        info = json.loads(daemon.stdout.readline())
        time.sleep(0.3)
        assert not stamps_after(sib.path, info["frozen_at"]), "sibling ran while frozen"
        killed_at = time.monotonic()
        daemon.kill()
        wait_for(lambda: sib.progressed_after(killed_at), timeout_s=10)
        resumed_at = stamps_after(sib.path, killed_at)[0]
        assert resumed_at - killed_at < 1.0, f"thawed {resumed_at - killed_at:.3f} s after SIGKILL"
        if layout.cpuset_writable:  # the holder, still in its slot, has every core again
            wait_for(lambda: sorted(os.sched_getaffinity(holder.pid))
                     == sorted(os.sched_getaffinity(0)), timeout_s=5)
        dev = layout.device(instance)
        parent = dev.parent[KIND[backend]]
        state = read(parent + ("/cgroup.freeze" if backend == "cgroup2" else "/freezer.state"))
        assert state in ("0", "THAWED")
    finally:
        if daemon:
            reap(daemon)
        if sib:
            sib.kill()
        if holder:
            os.kill(holder.pid, signal.SIGKILL)
            reap(holder)


PROBE = ("import json; from krex.enforce.cgroups import CgroupLayout; "
         "print(json.dumps(CgroupLayout.probe().bases()))")


def _unit(instance: str, name: str) -> tuple[dict[str, str], dict[str, str]]:
    """A caller's cgroup (a systemd unit, a Slurm step) in every usable hierarchy:
    (hierarchy bases, kind -> the unit's directory)."""
    bases = CgroupLayout.probe().bases()
    if not bases:
        pytest.skip("no writable cgroup hierarchy")
    unit = {k: os.path.join(b, f"krex-{instance}-{name}") for k, b in bases.items()}
    for kind, d in unit.items():
        os.makedirs(d, exist_ok=True)
        if kind == "cpuset":
            for f_name in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(d, f_name), "w") as f:
                    f.write(read(os.path.join(bases[kind], f_name)))
    return bases, unit


def _joiner(unit: dict[str, str]):
    def join() -> None:
        for d in unit.values():
            with open(d + "/cgroup.procs", "w") as f:
                f.write("0")
    return join


def test_cgroups_live_under_the_callers_own_cgroup(instance):
    """A daemon started inside a cgroup (a systemd unit, a Slurm step) makes krex's tree
    there, not at the hierarchy root; started at the root (control), at the root."""
    import subprocess

    bases, caller = _unit(instance, "caller")
    try:
        inside = json.loads(subprocess.run([PY, "-c", PROBE], preexec_fn=_joiner(caller),
                                           check=True,
                                           capture_output=True, text=True).stdout)
        outside = json.loads(subprocess.run([PY, "-c", PROBE], check=True,
                                            capture_output=True, text=True).stdout)
    finally:
        for d in caller.values():
            os.rmdir(d)
    for kind, d in caller.items():
        if kind in inside:
            assert os.path.normpath(inside[kind]) == os.path.normpath(d), (kind, inside)
            assert os.path.normpath(outside[kind]) == os.path.normpath(bases[kind])


@pytest.mark.parametrize("adhoc", [True, False], ids=["adhoc", "control-managed"])
def test_signal_freezing_stops_only_the_job_not_its_callers_group(adhoc, tmp_path):
    """An ad-hoc job's process group is its caller's (a shell pipeline): SIGSTOP goes to
    the job's own processes only.  Control: a managed job's group (its own session,
    started by krex) is stopped whole."""
    import psutil

    from krex.daemon.exclusivity import Exclusivity
    from krex.daemon.jobs import Job
    from krex.enforce.freeze import SignalFreeze

    # a "pipeline": a shell leading a group of two commands; the job is the first one
    shell = spawn(["sh", "-c", "sleep 30 & sleep 31 & wait"], start_new_session=True)

    def sleeps() -> list[psutil.Process]:
        """The shell's two children once both run `sleep` (a forked child's command line
        is the shell's, or empty, until it has exec'd: seen as an IndexError in CI)."""
        try:
            kids = psutil.Process(shell.pid).children()
            return kids if len(kids) == 2 and all(
                k.cmdline()[:1] == ["sleep"] for k in kids) else []
        except psutil.Error:
            return []

    try:
        wait_for(lambda: sleeps())
        member, mate = sorted(sleeps(), key=lambda p: p.cmdline()[-1])
        owner = ProcessRef.of(member.pid)
        job = Job(5, "j", "cpu", "region", "adhoc" if adhoc else "managed", owner,
                  root=None if adhoc else owner, group=ProcessGroup.led_by(shell.pid))
        target = Exclusivity.target(object.__new__(Exclusivity), job)
        op = SignalFreeze([target])
        op.apply()
        try:
            states = {p.pid: ProcessRef.of(p.pid).state() for p in (member, mate)}
        finally:
            op.revert()
        assert states[member.pid] == "T"
        assert states[mate.pid] == ("S" if adhoc else "T"), states
    finally:
        for p in psutil.Process(shell.pid).children():
            with contextlib.suppress(psutil.Error):
                p.kill()
        reap(shell)


def test_adopted_processes_go_back_where_they_came_from(instance):
    """A registered (adopted) process leaves with its job's end for the cgroups it came
    from; a process that joined at start (control) goes to the cgroup krex's tree is in."""
    layout = CgroupLayout.probe()
    bases, caller = _unit(instance, "unit")
    adopted = spawn(["sleep", "30"], preexec_fn=_joiner(caller))
    joined = None
    try:
        job = layout.create_job(instance, 1)
        assert job.adopt(ProcessRef.of(adopted.pid))
        joined = spawn(["sleep", "30"], preexec_fn=job.join_self)
        assert adopted.pid in _procs(job.own()[0])
        own = job.own()
        job.remove()
        for kind, d in caller.items():
            if job.paths().get(kind):
                assert adopted.pid in _procs(d), kind
            if job.paths().get(kind) in own:  # (a v1 cpuset is the device's: it stays)
                assert joined.pid in _procs(os.path.normpath(bases[kind])), kind
    finally:
        reap(adopted)
        if joined:
            reap(joined)
        for d in caller.values():
            os.rmdir(d)


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_node_scope_freezes_each_device_subtree_once(backend, tmp_path, instance, monkeypatch):
    """Siblings on another device (``--freeze-scope node``): one write per device."""
    layout = layout_or_skip(backend)
    writes: list[str] = []
    real = freeze_mod.write
    monkeypatch.setattr(freeze_mod, "write", lambda p, v: (writes.append(p), real(p, v)))
    holder, sibs = None, []
    try:
        holder, target = _holder(layout, instance)
        sibs = [Sibling(str(tmp_path), i, layout.create_job(instance, i, "fakegpu:0"))
                for i in (2, 3)]
        region = Enforcer(EnforceConfig(freeze=backend, isolate=False), layout, None).enter(
            target, [s.target for s in sibs], max_hold_s=5)
        frozen_writes = list(writes)
        frozen_at, thawed_at = hold(0.2)
        region.exit()
        for sib in sibs:
            assert_frozen_then_resumes(sib, frozen_at, thawed_at)
        assert sorted(os.path.basename(os.path.dirname(w)) for w in frozen_writes) == \
            ["dev-cpu", "dev-fakegpu_0"], frozen_writes
    finally:
        _end(sibs, holder)


PROBE_BASES = r"""
import json
from krex.enforce.cgroups import CgroupLayout
layout = CgroupLayout.probe()
print(json.dumps(layout.bases()))
"""


def test_a_daemon_started_inside_a_krex_tree_puts_its_own_beside_it(tmp_path):
    """Found by the suite: a test process adopted as a holder by a daemon that was then
    SIGKILLed stays in that daemon's holder slot; the next daemon it started made its
    tree *inside* the dead one (nested krex-<a>/hold-cpu/krex-<b>/...), so its sweep
    never saw the dead tree and the test process kept one core for the rest of the run.
    Now the base is cut at the first krex- component.  Control: a caller in a plain
    (non-krex) cgroup keeps it as its base."""
    layout = CgroupLayout.probe()
    if not layout.cpuset_writable or not layout.cpuset:
        pytest.skip(f"no writable v1 cpuset: {layout.reasons}")
    root = layout.mounts["cpuset"]
    dead = os.path.join(root, f"krex-d{os.getpid()}-1")  # no such daemon: a dead instance
    plain = os.path.join(root, f"plaintest-{os.getpid()}")
    made = []
    try:
        for d in (dead, dead + "/hold-cpu", plain):
            os.mkdir(d)
            made.append(d)
            for f in ("cpuset.mems", "cpuset.cpus"):
                with open(os.path.join(os.path.dirname(d), f)) as src:
                    value = src.read().strip()
                with open(os.path.join(d, f), "w") as dst:
                    dst.write(value)
        bases = {}
        for where in (dead + "/hold-cpu", plain):
            proc = spawn([PY, "-c", "import sys; sys.stdin.read(); exec(sys.argv[1])",
                          PROBE_BASES], stdin=-1, stdout=-1)
            try:
                with open(where + "/cgroup.procs", "w") as f:
                    f.write(str(proc.pid))
                out, _ = proc.communicate("", timeout=60)
            finally:
                reap(proc)
            bases[where] = json.loads(out)["cpuset"]
        assert bases[dead + "/hold-cpu"] == root.rstrip("/") or \
            os.path.realpath(bases[dead + "/hold-cpu"]) == os.path.realpath(root), bases
        assert os.path.realpath(bases[plain]) == os.path.realpath(plain), bases  # control
    finally:
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
@pytest.mark.parametrize("first", [True, False], ids=["thaw-first", "control-stack-order"])
def test_a_regions_end_thaws_the_device_before_the_rest_of_its_undo(backend, first, tmp_path,
                                                                    instance, monkeypatch):
    """The siblings (at a chain's end, the next holder among them) are thawed right
    after the holder's counters are read, before the isolation and the slot are undone;
    the report still counts them frozen.  Control: the plain stack order (isolation
    first) is what a region without the early thaw does."""
    from krex.enforce.enforcer import Enforcement
    from krex.enforce.freeze import SubtreeFreeze
    from krex.enforce.isolation import SlotIsolation
    from krex.enforce.slot import HolderSlot

    layout = layout_or_skip(backend)
    if not first:
        monkeypatch.setattr(Enforcement, "_thaw_first", lambda self: None)
    order: list[str] = []
    for cls in (SubtreeFreeze, SlotIsolation, HolderSlot):
        real = cls.revert
        monkeypatch.setattr(cls, "revert", lambda self, _r=real: (order.append(self.name),
                                                                   _r(self))[1])
    holder = sib = None
    try:
        holder, target, sib, region = _region_with_a_sibling(layout, backend, tmp_path, instance)
        frozen_at, thawed_at = hold(0.2)
        report = region.exit()
        assert_frozen_then_resumes(sib, frozen_at, thawed_at)
        assert report.processes_frozen == 1 and report.siblings_frozen == 1
        assert all(s.ok for s in report.steps), report.steps
        assert order.count("freeze") == 1, order
        if "isolate" not in order:
            pytest.skip("no slot isolation here (no writable v1 cpuset): nothing to order")
        if first:
            assert order[0] == "freeze", order
        else:
            assert order.index("freeze") > 0, order
    finally:
        _end([sib], holder)
