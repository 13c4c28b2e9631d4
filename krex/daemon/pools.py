"""The daemon's warm worker pools: one per device, started on first use.

Every worker is a managed job of kind ``worker`` (its own cgroup, the job
environment, the interposer where built), so regions and enforcement apply to
programs in workers exactly as to ``krex run`` jobs.  ``exec`` requests run
on a thread of their own; output streams back to the requesting connection.
A connection may have only so many programs in flight (and the node only
:data:`MAX_EXEC_THREADS`): past that, ``exec`` fails with ``limit_exceeded``.
A program run for a tenant gets ``KREX_TENANT`` in its environment, so the
regions it takes are that tenant's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from krex.daemon import priority
from krex.errors import KrexError, LimitExceeded, WorkerFailed
from krex.protocol import messages as m
from krex.workers import ExecRequest, PoolSpec, WorkerPool
from krex.workers.launcher import join_cgroups, merge_env

if TYPE_CHECKING:
    from krex.daemon.core import Daemon, Session

MAX_EXEC_THREADS = 512  # programs in flight on the whole node (one thread each)


class DaemonLauncher:
    """Makes each worker of a pool a managed job of the daemon."""

    def __init__(self, daemon: Daemon, device: str) -> None:
        self.daemon = daemon
        self.device = device
        self._spawning = threading.local()  # prepare() and started() share the spawn thread

    def prepare(self, index: int) -> tuple[dict[str, str], Callable[[], None] | None]:
        job = self.daemon.new_worker_job(self.device, index)
        info = self.daemon.job_env(job)
        self._spawning.job_id = job.job_id
        join = join_cgroups(info["cgroups"], new_group=False)

        def setup() -> None:  # the daemon thread that forks it may keep off some cores
            priority.widen()
            join()

        return merge_env(dict(os.environ), info["env"]), setup

    def started(self, pid: int) -> None:
        self.daemon.worker_started(self._spawning.job_id, pid)

    def exited(self, pid: int) -> None:
        self.daemon.worker_exited(pid)


class Pools:
    def __init__(self, daemon: Daemon, spec: PoolSpec, per_connection: int = 16) -> None:
        self.daemon = daemon
        self.template = spec
        self.pools: dict[str, WorkerPool] = {}
        self._starting: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.per_connection = per_connection
        self._in_flight: dict[Any, int] = {}  # session -> programs running for it
        self._running = 0  # programs running on the node, their connections open or not

    def pool(self, device: str) -> WorkerPool:
        """The device's pool, started on first use.

        Never holds ``_lock`` while a pool starts: starting calls back into the
        daemon (each worker becomes a job), and ``status`` holds the daemon's lock
        while it reads the pools.
        """
        with self._lock:
            pool = self.pools.get(device)
            starting = self._starting.get(device)
            if pool is None and starting is None:
                starting = self._starting[device] = threading.Event()
                owner = True
            else:
                owner = False
        if pool is not None:
            return pool
        if not owner:
            assert starting is not None
            starting.wait()
            return self.pool(device)
        try:
            spec = PoolSpec(**{**vars(self.template), "device": device})
            pool = WorkerPool(spec, DaemonLauncher(self.daemon, device))
            pool.start()
            with self._lock:
                self.pools[device] = pool
            return pool
        finally:
            with self._lock:
                self._starting.pop(device).set()

    def run(self, session: Session, msg: m.Exec, device: str, tenant: str | None = None) -> None:
        """Start the program on a thread of its own; the reply comes when it ends."""
        self.daemon.warmer.touch()  # a program in a warm worker is about to take regions
        with self._lock:
            mine = self._in_flight.get(session, 0)
            if mine >= self.per_connection:
                raise LimitExceeded(f"this connection already runs {mine} programs (the "
                                    "daemon's --max-execs-per-connection)")
            if sum(self._in_flight.values()) >= MAX_EXEC_THREADS:
                raise LimitExceeded(f"{MAX_EXEC_THREADS} programs are in flight on this node")
            self._in_flight[session] = mine + 1
            self._running += 1
        try:
            threading.Thread(target=self._run, args=(session, msg, device, tenant),
                             daemon=True, name=f"krex-exec-{msg.id}").start()
        except RuntimeError as exc:
            self._done(session)
            raise LimitExceeded(f"no thread for the program: {exc}") from None

    def idle(self) -> bool:
        """No program running and no pool starting: warm workers only wait."""
        with self._lock:
            return not self._running and not self._starting

    def _done(self, session: Session) -> None:
        with self._lock:
            self._running -= 1
            left = self._in_flight.get(session, 1) - 1
            if left > 0:
                self._in_flight[session] = left
            else:
                self._in_flight.pop(session, None)

    def session_closed(self, session: Session) -> None:
        """Programs of a closed connection run on; they no longer count against it."""
        with self._lock:
            self._in_flight.pop(session, None)

    def _run(self, session: Session, msg: m.Exec, device: str, tenant: str | None) -> None:
        # The program stops counting against its connection before its reply is sent: a
        # client that sends its next program on the reply must not find the cap full.
        try:
            reply = self._execute(session, msg, device, tenant)
        finally:
            self._done(session)
        session.push(reply)

    def _execute(self, session: Session, msg: m.Exec, device: str,
                 tenant: str | None) -> m.Message:
        try:
            req = ExecRequest.from_dict(msg.request)
        except (TypeError, ValueError, KeyError) as exc:
            return m.ErrorReply.of(WorkerFailed(f"bad exec request: {exc}"), msg.id)
        if tenant is not None:
            req.env = {**(req.env or {}), "KREX_TENANT": tenant}
        try:
            pool = self.pool(device)
            result = pool.submit(req, lambda stream, text: session.push(
                m.Output(re=msg.id, stream=stream, data=text)))
        except KrexError as exc:
            return m.ErrorReply.of(exc, msg.id)
        return m.Reply(re=msg.id, data={"result": result.to_dict()})

    def status(self) -> dict[str, Any]:
        with self._lock:
            pools = dict(self.pools)
            starting = list(self._starting)
        out: dict[str, Any] = {name: pool.status() for name, pool in pools.items()}
        out.update({name: {"starting": True, "workers": [], "served": 0, "queue_length": 0,
                           "recycles": {}} for name in starting})
        return out

    def running_in(self, cwd: str) -> int | None:
        """The pid of the worker running a program whose request named ``cwd`` (the
        daemon's record: a program that calls ``chdir`` does not change it)."""
        for pool in self.status().values():
            for w in pool.get("workers", []):
                if w.get("program_cwd") == cwd and w.get("pid"):
                    return int(w["pid"])
        return None

    def shutdown(self) -> None:
        with self._lock:
            pools, self.pools = list(self.pools.values()), {}
        for pool in pools:
            pool.shutdown()
