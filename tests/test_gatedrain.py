"""The gate/drain operation on real gate files (no processes needed)."""

import pytest

from krex.enforce.gate import GateFile
from krex.enforce.gatedrain import GatedJob, GateDrain


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
