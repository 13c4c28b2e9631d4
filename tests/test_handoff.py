"""Overlapped handoff (issue 18): the device subtree stays frozen from one holder to the
next, only the holders move; the outgoing report stays truthful; crashes mid-chain
leave nothing frozen.  Enforcement without the scheduler, then through a real daemon."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import threading
import time

import psutil
import pytest
from daemon_support import freezes, loop_rows, start_loops
from enforce_support import Sibling, layout_or_skip, stamps_after
from fakes import FakeSession, ScriptedExclusivity
from helpers import PY, Daemon, krex, reap, spawn, wait_for

from krex.enforce import freeze as freeze_mod
from krex.enforce.cgroups import CgroupLayout, _procs, instance_name, read
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.handoff import lease_handed
from krex.enforce.process import ProcessRef
from krex.enforce.undo import replay

LAYOUT = CgroupLayout.probe()
CGROUP_BACKENDS = ["cgroup2", "cgroup1"]
KIND = {"cgroup2": "v2", "cgroup1": "freezer"}
CONTROL = {"cgroup2": ("cgroup.freeze", "0"), "cgroup1": ("freezer.state", "THAWED")}


@pytest.fixture
def instance():
    name = instance_name(f"h{time.monotonic_ns()}x")
    yield name
    CgroupLayout.probe().remove_instance(name)


def _jobs(layout, instance, tmp_path, n=3):
    """n stamping jobs of one device, each in its own job cgroups."""
    return [Sibling(str(tmp_path), i, layout.create_job(instance, i)) for i in range(1, n + 1)]


def _quiet(sib: Sibling, t0: float, t1: float) -> bool:
    return not [x for x in sib.stamps() if t0 < x < t1]


def _thawed(layout, instance, backend) -> bool:
    control, value = CONTROL[backend]
    parent = layout.device(instance).parent[KIND[backend]]
    return read(os.path.join(parent, control)) == value


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_a_handoff_keeps_the_device_frozen_and_moves_only_the_holders(
        backend, tmp_path, instance, monkeypatch):
    """A holds with B and C frozen; A hands over to B: no freeze write, A stops, B runs,
    C never runs; A's report counts B and C frozen; the parent thaws once, at B's end.
    Control: undoing A's region and entering B's writes the freeze control twice."""
    layout = layout_or_skip(backend)
    jobs = _jobs(layout, instance, tmp_path)
    a, b, c = jobs
    writes: list[str] = []
    real = freeze_mod.write
    monkeypatch.setattr(freeze_mod, "write", lambda p, v: (writes.append(p), real(p, v)))
    try:
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        records = [r for op in reversed(first.applied) for r in op.undo_records()]
        time.sleep(0.2)
        before = len(writes)
        t_hand = time.monotonic()
        second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5)
        assert second is not None
        assert len(writes) == before, writes[before:]  # nothing thawed, nothing re-frozen
        slot_cpuset = layout.device(instance).slot.get("cpuset")
        if slot_cpuset and a.target.cgroups.cpuset != slot_cpuset:  # v1: moved after the grant
            assert a.proc.pid in _procs(slot_cpuset)
            lease_handed(second)
            # a stays there, frozen, staged for a handoff back to it (Enforcement.staged)
            assert second.staged == {a.target.job_id: [a.proc.pid]}
            assert b.proc.pid in _procs(slot_cpuset)
        report = first.exit()  # made after the grant: the subtree stays frozen
        assert not _thawed(layout, instance, backend)
        time.sleep(0.3)
        t_end = time.monotonic()
        assert _quiet(c, t_hand - 0.2, t_end)  # frozen through both regions
        assert _quiet(a, t_hand + 0.05, t_end)  # back among the frozen at the handoff
        assert stamps_after(b.path, t_hand + 0.05)  # the new holder runs
        assert report.processes_frozen == 2 and report.siblings_frozen == 2
        assert all(s.ok for s in report.steps), report.steps
        assert [s.name for s in second.steps] == [s.name for s in report.steps]
        assert [r for op in reversed(second.applied) for r in op.undo_records()] == records
        done = second.exit()
        assert done.processes_frozen == 2 and all(s.ok for s in done.steps), done.steps
        assert _thawed(layout, instance, backend)
        if slot_cpuset and a.target.cgroups.cpuset != slot_cpuset:  # put back before the thaw
            assert _procs(slot_cpuset) == [] and a.proc.pid in _procs(a.target.cgroups.cpuset)
        kind = KIND[backend]
        assert b.proc.pid in _procs(getattr(b.target.cgroups, kind))  # back in its job
        assert _procs(layout.device(instance).slot[kind]) == []
        thawed_at = time.monotonic()
        wait_for(lambda: all(s.progressed_after(thawed_at) for s in jobs), 10)
        # the control: the same two regions without the handoff
        third = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        mark = len(writes)
        third.exit()
        enforcer.enter(b.target, [a.target, c.target], max_hold_s=5).exit()
        assert len(writes) - mark >= 3, writes[mark:]  # thaw, freeze (and thaw again)
    finally:
        for s in jobs:
            s.kill()


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
@pytest.mark.parametrize("handoff", [True, False], ids=["handed-over", "plain"])
@pytest.mark.parametrize("seen", [True, False], ids=["seen-frozen-at-grant", "not-yet"])
@pytest.mark.parametrize("thaw", [True, False], ids=["thawed-in-its-region", "control"])
def test_a_region_answers_for_its_frozen_subtree_at_its_end(
        backend, thaw, seen, handoff, tmp_path, instance, monkeypatch):
    """A region still answers at its end for the subtree it froze: one someone thawed
    during the region makes its freeze step timed out (not clean), whether the grant
    already saw the subtree "frozen" or not, and whether the region handed the subtree
    over to the next holder (the chain goes on) or thaws it itself.  Control: untouched,
    the freeze is confirmed.  A handoff itself reads no freeze state (confirmed after
    the grant).  ``seen`` fixes what the grant's one look finds (it depends on whether
    the siblings were on a CPU), so both paths are taken on any machine."""
    layout = layout_or_skip(backend)
    jobs = _jobs(layout, instance, tmp_path)
    a, b, c = jobs
    control, thawed = CONTROL[backend]
    parent = layout.device(instance).parent[KIND[backend]]
    reads: list[str] = []
    real = freeze_mod.read
    monkeypatch.setattr(freeze_mod, "read", lambda p: (reads.append(p), real(p))[1])
    look = "_v2_frozen" if backend == "cgroup2" else "_v1_frozen"
    real_look = getattr(freeze_mod, look)
    try:
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        monkeypatch.setattr(freeze_mod, look, lambda d: seen)
        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        monkeypatch.setattr(freeze_mod, look, real_look)
        time.sleep(0.05)
        if thaw:  # another root process, say
            with open(os.path.join(parent, control), "w") as f:
                f.write(thawed)
        second = None
        if handoff:
            mark = len(reads)
            second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5)
            assert second is not None
            assert not [p for p in reads[mark:] if p.startswith(parent)], reads[mark:]
            lease_handed(second)
        report = first.exit()
        step = next(s for s in report.steps if s.name == "freeze")
        if thaw:
            assert step.timed_out and not step.ok and "thawed" in (step.error or ""), step
        else:
            assert step.ok and not step.timed_out, step
        if second is not None:
            second.exit()
        assert _thawed(layout, instance, backend)
    finally:
        for s in jobs:
            s.kill()


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_a_handoff_is_refused_when_a_sibling_runs_outside_its_cgroup(backend, tmp_path,
                                                                    instance):
    """A sibling without a cgroup is SIGSTOPped per process: not carried over (None,
    nothing changed); the control with every sibling in its cgroup is carried."""
    layout = layout_or_skip(backend)
    jobs = _jobs(layout, instance, tmp_path, n=2)
    loose = Sibling(str(tmp_path), 9)
    try:
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        a, b = jobs
        first = enforcer.enter(a.target, [b.target, loose.target], max_hold_s=5)
        assert enforcer.hand_over(first, b.target, [a.target, loose.target],
                                  max_hold_s=5) is None
        report = first.exit()  # the ordinary undo still works
        assert all(s.ok for s in report.steps)
        assert _thawed(layout, instance, backend)
        first = enforcer.enter(a.target, [b.target], max_hold_s=5)
        second = enforcer.hand_over(first, b.target, [a.target], max_hold_s=5)
        assert second is not None  # the control
        first.exit()
        second.exit()
    finally:
        loose.kill()
        for s in jobs:
            s.kill()


# Stands in for a daemon mid-chain: A's region, handed over to B, then (LEASED=1) B's
# lease sent, or (0) killed between B's grant and its lease.  Waits to be killed.
# argv: backend, journal, instance, leased, pids of A, B, C.
CHAIN = r"""
import json, sys, time
from krex.enforce.cgroups import CgroupLayout
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.guardian import GuardianClient
from krex.enforce.handoff import lease_handed
from krex.enforce.job import JobTarget
from krex.enforce.process import ProcessGroup, ProcessRef
backend, journal, instance = sys.argv[1:4]
leased, pids = sys.argv[4] == "1", list(map(int, sys.argv[5:]))
layout, guardian = CgroupLayout.probe(), GuardianClient()
guardian.start("standin-chain", journal)
targets = []
for i, pid in enumerate(pids, 1):
    ref = ProcessRef.of(pid)
    cgroups = layout.create_job(instance, i)
    cgroups.adopt(ref)
    targets.append(JobTarget(i, root=ref, group=ProcessGroup.led_by(pid), cgroups=cgroups))
