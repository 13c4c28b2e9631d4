"""Host enforcement without the daemon: freeze backends, isolation, safety, rollback."""

from __future__ import annotations

import os
import signal
import time

import pytest
from enforce_support import (
    Sibling,
    assert_frozen_then_resumes,
    hold,
    layout_or_skip,
    start_holder,
)
from helpers import CONTENTION, reap, wait_for

from krex.enforce import process as proc_mod
from krex.enforce.cgroups import CgroupLayout, instance_name
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.freeze import FREEZERS
from krex.enforce.isolation import CpuIsolation
from krex.enforce.job import JobTarget
from krex.enforce.process import ProcessGroup, ProcessRef
from krex.errors import EnforcementFailed, ProcessGone
from krex.protocol.report import ReasonCode

BACKENDS = ["signal", "cgroup2", "cgroup1"]


@pytest.fixture
def instance():
    # Unique, and alive to any daemon's sweep: the name must end in this process's
    # pid-starttime (a trailing "-<ns>" made it look dead, and other daemons removed it).
    name = instance_name(f"t{time.monotonic_ns()}x")
    yield name
    CgroupLayout.probe().remove_instance(name)


def _cgroups(layout: CgroupLayout, backend: str, instance: str, job_id: int):
    return None if backend == "signal" else layout.create_job(instance, job_id)


# --- freezing -------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_sibling_makes_no_progress_then_resumes(backend, tmp_path, instance):
    layout = layout_or_skip(backend)
    sibs = []
    try:
        sibs = [
            Sibling(str(tmp_path), i, _cgroups(layout, backend, instance, i), fork=(i == 1))
            for i in (1, 2)
        ]
        op = FREEZERS[backend]([s.target for s in sibs])
        assert op.available() == (True, "")
        op.apply()
        try:
            frozen_at, thawed_at = hold(0.4)
        finally:
            op.revert()
        for sib in sibs:
            assert_frozen_then_resumes(sib, frozen_at, thawed_at)
    finally:
        for sib in sibs:
            sib.kill()


@pytest.mark.parametrize("backend", ["cgroup2", "cgroup1"])
@pytest.mark.parametrize("thaw", [True, False], ids=["thawed-meanwhile", "control"])
def test_a_job_cgroup_thawed_during_the_freeze_is_named_at_the_revert(
        backend, thaw, tmp_path, instance):
    """The per-job freezer checks at its end that nobody thawed a cgroup it froze (its
    apply had seen it frozen): the freeze becomes incomplete, naming the cgroup.
    Control: untouched, nothing is incomplete."""
    layout = layout_or_skip(backend)
    sib = Sibling(str(tmp_path), 1, _cgroups(layout, backend, instance, 1))
    try:
        op = FREEZERS[backend]([sib.target])
        op.apply()
        assert op.incomplete is None
        if thaw:
            d = op.frozen[0]
            with open(os.path.join(d, op.control), "w") as f:
                f.write(op.thaw_value)
        op.revert()
        if thaw:
            assert op.incomplete and "thawed" in op.incomplete and d in op.incomplete
        else:
            assert op.incomplete is None
    finally:
        sib.kill()


def test_cgroup_freeze_also_stops_processes_outside_the_cgroup(tmp_path, instance):
    layout = layout_or_skip("cgroup2")
    inside = outside = None
    try:
        inside = Sibling(str(tmp_path), 1, layout.create_job(instance, 1))
        outside = Sibling(str(tmp_path), 2)  # an ad-hoc job: no cgroup of its own
        outside.target.cgroups = layout.create_job(instance, 2)  # empty cgroup
        op = FREEZERS["cgroup2"]([inside.target, outside.target])
        op.apply()
        try:
            assert op.full_backend == "cgroup2+signal"
            frozen_at, thawed_at = hold(0.3)
        finally:
            op.revert()
        assert_frozen_then_resumes(inside, frozen_at, thawed_at)
        assert_frozen_then_resumes(outside, frozen_at, thawed_at)
    finally:
        for sib in (inside, outside):
            if sib:
                sib.kill()


def test_signal_freeze_leaves_an_already_stopped_process_stopped(tmp_path):
    sib = Sibling(str(tmp_path), 1)
    try:
        os.kill(sib.proc.pid, signal.SIGSTOP)
        wait_for(lambda: sib.target.root.state() == "T")
        op = FREEZERS["signal"]([sib.target])
        op.apply()
        op.revert()
        time.sleep(0.1)
        assert sib.target.root.state() == "T"
    finally:
        sib.kill()


# --- process safety -------------------------------------------------------


def test_stale_process_ref_is_never_signalled(tmp_path):
    sib = Sibling(str(tmp_path), 1)
    try:
        real = sib.target.root
        stale = ProcessRef(real.pid, real.start_time + 1)  # same PID, another process
        assert not stale.alive()
        assert stale.send_signal(signal.SIGSTOP) is False
        time.sleep(0.05)
        assert real.state() != "T"
        t = time.monotonic()
        wait_for(lambda: sib.progressed_after(t))
    finally:
        sib.kill()
    assert not real.alive()
    assert real.send_signal(signal.SIGCONT) is False
    with pytest.raises(ProcessGone):
        ProcessRef.of(real.pid)


