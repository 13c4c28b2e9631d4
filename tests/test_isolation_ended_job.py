"""A job that ends while a grant plans or applies CPU isolation is skipped, not an
enforcement failure (found by bench_chaos's load check: the grant failed with
``enforcement_failed`` on the ended job's removed ``cpuset.cpus``).

Jobs' own cpusets exist only on cgroup v2 (on v1 a job shares its device's cpuset),
so the cpusets here are plain directories with a ``cpuset.cpus`` file: the code under
test only reads and writes that file (a write replacing its value, as a cgroup file's
does), and removing the directory is what a job's end does to it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from krex.enforce.cgroups import JobCgroups
from krex.enforce.isolation import CpuIsolation
from krex.enforce.job import JobTarget


@pytest.fixture(autouse=True)
def _files_replace_on_write(monkeypatch):
    # A cgroup file takes each write(2) as its whole new value; a plain file needs
    # truncating for that.
    from krex.enforce import isolation

    monkeypatch.setattr(isolation, "write", lambda path, value: Path(path).write_text(value))


def _job(tmp: Path, job_id: int, cpus: str) -> tuple[JobTarget, Path]:
    d = tmp / f"job-{job_id}"
    d.mkdir()
    (d / "cpuset.cpus").write_text(cpus)
    return JobTarget(job_id, cgroups=JobCgroups(cpuset=str(d))), d


@pytest.mark.parametrize("ends", ["before the plan", "between the plan and the writes"])
def test_a_job_that_ends_during_a_grant_is_skipped(tmp_path, ends):
    holder, holder_dir = _job(tmp_path, 1, "0-1")
    sibling, gone_dir = _job(tmp_path, 2, "0-1")
    survivor, survivor_dir = _job(tmp_path, 3, "0-1")
    op = CpuIsolation(holder, [sibling, survivor], cores=[1], all_cores=[0, 1])
    if ends == "before the plan":
        shutil.rmtree(gone_dir)
        assert {r["path"] for r in op.undo_records()} == {str(holder_dir), str(survivor_dir)}
    else:
        op.undo_records()  # plans: reads every cpuset
        shutil.rmtree(gone_dir)
    op.apply()
    assert (holder_dir / "cpuset.cpus").read_text() == "1"
    assert (survivor_dir / "cpuset.cpus").read_text() == "0"
    op.revert()
    assert (holder_dir / "cpuset.cpus").read_text() == "0-1"
    assert (survivor_dir / "cpuset.cpus").read_text() == "0-1"
    assert not gone_dir.exists()


def test_control_a_cpuset_that_cannot_be_written_for_another_reason_still_fails(tmp_path):
    # Only a job's end (its directory gone) is skipped; any other write error is an
    # enforcement failure the grant must report.
    holder, holder_dir = _job(tmp_path, 1, "0-1")
    (holder_dir / "cpuset.cpus").unlink()
    (holder_dir / "cpuset.cpus").mkdir()  # reading or writing it fails: IsADirectoryError
    op = CpuIsolation(holder, [], cores=[1], all_cores=[0, 1])
    with pytest.raises(IsADirectoryError):
        op.apply()
