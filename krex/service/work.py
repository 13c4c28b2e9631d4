"""What each job kind runs, as a client of the node daemon.

``exec``: a program (source text, or a path on this node) in a warm worker;
``evaluate``: ``krex.evaluate`` on reference/candidate/inputs (source text or
``path.py:function``), stored in the records database; ``bench``: a command
timed in a region (``krex.measure.command``).  Source text is written to the
job's own folder under the state directory first.

Each job runs as its tenant in the daemon: the runner thread acts for the
job's tenant (:data:`krex.client.connection.ACTING_FOR`), so every program it
runs in a warm worker — an exec, an evaluation's candidate and reference —
carries the tenant id, the daemon (which trusts the service: it runs as the
daemon's user) charges that program's regions to the tenant, and the
daemon's per-tenant fair share and quotas apply (docs/service.md).  A
program that ends on the daemon's quota error fails its job with
``quota_exceeded``, and the tenant's next submits are refused (HTTP 429, with
Retry-After) for :data:`QUOTA_BACKOFF_S` — or as long as the daemon said.

Evaluations and benches run in a process of their own
(:mod:`krex.service.child`, in the job's folder, ``KREX_TENANT`` set), so that a
cancel can kill them and so that a bench's region and ad-hoc job are its
tenant's too.

Whose code runs as whom (:class:`Place`): the daemon says whom a tenant's
programs run as (``program_user``; on a root node daemon the tenant's own uid,
never root).  The job's folder stays the service's (``0750``, the tenant user's
group: its code reads the files the service wrote there and writes none);
its code works in ``work/`` inside, which is the tenant user's (``0700``), and
an evaluation's working directory is given to that user too.  A bench's
commands run as that user; a service that runs as root in front of a daemon
that runs tenants' code as another user refuses benches rather than run them
as root.

Cancel (:meth:`Work.stop`): an exec job's program runs in a warm worker, its
request naming the job's ``work/`` as its working directory; the service asks
the daemon (``stop_program``) to kill the worker running the program of that
folder (the daemon's record, which a program's ``chdir`` does not change): the
daemon stops it, checks again (the worker may have moved on), and kills every
process in the worker's cgroup — what the program started, a double fork that
left the worker's process tree included.  The pool sees its worker die and
replaces it (recycled); the program's region, if it held one, ends with its
holder.  An evaluation's
or a bench's process is stopped first (it can no longer write a result or a
record), then the warm worker running its program (an evaluation's, found by
the same folder) and every command it started (a bench's timed runs) are
killed, then the process itself: its region ends with it, and the job ends
``cancelled`` with the error ``job_stopped`` and no result.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from krex.client.connection import ACTING_FOR, Client
from krex.errors import (
    AccessDenied,
    BadRequest,
    InternalError,
    JobStopped,
    KrexError,
    QuotaExceeded,
    error_class,
)
from krex.protocol.runas import RunAs
from krex.service import summary
from krex.service.child import LOG_NAME, RESULT_NAME
from krex.service.config import ServiceConfig
from krex.service.jobs import Job
from krex.workers.launcher import job_environment

QUOTA_BACKOFF_S = 5.0  # submits refused after the daemon refused a tenant (seconds unknown)
LATE_PROGRAM_S = 1.0  # after a cancelled evaluation's process is killed: its program looked for
STOP_POLL_S = 0.05
SPARE_CHILDREN = 2  # evaluate/bench processes kept started ahead of their jobs
def daemon_client() -> Client:
    """A connection to the node daemon (started on demand, like any client's)."""
    return Client()


@dataclass(frozen=True)
class Place:
    """Where a job's files are, and whom its code runs as."""

    folder: str  # the service's: what it writes for the job (the job's code reads it)
    work: str  # the working directory of the job's code, its user's
    run_as: RunAs | None  # None: the daemon's own user

    def write(self, name: str, text: str) -> str:
        """A file of the job's (a program's source) that its code may read, not change."""
        path = os.path.join(self.folder, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
        with os.fdopen(fd, "w") as f:
            if self.run_as is not None:  # (the service's umask is 077)
                os.fchown(f.fileno(), -1, self.run_as.gid)
                os.fchmod(f.fileno(), 0o640)
            f.write(text)
        return path


class Work:
    """The job kinds, bound to a configuration; ``kinds()`` is what ``JobStore`` runs."""

    def __init__(self, config: ServiceConfig,
                 finished: Callable[[Job, dict[str, Any]], None] | None = None) -> None:
        self.config = config
        self.finished = finished  # told of each result (the node watcher's attribution)
        self._lock = threading.Lock()
        self._refused: dict[str, tuple[float, str]] = {}  # tenant -> (until, why), monotonic
        self._children: dict[str, subprocess.Popen[bytes]] = {}  # job id -> its process
        self._spares: list[subprocess.Popen[bytes]] = []  # started, waiting for a job
        self._closed = False

    def admit(self, tenant: str) -> None:
        """Refuse a submit while the daemon's latest quota refusal of ``tenant`` holds."""
        with self._lock:
            until, why = self._refused.get(tenant, (0.0, ""))
        left = until - time.monotonic()
        if left > 0:
            raise QuotaExceeded(f"{why} (the node daemon refused one of tenant {tenant!r}'s "
                                "jobs; submits are refused until then)", seconds=round(left, 3),
                                hint=f"retry after {left:.1f} s, or ask the node's operator "
                                     "for a larger quota")

    def kinds(self) -> dict[str, Callable[[Job], dict[str, Any]]]:
        return {"exec": self._told(self.exec), "evaluate": self._told(self.evaluate),
                "bench": self._told(self.bench)}

    def _told(self, fn: Callable[[Job, Place], dict[str, Any]]
              ) -> Callable[[Job], dict[str, Any]]:
        def run(job: Job) -> dict[str, Any]:
            acting = ACTING_FOR.set(job.tenant)
            try:
                result = fn(job, self._place(job))
            except QuotaExceeded as exc:
                with self._lock:
                    wait = exc.seconds if exc.seconds is not None else QUOTA_BACKOFF_S
                    self._refused[job.tenant] = (time.monotonic() + wait, exc.message)
                raise
            finally:
                ACTING_FOR.reset(acting)
                self._clean(job)
            if self.finished is not None:
                self.finished(job, result)
            return result
        return run

    def _place(self, job: Job) -> Place:
        """The job's folder and ``work/``, made for whom the daemon runs its code as."""
        with daemon_client() as client:
            run_as, daemon_uid = client.program_user(job.tenant)
        if job.kind == "bench" and run_as is None and os.geteuid() == 0 and daemon_uid != 0:
            raise AccessDenied(
                f"this service runs as root and its node daemon runs tenants' code as uid "
                f"{daemon_uid}: a bench's commands would run as root",
                hint="run the service as the daemon's user, or the daemon as root (its "
                     "tenants' code then runs as their own uids: krex serve --tenant-uids)")
        jobs = os.path.join(self.config.state_dir, "jobs")
        folder, work = _paths(self.config.state_dir, job.id)
        os.makedirs(jobs, mode=0o700, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)  # a run the service's stop interrupted
        os.mkdir(folder, 0o700)
        os.mkdir(work, 0o700)
        if run_as is not None:  # its user enters the state directory, lists nothing
            for d in (self.config.state_dir, jobs):
                os.chmod(d, 0o711)
            os.chown(folder, os.getuid(), run_as.gid, follow_symlinks=False)
            os.chmod(folder, 0o750)
            run_as.give(work)
        return Place(folder, work, run_as)

    def _clean(self, job: Job) -> None:
        shutil.rmtree(os.path.join(self.config.state_dir, "jobs", job.id), ignore_errors=True)

    # -- the kinds -----------------------------------------------------------------------

    def exec(self, job: Job, place: Place) -> dict[str, Any]:
        r = job.request
        path = r.get("path") or place.write("program.py", r["program"])
        if not os.path.isfile(path):
            raise BadRequest(f"no such program on this node: {path}",
                             hint="send the program's source as `program`")
        out = _Tail(self.config.job_output_bytes)
        env = {**job_environment(), **r.get("env", {})}
        with daemon_client() as client:
            result = client.exec(path, r.get("args", []), device=r.get("device"),
                                 timeout_s=r.get("timeout_s"), cwd=place.work, env=env,
                                 on_output=out.add)
        _raise_quota(result.exception)
        return summary.execution(result.to_dict(), out.text("stdout"), out.text("stderr"))

    def evaluate(self, job: Job, place: Place) -> dict[str, Any]:
        if job.request.get("problem") is not None:
            specs = _kernelbench(place, job.request["problem"], job.request["solution"])
        else:
            specs = {side: _spec(place, side, job.request[side]) for side in
                     ("reference", "candidate", "inputs")}
        try:
            return self._in_child(job, place, {**job.request, **specs})
        finally:
            self._fit_records()

    def _fit_records(self) -> None:
        """``--records-max-mb``: the oldest evaluations go once the records database's pages
        in use pass it (after each evaluation job: the child stored its record)."""
        if self.config.records_max_mb is None:
            return
        from krex.records import RecordStore

        with RecordStore(self.config.records) as store:  # SQLite serialises two prunes
            store.prune(int(self.config.records_max_mb * 2**20))

    def bench(self, job: Job, place: Place) -> dict[str, Any]:
        return self._in_child(job, place, job.request)

    def _in_child(self, job: Job, place: Place, request: dict[str, Any]) -> dict[str, Any]:
        """Run ``job`` in a process of its own (:mod:`krex.service.child`), in its folder,
        as its tenant; its result, or its error raised here."""
        folder = place.folder
        payload = json.dumps({"kind": job.kind, "tenant": job.tenant, "request": request,
                              "records": self.config.records, "folder": folder,
                              "work": place.work,
                              "run_as": place.run_as.to_dict() if place.run_as else None}
                             ).encode()
        proc = self._spare()
        with self._lock:
            self._children[job.id] = proc
        try:
            proc.communicate(payload)
        finally:
            with self._lock:
                self._children.pop(job.id, None)
        return _child_result(folder, proc.returncode, job.cancel_requested)

    # -- cancel ----------------------------------------------------------------------------

    def stop(self, job: Job) -> bool:
        """Interrupt ``job``'s running work; True once it was (False: not started yet)."""
        folder, work = _paths(self.config.state_dir, job.id)
        if job.kind == "exec":
            return _kill_workers_in(work)
        with self._lock:
            proc = self._children.get(job.id)
        if proc is None:
            return False
        _kill_child(proc, folder)
        if job.kind == "evaluate":  # a program sent just before the child stopped
            _linger(lambda: _kill_workers_in(work), LATE_PROGRAM_S)
        return True

    def close(self) -> None:
        """Kill the jobs' processes (the service stops: their jobs end ``interrupted``)
        and the spares."""
        with self._lock:
            children, spares, self._spares = list(self._children.items()), self._spares, []
            self._closed = True
        for job_id, proc in children:
            _kill_child(proc, os.path.join(self.config.state_dir, "jobs", job_id))
        for proc in spares:
            proc.kill()
            proc.wait()

    def _spare(self) -> subprocess.Popen[bytes]:
        """A job's process: a spare started earlier (its imports done), and the next
        spare started in its place."""
        with self._lock:
            ready = [p for p in self._spares if p.poll() is None]
            for p in self._spares:
                if p not in ready:
                    p.wait()
            proc = ready.pop(0) if ready else None
            self._spares = ready
            if not self._closed:
                while len(self._spares) < SPARE_CHILDREN - (proc is None):
                    self._spares.append(_spawn_child())
        return proc or _spawn_child()



def _paths(state_dir: str, job_id: str) -> tuple[str, str]:
    """A job's folder and its code's working directory."""
    folder = os.path.join(state_dir, "jobs", job_id)
    return folder, os.path.join(folder, "work")


def _spec(place: Place, side: str, value: str | dict[str, str]) -> str:
    if isinstance(value, str):  # a node path (absolute: schemas refuse a relative one)
        path, sep, fn = value.rpartition(":")
        return f"{os.path.abspath(path)}:{fn}" if sep and path.endswith(".py") else value
    return f"{place.write(f'{side}.py', value['source'])}:{value['function']}"


def _kernelbench(place: Place, problem: str | dict[str, str],
                 solution: str | dict[str, str]) -> dict[str, str]:
    """A KernelBench pair's three specs: its generated modules in the job's folder, where
    the job's code may read them (the files, sent as text, beside them)."""
    from krex.evaluate import kernelbench

    paths = [value if isinstance(value, str) else place.write(f"{role}.py", value["source"])
             for role, value in (("problem", problem), ("solution", solution))]
    return {role: f"{place.write(f'kernelbench_{filename}', text)}:{name}" for role,
            (filename, name, text) in kernelbench.modules(*map(os.path.abspath, paths)).items()}


def _kill_workers_in(folder: str) -> bool:
    """Have the daemon kill the warm worker running the program started in ``folder``,
    with every process in its cgroup (a double fork's too); True if one was."""
    try:
        with daemon_client() as client:
            return bool(client.stop_program(folder).get("stopped"))
    except KrexError:
        return False


def _kill_child(proc: subprocess.Popen[bytes], folder: str) -> None:
    """Stop a job's process (it can no longer write a result or a record), kill the
    warm worker running its program and every process it started, then the process.
    Its pid stays ours until its runner thread reaps it."""
    import psutil

    if proc.poll() is not None:
        return
    try:
        child = psutil.Process(proc.pid)
        child.suspend()
        tree = child.children(recursive=True)
    except psutil.Error:
        return
    for p in tree:  # a bench's runs (sessions of their own): stopped, then killed
        with contextlib.suppress(psutil.Error):
            p.suspend()
    _kill_workers_in(folder)
    for p in [*tree, child]:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _spawn_child() -> subprocess.Popen[bytes]:
    """A job's process: ``-I`` and cwd ``/``, so nothing is imported from the state
    directory (tenant code can write there) or from PYTHON* variables; the job's minimal
    environment (:data:`~krex.workers.launcher.JOB_ENV`: a bench's commands are tenant
    code)."""
    return subprocess.Popen([sys.executable, "-I", "-m", "krex.service.child"], cwd="/",
                            env=job_environment(), stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _linger(fn: Callable[[], bool], seconds: float) -> None:
    """Call ``fn`` until it returns True or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while not fn() and time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)


def _child_result(folder: str, code: int | None, cancelled: bool) -> dict[str, Any]:
    """What a job's process wrote, or why it wrote nothing."""
    try:
        with open(os.path.join(folder, RESULT_NAME)) as f:
            out = json.load(f)
    except (OSError, ValueError):
        if cancelled:
            raise JobStopped("the job was cancelled while it ran: its process was killed "
                             "before it finished (nothing was recorded)") from None
        with contextlib.suppress(OSError), open(os.path.join(folder, LOG_NAME)) as f:
            raise InternalError(f"the job's process exited with status {code} and no result: "
                                f"{f.read()[-2000:]}") from None
        raise InternalError(f"the job's process exited with status {code} and no result") \
            from None
    if "error" in out:
        e = out["error"]
        raise error_class(e["code"])(e["message"], **e.get("fields", {}))
    return out["result"]


def _raise_quota(exception: str | None) -> None:
    """A program that ended on the daemon's quota error: the job's error is that one."""
    name = f"{QuotaExceeded.__name__}: "
    if exception and exception.startswith(name):
        raise QuotaExceeded(exception.removeprefix(name),
                            hint="wait and submit again, or ask the node's operator for a "
                                 "larger quota (krex serve --tenant-region-s-per-min, "
                                 "--tenant-max-jobs, --tenant-max-hold-s)")


class _Tail:
    """The last ``limit`` bytes of each output stream."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: dict[str, str] = {"stdout": "", "stderr": ""}

    def add(self, stream: str, text: str) -> None:
        key = "stderr" if stream == "stderr" else "stdout"
        self.parts[key] = (self.parts[key] + text)[-self.limit:]

    def text(self, stream: str) -> str:
        return self.parts[stream]