a, b, c = targets
enforcer = Enforcer(EnforceConfig(freeze=backend), layout, guardian)
first = enforcer.enter(a, [b, c], max_hold_s=60)
second = enforcer.hand_over(first, b, [a, c], max_hold_s=60)
assert second is not None
if leased:
    lease_handed(second)
print(json.dumps({"frozen_at": time.monotonic(), "ended": sorted(guardian.leases)}), flush=True)
time.sleep(600)
"""

def test_the_likely_next_holder_waits_frozen_in_the_slots_cpuset(tmp_path, instance,
                                                                  monkeypatch):
    """After a grant the job likely to hold next is put, frozen, into the slot's v1
    cpuset (``prefetch``): the handoff to it writes no cpuset move on the grant path,
    and it never runs before that.  Control: a handoff to another job moves that one's
    cpuset as before; the staged job stays frozen, and at the chain's end it is back
    in its device's cpuset before the thaw.  A staged job that ends leaves the slot."""
    from krex.enforce import slot as slot_mod

    backend = "cgroup2" if LAYOUT.v2_writable else "cgroup1"
    layout = layout_or_skip(backend)
    if not layout.cpuset_writable:
        pytest.skip("needs a writable cgroup v1 cpuset")
    a, b, c = _jobs(layout, instance, tmp_path)
    cpuset = layout.device(instance).slot["cpuset"]
    writes: list[tuple[str, str]] = []
    real = slot_mod.write
    monkeypatch.setattr(slot_mod, "write", lambda p, v: (writes.append((p, v)), real(p, v)))
    thaw = freeze_mod.write
    monkeypatch.setattr(freeze_mod, "write", lambda p, v: (writes.append((p, v)), thaw(p, v)))
    try:
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        time.sleep(0.1)
        t0 = time.monotonic()
        assert first.prefetch(b.target)
        assert b.proc.pid in _procs(cpuset)  # staged
        time.sleep(0.2)
        assert _quiet(b, t0, time.monotonic())  # and still frozen
        before = len(writes)
        second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5)
        assert second is not None
        moved = [v for p, v in writes[before:] if p == cpuset + "/cgroup.procs"]
        assert moved == [], moved  # no cpuset move of b on the grant path
        first.exit()
        t1 = time.monotonic()
        wait_for(lambda: stamps_after(b.path, t1), timeout_s=5)  # b holds and runs
        # the control: staged c, but a is granted next
        assert second.prefetch(c.target) and c.proc.pid in _procs(cpuset)
        before = len(writes)
        third = enforcer.hand_over(second, a.target, [b.target, c.target], max_hold_s=5)
        assert third is not None
        moved = [v for p, v in writes[before:] if p == cpuset + "/cgroup.procs"]
        assert str(a.proc.pid) in moved, moved  # not staged: moved on the grant path
        second.exit()
        t2 = time.monotonic()
        time.sleep(0.2)
        assert _quiet(c, t2, time.monotonic()) and c.proc.pid in _procs(cpuset)
        before = len(writes)
        third.exit()  # the chain's end: c back in the device's cpuset, then thawed
        ends = [(os.path.basename(p), v) for p, v in writes[before:]]
        control, value = CONTROL[backend]
        assert ("cgroup.procs", str(c.proc.pid)) in ends and (control, value) in ends, ends
        assert ends.index(("cgroup.procs", str(c.proc.pid))) < ends.index((control, value))
        assert c.proc.pid not in _procs(cpuset)
        assert c.target.cgroups.cpuset and c.proc.pid in _procs(c.target.cgroups.cpuset)
        t3 = time.monotonic()
        wait_for(lambda: stamps_after(c.path, t3), timeout_s=5)  # thawed: it runs again
        # a staged job that ends leaves the slot's cpuset (it is thawed as it goes)
        fourth = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        assert fourth.prefetch(c.target) and c.proc.pid in _procs(cpuset)
        c.target.cgroups.remove()
        assert c.proc.pid not in _procs(cpuset)
        fourth.exit()
    finally:
        for j in (a, b, c):
            j.kill()