def test_protected_pids_are_never_signalled(tmp_path):
    sib = Sibling(str(tmp_path), 1)
    try:
        ref = sib.target.root
        proc_mod.PROTECTED.add(ref.pid)
        try:
            assert ref.send_signal(signal.SIGSTOP) is False
            assert ref not in sib.target.processes()
        finally:
            proc_mod.PROTECTED.discard(ref.pid)
        assert ProcessRef.of(os.getpid()).send_signal(signal.SIGCONT) is False
        assert ProcessRef.of(1).send_signal(signal.SIGCONT) is False
    finally:
        sib.kill()


def test_job_processes_cover_group_descendants_and_tracked(tmp_path):
    sib = Sibling(str(tmp_path), 1, fork=True)
    try:
        pids = {r.pid for r in JobTarget(1, group=ProcessGroup.led_by(sib.proc.pid)).processes()}
        assert sib.proc.pid in pids and len(pids) == 2
        assert {r.pid for r in JobTarget(1, root=sib.target.root).processes()} == pids
        assert {r.pid for r in JobTarget(1, tracked=[sib.target.root]).processes()} == pids
    finally:
        sib.kill()


# --- CPU isolation --------------------------------------------------------


def _masks(pid: int) -> dict[int, list[int]]:
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def _cores_or_skip() -> tuple[list[int], list[int]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("CPU isolation needs at least 2 cores")
    return cores, [cores[-1]]


@pytest.mark.parametrize("with_cpuset", [False, True])
def test_isolation_moves_every_holder_thread_and_restores_exactly(with_cpuset, tmp_path, instance):
    all_cores, reserved = _cores_or_skip()
    layout = CgroupLayout.probe()
    if with_cpuset and not layout.cpuset_writable:
        pytest.skip(f"no writable cpuset: {layout.reasons}")
    holder_cg = layout.create_job(instance, 10) if with_cpuset else None
    holder = sib = None
    try:
        holder = start_holder(threads=3)
        if holder_cg:
            holder_cg.adopt(ProcessRef.of(holder.pid))
        sib = Sibling(str(tmp_path), 11, layout.create_job(instance, 11) if with_cpuset else None)
        first_tid = min(_masks(holder.pid))
        os.sched_setaffinity(max(_masks(holder.pid)), [all_cores[0]])  # a custom mask to keep
        before_h, before_s = _masks(holder.pid), _masks(sib.proc.pid)
        assert len(before_h) == 4 and any(m != reserved for m in before_h.values())
        target = JobTarget(10, root=ProcessRef.of(holder.pid),
                           group=ProcessGroup.led_by(holder.pid), cgroups=holder_cg)
        op = CpuIsolation(target, [sib.target], reserved, all_cores)
        assert op.available() == (True, "")
        op.apply()
        try:
            during_h, during_s = _masks(holder.pid), _masks(sib.proc.pid)
        finally:
            op.revert()
        assert all(m == reserved for m in during_h.values()), during_h
        assert all(not set(m) & set(reserved) for m in during_s.values()), during_s
        assert _masks(holder.pid) == before_h and _masks(sib.proc.pid) == before_s
        assert first_tid in during_h
        if with_cpuset:
            # a v1 cpuset is the device's (shared): SlotIsolation's, not moved per job here
            own = holder_cg.cpuset in holder_cg.own()
            assert op.backend == ("cpuset+affinity" if own else "affinity")
    finally:
        if holder:
            reap(holder)
        if sib:
            sib.kill()


def test_isolation_unavailable_on_one_core_or_all_reserved():
    holder = JobTarget(1)
    assert CpuIsolation(holder, [], [], [0]).available()[0] is False
    assert CpuIsolation(holder, [], [0, 1], [0, 1]).available()[0] is False
    assert CpuIsolation(holder, [], [5], [0, 1]).available()[0] is False


# --- the enforcer ---------------------------------------------------------


class Recorder:
    """A pre-op that records its calls (and can fail on apply)."""

    name = "gate"
    backend = "test"

    def __init__(self, log: list, fail: bool = False):
        self.log, self.fail = log, fail

    def available(self):
        return True, ""

    def apply(self):
        self.log.append("apply")
        if self.fail:
            raise OSError("gate broke")

    def revert(self):
        self.log.append("revert")

    def undo_records(self):
        return []


@pytest.mark.parametrize("backend", BACKENDS)
def test_enforcer_region_report(backend, tmp_path, instance):
    layout = layout_or_skip(backend)
    _cores_or_skip()  # the report's third step is isolation (a shield elsewhere can narrow us)
    sib = holder = None
    try:
        sib = Sibling(str(tmp_path), 2, _cgroups(layout, backend, instance, 2))
        holder = start_holder(threads=2)
        target = JobTarget(1, root=ProcessRef.of(holder.pid), group=ProcessGroup.led_by(holder.pid))
        log: list = []
        enforcer = Enforcer(EnforceConfig(freeze=backend), layout, None)
        region = enforcer.enter(target, [sib.target], max_hold_s=5, pre_ops=[Recorder(log)])
        frozen_at, thawed_at = hold(0.3)
        report = region.exit()
        assert_frozen_then_resumes(sib, frozen_at, thawed_at)
        assert log == ["apply", "revert"]
        assert [s.name for s in report.steps] == ["gate", "freeze", "isolate"]
        assert report.freeze_backend == backend and report.siblings_frozen == 1
        assert report.processes_frozen == 1
        assert all(s.ok and s.apply_ms >= 0 and s.revert_ms >= 0 for s in report.steps)
        assert [r for r in region.reasons if r.code.value not in CONTENTION] == []
        assert report.holder_involuntary_switches >= 0
        assert region.exit() is report  # idempotent
    finally:
        for p in (holder,):
            if p:
                reap(p)
        if sib:
            sib.kill()


def test_failure_midway_reverts_what_was_applied(tmp_path, monkeypatch):
    _cores_or_skip()
    sib = Sibling(str(tmp_path), 2)
    log: list = []

    def broken(self):
        raise OSError("cpuset write failed")

    monkeypatch.setattr(CpuIsolation, "apply", broken)
    try:
        enforcer = Enforcer(EnforceConfig(freeze="signal"), CgroupLayout.none(), None)
        with pytest.raises(EnforcementFailed) as info:
            enforcer.enter(JobTarget(1), [sib.target], max_hold_s=5, pre_ops=[Recorder(log)])
        t = time.monotonic()
        report = info.value.host
        assert log == ["apply", "revert"]
        steps = {s.name: s for s in report.steps}
        assert steps["gate"].ok and steps["freeze"].ok and steps["freeze"].revert_ms >= 0
        assert not steps["isolate"].ok and "cpuset write failed" in steps["isolate"].error
        wait_for(lambda: sib.progressed_after(t), timeout_s=10)  # thawed again
    finally:
        sib.kill()


def test_failure_in_first_pre_op_applies_nothing_else(tmp_path):
    sib = Sibling(str(tmp_path), 2)
    log: list = []
    try:
        enforcer = Enforcer(EnforceConfig(freeze="signal"), CgroupLayout.none(), None)
        with pytest.raises(EnforcementFailed):
            enforcer.enter(
                JobTarget(1), [sib.target], max_hold_s=5, pre_ops=[Recorder(log, fail=True)]
            )
        assert log == ["apply", "revert"]
        assert sib.target.root.state() != "T"
    finally:
        sib.kill()


def test_unavailable_mechanisms_are_reported_not_clean(tmp_path):
    enforcer = Enforcer(
        EnforceConfig(freeze="cgroup2", measure_cores=[]), CgroupLayout.none(), None
    )
    region = enforcer.enter(JobTarget(1), [], max_hold_s=1)
    report = region.exit()
    whats = {r.evidence["mechanism"] for r in region.reasons}
    assert whats == {"freeze", "isolate"} and report.steps == []
    assert {r.code for r in region.reasons} == {ReasonCode.MECHANISM_UNAVAILABLE}
    assert "freeze" in enforcer.backends() and "isolate" in enforcer.backends()


def test_sweep_thaws_and_removes_leftovers_of_dead_daemons(tmp_path):
    layout = layout_or_skip("cgroup2")
    dead = "t999999999-1"  # no such daemon PID
    sib = Sibling(str(tmp_path), 1, layout.create_job(dead, 1))
    try:
        op = FREEZERS["cgroup2"]([sib.target])
        op.apply()
        t = time.monotonic()
        removed = layout.sweep()
        assert any(dead in r for r in removed)
        assert not os.path.exists(sib.target.cgroups.v2)
        wait_for(lambda: sib.progressed_after(t), timeout_s=10)
    finally:
        layout.remove_instance(dead)
        sib.kill()


def test_unfrozen_jobs_are_kept_off_the_reserved_cores(tmp_path):
    all_cores, reserved = _cores_or_skip()
    sib = Sibling(str(tmp_path), 2)
    other = Sibling(str(tmp_path), 3)
    holder = start_holder(threads=2)
    try:
        before = _masks(other.proc.pid)
        target = JobTarget(1, root=ProcessRef.of(holder.pid), group=ProcessGroup.led_by(holder.pid))
        enforcer = Enforcer(
            EnforceConfig(freeze="off", measure_cores=reserved), CgroupLayout.none()
        )
        region = enforcer.enter(target, [sib.target], max_hold_s=5, others=[other.target])
        try:
            during = [_masks(p) for p in (sib.proc.pid, other.proc.pid)]
            held = _masks(holder.pid)
        finally:
            report = region.exit()
        assert all(not set(m) & set(reserved) for d in during for m in d.values())
        assert all(m == reserved for m in held.values())
        assert _masks(other.proc.pid) == before
        assert report.freeze_backend == "off"
        assert region.reasons[0].evidence["mechanism"] == "freeze"
        assert region.reasons[0].code is ReasonCode.MECHANISM_DISABLED
    finally:
        reap(holder)
        sib.kill()
        other.kill()
