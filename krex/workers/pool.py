"""WorkerPool: warm workers for one device, sized between min and max.

``submit`` takes a worker in FIFO order (starting one when the queue is
longer than the idle supply and the pool is below ``max_workers``), runs
the request there (``execution.run_on``), and then either returns the
worker to the idle set or recycles it: kills, reaps and replaces it.  A
keeper thread replaces workers that die while idle and stops idle workers
above ``min_workers + spare_workers`` after ``idle_shutdown_s``.
``spare_workers`` are kept ready beyond the busy ones (and beyond
``min_workers`` when all are idle), so a crash or a recycle does not leave
the next program waiting for a worker to start.  An idle worker is taken
most-recently-used first, so back-to-back programs share one warm worker.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from krex.errors import KrexError, ShuttingDown, WorkerFailed
from krex.workers.execution import run_on
from krex.workers.launcher import DefaultLauncher, WorkerLauncher
from krex.workers.process import WorkerProcess, WorkerStartError
from krex.workers.spec import ExecRequest, ExecResult, PoolSpec

OutputCallback = Callable[[str, str], None]


class WorkerPool:
    def __init__(self, spec: PoolSpec, launcher: WorkerLauncher | None = None) -> None:
        self.spec = spec
        self.launcher = launcher or DefaultLauncher()
        self._cond = threading.Condition()
        self._workers: dict[int, WorkerProcess] = {}  # ready, busy or idle
        self._idle: collections.deque[WorkerProcess] = collections.deque()
        self._queue: collections.deque[object] = collections.deque()
        self._starting = 0
        self._spawned = 0
        self._failures: list[str] = []
        self._recycles: collections.Counter[str] = collections.Counter()
        self._served = 0
        self._closed = False
        self._keeper = threading.Thread(target=self._keep, name="krex-pool-keeper", daemon=True)

    # -- public API ------------------------------------------------------------------

    def start(self) -> None:
        """Start ``min_workers`` and wait until they are ready."""
        with self._cond:
            for _ in range(self.spec.min_workers):
                self._spawn_locked()
            failures = len(self._failures)
            self._cond.wait_for(lambda: self._starting == 0)
            failed = len(self._failures) > failures and not self._workers
        if failed and self.spec.min_workers:
            self.shutdown()
            raise WorkerFailed(self._failures[-1], device=self.spec.device)
        self._keeper.start()

    def submit(self, req: ExecRequest, on_output: OutputCallback | None = None) -> ExecResult:
        """Run ``req`` in a warm worker; blocks until it is done.  Thread-safe."""
        submitted = time.monotonic()
        worker = self._acquire()
        worker.program_cwd = req.cwd
        timeout_s = req.timeout_s if req.timeout_s is not None else self.spec.default_timeout_s
        result = run_on(worker, req, on_output or _discard, submitted, timeout_s,
                        closing=lambda: self._closed)
        worker.programs += 1
        if not result.recycled and worker.programs >= self.spec.max_programs:
            result.recycled, result.recycle_reason = True, "max_programs"
        self._release(worker, result.recycle_reason if result.recycled else None)
        result.duration_s = time.monotonic() - submitted
        return result

    def status(self) -> dict[str, Any]:
        with self._cond:
            now = time.monotonic()
            workers = [_describe(w, now) for w in self._workers.values()]
            ready = next((w.ready for w in self._workers.values() if w.ready), {})
            return {"device": self.spec.device, "workers": workers, "starting": self._starting,
                    "queue_length": len(self._queue), "served": self._served,
                    "recycles": dict(self._recycles), "min_workers": self.spec.min_workers,
                    "max_workers": self.spec.max_workers, "context": ready.get("context"),
                    "preloaded": ready.get("preloaded", []), "missing": ready.get("missing", {}),
                    "memory_cap": ready.get("memory_cap"),
                    "last_start_failure": self._failures[-1] if self._failures else None}

    def shutdown(self, timeout_s: float = 5) -> None:
        """Kill and reap every worker; running programs end as "cancelled"."""
        with self._cond:
            self._closed = True
            workers = list(self._workers.values())
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._starting == 0, timeout=timeout_s)
            workers = list({id(w): w for w in workers + list(self._workers.values())}.values())
            self._workers.clear()
            self._idle.clear()
        for w in workers:
            w.kill(timeout_s)
        if self._keeper.is_alive():
            self._keeper.join(timeout_s)

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- taking and giving back workers -------------------------------------------------

    def _acquire(self) -> WorkerProcess:
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            failures = len(self._failures)
            try:
                while True:
                    if self._closed:
                        raise ShuttingDown("the worker pool is shutting down",
                                           device=self.spec.device)
                    if self._idle and self._queue[0] is ticket:
                        worker = self._idle.pop()  # the most recently used: its caches are warm
                        worker.busy = True
                        self._keep_spare_locked()
                        return worker
                    self._scale_up_locked()
                    if len(self._failures) > failures and not self._workers \
                            and not self._starting:
                        raise WorkerFailed(self._failures[-1], device=self.spec.device)
                    self._cond.wait(0.5)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _release(self, worker: WorkerProcess, recycle_reason: str | None) -> None:
        with self._cond:
            self._served += 1
            worker.busy = False
            worker.program_cwd = None
            if recycle_reason is None and not self._closed and worker.alive():
                worker.idle_since_mono_s = time.monotonic()
                self._idle.append(worker)
                self._cond.notify_all()
                return
            self._workers.pop(worker.pid, None)
            if recycle_reason:
                self._recycles[recycle_reason.split(":")[0]] += 1
            self._replenish_locked()
            self._cond.notify_all()
        worker.kill()

    # -- sizing ------------------------------------------------------------------------

    def _scale_up_locked(self) -> None:
        total = len(self._workers) + self._starting
        wanted = len(self._queue) - len(self._idle) - self._starting
        for _ in range(max(0, min(wanted, self.spec.max_workers - total))):
            self._spawn_locked()

    def _replenish_locked(self) -> None:
        if self._closed:
            return
        for _ in range(self._floor() - len(self._workers) - self._starting):
            self._spawn_locked()
        self._keep_spare_locked()

    def _floor(self) -> int:
        """Workers kept even when idle: the minimum and the spares, within the maximum."""
        return min(self.spec.max_workers, self.spec.min_workers + self.spec.spare_workers)

    def _keep_spare_locked(self) -> None:
        """``spare_workers`` ready (or starting) beyond the busy ones, within the maximum."""
        if self._closed:
            return
        room = self.spec.max_workers - len(self._workers) - self._starting
        wanted = self.spec.spare_workers - len(self._idle) - self._starting
        for _ in range(max(0, min(room, wanted))):
            self._spawn_locked()

    def _spawn_locked(self) -> None:
        self._starting += 1
        self._spawned += 1
        index = self._spawned
        threading.Thread(target=self._start_one, args=(index,), name=f"krex-pool-start-{index}",
                         daemon=True).start()

    def _start_one(self, index: int) -> None:
        worker = None
        try:
            worker = WorkerProcess.spawn(self.spec, self.launcher, index)
            worker.wait_ready(self.spec.start_timeout_s)
        except (WorkerStartError, OSError, KrexError) as e:  # KrexError: the launcher's own
            # (a device server that would not start) -- once left counted as a start in
            # progress: the pool never started another and its callers waited on
            self._start_failed(worker, str(e) or type(e).__name__)
            return
        with self._cond:
            self._starting -= 1
            if not self._closed:
                worker.idle_since_mono_s = time.monotonic()
                self._workers[worker.pid] = worker
                self._idle.appendleft(worker)  # taken last: a worker that ran programs is warmer
                self._cond.notify_all()
                return
            self._cond.notify_all()
        worker.kill()

    def _start_failed(self, worker: WorkerProcess | None, why: str) -> None:
        if worker is not None:
            worker.kill()
        with self._cond:
            self._starting -= 1
            self._failures.append(why)
            self._recycles["start_failed"] += 1
            self._cond.notify_all()

    def _keep(self) -> None:
        """Replace workers that died while idle; stop idle ones above the minimum."""
        while True:
            with self._cond:
                self._cond.wait(0.25)
                if self._closed:
                    return
                doomed = self._doomed_locked()
                self._replenish_locked()
            for w in doomed:
                w.kill()

    def _doomed_locked(self) -> list[WorkerProcess]:
        now, doomed = time.monotonic(), []
        for w in list(self._idle):
            dead = not w.alive()
            surplus = len(self._workers) > self._floor() \
                and len(self._idle) > self.spec.spare_workers
            if dead or (surplus and now - w.idle_since_mono_s > self.spec.idle_shutdown_s):
                self._idle.remove(w)
                self._workers.pop(w.pid, None)
                self._recycles["died_idle" if dead else "idle_scale_down"] += 1
                doomed.append(w)
        return doomed


def _describe(w: WorkerProcess, now: float) -> dict[str, Any]:
    return {"pid": w.pid, "programs": w.programs, "busy": w.busy,
            "program_cwd": w.program_cwd,
            "started_wall_s": w.started_wall_s,
            "idle_s": None if w.busy else round(now - w.idle_since_mono_s, 3),
            "context_s": w.ready.get("context_s"), "preload_s": w.ready.get("preload_s")}


def _discard(stream: str, text: str) -> None:
    pass
