"""The sealed evaluation's call loop on one CPU: the driver and both dispatchers.

A sealed call is two wake-ups: the driver wakes the callee's dispatcher, the
dispatcher wakes the driver.  On one CPU each wake-up is a context switch; to another
CPU it is an inter-processor interrupt, and on a virtual machine an idle vCPU must be
scheduled again by the host -- tens of microseconds, and not the same for both sides:
measured here, the empty call of the side whose callee sat on the other vCPU cost
90-140 us against 30-50 us, and equal-speed candidates read 0.92-0.96x in 1 run of 5.
:class:`OneCore` puts the driver's thread and both callees' dispatching threads on
the CPU the driver runs on, so both sides pay the same local switch.  Threads the
callees started before (library pools) keep their CPUs.  Moving a process into a
cpuset (a region's slot) resets its affinity, so it is pinned again on each region's
entry (:meth:`region`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


def current_cpu() -> int:
    """The CPU this thread last ran on (``/proc/thread-self/stat`` field 39)."""
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


class OneCore:
    """Pin the driver's thread and the callees' dispatching threads (``tids``) to one
    CPU of the driver's, and put back what each had."""

    def __init__(self, tids: list[int]) -> None:
        self.tids = tids
        self.saved: dict[int, set[int]] = {}  # 0: the driver's thread
        self.cpu: int | None = None

    def pin(self) -> int | None:
        """Pin all to the driver's CPU; None where it could not (the loop runs unpinned)."""
        try:
            allowed = os.sched_getaffinity(0)
            cpu = current_cpu()
            cpu = cpu if cpu in allowed else min(allowed)
            for tid in (0, *self.tids):
                self.saved.setdefault(tid, os.sched_getaffinity(tid))
                os.sched_setaffinity(tid, {cpu})
        except (OSError, ValueError):
            self.restore()
            return None
        self.cpu = cpu
        return cpu

    def restore(self) -> None:
        for tid, mask in self.saved.items():
            with contextlib.suppress(OSError, ValueError):
                os.sched_setaffinity(tid, mask)
        self.saved, self.cpu = {}, None

    def region(self, factory: Any) -> Any:
        """``factory`` with the threads pinned again once each region is granted."""

        @contextlib.contextmanager
        def pinned(device: str, **kw: Any) -> Iterator[Any]:
            with factory(device, **kw) as region:
                self.restore()  # the grant may have moved them: their masks as they are now
                self.pin()
                yield region

        return pinned
