"""One lane per device: its enforcement runs in order, off the daemon's lock.

Setting up a region's enforcement can wait for seconds (siblings draining
their GPU queues, processes that are slow to stop); undoing it takes time
too.  Each device gets a :class:`Lane`, a thread that runs that device's
enforcement tasks one after another, so a grant's set-up never overlaps the
previous region's undo on the same device, while other devices, status,
releases and every other request go on.  A task that raises is logged and
the lane goes on with the next.

A task may also run on the thread that gave it (:meth:`Lanes.claim`): when the
lane is idle, that thread takes the lane's turn at once and runs the task
itself (once the daemon's lock is released), which spares the wake-up of the
lane's thread — on a loaded 2-core machine each cross-thread hop can cost a
scheduler tick.  Tasks given meanwhile queue behind it, as behind any other.
A task claimed by the thread that is running the lane's current task, with
nothing queued behind that one (a release whose undo grants the next region:
its set-up), runs next on that thread, in the same turn.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from krex.daemon import priority

log = logging.getLogger("krex.daemon")
Task = Callable[[], None]


class Lane:
    """A thread that runs one device's tasks in the order they were given."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._turn = threading.Lock()  # held by whoever runs this lane's task now
        self._runner: int | None = None  # the thread running this lane's task now
        self._thread = threading.Thread(target=self._run, name=f"krex-lane-{name}", daemon=True)
        self._thread.start()

    def submit(self, task: Task) -> None:
        with self._lock:
            self._pending += 1
        self._tasks.put(task)

    def claim(self, task: Task) -> Task | None:
        """Take the lane's turn for ``task`` now if the lane is idle and return the
        call that runs it (the caller must make it, soon, on its own thread); else
        queue it as :meth:`submit` does and return None."""
        with self._lock:
            self._pending += 1
            if self._runner == threading.get_ident() and self._pending == 2:
                # given by the lane's current task, nothing queued behind it: next, here
                return lambda: self._run_one(task, taken=True, within=True)
            mine = self._pending == 1 and self._turn.acquire(blocking=False)
        if not mine:
            self._tasks.put(task)
            return None
        return lambda: self._run_one(task, taken=True)

    def busy(self) -> bool:
        with self._lock:
            return self._pending > 0

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every task given so far has run; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        self._tasks.put(None)

    def _run(self) -> None:
        priority.elevate()
        while True:
            task = self._tasks.get()
            if task is None:
                return
            self._run_one(task)

    def _run_one(self, task: Task, taken: bool = False, within: bool = False) -> None:
        """``within``: claimed inside the turn of the task this thread is running."""
        if not taken:
            self._turn.acquire()  # a claimed task (given before the queued ones) first
        self._runner = threading.get_ident()
        try:
            task()
        except Exception:  # a bug in one task must not stop the device's lane
            log.exception("lane %s: task failed", self.name)
        finally:
            if not within:
                self._runner = None
                self._turn.release()
            with self._idle:
                self._pending -= 1
                if not self._pending:
                    self._idle.notify_all()


class Lanes:
    """The lanes of a daemon, one per device, started on first use."""

    def __init__(self) -> None:
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()

    def submit(self, device: str, task: Task) -> None:
        self._lane(device).submit(task)

    def _lane(self, device: str) -> Lane:
        with self._lock:
            lane = self._lanes.get(device)
            if lane is None:
                lane = self._lanes[device] = Lane(device)
            return lane

    def claim(self, device: str, task: Task) -> Task | None:
        """:meth:`Lane.claim` on ``device``'s lane."""
        return self._lane(device).claim(task)

    def busy(self) -> list[str]:
        with self._lock:
            lanes = list(self._lanes.values())
        return [lane.name for lane in lanes if lane.busy()]

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            lanes = list(self._lanes.values())
        return all(lane.wait_idle(max(0.0, deadline - time.monotonic())) for lane in lanes)

    def close(self) -> None:
        with self._lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.close()
