"""The gate/drain operation on real gate files (no processes needed)."""

import signal
import time
from dataclasses import replace

import pytest
from helpers import PY, reap, spawn

from krex.devices.native import COUNTERS
from krex.enforce.gate import GateFile
from krex.enforce.gatedrain import GatedJob, GateDrain
from krex.enforce.process import ProcessRef
from krex.errors import DrainTimeout


@pytest.fixture
def jobs(tmp_path):
    out = [GatedJob(i, GateFile.create(tmp_path / f"job-{i}"), str(tmp_path / f"job-{i}"))
           for i in range(3)]
    yield out
    for j in out:
        j.gate.unlink()


def test_apply_closes_every_gate_and_revert_reopens(jobs):
    op = GateDrain(jobs, timeout_s=0.5)
    op.apply()
    assert all(j.gate.is_closed(0) for j in jobs)
    # No process of these jobs has launched through the interposer: idle.
    assert op.idle_jobs == [0, 1, 2]
    assert op.undo_records()[0] == {"kind": "gate_open", "path": jobs[0].path, "slot": 0}
    op.revert()
    assert not any(j.gate.is_closed(0) for j in jobs)


def test_a_job_ending_mid_region_does_not_leave_other_gates_closed(jobs):
    op = GateDrain(jobs, timeout_s=0.5)
    op.apply()
    jobs[1].gate.unlink()  # the job ended while the region held its gate
    op.revert()
    assert not jobs[0].gate.is_closed(0) and not jobs[2].gate.is_closed(0)


def test_guardian_record_reopens_a_gate(jobs):
    from krex.enforce.undo import replay

    jobs[0].gate.close(0)
    assert replay([{"kind": "gate_open", "path": jobs[0].path, "slot": 0}]) == []
    assert not jobs[0].gate.is_closed(0)


def _own_slot(gate, proc, slot_index=0, **fields):
    """Write a slot by hand as the interposer would (owner pid + start time)."""
    p = gate._dev(0).procs[slot_index]
    p.pid, p.start_time = proc.pid, ProcessRef.of(proc.pid).start_time
    for name, value in fields.items():
        if name in COUNTERS:
            p.counters[COUNTERS.index(name)] = value
        else:
            setattr(p, name, value)


@pytest.mark.parametrize("member", [False, True], ids=["stranger", "member"])
def test_kill_policy_kills_only_verified_members(jobs, member):
    """The pid in a gate file is job-writable: a process that is not a member of the job
    (pid + start time) is never killed; a member that does not drain is."""
    victim = spawn([PY, "-c", "import time; time.sleep(60)"])
    try:
        _own_slot(jobs[0].gate, victim)  # it will never acknowledge
        members = [ProcessRef.of(victim.pid)] if member else []
        job = replace(jobs[0], members=lambda: members)
        op = GateDrain([job], timeout_s=0.2, policy="kill")
        if member:
            op.apply()
            assert victim.wait(timeout=5) == -signal.SIGKILL
        else:
            with pytest.raises(DrainTimeout, match="not a verified member"):
                op.apply()
            assert victim.poll() is None  # alive: not ours to kill
        op.revert()
    finally:
        reap(victim)


def test_findings_name_drain_failures_and_gate_bypasses(jobs):
    sibling = spawn([PY, "-c", "import time; time.sleep(60)"])
    try:
        gate = jobs[0].gate
        _own_slot(gate, sibling, unwrapped=2, unmatched=1)
        gate._dev(0).overflow_procs = 1
        op = GateDrain([jobs[0]], timeout_s=0.2)
        op.drain_failures.append((0, sibling.pid, 719))
        found = op.findings()
        assert [f["what"] for f in found] == ["drain", "gate_bypass", "gate_bypass"]
        assert "719" in found[0]["why"] and "2 driver entry points" in found[1]["why"]
        assert "every gate slot taken" in found[2]["why"]
        clean = GateDrain([jobs[1]], timeout_s=0.2)
        assert clean.findings() == []  # negative control
    finally:
        reap(sibling)


def test_siblings_that_do_not_drain_are_waited_for_at_once_not_one_after_another(jobs):
    """Issue 12: N siblings that never acknowledge, kill policy: the grant waits one
    timeout (all together), then kills them all — not one ``timeout_s`` per sibling.
    Control: the per-sibling waits add up to N timeouts, what the sequential form cost."""
    timeout_s = 0.4
    victims = [spawn([PY, "-c", "import time; time.sleep(60)"]) for _ in jobs]
    try:
        gated = []
        for job, victim in zip(jobs, victims, strict=True):
            _own_slot(job.gate, victim)
            members = [ProcessRef.of(victim.pid)]
            gated.append(replace(job, members=lambda m=members: m))
        op = GateDrain(gated, timeout_s=timeout_s, policy="kill")
        t0 = time.monotonic()
        op.apply()
        elapsed = time.monotonic() - t0
        op.revert()
        assert all(v.wait(timeout=5) == -signal.SIGKILL for v in victims)
        assert sorted(op.waited_s) == [j.job_id for j in jobs]
        assert elapsed < 2 * timeout_s, f"waited {elapsed:.2f} s for {len(jobs)} siblings"
        # the control: waiting for each in turn costs the sum of their waits
        assert sum(op.waited_s.values()) >= len(jobs) * timeout_s > elapsed
    finally:
        for v in victims:
            reap(v)
