"""The daemon's warm worker pools: one per device, started on first use.

Every worker is a managed job of kind ``worker`` (its own cgroup, the job
environment, the interposer where built), so regions and enforcement apply to
programs in workers exactly as to ``krex run`` jobs.  ``exec`` requests run
on a thread of their own; output streams back to the requesting connection.
A connection may have only so many programs in flight (and the node only
:data:`MAX_EXEC_THREADS`): past that, ``exec`` fails with ``limit_exceeded``.
A program run for a tenant gets ``KREX_TENANT`` in its environment, so the
regions it takes are that tenant's; on a root daemon it runs in a pool of
that tenant's own, as the tenant's uid (:mod:`krex.daemon.users`), never as
root.  ``status`` shows each device's pools as one: their workers (each with
its ``uid``) together, their counts summed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from krex.daemon import priority
from krex.errors import KrexError, LimitExceeded, WorkerFailed
from krex.protocol import messages as m
from krex.protocol.runas import RunAs
from krex.workers import ExecRequest, PoolSpec, WorkerPool
from krex.workers.launcher import job_environment, join_cgroups, merge_env

if TYPE_CHECKING:
    from krex.daemon.core import Daemon, Session

MAX_EXEC_THREADS = 512  # programs in flight on the whole node (one thread each)
PoolKey = tuple[str, int | None]  # (device, the tenant user's uid; None: the daemon's user)


class DaemonLauncher:
    """Makes each worker of a pool a managed job of the daemon."""

    def __init__(self, daemon: Daemon, device: str, user: TenantUser | None = None) -> None:
        self.daemon = daemon
        self.device = device
        self.user = user  # None: the daemon's own user
        self._spawning = threading.local()  # prepare() and started() share the spawn thread

    def prepare(self, index: int) -> tuple[dict[str, str], Callable[[], None] | None]:
        job = self.daemon.new_worker_job(self.device, index, self.user)
        info = self.daemon.job_env(job)
        self._spawning.job_id = job.job_id
        join = join_cgroups(info["cgroups"], new_group=False)
        run_as = self.user.run_as if self.user else None
        become = run_as.preexec() if run_as else None

        def setup() -> None:  # the daemon thread that forks it may keep off some cores
            priority.widen()
            join()  # as root: then the tenant's user for good
            if become is not None:
                become()

        if run_as is None:
            return merge_env(dict(os.environ), info["env"]), setup
        # a tenant's worker: none of the daemon's other variables (its user's secrets)
        return {**merge_env(job_environment(), info["env"]), **run_as.env()}, setup

    def started(self, pid: int) -> None:
        self.daemon.worker_started(self._spawning.job_id, pid)

    def exited(self, pid: int) -> None:
        self.daemon.worker_exited(pid)


@dataclass(frozen=True)
class TenantUser:
    """Whose pool: the tenant and the user its code runs as."""

    tenant: str
    run_as: RunAs


class Pools:
    def __init__(self, daemon: Daemon, spec: PoolSpec, per_connection: int = 16) -> None:
        self.daemon = daemon
        self.template = spec
        self.pools: dict[PoolKey, WorkerPool] = {}
        self._starting: dict[PoolKey, threading.Event] = {}
        self._lock = threading.Lock()
        self.per_connection = per_connection
        self._in_flight: dict[Any, int] = {}  # session -> programs running for it
        self._running = 0  # programs running on the node, their connections open or not
        self._device_slots: dict[str, threading.Semaphore] = {}

    def pool(self, device: str, user: TenantUser | None = None) -> WorkerPool:
        """The device's pool (``user``'s: that tenant's, as its uid), started on first use.

        Never holds ``_lock`` while a pool starts: starting calls back into the
        daemon (each worker becomes a job), and ``status`` holds the daemon's lock
        while it reads the pools.
        """
        key = (device, user.run_as.uid if user else None)
        with self._lock:
            pool = self.pools.get(key)
            starting = self._starting.get(key)
            if pool is None and starting is None:
                starting = self._starting[key] = threading.Event()
                owner = True
            else:
                owner = False
        if pool is not None:
            return pool
        if not owner:
            assert starting is not None
            starting.wait()
            return self.pool(device, user)
        try:
            fields: dict[str, Any] = {**vars(self.template), "device": device}
            if user is not None:  # who the worker is wins over what a program's request says
                fields["pinned_env"] = [*self.template.pinned_env, *user.run_as.env()]
                # a tenant's workers stay warm while it uses them, then stop (idle_shutdown_s)
                fields.update(min_workers=0, spare_workers=0)
            pool = WorkerPool(PoolSpec(**fields), DaemonLauncher(self.daemon, device, user))
            pool.start()
            with self._lock:
                self.pools[key] = pool
            return pool
        finally:
            with self._lock:
                self._starting.pop(key).set()

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

    def _slots(self, device: str) -> threading.Semaphore:
        """``max_workers`` programs of ``device`` run at once across its tenant users'
        pools, as in one pool (the daemon's own pool is capped by itself: a semaphore
        before it moved its exec latency's median up by a second under load)."""
        with self._lock:
            slots = self._device_slots.get(device)
            if slots is None:
                slots = self._device_slots[device] = threading.Semaphore(
                    self.template.max_workers)
            return slots

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
            user = self.daemon.tenant_user(tenant)
            pool = self.pool(device, user)
            # tenants' programs: the device's max_workers at once, whoever's pool they are in
            with self._slots(device) if user else contextlib.nullcontext():
                result = pool.submit(req, lambda stream, text: session.push(
                    m.Output(re=msg.id, stream=stream, data=text)))
        except KrexError as exc:
            return m.ErrorReply.of(exc, msg.id)
        return m.Reply(re=msg.id, data={"result": result.to_dict()})

    def status(self) -> dict[str, Any]:
        """Each device's pools as one (the daemon's and its tenants')."""
        with self._lock:
            pools = dict(self.pools)
            starting = list(self._starting)
        out: dict[str, Any] = {}
        for (device, uid), pool in sorted(pools.items(), key=lambda kv: kv[0][1] or -1):
            st = pool.status()
            for w in st["workers"]:
                w["uid"] = uid
            if device in out:
                _add(out[device], st)
            else:
                out[device] = st
        for device, _ in starting:
            out.setdefault(device, {"starting": True, "workers": [], "served": 0,
                                    "queue_length": 0, "recycles": {}})
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


def _add(into: dict[str, Any], st: dict[str, Any]) -> None:
    """Another pool of the same device, added to ``into``'s workers and counts."""
    into["workers"] = [*into["workers"], *st["workers"]]
    for key in ("served", "queue_length", "starting"):
        into[key] = into.get(key, 0) + st.get(key, 0)
    into["recycles"] = dict(Counter(into.get("recycles", {})) + Counter(st.get("recycles", {})))