@pytest.mark.parametrize("expire", [True, False], ids=["lease-expired", "control"])
def test_a_handoff_is_refused_once_the_guardian_expired_the_lease(expire, tmp_path, instance):
    """The grant path knows a lease alive from its own clock (no read of the guardian's
    pipe); past that clock it asks the guardian, and a lease it expired (it undid what
    the region carries) is not carried over: the handoff is refused and the region
    reports its revocation.  Control: a lease not yet run out is carried."""
    from krex.enforce.guardian import GuardianClient

    backend = "cgroup2" if LAYOUT.v2_writable else "cgroup1"
    layout = layout_or_skip(backend)
    a, b, c = _jobs(layout, instance, tmp_path)
    guardian = GuardianClient()
    try:
        guardian.start("t", str(tmp_path / "j.json"))
        margin = 0.2 if expire else 30.0
        enforcer = Enforcer(EnforceConfig(freeze=backend, lease_margin_s=margin), layout,
                            guardian)
        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=0.1)
        assert guardian.surely_active(first.lease_id)
        if expire:
            wait_for(lambda: first.lease_id in guardian.expired(), timeout_s=5)
            assert not guardian.surely_active(first.lease_id)
        second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5)
        assert (second is None) == expire
        report = first.exit()
        if second is not None:
            second.exit()
            assert not any(r.code.value == "lease_expired" for r in second.reasons)
        assert any(r.code.value == "lease_expired" for r in first.reasons) == expire, report
    finally:
        guardian.stop()
        for j in (a, b, c):
            j.kill()



@pytest.mark.parametrize("leased", [True, False], ids=["after-lease", "before-lease"])
@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_sigkill_of_the_daemon_mid_chain_thaws_everything(backend, leased, tmp_path,
                                                          instance):
    """Killed right after a handoff's grant, before the new lease was sent (the old
    lease's records are the same and still held), or after it: the guardian thaws the
    device and gives the holder every core back within a second."""
    layout = layout_or_skip(backend)
    jobs = [Sibling(str(tmp_path), i) for i in (1, 2, 3)]
    daemon = None
    try:
        journal = str(tmp_path / "journal.json")
        daemon = spawn([PY, "-c", CHAIN, backend, journal, instance, "1" if leased else "0",
                        *(str(s.proc.pid) for s in jobs)])
        info = json.loads(daemon.stdout.readline())
        assert len(info["ended"]) == 1  # one lease at a time: the old one ended, or not yet
        time.sleep(0.2)
        a, b, c = jobs
        assert _quiet(c, info["frozen_at"], time.monotonic())
        killed_at = time.monotonic()
        daemon.kill()
        for s in (a, c):
            wait_for(lambda s=s: s.progressed_after(killed_at), timeout_s=10)
            assert stamps_after(s.path, killed_at)[0] - killed_at < 1.0
        if layout.cpuset_writable:  # the new holder, still in the slot, has every core
            wait_for(lambda: sorted(os.sched_getaffinity(b.proc.pid))
                     == sorted(os.sched_getaffinity(0)), timeout_s=5)
        assert _thawed(layout, instance, backend)
    finally:
        if daemon:
            reap(daemon)
        for s in jobs:
            s.kill()


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_undo_records_alone_end_a_chain(backend, tmp_path, instance):
    """The guardian's replay of the chain's current lease (no revert runs)."""
    layout = layout_or_skip(backend)
    jobs = _jobs(layout, instance, tmp_path)
    try:
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        a, b, c = jobs
        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5)
        assert second is not None
        lease_handed(second)  # no guardian: a no-op, and nothing left pending
        first.exit()
        third = enforcer.hand_over(second, c.target, [a.target, b.target], max_hold_s=5)
        assert third is not None
        second.exit()
        replayed_at = time.monotonic()
        assert replay([r for op in reversed(third.applied) for r in op.undo_records()]) == []
        for s in jobs:
            wait_for(lambda s=s: s.progressed_after(replayed_at), timeout_s=10)
        if layout.cpuset_writable:
            assert sorted(os.sched_getaffinity(c.proc.pid)) == sorted(os.sched_getaffinity(0))
        third.exit()
    finally:
        for s in jobs:
            s.kill()


# A job taking N back-to-back regions of HOLD_MS; prints its grants' and releases'
# monotonic times and its reports.  argv: N, hold_ms.
CONTENDER = r"""
import json, sys, time
from krex.client.connection import Client
n, hold_s = int(sys.argv[1]), float(sys.argv[2]) / 1e3
c = Client(autostart=False)
job = c.register()["job_id"]
print("ready", flush=True)
sys.stdin.readline()
rows = []
for _ in range(n):
    rid = c.acquire(job)["region"]
    end = time.perf_counter() + hold_s
    while time.perf_counter() < end:
        pass
    rows.append(c.release(rid)["report"])
print(json.dumps({"job": job, "reports": rows}), flush=True)
c.close()
"""


def _contenders(sock: str, n_jobs: int, regions: int, hold_ms: float = 3.0):
    env = {**os.environ, "KREX_SOCKET": sock}
    procs = [subprocess.Popen([PY, "-c", CONTENDER, str(regions), str(hold_ms)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env, start_new_session=True) for _ in range(n_jobs)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return procs


@pytest.mark.root
def test_a_chain_of_handoffs_through_the_daemon_reports_truthfully(tmp_path):
    """Four jobs back to back: many grants are handed over (their freeze step writes
    nothing); every report counts each sibling's process frozen, the next holder's
    included; no two regions overlap.  Control: with --freeze off nothing is carried."""
    if os.geteuid() != 0:
        pytest.skip("needs root for cgroups")
    results = {}
    for name, extra in (("on", ()), ("off", ("--freeze", "off"))):
        rt = tmp_path / name
        rt.mkdir(mode=0o700)
        d = Daemon(str(rt), *extra).start()
        procs = []
        try:
            procs = _contenders(d.socket, 4, 12)
            outs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
        finally:
            for p in procs:
                reap(p)
            d.stop()
        results[name] = outs
    reports = [r for o in results["on"] for r in o["reports"]]
    carried = [r for r in reports if _carried(r)]
    assert len(carried) >= len(reports) // 3, [r["host"]["steps"] for r in reports[:4]]
    # one process per job: a handed-over region still counts the next holder it froze,
    # and a job frozen before it asked (it may wait a whole chain) is counted too
    alive = _alive_counts(results["on"])
    counts = [(r["host"]["processes_frozen"], r["host"]["siblings_frozen"]) for r in reports]
    assert sum(s == 3 for _, s in counts) >= len(counts) // 2, counts
    wrong = [(r["host"]["processes_frozen"], alive[r["region"]]) for r in reports
             if r["region"] in alive and r["host"]["processes_frozen"] != alive[r["region"]]]
    assert len(alive) >= 8 and not wrong, (wrong, len(alive))
    spans = sorted((r["granted_mono_s"], r["released_mono_s"]) for r in reports)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:], strict=False)), "overlap"
    assert not any(_carried(r) for o in results["off"] for r in o["reports"])  # the control


