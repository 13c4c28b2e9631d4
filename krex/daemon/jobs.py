"""The job registry: which processes belong to which job.

A job is either *managed* (created by ``krex run`` or the worker pool: its
owner process starts it, in its own process group and cgroup) or *ad hoc* (a
process that registered itself to use regions).  Membership is what every
access check rests on: a process belongs to a job when it is the job's root
or owner, in its process group or cgroup, a descendant of its root or owner,
or a process that registered itself into it.  Processes are always
:class:`~krex.enforce.process.ProcessRef` (PID and start time), so a recycled
PID belongs to nothing.

Each job also keeps where its time went (:class:`Account`): waiting at the
daemon, its grants' enforcement set-up, holding regions, and frozen by other
jobs' regions.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from krex.enforce.process import (
    ProcessGroup,
    ProcessRef,
    is_descendant,
    process_group,
    start_time,
)

MODES = ("region", "command", "none")


@dataclass
class Account:
    """Where a job's time went, summed over its regions (seconds)."""

    regions: int = 0
    waited_s: float = 0.0  # its requests queued at the daemon
    enforce_s: float = 0.0  # its grants' enforcement being set up (after it was chosen)
    held_s: float = 0.0  # holding regions
    frozen_s: float = 0.0  # stopped (gated, drained or frozen) by other jobs' regions

    def to_dict(self) -> dict[str, Any]:
        return {"regions": self.regions, "waited_s": self.waited_s, "enforce_s": self.enforce_s,
                "held_s": self.held_s, "frozen_s": self.frozen_s}


@dataclass
class Job:
    job_id: int
    name: str
    device: str
    mode: str
    kind: str  # "managed" | "adhoc" | "worker"
    owner: ProcessRef
    root: ProcessRef | None = None
    group: ProcessGroup | None = None  # its root's group, while that group's leader lives
    cgroups: Any = None
    members: set[ProcessRef] = field(default_factory=set)
    created_wall_s: float = field(default_factory=time.time)
    exit_code: int | None = None
    uid: int = 0  # the owner's user: who may act on the job
    tenant: str = ""  # whose share and quotas its regions use
    account: Account = field(default_factory=Account)
    ended_wall_s: float | None = None
    requeue_lapses: int = 0  # its re-queued regions that lapsed in a row (krex.daemon.holds)
    requeue_skip: int = 0  # releases to let pass without re-queueing it (backing off)

    def anchors(self) -> list[ProcessRef]:
        # A worker job's owner is the daemon itself: only the worker's own tree counts.
        owner = None if self.kind == "worker" else self.owner
        return [p for p in (owner, self.root, *self.members) if p is not None]

    def contains(self, pid: int) -> bool:
        st = start_time(pid)
        if st is None:
            return False
        if any(a.pid == pid and a.start_time == st for a in self.anchors()):
            return True
        if self.group is not None and process_group(pid) == self.group.pgid \
                and self.group.live():
            return True
        if self.cgroups is not None and pid in _cgroup_pids(self.cgroups):
            return True
        return any(a.alive() and is_descendant(pid, a.pid) for a in self.anchors())

    def alive(self) -> bool:
        if self.kind == "worker" and self.root is None:
            return True  # being spawned
        return any(a.alive() for a in self.anchors())

    def may_have_processes(self) -> bool:
        """Cheap: whether anything of the job can run (and so be frozen)."""
        return self.root is not None or bool(self.members) or self.kind == "adhoc"

    def summary(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "name": self.name,
            "device": self.device,
            "mode": self.mode,
            "kind": self.kind,
            "owner_pid": self.owner.pid,
            "root_pid": self.root.pid if self.root else None,
            "uid": self.uid,
            "tenant": self.tenant,
            **self.account.to_dict(),
        }

    def record(self) -> dict[str, Any]:
        """The job's summary with its life times (the ``jobs`` request)."""
        return {**self.summary(), "created_wall_s": self.created_wall_s,
                "ended_wall_s": self.ended_wall_s, "exit_code": self.exit_code}


def _cgroup_pids(cgroups: Any) -> list[int]:
    try:
        return cgroups.pids()
    except (AttributeError, OSError):
        return []


class JobRegistry:
    def __init__(self) -> None:
        self.jobs: dict[int, Job] = {}
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        return next(self._ids)

    def add(self, job: Job) -> Job:
        self.jobs[job.job_id] = job
        return job

    def get(self, job_id: int) -> Job | None:
        return self.jobs.get(job_id)

    def remove(self, job_id: int) -> Job | None:
        return self.jobs.pop(job_id, None)

    def adhoc_for(self, pid: ProcessRef) -> Job | None:
        for job in self.jobs.values():
            if job.kind == "adhoc" and job.owner == pid:
                return job
        return None

    def of_tenant(self, tenant: str) -> int:
        """Jobs of a tenant now (workers are the daemon's)."""
        return sum(j.tenant == tenant and j.kind != "worker" for j in self.jobs.values())

    def on_device(self, device: str | None) -> list[Job]:
        return [j for j in self.jobs.values() if device is None or j.device == device]

    def dead(self) -> list[Job]:
        return [j for j in self.jobs.values() if not j.alive()]
