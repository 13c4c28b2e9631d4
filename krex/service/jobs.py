"""Jobs: submitted once (idempotency keys), run by a few runner threads, waited for, cancelled.

A job is one evaluation, exec or bench on behalf of a tenant, queued fairly between
tenants (:mod:`krex.service.fairqueue`: the next job is the oldest of the tenant with
the fewest running).  States:
``queued`` -> ``running`` -> ``succeeded`` | ``failed`` | ``timed_out`` | ``crashed`` |
``cancelled``.  ``succeeded`` means the work was done and, for a program, that it exited 0:
a program that raised or exited non-zero is ``failed``, one stopped at its timeout
``timed_out``, one whose worker died under it ``crashed`` (the result's ``outcome``, the
word of :data:`krex.protocol.outcome.OUTCOMES`); an error of krex's own is ``failed``.
The store is SQLite (``jobs.sqlite3`` in the state directory), so a retried
submit finds its job after a restart too; a job that was running when the
service stopped is ``failed`` with ``interrupted`` on the next start, and
queued ones run then.

* **Idempotency**: ``(tenant, key)`` is unique.  The same key with the same
  request returns the existing job; with another request it is an
  :class:`~krex.errors.IdempotencyConflict`.
* **Quotas** (:class:`~krex.service.tenants.Quotas`): active jobs and jobs per
  minute, checked under the store's lock at submit.
* **Cancel**: a queued job is cancelled at once; a running one is marked,
  ``stop(job)`` interrupts its program (retried until the job's work returns:
  the program may not have started yet), and the job ends ``cancelled`` (what
  its work returned is kept, marked discarded).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from krex.errors import IdempotencyConflict, JobNotFound, KrexError, ServiceQuotaExceeded
from krex.protocol.outcome import OUTCOMES
from krex.records.store import used_bytes
from krex.service.config import KEEP_FINISHED
from krex.service.fairqueue import FairQueue
from krex.service.tenants import Tenant

KINDS = ("evaluate", "exec", "bench")
ACTIVE = ("queued", "running")
TERMINAL = OUTCOMES  # succeeded, failed, timed_out, crashed, cancelled
# SQLite's page cache for the jobs database (KiB; SQLite's default is 2000): every query
# is by an index, and the cache is memory the service keeps once the database outgrows it.
CACHE_KIB = 512
STOP_RETRY_S = 0.1  # a cancelled job's program not found yet (not started): look again

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, kind TEXT NOT NULL, idem_key TEXT,
    request TEXT NOT NULL, request_sha256 TEXT NOT NULL, state TEXT NOT NULL,
    created_s REAL NOT NULL, started_s REAL, ended_s REAL, cancel_requested INTEGER NOT NULL,
    result TEXT, error TEXT);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_key ON jobs (tenant, idem_key) WHERE idem_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs (tenant, created_s);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state);
"""

Work = Callable[["Job"], dict[str, Any]]  # runs a job; its result (KrexError: failed)


@dataclass
class Job:
    id: str
    tenant: str
    kind: str
    request: dict[str, Any]
    state: str = "queued"
    key: str | None = None
    created_s: float = field(default_factory=time.time)
    started_s: float | None = None
    ended_s: float | None = None
    cancel_requested: bool = False
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "tenant": self.tenant, "kind": self.kind, "state": self.state,
                "idempotency_key": self.key, "created_s": self.created_s,
                "started_s": self.started_s, "ended_s": self.ended_s,
                "cancel_requested": self.cancel_requested, "request": self.request,
                "result": self.result, "error": self.error}

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


def request_digest(kind: str, request: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps([kind, request], sort_keys=True).encode()).hexdigest()


def error_body(exc: KrexError) -> dict[str, Any]:
    return {"code": exc.code, "what": exc.message, "hint": exc.hint or None}