def _alive_counts(outs: list[dict]) -> dict[int, int]:
    """region -> its siblings' processes frozen, for each region whose report is made
    while all of them are sure to be alive: a job's process exits after its last release,
    and a region's report is made on the device's lane before that lane reads the release
    of the region granted after it, so a job whose last grant comes two or more grants
    after this one is alive when this report counts it.  (With one process per job.)"""
    order = sorted((r["granted_mono_s"], o["job"], r["region"]) for o in outs
                   for r in o["reports"])
    last = {job: i for i, (_, job, _) in enumerate(order)}
    return {region: len(last) - 1 for i, (_, job, region) in enumerate(order)
            if all(n >= i + 2 for j, n in last.items() if j != job)}


def _carried(report: dict) -> bool:
    return any(s["name"] == "freeze" and s["apply_ms"] is not None and s["apply_ms"] < 0.02
               for s in report["host"]["steps"]) and report["host"]["freeze_backend"] != "off"


# A job taking back-to-back 3 ms regions until its daemon is gone; a line per region.
LOOP = r"""
import sys, time
from krex.client.connection import Client
c = Client(autostart=False)
job = c.register()["job_id"]
f = open(sys.argv[1], "a", buffering=1)
print("ready", flush=True)
while True:
    rid = c.acquire(job)["region"]
    end = time.perf_counter() + 0.003
    while time.perf_counter() < end:
        pass
    c.release(rid)
    f.write(f"{time.monotonic()}\n")
"""


def _loops(sock: str, tmp_path, n: int = 3):
    env = {**os.environ, "KREX_SOCKET": sock}
    procs = []
    for i in range(n):
        procs.append(subprocess.Popen([PY, "-c", LOOP, str(tmp_path / f"loop{i}")],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, env=env, start_new_session=True))
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


def _regions_after(path, t: float) -> int:
    try:
        with open(path) as f:
            return sum(1 for x in f.read().split() if float(x) > t)
    except (OSError, ValueError):
        return 0


def _krex_frozen(daemon_pid: int) -> list[str]:
    """This daemon's device subtrees that are frozen (v1 freezer, v2)."""
    out = []
    bases = LAYOUT.bases()
    for base in filter(None, (bases.get("freezer"), bases.get("v2"))):
        for d in glob.glob(os.path.join(base, f"**/krex-d{daemon_pid}-*/dev-*"),
                           recursive=True):
            for control, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                path = os.path.join(d, control)
                if os.path.exists(path) and read(path) != thawed:
                    out.append(path)
    return out


@pytest.mark.root
@pytest.mark.parametrize("crash", ["daemon", "guardian+daemon", "holder"])
def test_a_crash_mid_chain_leaves_nothing_frozen_and_the_shield_undone(crash, tmp_path):
    """Three jobs hand the device to each other back to back; then the daemon, the
    daemon and its guardian, or one holder is SIGKILLed.  Every job runs again (the
    loops end, or go on), the device subtrees are thawed, the shield's rest cpuset goes."""
    if os.geteuid() != 0 or not (LAYOUT.freezer_writable or LAYOUT.v2_writable):
        pytest.skip("needs root and a cgroup freezer")
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    d = Daemon(str(rt)).start()
    procs = []
    try:
        procs = _loops(d.socket, tmp_path)
        t0 = time.monotonic()
        wait_for(lambda: all(_regions_after(tmp_path / f"loop{i}", t0) >= 5 for i in range(3)),
                 timeout_s=20)
        pid = d.proc.pid
        wait_for(lambda: _krex_frozen(pid), timeout_s=5)  # the check sees a held region
        if crash == "holder":
            procs[0].kill()
            killed_at = time.monotonic()
            wait_for(lambda: all(_regions_after(tmp_path / f"loop{i}", killed_at) >= 5
                                 for i in (1, 2)), timeout_s=20)
            d.stop()
        else:
            if crash == "guardian+daemon":
                for p in psutil.Process(pid).children():
                    if "krex.enforce.guardian" in " ".join(p.cmdline()):
                        p.kill()
            os.kill(pid, signal.SIGKILL)
            d.proc.wait(10)
            if crash == "guardian+daemon":  # nobody left to thaw: the next daemon sweeps
                d = Daemon(str(rt)).start()
                d.stop()
        for p in procs:  # a frozen job could not end
            p.wait(timeout=15)
        assert not _krex_frozen(pid)
        wait_for(lambda: not glob.glob(os.path.join(LAYOUT.cpuset or "/nonexistent",
                                                    f"krex-shield{pid}-*")), timeout_s=10)
    finally:
        for p in procs:
            reap(p)
        d.stop()


