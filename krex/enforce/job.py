"""What enforcement acts on: one managed job and the processes that make it up."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from krex.enforce.cgroups import JobCgroups
from krex.enforce.process import (
    ProcessGroup,
    ProcessRef,
    may_touch,
    process_uid,
    start_time,
    task_stat,
)

# pid -> (ppid, pgid, start time): one pass over /proc/*/stat.
ProcTable = dict[int, tuple[int, int, int]]


def scan() -> ProcTable:
    """Every process's parent, group and start time, from one pass over /proc."""
    table: ProcTable = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = task_stat(int(name))
            if st is not None:
                table[int(name)] = (st.ppid, st.pgrp, st.start_time)
    return table


@dataclass
class JobTarget:
    """One managed job: its root process, process group, cgroups and registered PIDs."""

    job_id: int
    root: ProcessRef | None = None
    group: ProcessGroup | None = None  # matched while its leader lives
    cgroups: JobCgroups | None = None
    tracked: list[ProcessRef] = field(default_factory=list)
    uid: int | None = None  # a non-operator's job: processes of other users are not its


    def processes(self, table: ProcTable | None = None) -> list[ProcessRef]:
        """Every live process of the job, never PID <= 1, this one or protected ones.

        A job whose root and tracked processes are all in its cgroup is its
        cgroup (children never leave it); any other needs a /proc ``table``
        (scanned here when not given) for its group and descendants.
        """
        only = self.cgroup_only()
        if only is not None:
            return [r for pid in only if self.may_touch(pid) and (r := _ref(pid))]
        refs: dict[int, ProcessRef] = {}
        for ref in self._candidates(table):
            if ref.pid not in refs and self.may_touch(ref.pid) and ref.alive():
                refs[ref.pid] = ref
        return sorted(refs.values(), key=lambda r: r.pid)

    def may_touch(self, pid: int) -> bool:
        """:func:`may_touch`, and for a non-operator's job only its owner's processes: a
        set-user-ID descendant, or another user's process in the job's group, is never
        signalled or moved for it (issue 44)."""
        return may_touch(pid) and (self.uid is None or process_uid(pid) == self.uid)

    def may_run_outside(self) -> bool:
        """Whether a process of the job may be outside its cgroup (so a cgroup freeze
        would miss it).  Checked once per set of anchors, then remembered: processes
        born inside a cgroup stay there, so no read or /proc walk per grant."""
        cg = self.cgroups
        if cg is None:
            return True
        anchors = tuple((a.pid, a.start_time) for a in self._anchors())
        if cg.verified == anchors:
            return False
        if not cg.own():
            return True
        if not anchors:
            return False  # nothing yet: what it starts joins the cgroup before exec
        if self.cgroup_only() is None:
            return True
        cg.verified = anchors
        return False

    def _anchors(self) -> list[ProcessRef]:
        return ([self.root] if self.root else []) + list(self.tracked)

    def cgroup_only(self) -> list[int] | None:
        """The job's PIDs if its cgroup holds all of it, else None (needs a scan)."""
        in_cgroup = self.cgroups.pids() if self.cgroups else []
        anchors = ([self.root] if self.root else []) + list(self.tracked)
        if in_cgroup and all(a.pid in in_cgroup or not a.alive() for a in anchors):
            return in_cgroup
        return None

    def _candidates(self, table: ProcTable | None) -> list[ProcessRef]:
        in_cgroup = self.cgroups.pids() if self.cgroups else []
        anchors = ([self.root] if self.root else []) + list(self.tracked)
        table = scan() if table is None else table
        pids = set(in_cgroup)
        if self.group is not None and self.group.live():
            number = self.group.pgid
            pids.update(pid for pid, (_, pgid, _) in table.items() if pgid == number)
        for anchor in anchors:
            if table.get(anchor.pid, (0, 0, -1))[2] == anchor.start_time:
                pids.update(_descendants(table, anchor.pid) + [anchor.pid])
        return [ProcessRef(pid, table[pid][2]) for pid in pids if pid in table]


def processes_of(targets: list[JobTarget]) -> list[list[ProcessRef]]:
    """``processes()`` of each target, scanning /proc at most once."""
    onlys = [t.cgroup_only() for t in targets]
    table = scan() if any(only is None for only in onlys) else None
    return [
        t.processes(table)
        if only is None
        else [r for pid in only if t.may_touch(pid) and (r := _ref(pid))]
        for t, only in zip(targets, onlys, strict=True)
    ]


def _ref(pid: int) -> ProcessRef | None:
    started = start_time(pid)
    return None if started is None else ProcessRef(pid, started)


def _descendants(table: ProcTable, pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