class JobStore:
    """The jobs and the runner threads that do them (``work[kind](job)``)."""

    def __init__(self, path: str, work: dict[str, Work], runners: int = 8,
                 admit: Callable[[str], None] | None = None,
                 stop: Callable[[Job], bool] | None = None,
                 keep_finished: int = KEEP_FINISHED, max_bytes: int | None = None) -> None:
        self.keep_finished = keep_finished
        self.max_bytes = max_bytes  # the database's pages in use at most (None: no budget)
        # pruned every this many finished jobs: at most a quarter more are kept meanwhile
        self._prune_every = max(1, min(1000, keep_finished // 4))
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        self.path = path
        self.work = work
        self.admit = admit  # raises when a tenant may not submit now (the daemon's quota)
        self.stop = stop  # interrupts a running job's program; True once it did
        self.db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
        self.db.executescript(_SCHEMA)
        self._cond = threading.Condition()
        self._queue = FairQueue()  # fair between tenants (krex.service.fairqueue)
        self._live: dict[str, Job] = {}  # active jobs (the database has them too)
        self._closed = False
        self.counters: collections.Counter[str] = collections.Counter()
        self._recover()
        self._threads = [threading.Thread(target=self._run, name=f"krex-service-runner-{i}",
                                          daemon=True) for i in range(runners)]
        for t in self._threads:
            t.start()

    # -- submit, read, wait, cancel --------------------------------------------------

    def submit(self, tenant: Tenant, kind: str, request: dict[str, Any],
               key: str | None = None) -> tuple[Job, bool]:
        """The job for this request, and whether it was made now (False: an earlier
        submit with the same idempotency key made it)."""
        digest = request_digest(kind, request)
        with self._cond:
            if key is not None:
                found = self._by_key(tenant.name, key)
                if found is not None:
                    if found[1] != digest:
                        raise IdempotencyConflict(
                            f"idempotency key {key!r} was used for another request (job "
                            f"{found[0].id})")
                    self.counters["idempotent_replays"] += 1
                    return found[0], False
            self._check_quotas(tenant)
            job = Job(uuid.uuid4().hex[:20], tenant.name, kind, request, key=key)
            self._insert(job, digest)
            self._live[job.id] = job
            self._queue.push(job.id, job.tenant)
            self.counters["submitted"] += 1
            self._cond.notify_all()
        return job, True

    def get(self, tenant: str, job_id: str) -> Job:
        with self._cond:
            job = self._live.get(job_id) or self._load(job_id)
        if job is None or job.tenant != tenant:
            raise JobNotFound(f"no job {job_id!r} for tenant {tenant!r}")
        return job

    def wait(self, tenant: str, job_id: str, timeout_s: float) -> Job:
        """The job once it is done, or as it is after ``timeout_s`` (a long poll)."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            while True:
                job = self.get(tenant, job_id)
                left = deadline - time.monotonic()
                if job.done or left <= 0 or self._closed:
                    return job
                self._cond.wait(left)

    def cancel(self, tenant: str, job_id: str) -> Job:
        with self._cond:
            job = self.get(tenant, job_id)
            if job.state == "queued":
                self._queue.remove(job.id)
                self._finish(job, "cancelled", None, None)
            elif job.state == "running" and not job.cancel_requested:
                job.cancel_requested = True
                self.db.execute("UPDATE jobs SET cancel_requested=1 WHERE id=?", (job.id,))
                if self.stop is not None:
                    threading.Thread(target=self._stop, args=(job,), daemon=True,
                                     name=f"krex-service-cancel-{job.id}").start()
            return job

    def _stop(self, job: Job) -> None:
        """Interrupt the job's program; until it is, or the job's work returns."""
        assert self.stop is not None
        while not job.done and not self._closed:
            if self.stop(job):
                with self._cond:
                    self.counters["programs_stopped"] += 1
                return
            with self._cond:
                self._cond.wait_for(lambda: job.done or self._closed, timeout=STOP_RETRY_S)

    def list(self, tenant: str, state: str | None = None, limit: int = 50,
             before: str | None = None) -> tuple[list[Job], str | None]:
        """The tenant's jobs, newest first, at most ``limit`` of them, older than the job
        ``before`` (a cursor: the ``next`` of the page before); and the next page's
        cursor (None: no more).  Every job the store keeps is reached by paging."""
        sql = "SELECT * FROM jobs WHERE tenant=?"
        args: list[Any] = [tenant]
        if state:
            sql += " AND state=?"
            args.append(state)
        with self._cond:
            if before is not None:
                row = self.db.execute("SELECT created_s FROM jobs WHERE tenant=? AND id=?",
                                      (tenant, before)).fetchone()
                if row is None:
                    raise JobNotFound(f"no job {before!r} to list jobs before",
                                      hint="pass the `next` of the page before, or no "
                                           "`before` for the newest jobs")
                sql += " AND (created_s < ? OR (created_s = ? AND id < ?))"
                args += [row[0], row[0], before]
            sql += " ORDER BY created_s DESC, id DESC LIMIT ?"
            args.append(limit + 1)
            rows = self.db.execute(sql, args).fetchall()
            more = len(rows) > limit
            jobs = [self._live.get(r[0]) or _from_row(r) for r in rows[:limit]]
        return jobs, jobs[-1].id if more else None

    def stats(self) -> dict[str, Any]:
        """Jobs by tenant and state (active ones, and counts since start)."""
        with self._cond:
            active: dict[str, dict[str, int]] = {}
            for job in self._live.values():
                per = active.setdefault(job.tenant, {"queued": 0, "running": 0})
                per[job.state] += 1
            return {"queued": len(self._queue), "active": active,
                    "counters": dict(self.counters), "runners": len(self._threads)}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=1.0)

    # -- running -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._live[self._queue.pop()]
                job.state, job.started_s = "running", time.time()
                self.db.execute("UPDATE jobs SET state='running', started_s=? WHERE id=?",
                                (job.started_s, job.id))
            self._do(job)

    def _do(self, job: Job) -> None:
        result, error = None, None
        try:
            result = self.work[job.kind](job)
        except KrexError as exc:
            error = error_body(exc)
        except Exception as exc:  # noqa: BLE001  (a bug in one job must not kill its runner)
            error = {"code": "internal_error", "what": f"{type(exc).__name__}: {exc}",
                     "hint": "this is a bug in krex's service: report it with the request"}
        with self._cond:
            self._queue.finished(job.tenant)
            if job.cancel_requested:
                if result is not None:
                    result = {**result, "discarded": "the job was cancelled while it ran"}
                self._finish(job, "cancelled", result, error)
            else:
                self._finish(job, "failed" if error else _settled(result), result, error)

    def _finish(self, job: Job, state: str, result: dict[str, Any] | None,
                error: dict[str, Any] | None) -> None:
        job.state, job.ended_s, job.result, job.error = state, time.time(), result, error
        self.db.execute("UPDATE jobs SET state=?, ended_s=?, result=?, error=? WHERE id=?",
                        (state, job.ended_s, _dump(result), _dump(error), job.id))
        self._live.pop(job.id, None)
        self.counters[f"{job.kind}_{state}"] += 1
        self._cond.notify_all()
        if self.counters["finished"] % self._prune_every == self._prune_every - 1:
            self._prune()
        self.counters["finished"] += 1
        self._fit_budget()

    # -- the database ------------------------------------------------------------------

    def _check_quotas(self, tenant: Tenant) -> None:
        if self.admit is not None:
            self.admit(tenant.name)
        q = tenant.quotas
        active = sum(1 for j in self._live.values() if j.tenant == tenant.name)
        if active >= q.max_active_jobs:
            raise ServiceQuotaExceeded(f"tenant {tenant.name!r} has {active} active jobs "
                                       f"(quota {q.max_active_jobs})")
        recent = self.db.execute("SELECT count(*) FROM jobs WHERE tenant=? AND created_s>?",
                                 (tenant.name, time.time() - 60)).fetchone()[0]
        if recent >= q.max_jobs_per_minute:
            raise ServiceQuotaExceeded(
                f"tenant {tenant.name!r} submitted {recent} jobs in the last minute (quota "
                f"{q.max_jobs_per_minute})", hint="submit fewer jobs per minute")

    def _insert(self, job: Job, digest: str) -> None:
        self.db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (job.id, job.tenant, job.kind, job.key, json.dumps(job.request), digest,
                         job.state, job.created_s, None, None, 0, None, None))

    def _by_key(self, tenant: str, key: str) -> tuple[Job, str] | None:
        row = self.db.execute("SELECT * FROM jobs WHERE tenant=? AND idem_key=?",
                              (tenant, key)).fetchone()
        if row is None:
            return None
        return self._live.get(row[0]) or _from_row(row), row[5]

    def _load(self, job_id: str) -> Job | None:
        row = self.db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else _from_row(row)

    def _recover(self) -> None:
        """Jobs of an earlier run: running ones failed (interrupted), queued ones run now."""
        now = time.time()
        self.db.execute("UPDATE jobs SET state='failed', ended_s=?, error=? WHERE state="
                        "'running'", (now, _dump({"code": "interrupted", "what": "the service "
                                                  "stopped while the job ran",
                                                  "hint": "submit it again (a new key)"})))
        for row in self.db.execute("SELECT * FROM jobs WHERE state='queued' ORDER BY created_s"):
            job = _from_row(row)
            self._live[job.id] = job
            self._queue.push(job.id, job.tenant)

    def used_bytes(self) -> int:
        return used_bytes(self.db)

    def _fit_budget(self) -> None:
        """Past ``max_bytes``, the oldest finished jobs go (a tenth of them at a time):
        the file stops growing near its budget, whatever the jobs' outputs weigh."""
        if self.max_bytes is None:
            return
        while used_bytes(self.db) > self.max_bytes:
            done = self.db.execute("SELECT count(*) FROM jobs WHERE state NOT IN "
                                   "('queued','running')").fetchone()[0]
            if not done:
                return  # only active jobs: they are kept, whatever they weigh
            self.db.execute("DELETE FROM jobs WHERE id IN (SELECT id FROM jobs WHERE state "
                            "NOT IN ('queued','running') ORDER BY created_s LIMIT ?)",
                            (max(1, done // 10),))
            self.counters["pruned_for_bytes"] += max(1, done // 10)

    def _prune(self) -> None:
        self.db.execute("DELETE FROM jobs WHERE state NOT IN ('queued','running') AND "
                        "id NOT IN (SELECT id FROM jobs ORDER BY created_s DESC LIMIT ?)",
                        (self.keep_finished,))


def _settled(result: dict[str, Any] | None) -> str:
    """A finished job's state: its program's outcome where it ran one, else succeeded."""
    said = (result or {}).get("outcome")
    return said if said in TERMINAL else "succeeded"


def _dump(value: dict[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(value, default=str)


def _from_row(row: tuple[Any, ...]) -> Job:
    (jid, tenant, kind, key, request, _digest, state, created, started, ended, cancel,
     result, error) = row
    return Job(jid, tenant, kind, json.loads(request), state, key, created, started, ended,
               bool(cancel), json.loads(result) if result else None,
               json.loads(error) if error else None)