def test_gates_stay_closed_across_a_handoff_only_the_holders_change(tmp_path, instance):
    """GPU step: A holds with B's and C's gates closed; at the handoff to B only A's gate
    closes (and only A is drained) and B's opens; C's is not closed again (same
    generation).  Control: a drain that times out changes nothing (A's gate open
    again, the handoff raises) and the ordinary undo opens every gate."""
    from krex.enforce.gate import GateFile
    from krex.enforce.gatedrain import GatedJob, GateDrain
    from krex.errors import DrainTimeout

    layout = layout_or_skip("cgroup1")
    jobs = _jobs(layout, instance, tmp_path)
    gates = {}
    for s in jobs:
        path = str(tmp_path / f"gate-{s.target.job_id}")
        gates[s.target.job_id] = GatedJob(s.target.job_id, GateFile.create(path), path)
    a, b, c = jobs
    ga, gb, gc = (gates[s.target.job_id].gate for s in jobs)
    victim = None
    try:
        enforcer = Enforcer(EnforceConfig(freeze="cgroup1"), layout, None)

        def drain(*targets):
            return [GateDrain([gates[t.target.job_id] for t in targets], timeout_s=0.3)]

        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5,
                               pre_ops=drain(b, c))
        assert (ga.is_closed(), gb.is_closed(), gc.is_closed()) == (False, True, True)
        c_generation = gc.generation()
        second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5,
                                    pre_ops=drain(a, c))
        assert second is not None
        assert (ga.is_closed(), gb.is_closed(), gc.is_closed()) == (True, False, True)
        assert gc.generation() == c_generation  # kept closed, not closed again
        first.exit()
        assert (ga.is_closed(), gb.is_closed(), gc.is_closed()) == (True, False, True)
        report = second.exit()
        assert not any(g.is_closed() for g in (ga, gb, gc))
        assert all(s.ok for s in report.steps), report.steps
        # the control: B's process never acknowledges the drain when C takes over
        victim = spawn([PY, "-c", "import time; time.sleep(60)"])
        p = gb._dev(0).procs[0]
        p.pid, p.start_time = victim.pid, ProcessRef.of(victim.pid).start_time
        first = enforcer.enter(b.target, [a.target, c.target], max_hold_s=5,
                               pre_ops=drain(a, c))
        with pytest.raises(DrainTimeout):
            enforcer.hand_over(first, c.target, [a.target, b.target], max_hold_s=5,
                               pre_ops=drain(a, b))
        assert not gb.is_closed() and ga.is_closed() and gc.is_closed()  # as before
        first.exit()
        assert not any(g.is_closed() for g in (ga, gb, gc))
    finally:
        if victim:
            reap(victim)
        for s in jobs:
            s.kill()
        for g in gates.values():
            g.gate.unlink()


# A fakegpu job under `krex run`: REGIONS back-to-back regions, each launching three
# 1 ms kernels and synchronising; prints the reports' host evidence as JSON.
GPU_JOB = r"""
import ctypes, json, sys
import krex
lib = ctypes.CDLL("libcuda.so.1")
def ok(rc):
    assert rc == 0, rc
dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
for rc in (lambda: lib.cuInit(0), lambda: lib.cuDeviceGet(ctypes.byref(dev), 0),
           lambda: lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
           lambda: lib.cuCtxSetCurrent(ctx),
           lambda: lib.cuModuleLoadData(ctypes.byref(mod), b"fake"),
           lambda: lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_us_1000")):
    ok(rc())
args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)
print("ready", flush=True)
sys.stdin.readline()
done = []
def launch():
    for _ in range(3):
        ok(lib.cuLaunchKernel(fn, *args))
    ok(lib.cuCtxSynchronize())
if sys.argv[2] == "pipelined":  # each release asks for the next region too
    for r in krex.regions(int(sys.argv[1]), device="fakegpu:0"):
        launch()
        done.append(r)
else:
    for _ in range(int(sys.argv[1])):
        with krex.region(device="fakegpu:0") as r:
            launch()
        done.append(r)
print(json.dumps([r.report.host.to_dict() for r in done]), flush=True)
"""


