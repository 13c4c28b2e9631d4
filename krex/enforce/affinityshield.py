"""The shield's fallback without a writable cpuset: every movable thread's affinity.

Mode ``affinity`` of :mod:`krex.enforce.shield` (root, no cgroup v1 cpuset:
e.g. a pure cgroup v2 machine, where cpuset partitions are not implemented
yet).  At a region's start every thread of every process on the machine that
may run on a reserved core gets that core taken out of its affinity mask
(``sched_setaffinity``; a thread pinned only to reserved cores gets the rest
of the cores); its previous mask is an ``affinity`` undo record in the
region's guardian lease (replayed with a start-time check).  At the end each
mask is put back; threads and processes born during the region inherited
the narrowed mask, so they get their process's (or parent's) previous mask.

Not moved (named in the evidence): kernel threads, PID 1, the daemon and the
guardian (:func:`~krex.enforce.process.may_touch`), the holder's processes.
Unlike the cpuset shield, a task that starts during the region from an
exempt parent (PID 1) is not moved until the next region (``late``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from krex.enforce.process import (
    ProcessRef,
    ThreadRef,
    may_touch,
    start_time,
    task_stat,
    threads_of,
)

_PF_KTHREAD = 0x00200000
_LISTED = 32


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _flags_ppid(pid: int) -> tuple[int, int] | None:
    try:
        st = task_stat(pid)
    except OSError:
        return None
    return (st.flags, st.ppid) if st else None


def _mask(tid: int) -> set[int] | None:
    try:
        return set(os.sched_getaffinity(tid))
    except OSError:
        return None


class AffinityRegion:
    """One region's affinity shield: narrow every movable thread, put each back."""

    name = "shield"
    backend = "affinity"

    def __init__(self, holder: Any, cores: list[int], all_cores: list[int],
                 devices: set[int] | frozenset[int] = frozenset()) -> None:
        self.holder = holder
        self.devices = devices  # fake devices' servers (Shield.exempt_device): never moved
        self.cores = sorted(cores)
        self.reserved = set(cores)
        self.rest = sorted(set(all_cores) - self.reserved)
        self.masks: dict[ThreadRef, set[int]] = {}  # previous masks
        self.proc_masks: dict[int, set[int]] = {}  # pid -> its main thread's previous mask
        self.exclude: set[int] | None = None
        self.refused: list[int] = []
        self.evidence: dict[str, Any] = {"mode": "affinity", "not_enforced": "", "why": "",
                                         "cores": self.cores}

    def available(self) -> tuple[bool, str]:
        return True, ""  # built only when the shield can act (Shield.ops)

    def _movable(self) -> list[ProcessRef]:
        if self.exclude is None:
            self.exclude = {r.pid for r in self.holder.processes()} | set(self.devices)
        out = []
        for pid in _pids():
            info = _flags_ppid(pid)
            if info is None or info[0] & _PF_KTHREAD or pid in self.exclude or not may_touch(pid):
                continue
            started = start_time(pid)
            if started is not None:
                out.append(ProcessRef(pid, started))
        return out

    def _plan(self) -> int:
        """Record every movable thread that may run on a reserved core; new ones count."""
        new = 0
        for ref in self._movable():
            for thread in threads_of(ref):
                if thread in self.masks:
                    continue
                mask = _mask(thread.tid)
                if mask is not None and mask & self.reserved:
                    self.masks[thread] = mask
                    if thread.tid == ref.pid:
                        self.proc_masks[ref.pid] = mask
                    new += 1
        return new

    def undo_records(self) -> list[dict]:
        if not self.masks:
            self._plan()
        return [{"kind": "affinity", "pid": t.pid, "tid": t.tid, "start_time": t.start_time,
                 "cpus": sorted(mask)} for t, mask in self.masks.items()]

    def apply(self) -> None:
        t0 = time.perf_counter()
        self._plan()
        done: set[ThreadRef] = set()
        for _round in range(3):  # threads started while we were moving the others
            for thread, mask in self.masks.items():
                if thread not in done:
                    self._set(thread, sorted(mask - self.reserved) or self.rest)
                    done.add(thread)
            if not self._plan():
                break
        self.evidence.update(moved=len(done), processes=len(self.proc_masks),
                             refused=self.refused[:_LISTED],
                             apply_ms=round((time.perf_counter() - t0) * 1e3, 3))

    def _set(self, thread: ThreadRef, cpus: list[int]) -> None:
        try:
            if thread.alive():
                os.sched_setaffinity(thread.tid, cpus)
        except ProcessLookupError:
            pass
        except OSError:
            self.refused.append(thread.tid)

    def revert(self) -> None:
        for thread, mask in self.masks.items():
            self._set(thread, sorted(mask))
        self.evidence["late"] = self._born_meanwhile()

    def _born_meanwhile(self) -> list[int]:
        """Threads and children born during the region inherited a narrowed mask: give
        them their process's or parent's previous one.  Returns unknown late pids."""
        late = []
        for ref in self._movable():
            info = _flags_ppid(ref.pid)
            previous = self.proc_masks.get(ref.pid) or (
                self.proc_masks.get(info[1]) if info else None)
            for thread in threads_of(ref):
                if thread in self.masks:
                    continue
                mask = _mask(thread.tid)
                if previous is not None and mask is not None and not mask & self.reserved:
                    self._set(thread, sorted(previous))
                elif previous is None and mask is not None and mask & self.reserved:
                    late.append(ref.pid)
        return sorted(set(late))[:_LISTED]


__all__ = ["AffinityRegion"]
