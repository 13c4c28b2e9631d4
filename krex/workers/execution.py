"""One program on one worker, seen from the pool: send, stream, wait, judge.

``run_on`` sends the request, forwards output to ``on_output`` on the
caller's thread as it arrives, and turns what happens into an
``ExecResult``: the worker's ``done`` message, its death (``crashed``), the
deadline passing (``timeout``: the worker is killed) or the pool closing
(``cancelled``).
"""

from __future__ import annotations

import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from krex.workers.process import WorkerProcess
from krex.workers.spec import EXIT_TIMEOUT, ExecRequest, ExecResult

# For the end-of-output sentinels once the program is done: normally milliseconds, but the
# worker's IO thread can wait seconds for a CPU on a loaded machine (a 2 s wait once lost
# an exec's output in a 25-minute load run).  Past it, the output is said to be incomplete.
_SYNC_WAIT_S = 15.0
INCOMPLETE = "krex: the program's output may be incomplete: its end did not arrive within"
_DRAIN_WAIT_S = 1.0  # for the rest of a dead worker's output
_seq = iter(range(1, 1 << 62))


@dataclass
class _Run:
    worker: WorkerProcess
    on_output: Callable[[str, str], None]
    seq: int
    synced: set[str] = field(default_factory=set)
    closed: set[str] = field(default_factory=set)
    stderr: list[str] = field(default_factory=list)
    done: dict[str, Any] | None = None

    def deliver(self, event: tuple) -> None:
        kind = event[0]
        if kind == "out":
            if event[1] == "stderr":
                self.stderr.append(event[2])
            try:
                self.on_output(event[1], event[2])
            except Exception:  # noqa: BLE001, S110  (a broken consumer must not break the run)
                pass
        elif kind == "sync":
            self.synced.add(event[1])
        elif kind == "eof":
            self.closed.add(event[1])
        elif kind == "msg" and event[1].get("t") == "done" and event[1].get("seq") == self.seq:
            self.done = event[1]

    def pump(self, until: Callable[[], bool], deadline: float) -> bool:
        """Deliver events until ``until()`` or the deadline; True if ``until()``."""
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                event = self.worker.events.get(timeout=min(left, 0.25))
            except queue.Empty:
                continue
            for merged in _coalesce(event, self.worker.events):
                self.deliver(merged)
        return True


def _coalesce(first: tuple, events: queue.Queue) -> list[tuple]:
    """``first`` and whatever else is already queued, adjacent output of a stream joined."""
    out = [first]
    while len(out) < 256:
        try:
            event = events.get_nowait()
        except queue.Empty:
            break
        last = out[-1]
        if event[0] == "out" and last[0] == "out" and event[1] == last[1]:
            out[-1] = ("out", last[1], last[2] + event[2])
        else:
            out.append(event)
    return out


def run_on(worker: WorkerProcess, req: ExecRequest, on_output: Callable[[str, str], None],
           submitted: float, timeout_s: float | None, closing: Callable[[], bool]) -> ExecResult:
    run = _Run(worker, on_output, next(_seq))
    _drop_stale(worker)
    worker.send({"t": "run", "seq": run.seq, "request": _wire(req)})
    deadline = submitted + timeout_s if timeout_s is not None else float("inf")
    finished = run.pump(lambda: run.done is not None or "control" in run.closed or closing(),
                        deadline)
    if run.done is not None:
        streams = {"stdout", "stderr"}
        if not run.pump(lambda: run.synced >= streams or streams <= run.closed,
                        time.monotonic() + _SYNC_WAIT_S):  # never lost silently
            run.deliver(("out", "stderr", f"\n{INCOMPLETE} {_SYNC_WAIT_S:g} s\n"))
        return _from_done(run, submitted)
    if not finished:
        return _timed_out(run, timeout_s or 0.0)
    if closing():
        return _cancelled(run)
    return _crashed(run)


def _wire(req: ExecRequest) -> dict[str, Any]:
    return {"kind": req.kind, "path": req.path, "args": list(req.args), "cwd": req.cwd,
            "env": dict(req.env), "payload": req.payload}


def _drop_stale(worker: WorkerProcess) -> None:
    """Output left over from before this request belongs to nobody."""
    while True:
        try:
            worker.events.get_nowait()
        except queue.Empty:
            return


def _from_done(run: _Run, submitted: float) -> ExecResult:
    done = run.done
    assert done is not None  # called once the worker said so
    r, reason = done["result"], done.get("recycle")
    started = r.get("started_mono_s")
    return ExecResult(
        status=r["status"], exit_code=r["exit_code"], exception=r.get("exception"),
        traceback=r.get("traceback"), value=r.get("value"), worker_pid=run.worker.pid,
        recycled=reason is not None, recycle_reason=reason,
        dispatch_s=None if started is None else max(0.0, started - submitted),
        started_mono_s=started, ended_mono_s=r.get("ended_mono_s"),
        restored=list(done.get("restored", [])))


def _timed_out(run: _Run, timeout_s: float) -> ExecResult:
    run.worker.kill()
    run.pump(lambda: {"stdout", "stderr"} <= run.closed, time.monotonic() + _DRAIN_WAIT_S)
    return ExecResult(
        status="timeout", exit_code=EXIT_TIMEOUT, worker_pid=run.worker.pid,
        exception=f"Timeout: the program ran longer than {timeout_s:g} s and its worker was killed",
        recycled=True, recycle_reason=f"timeout: {timeout_s:g} s")


def _cancelled(run: _Run) -> ExecResult:
    return ExecResult(status="cancelled", exit_code=1, worker_pid=run.worker.pid,
                      exception="Cancelled: the worker pool shut down while the program ran",
                      recycled=True, recycle_reason="shutdown")


def _crashed(run: _Run) -> ExecResult:
    code = run.worker.kill()
    run.pump(lambda: {"stdout", "stderr"} <= run.closed, time.monotonic() + _DRAIN_WAIT_S)
    how = _death(code)
    tail = "".join(run.stderr)[-4000:] or None
    return ExecResult(
        status="crashed", exit_code=_exit_code(code),
        exception=f"WorkerCrashed: worker {run.worker.pid} {how} while running the program",
        traceback=tail, worker_pid=run.worker.pid, recycled=True, recycle_reason=f"crashed: {how}")


def _exit_code(code: int | None) -> int:
    """As a shell reports the program run alone: ``os._exit(3)`` -> 3, SIGSEGV -> 139."""
    if code is None:
        return 1
    return 128 - code if code < 0 else code


def _death(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"died from {signal.Signals(-code).name}"
        except ValueError:
            return f"died from signal {-code}"
    return f"exited with status {code}"
