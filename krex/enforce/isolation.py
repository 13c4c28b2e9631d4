"""CPU isolation: the holder on reserved cores, every other managed job off them.

Jobs with a cpuset cgroup are moved by writing ``cpuset.cpus`` (all their
threads move at once, new threads follow).  Every thread of every process is
then also given the right affinity mask (``/proc/PID/task/TID``), which both
covers processes outside a cpuset and makes the result exact.  Revert writes
back the previous ``cpuset.cpus`` values and then every thread's previous
mask; threads born during the region get their process's previous mask.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from krex.enforce.cgroups import read, write
from krex.enforce.job import JobTarget, processes_of
from krex.enforce.process import ProcessRef, ThreadRef, threads_of


def default_cores(all_cores: list[int]) -> list[int]:
    """The automatic reservation: none on 1 core, the last core below 8, else the last N//4."""
    n = len(all_cores)
    if n < 2:
        return []
    return sorted(all_cores)[-(1 if n < 8 else n // 4) :]


def _get_affinity(tid: int) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(tid))
    except OSError:
        return None


def _set_affinity(thread: ThreadRef, cpus: list[int]) -> None:
    if thread.alive():
        try:
            os.sched_setaffinity(thread.tid, cpus)
        except (ProcessLookupError, OSError):
            pass


class CpuIsolation:
    """Reserve ``cores`` for ``holder``; keep ``others`` on the remaining cores."""

    name = "isolate"
    keepable = True  # may stay applied for the holder's next region (krex.daemon.keep)

    def __init__(
        self,
        holder: JobTarget,
        others: list[JobTarget],
        cores: list[int],
        all_cores: list[int] | None = None,
    ) -> None:
        self.holder = holder
        self.others = others
        self.cores = sorted(cores)
        self.all_cores = sorted(all_cores if all_cores is not None else os.sched_getaffinity(0))
        self.rest = [c for c in self.all_cores if c not in self.cores]
        self.cpusets: dict[str, str] = {}  # cpuset dir -> previous cpuset.cpus
        self.masks: dict[ThreadRef, list[int]] = {}  # thread -> previous mask
        self.proc_masks: dict[ProcessRef, list[int]] = {}
        self._planned = False

    @property
    def backend(self) -> str:
        return "cpuset+affinity" if self._cpuset_dirs() else "affinity"

    def available(self) -> tuple[bool, str]:
        if not self.cores:
            return False, "no cores to reserve (a single-core machine, or --measure-cores empty)"
        if not set(self.cores) <= set(self.all_cores):
            return False, f"reserved cores {self.cores} not all usable (have {self.all_cores})"
        if not self.rest:
            return False, "every core is reserved: nowhere left for the other jobs"
        return True, ""

    def _jobs(self) -> list[tuple[JobTarget, bool]]:
        return [(self.holder, True)] + [(t, False) for t in self.others]

    def _cpuset_dirs(self) -> list[tuple[str, bool]]:
        """Jobs' own cpusets (a v1 device cpuset is shared: :class:`SlotIsolation`'s)."""
        return [(t.cgroups.cpuset, h) for t, h in self._jobs()
                if t.cgroups and t.cgroups.cpuset and t.cgroups.cpuset in t.cgroups.own()]

    def _plan(self) -> None:
        if self._planned:
            return
        for d, _ in self._cpuset_dirs():
            try:
                self.cpusets[d] = read(d + "/cpuset.cpus")
            except FileNotFoundError:  # the job ended meanwhile: nothing of it to move
                continue
        for refs in processes_of([t for t, _ in self._jobs()]):
            for ref in refs:
                self._snapshot(ref)
        self._planned = True

    def _snapshot(self, ref: ProcessRef) -> None:
        for thread in threads_of(ref):
            mask = _get_affinity(thread.tid)
            if mask is not None:
                self.masks.setdefault(thread, mask)
                if thread.tid == ref.pid:
                    self.proc_masks.setdefault(ref, mask)

    def undo_records(self) -> list[dict]:
        self._plan()
        records: list[dict[str, Any]] = [{"kind": "cpuset", "path": d, "cpus": v}
                                         for d, v in self.cpusets.items()]
        for t, mask in self.masks.items():
            records.append({"kind": "affinity", "pid": t.pid, "tid": t.tid,
                            "start_time": t.start_time, "cpus": mask})
        return records

    def _wanted(self, is_holder: bool, previous: list[int] | None) -> list[int]:
        if is_holder:
            return self.cores
        kept = [c for c in (previous or self.all_cores) if c in self.rest]
        return kept or self.rest

    def apply(self) -> None:
        self._plan()
        for d, is_holder in self._cpuset_dirs():
            if d not in self.cpusets:
                continue
            wanted = _cpulist(self.cores if is_holder else self.rest)
            if _parse_cpulist(self.cpusets[d]) != _parse_cpulist(wanted):
                try:
                    write(d + "/cpuset.cpus", wanted)
                except FileNotFoundError:  # ended between the plan and now
                    del self.cpusets[d]
        for _round in range(3):  # threads started while we were moving others
            if not self._place_all():
                return

    def _place_all(self) -> int:
        moved = 0
        jobs = self._jobs()
        for (_, is_holder), refs in zip(jobs, processes_of([t for t, _ in jobs]), strict=True):
            for ref in refs:
                for thread in threads_of(ref):
                    wanted = self._wanted(is_holder, self.masks.get(thread))
                    if _get_affinity(thread.tid) not in (None, wanted):
                        _set_affinity(thread, wanted)
                        moved += 1
        return moved

    def revert(self) -> None:
        for d, cpus in self.cpusets.items():
            try:
                if _parse_cpulist(read(d + "/cpuset.cpus")) != _parse_cpulist(cpus):
                    write(d + "/cpuset.cpus", cpus or "\n")
            except FileNotFoundError:
                pass
        jobs = [t for t, _ in self._jobs()]
        for target, refs in zip(jobs, processes_of(jobs), strict=True):
            for ref in refs:
                fallback = self.proc_masks.get(ref) or self._job_mask(target)
                for thread in threads_of(ref):
                    _set_affinity(thread, self.masks.get(thread, fallback))

    def _job_mask(self, target: JobTarget) -> list[int]:
        for ref, mask in self.proc_masks.items():
            if target.root is not None and ref == target.root:
                return mask
        return self.all_cores


def _cpulist(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores)


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


class SlotIsolation:
    """CPU isolation in a few writes, whatever the number of jobs.

    The holder's slot (``hold-<device>``, where :class:`~krex.enforce.slot.HolderSlot`
    moved it) is its reserved-core cpuset; every other device's subtree (parent and
    slot) not frozen by this region is narrowed to the remaining cores with one
    write each, and put back on revert.  Jobs with processes outside their cgroups
    (and the holder, if it has such) fall back to per-thread affinity
    (:class:`CpuIsolation`).  O(devices) writes, not O(jobs).
    """

    name = "isolate"
    keepable = True  # may stay applied for the holder's next region (krex.daemon.keep)
    backend = "cpuset-slot"

    def __init__(self, holder: JobTarget, others: list[JobTarget], frozen: set[str],
                 # frozen: the devices whose subtrees this region froze
                 cores: list[int], all_cores: list[int]) -> None:
        dev = holder.cgroups.device if holder.cgroups else None
        self.slot = dev.slot.get("cpuset") if dev else None
        self.cores, self.all_cores = sorted(cores), sorted(all_cores)
        self.rest = [c for c in self.all_cores if c not in self.cores]
        dirs: dict[str, None] = {}
        for t in others:
            other = t.cgroups.device if t.cgroups else None
            if other is None or other.device in frozen:
                continue  # a frozen device's jobs cannot run: no need to move them
            for d in (other.parent.get("cpuset"), other.slot.get("cpuset")):
                if d and d != self.slot:
                    dirs[d] = None
        self.narrow = list(dirs)
        self.previous: dict[str, str] = {}
        loose = [_bare(t) for t in others if t.may_run_outside()]
        bare_holder = _bare(holder) if holder.may_run_outside() else JobTarget(-1)
        self.loose = (CpuIsolation(bare_holder, loose, cores, all_cores)
                      if loose or bare_holder.job_id != -1 else None)

    def available(self) -> tuple[bool, str]:
        if not self.slot:
            return False, "the holder has no cpuset slot"
        if not self.cores or not self.rest:
            return False, "no cores to reserve, or none left for the other jobs"
        return True, ""

    def undo_records(self) -> list[dict]:
        # After a crash nobody stays pinned: the slot gets every core back.
        records: list[dict[str, Any]] = [{"kind": "cpuset", "path": self.slot,
                                          "cpus": _cpulist(self.all_cores)}]
        self._plan()
        records += [{"kind": "cpuset", "path": d, "cpus": v} for d, v in self.previous.items()]
        return records + (self.loose.undo_records() if self.loose else [])

    def _plan(self) -> None:
        for d in self.narrow:
            if d not in self.previous:
                self.previous[d] = read(d + "/cpuset.cpus")

    def apply(self) -> None:
        assert self.slot is not None
        self._plan()
        if _parse_cpulist(read(self.slot + "/cpuset.cpus")) != self.cores:
            write(self.slot + "/cpuset.cpus", _cpulist(self.cores))
        rest = _cpulist(self.rest)
        for d in self.narrow:
            write(d + "/cpuset.cpus", rest)
        if self.loose is not None:
            self.loose.apply()

    def carriable(self, fresh: SlotIsolation) -> bool:
        """Whether ``fresh`` (the next holder's) would write exactly what this wrote."""
        return (self.loose is None and fresh.loose is None and fresh.slot == self.slot
                and fresh.cores == self.cores and fresh.narrow == self.narrow)

    def hand_over(self, fresh: SlotIsolation) -> None:
        """``fresh`` keeps the cpusets as they are and puts them back at its end."""
        fresh.previous, self.previous = self.previous, {}

    def revert(self) -> None:
        if self.loose is not None:
            self.loose.revert()
        for d, cpus in self.previous.items():
            try:
                write(d + "/cpuset.cpus", cpus or "\n")
            except FileNotFoundError:
                pass


def _bare(target: JobTarget) -> JobTarget:
    """The job without its cgroups: its processes found from /proc (affinity only)."""
    return dataclasses.replace(target, cgroups=None, tracked=list(target.tracked))