@pytest.mark.root
@pytest.mark.parametrize(("jobs", "how"), [(3, "plain"), (3, "pipelined"), (1, "pipelined")])
def test_a_gpu_chain_hands_the_gates_over_and_every_holder_can_launch(runtime_dir,
                                                                      monkeypatch, jobs, how):
    """Fakegpu jobs back to back: grants are handed over with the gates carried
    (a handed-over holder whose gate stayed closed would park at its first launch and
    never finish); every region gated each of its sibling jobs.  Pipelined
    (``krex.regions``): every grant but the first is handed over — alone, a job's next
    region is handed to itself, its gate closed (drained) and opened again."""
    from krex.devices import fakegpu

    if not fakegpu.available() or os.geteuid() != 0:
        pytest.skip("needs fakegpu and root")
    d = Daemon(str(runtime_dir)).start()
    monkeypatch.setenv("KREX_SOCKET", d.socket)
    procs = []
    try:
        procs = [krex("run", "--device", "fakegpu:0", "--", PY, "-c", GPU_JOB, "8", how,
                      stdin=subprocess.PIPE) for _ in range(jobs)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    finally:
        for p in procs:
            reap(p)
        d.stop()
    hosts = [h for out, _ in outs for h in json.loads(out.strip().splitlines()[-1])]
    steps = [{s["name"]: s for s in h["steps"]} for h in hosts]
    assert all(s["gate_drain"]["ok"] for s in steps), steps
    handed = [h for h in hosts if h["handed_over"]]
    print(f"{len(handed)}/{len(hosts)} handed over")
    if how == "pipelined":  # set up: each job's first region, and one after a job ends
        assert len(handed) >= len(hosts) - 2 * jobs, [h["handed_over"] for h in hosts]
    else:
        assert handed and len(handed) < len(hosts)  # chains end: some are set up again
    # every sibling job (fewer near the end, as jobs finish) gated, handed over or not
    assert all((h["gated_jobs"] or 0) == h["siblings_frozen"] for h in hosts), \
        [(h["gated_jobs"], h["siblings_frozen"]) for h in hosts]
    assert any((h["gated_jobs"] or 0) == jobs - 1 for h in hosts)


class _ThreadNoting(ScriptedExclusivity):
    """Enforcement that does nothing but note which thread hands over and undoes."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[tuple[str, str]] = []

    def enter(self, holder, siblings, request, others=()):
        return _NotedHeld(self)

    def hand_over(self, held, holder, siblings, request, others=()):
        self.threads.append(("hand_over", threading.current_thread().name))
        return _NotedHeld(self)


class _NotedHeld:
    def __init__(self, owner: _ThreadNoting) -> None:
        self.owner = owner

    def can_hand_over(self) -> bool:
        return True

    def lease(self) -> None:
        pass

    def exit(self):
        from krex.daemon.exclusivity import Evidence
        from krex.protocol.report import HostEvidence

        self.owner.threads.append(("exit", threading.current_thread().name))
        return Evidence(HostEvidence(), None, [])


def _release_behind_a_waiter(exclusivity, device: str, tmp_path) -> tuple[list, str]:
    """a holds ``device``, b waits; a releases on a thread named session-a: the threads
    ``exclusivity`` noted during the release, and the thread expected (cpu: a's own,
    else the lane's)."""
    from krex.daemon.config import DaemonConfig
    from krex.daemon.core import Daemon as Core
    from krex.protocol import messages as m

    core = Core(DaemonConfig(runtime_dir=str(tmp_path), fair_window_ms=0),
                exclusivity=exclusivity)
    try:
        a, b = FakeSession(), FakeSession()
        ja = core.handle(a, m.CreateJob(device=device, name="a", mode="region"))["job_id"]
        jb = core.handle(b, m.CreateJob(device=device, name="b", mode="region"))["job_id"]
        core.handle(a, m.Acquire(id=1, job_id=ja))
        region = a.reply(1).data["region"]
        core.handle(b, m.Acquire(id=2, job_id=jb))  # queued behind a
        core.lanes.wait_idle(5)
        del exclusivity.threads[:]
        released = threading.Thread(target=core.handle, name="session-a",
                                    args=(a, m.Release(id=3, region=region)))
        released.start()
        released.join(5)
        assert b.reply(2).data["region"] != region  # b was granted
        assert a.reply(3).data["report"]["outcome"] == "released"
        core.lanes.wait_idle(5)
        noted = list(exclusivity.threads)  # (b's region is undone at the shutdown)
    finally:
        core.shutdown()
    return noted, "session-a" if device == "cpu" else f"krex-lane-{device}"


@pytest.mark.parametrize("device", ["cpu", "fakegpu:0"])
def test_a_release_hands_over_on_the_releasing_thread_not_the_lane(device, tmp_path):
    """The release's own session thread runs the handoff (and the outgoing report) when
    the lane is idle: the grant takes no hop through the lane's thread, one wake-up
    less on the way (each can cost a scheduler tick on a loaded machine).  Control: on a
    GPU device, whose handoff may wait for a drain, it stays on the lane's thread."""
    noted, expected = _release_behind_a_waiter(_ThreadNoting(), device, tmp_path)
    assert dict(noted) == {"hand_over": expected, "exit": expected}, noted


class _SetUpNoting(_ThreadNoting):
    """Notes which thread sets a grant up; sets up on the caller as the real one does."""

    def enter(self, holder, siblings, request, others=()):
        self.threads.append(("enter", threading.current_thread().name))
        return _NotedHeld(self)

    def sets_up_on_caller(self, device):
        from krex.daemon.exclusivity import Exclusivity

        return Exclusivity.sets_up_on_caller(self, device)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", "fakegpu:0"])
def test_an_uncontended_acquire_sets_up_on_its_own_thread_not_the_lane(device, tmp_path):
    """An acquire that finds its device's lane idle sets the region up on the acquiring
    session's thread and the grant is sent from there: no wake-up of the lane's thread
    on the way (the hop, and the two threads' convoy on the GIL, were a third of the
    bare round trip).  Control: on a GPU device (whose drain may wait seconds) the
    set-up stays on the lane's thread."""
    from krex.daemon.config import DaemonConfig
    from krex.daemon.core import Daemon as Core
    from krex.protocol import messages as m

    core = Core(DaemonConfig(runtime_dir=str(tmp_path), fair_window_ms=0),
                exclusivity=_SetUpNoting())  # type: ignore[arg-type]
    noted = core.exclusivity.threads  # type: ignore[attr-defined]
    try:
        a = FakeSession()
        ja = core.handle(a, m.CreateJob(device=device, name="a", mode="region"))["job_id"]
        acquired = threading.Thread(target=core.handle, name="session-a",
                                    args=(a, m.Acquire(id=1, job_id=ja)))
        acquired.start()
        acquired.join(5)
        region = a.reply(1).data["region"]
        expected = "session-a" if device == "cpu" else f"krex-lane-{device}"
        assert noted == [("enter", expected)], noted
        core.handle(a, m.Release(id=2, region=region))
        assert a.reply(2).data["report"]["outcome"] == "released"
    finally:
        core.shutdown()


class _NoHandover(_SetUpNoting):
    """Set-ups and undos only (nothing carried over), noting their threads."""

    def enter(self, holder, siblings, request, others=()):
        self.threads.append(("enter", threading.current_thread().name))
        return _UncarriedHeld(self)


class _UncarriedHeld(_NotedHeld):
    def can_hand_over(self) -> bool:
        return False


@pytest.mark.parametrize("device", ["cpu", "fakegpu:0"])
def test_a_release_sets_the_next_region_up_on_the_releasing_thread(device, tmp_path):
    """A release whose undo grants the next region (nothing carried over: the bare
    daemon, a chain's end) sets that region up next on the releasing session's thread,
    in the same turn of the device's lane: no wake-up of the lane's thread between
    the release and the next grant.  Control: on a GPU device both stay on the lane."""
    noted, expected = _release_behind_a_waiter(_NoHandover(), device, tmp_path)
    assert noted == [("exit", expected), ("enter", expected)], noted


class _CountingPipe:
    """A guardian's stdin that counts the writes made to it."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.writes.append(data)
        return self.pipe.write(data)

    def flush(self) -> None:
        self.pipe.flush()

    def close(self) -> None:
        self.pipe.close()


def test_a_handoffs_new_lease_and_the_old_ones_end_reach_the_guardian_in_one_write(tmp_path):
    """``lease_handed`` sends the new region's lease and the old one's end in one write
    (``GuardianClient.batch``): the guardian wakes and rewrites its journal once per
    handoff, and reads the lease before the end.  Control: outside a batch, each
    message is its own write; the guardian holds exactly the new lease afterwards."""
    from krex.enforce.guardian import GuardianClient

    journal = tmp_path / "j.json"
    guardian = GuardianClient()
    try:
        guardian.start("t", str(journal))
        assert guardian.proc is not None
        pipe = _CountingPipe(guardian.proc.stdin)
        guardian.proc.stdin = pipe  # type: ignore[assignment]
        undo = [{"op": "noop"}]
        guardian.lease(1, 60.0, undo)
        guardian.lease(2, 60.0, undo)
        assert len(pipe.writes) == 2  # control: one write each
        with guardian.batch():
            guardian.lease(3, 60.0, undo)
            guardian.end(1)
            guardian.end(2)
        assert len(pipe.writes) == 3
        assert [json.loads(x)["cmd"] for x in pipe.writes[-1].splitlines()] == [
            "lease", "end", "end"]
        # The journal replays exactly the new lease's undo.  Its lease ids may be an
        # ended one's: the guardian does not rewrite a journal that would replay the same
        # records (krex.enforce.guardian, _journal), so where it read lease 1 alone and
        # then lease 2 with the batch, the journal still names lease 1 (one CI run).
        wait_for(lambda: journal.exists() and [
            v["undo"] for v in json.loads(journal.read_text()).get("leases", {}).values()]
            == [undo], timeout_s=30)
        guardian.end(3)
    finally:
        guardian.stop()


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
def test_lease_handed_sends_the_lease_and_the_end_in_one_write(backend, tmp_path, instance):
    """A real handoff under a guardian: ``lease_handed`` makes one write to the guardian
    (the new lease, then the old one's end), and the guardian then holds exactly the
    new lease.  Control: the grant's own lease, outside a handoff, is a write alone."""
    from krex.enforce.guardian import GuardianClient

    layout = layout_or_skip(backend)
    jobs = _jobs(layout, instance, tmp_path)
    a, b, c = jobs
    guardian = GuardianClient()
    try:
        guardian.start("t", str(tmp_path / "j.json"))
        assert guardian.proc is not None
        pipe = _CountingPipe(guardian.proc.stdin)
        guardian.proc.stdin = pipe  # type: ignore[assignment]
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, guardian)
        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        assert len(pipe.writes) == 1  # control: the first region's lease
        second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5)
        assert second is not None
        lease_handed(second)
        assert len(pipe.writes) == 2, pipe.writes
        sent = [json.loads(x) for x in pipe.writes[-1].splitlines()]
        assert [(m["cmd"], m["id"]) for m in sent] == [("lease", second.lease_id),
                                                       ("end", first.lease_id)]
        assert set(guardian.leases) == {second.lease_id}
        first.exit()
        second.exit()
    finally:
        guardian.stop()
        for s in jobs:
            s.kill()


@pytest.mark.parametrize("backend", CGROUP_BACKENDS)
@pytest.mark.parametrize("prefetched", [True, False], ids=["prefetched", "control-at-handoff"])
def test_a_handoff_takes_the_counters_read_while_its_holder_was_frozen(
        backend, prefetched, tmp_path, instance, monkeypatch):
    """B's counters, read after A's grant while B is frozen (``prefetch``), are B's
    region's start: the handoff to B reads none of B's threads on the grant path, and
    B's report still counts the CPU B used in its region.  Control: without the
    prefetch the handoff reads them.  The holder itself is never prefetched."""
    from krex.enforce import cgroups, schedstat
    from krex.enforce import slot as slot_module
    from krex.enforce.slot import HolderSlot

    layout = layout_or_skip(backend)
    jobs = _jobs(layout, instance, tmp_path)
    a, b, c = jobs
    reads: list[int] = []
    real = schedstat.thread_counts
    monkeypatch.setattr(schedstat, "thread_counts",
                        lambda pid, tid: (reads.append(pid), real(pid, tid))[1])
    listed: list[str] = []  # the cgroup.procs files read
    real_procs = cgroups._procs
    for module in (cgroups, slot_module):
        monkeypatch.setattr(module, "_procs", lambda d: (listed.append(d), real_procs(d))[1])
    try:
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        first = enforcer.enter(a.target, [b.target, c.target], max_hold_s=5)
        assert not first.prefetch(a.target)
        if prefetched:
            assert first.prefetch(b.target)
        time.sleep(0.1)
        mark, listed_mark = len(reads), len(listed)
        used = psutil.Process(b.proc.pid).cpu_times()
        second = enforcer.hand_over(first, b.target, [a.target, c.target], max_hold_s=5)
        assert second is not None
        on_path = reads[mark:]
        slot = next(op for op in second.applied if isinstance(op, HolderSlot))
        assert b.proc.pid in slot.pids()  # moved
        # B's members are read once when prefetched and the check that they are the
        # prefetched processes read the directory moved from (v2): that read is the
        # move's.  Controls: not prefetched, or the freezer moved (v1), the move reads too.
        b_dirs = b.target.cgroups.own()
        one = prefetched and slot.moves[slot._lead()][0] == b_dirs[0]
        on_path_listed = [d for d in listed[listed_mark:] if d in b_dirs]
        assert len(on_path_listed) == (1 if one else 2), on_path_listed
        lease_handed(second)
        first.exit()
        time.sleep(0.3)  # B, a busy loop, runs in its region
        report = second.exit()
        now = psutil.Process(b.proc.pid).cpu_times()
        ran_ms = 1e3 * (now.user + now.system - used.user - used.system)
        assert (b.proc.pid in on_path) is not prefetched, on_path
        # the region's CPU is B's CPU since the handoff (/proc's in 10 ms ticks)
        assert ran_ms > 20 and report.holder_cpu_ms is not None
        assert abs(report.holder_cpu_ms - ran_ms) < 0.2 * ran_ms + 20, (report, ran_ms)
    finally:
        for s in jobs:
            s.kill()


class _PrefetchNoting(_ThreadNoting):
    """Notes whose counters the daemon asks to read after each grant."""

    def __init__(self) -> None:
        super().__init__()
        self.prefetched: list[int] = []

    def prefetch(self, held, job, siblings=None, others=()) -> bool:
        self.prefetched.append(job.job_id)
        return True


def test_after_a_grant_the_daemon_prefetches_the_next_holders_counters(tmp_path):
    """After each grant the job the scheduler would grant next (here c, behind b) has
    its counters read, off the grant path; nobody queued, nothing read (control)."""
    from krex.daemon.config import DaemonConfig
    from krex.daemon.core import Daemon as Core
    from krex.protocol import messages as m

    ex = _PrefetchNoting()
    core = Core(DaemonConfig(runtime_dir=str(tmp_path), fair_window_ms=0), exclusivity=ex)
    try:
        a, b, c = FakeSession(), FakeSession(), FakeSession()
        ids = {s: core.handle(s, m.CreateJob(device="cpu", name=n, mode="region"))["job_id"]
               for s, n in ((a, "a"), (b, "b"), (c, "c"))}
        core.handle(a, m.Acquire(id=1, job_id=ids[a]))
        region = a.reply(1).data["region"]
        core.lanes.wait_idle(5)
        assert ex.prefetched == []  # nobody queued at a's grant
        core.handle(b, m.Acquire(id=2, job_id=ids[b]))
        core.handle(c, m.Acquire(id=3, job_id=ids[c]))
        core.handle(a, m.Release(id=4, region=region))
        b.reply(2)  # b granted (handed over)
        core.lanes.wait_idle(5)
        assert ex.prefetched == [ids[c]]
    finally:
        core.shutdown()


def test_a_handoff_takes_the_prefetched_processes_only_when_the_cgroup_holds_the_same_pids():
    """``_same_processes``: the prefetched refs (read while the job was frozen) stand for
    the job's processes only when its cgroup holds exactly their PIDs now; a process
    more, one fewer, an empty cgroup or no prefetch make the handoff look them up."""
    from krex.enforce.handoff import _same_processes
    from krex.enforce.job import JobTarget
    from krex.enforce.schedstat import HolderCounters

    class Cgroups:
        def __init__(self, pids: list[int]) -> None:
            self._pids = pids

        def pids(self) -> list[int]:
            return sorted(self._pids)

    pre = HolderCounters([ProcessRef(300, 7), ProcessRef(200, 5)])
    same = JobTarget(1, cgroups=Cgroups([200, 300]))  # type: ignore[arg-type]
    assert _same_processes(same, pre) == pre.refs
    for pids in ([200, 300, 400], [200], []):  # controls
        assert _same_processes(JobTarget(1, cgroups=Cgroups(pids)), pre) is None  # type: ignore[arg-type]
    assert _same_processes(same, None) is None


def test_the_slot_move_takes_a_read_of_its_members_only_of_its_own_frozen_directory(
        monkeypatch):
    """A handoff's read of the incoming holder's members stands for the slot move's own
    read only when it is of the directory moved from, and that job is frozen."""
    from krex.enforce import slot as slot_module
    from krex.enforce.job import JobTarget
    from krex.enforce.slot import HolderSlot

    calls: list = []
    monkeypatch.setattr(slot_module, "move_all",
                        lambda src, dst, rounds=4, known=None: calls.append(known) or [])
    monkeypatch.setattr(slot_module, "_procs", lambda d: [9])  # the move's own read
    slot = HolderSlot(JobTarget(1))
    slot.moves = {"v2": ("/cg/job-1", "/cg/hold")}
    slot.apply(source_frozen=True, members=("/cg/job-1", [5, 7]))
    slot.apply(source_frozen=True, members=("/cg/job-2", [5, 7]))  # control: another dir
    slot.apply(source_frozen=True)
    slot.apply(source_frozen=False, members=("/cg/job-1", [5, 7]))  # control: not frozen
    assert calls == [[5, 7], [9], [9], None]


def test_a_frozen_holder_joins_the_reserved_cores_before_the_move_that_thaws_it(monkeypatch):
    """At a handoff the incoming holder (frozen) is put into the slot's cpuset first and
    thawed by the freezing hierarchy's move last, so it wakes on the reserved cores, not
    on the daemon's.  Control: set up from scratch (not frozen), the order is the other
    way round, as a running job's forks must be followed first."""
    from krex.enforce import slot as slot_module
    from krex.enforce.job import JobTarget
    from krex.enforce.slot import HolderSlot

    order: list = []
    monkeypatch.setattr(slot_module, "move_all", lambda src, dst, rounds=4, known=None:
                        order.append(("move", dst)) or [5])
    monkeypatch.setattr(slot_module, "write", lambda path, value: order.append(("write", path)))
    slot = HolderSlot(JobTarget(1))
    slot.moves = {"v2": ("/v2/job-1", "/v2/hold"), "cpuset": ("/cs/dev", "/cs/hold")}
    slot.apply(source_frozen=True, members=("/v2/job-1", [5]))
    assert order == [("write", "/cs/hold/cgroup.procs"), ("move", "/v2/hold")]
    order.clear()
    slot.apply(source_frozen=False)
    assert order == [("move", "/v2/hold"), ("write", "/cs/hold/cgroup.procs")]


def test_handoffs_are_planned_after_the_grant_and_replanned_when_a_job_arrives(daemon):
    """Two pipelined loops through a real daemon: their handoffs use the operations worked
    out after the previous grant (``host.handover_prepared``).  A job that registers
    mid-chain changes the jobs the plan was made for: every region granted after it
    counts it among the frozen siblings (a plan kept for the old jobs would count one
    sibling: the control, checked by hand with the key comparison removed)."""
    if not freezes(daemon):
        pytest.skip("no freeze backend here: nothing is handed over")
    n = 400
    loops, start = start_loops("pipelined", n, 3)
    late = None
    try:
        time.sleep(max(0.0, start - time.monotonic()) + 0.3)  # the chain is under way
        t_launch = time.monotonic()
        late = subprocess.Popen([PY, "-m", "krex", "run", "--", PY, "-c",
                                 "import time; time.sleep(60)"])
        created = wait_for(lambda: _late_job(daemon, late.pid), 30)
        t_reg = created - (time.time() - time.monotonic())  # made then, on this clock
    finally:
        rows = loop_rows(loops)
        if late is not None:
            reap(late)
    handed = [r for r in rows if r["handed_over"]]
    assert len(handed) >= n, rows
    assert sum(r["prepared"] for r in handed) >= 0.8 * len(handed), handed
    before = [r for r in rows if r["released"] < t_launch]
    # handed over (the previous region released) after the job was made: 1 ms of margin
    # for a handoff under way as it was made (its siblings read before)
    after = [b for a, b in zip(rows, rows[1:], strict=False) if a["released"] > t_reg + 1e-3]
    assert before and all(r["siblings_frozen"] == 1 for r in before), before
    assert len(after) >= 10, (t_reg, rows[-1])
    assert all(r["siblings_frozen"] == 2 for r in after), after
    assert sum(r["prepared"] for r in after if r["handed_over"]) >= 5, after


def _late_job(daemon, pid: int) -> float | None:
    """When ``krex run`` (process ``pid``) made its job (wall clock), once it has (its
    command, started in the job's cgroup under the frozen device parent, is frozen
    until the chain ends)."""
    from krex.client.connection import Client

    with Client(daemon.socket, autostart=False) as c:
        return next((j["created_wall_s"] for j in c.jobs() if j.get("owner_pid") == pid
                     and j.get("ended_wall_s") is None), None)


def test_a_prepared_handoff_is_taken_once_and_only_for_the_same_jobs():
    """``job_key`` changes with every input of a handoff's operations (a new sibling, a
    process joining a job, another cgroup), and a prepared handoff is given out once,
    only under its own key.  Control: the same jobs give the same key."""
    from types import SimpleNamespace

    from krex.daemon.jobs import Job
    from krex.enforce.handoff import Prepared, job_key, take_prepared

    def job(i: int) -> Job:
        return Job(i, f"j{i}", "cpu", "region", "managed", ProcessRef(100 + i, 1),
                   root=ProcessRef(200 + i, 1), cgroups=object())

    a, b, c = job(1), job(2), job(3)
    key = job_key(a, [b], [])
    assert job_key(a, [b], []) == key  # control: nothing changed
    assert job_key(a, [b, c], []) != key  # a new sibling
    assert job_key(a, [b], [c]) != key  # a new job on another device
    assert job_key(b, [a], []) != key  # another holder
    b.members.add(ProcessRef(300, 1))
    assert job_key(a, [b], []) != key  # a process joined a sibling
    key = job_key(a, [b], [])
    a.cgroups = object()
    assert job_key(a, [b], []) != key  # other cgroups
    old = SimpleNamespace(prepared=None)
    made = Prepared(key, None, [], [], [])  # type: ignore[arg-type]
    old.prepared = made
    assert take_prepared(old, job_key(a, [b, c], [])) is None  # type: ignore[arg-type]
    assert old.prepared is None  # a mismatch drops it: never used later either
    old.prepared = made
    assert take_prepared(old, key) is made  # type: ignore[arg-type]
    assert take_prepared(old, key) is None  # type: ignore[arg-type]  # once
