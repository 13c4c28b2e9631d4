"""The daemon's state and request handling, independent of sockets.

In: validated messages from a :class:`Session` (who sent them is known from
``SO_PEERCRED``).  Out: replies, pushed grants and revocations, enforcement
actions and events.  State (jobs, regions, the scheduler, counters) changes
under one lock that is held only for bookkeeping: nothing under it waits on
a process, a device or a socket.  Enforcement runs on each device's lane
(:mod:`krex.daemon.lanes`); messages queued under the lock are sent once it
is released.  The scheduler decides, :mod:`krex.daemon.holds` carries each
region through its life, :mod:`krex.daemon.access` says who may do what.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from krex.daemon import priority
from krex.daemon.access import Access
from krex.daemon.config import DaemonConfig
from krex.daemon.eventlog import EventLog
from krex.daemon.exclusivity import Exclusivity
from krex.daemon.finished import FinishedRegions
from krex.daemon.holds import Holds, Phase, RegionState
from krex.daemon.jobs import MODES, Job, JobRegistry
from krex.daemon.lanes import Lanes
from krex.daemon.neighbours import Neighbours
from krex.daemon.pools import Pools, TenantUser
from krex.daemon.scheduler import Request, Scheduler
from krex.daemon.tenants import Ledger, Quota
from krex.daemon.users import DAEMON, TenantUsers
from krex.devices import discover, parse_device
from krex.enforce.process import ProcessGroup, ProcessRef, is_descendant, process_uid
from krex.enforce.warm import MoveWarmer
from krex.errors import (
    AccessDenied,
    BadRequest,
    KrexError,
    LimitExceeded,
    OfferLapsed,
    ProcessGone,
    ShuttingDown,
    UnknownJob,
    UnknownRegion,
)
from krex.protocol import messages as m
from krex.protocol.framing import MAX_FRAME
from krex.protocol.installation import installation
from krex.protocol.peer import Peer
from krex.protocol.report import Reason, ReasonCode, RegionReport

log = logging.getLogger("krex.daemon")
LIVE = 1 << 40  # ``jobs`` cursors: live jobs come after every ended one
PAGE_BYTES = MAX_FRAME // 2  # a page of records stays well inside one frame


class Session(Protocol):
    """What the core needs from a connection."""

    peer: Peer  # the kernel's credentials
    process: ProcessRef  # the peer's process, with its start time
    verified: set[tuple[int, int]]

    def push(self, message: m.Message) -> None: ...

    def __hash__(self) -> int: ...


@dataclass
class Counters:
    granted: int = 0
    released: int = 0
    revoked: int = 0
    cancelled: int = 0
    errors: int = 0
    requeued: int = 0  # regions the daemon queued again at a release (krex.daemon.holds)
    requeue_claimed: int = 0  # ... that their jobs asked for
    requeue_lapsed: int = 0  # ... that ended unclaimed
    offered: int = 0  # ... offered to their jobs at the grant (messages.Offer)
    offers_claimed: int = 0  # acquires that took an offer
    offers_lapsed: int = 0  # ... that came too late (their reply: offer_lapsed)
    lapses_waited: int = 0  # claim windows a lapse waited for its job's unread input
    handed_over: int = 0  # grants that took the previous region's enforcement over
    # releases after which the device was not handed over, by why (Holds._chain_end)
    chain_ends: dict[str, int] = dataclasses.field(default_factory=dict)


# what a tenant user's worker reads first: the interpreter's start-up, krex's package
_KREX_FILES = [os.__file__, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                        "__init__.py")]


class Daemon:
    def __init__(self, config: DaemonConfig, exclusivity: Exclusivity | None = None) -> None:
        self.config = config
        self.lock = threading.RLock()
        self._local = threading.local()
        self.jobs = JobRegistry()
        self.scheduler = Scheduler(window_s=config.fair_window_ms / 1e3)
        self.holds = Holds(self)
        self.lanes = Lanes()
        self._seq = itertools.count(1)
        self.finished = FinishedRegions(max_records=config.keep_regions)
        self._unrecorded: list[tuple[int, int, RegionReport]] = []  # see record_region
        self.ended_jobs: deque[tuple[int, int, dict[str, Any]]] = deque(maxlen=config.keep_jobs)
        self.devices = discover()
        self.events = EventLog(config.event_log, max_queue=config.event_log_queue,
                               max_bytes=int(config.event_log_max_mb * 2**20) or None)
        self.exclusivity = exclusivity or Exclusivity(config)
        self.exclusivity.lock_clocks([d.name for d in self.devices])
        uids = config.tenant_uid_range()
        gid = config.socket_gid()
        self.users = TenantUsers(uids, config.runtime_dir, gid) \
            if uids is not None and gid is not None else None
        self.access = Access(config.node, os.getuid(), self.users)
        self.quota = Quota(config.tenant_max_jobs, config.tenant_region_s_per_min,
                           config.tenant_max_hold_s)
        self.ledger = Ledger()
        self.neighbours = Neighbours(config.socket_path, os.getuid())
        self.counters = Counters()
        self.started_mono_s = time.monotonic()
        self.accepting = True
        self.wakeup = threading.Condition(self.lock)
        self._region_ids = iter(range(1, 1 << 62))
        self.last_activity_mono_s = time.monotonic()
        self.planned_wake_mono_s = 0.0  # when the ticker will next look at deadlines
        self.pools = Pools(self, config.pool_spec(), config.max_execs_per_connection)
        self.warmer = MoveWarmer.for_layout(getattr(self.exclusivity, "layout", None),
                                            config.warm_moves_ms, config.warm_linger_s,
                                            config.reserved_cores())
        self.warmer.start()

    # -- the lock and the outbox ---------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The state lock; messages pushed meanwhile are sent after the outermost release,
        then finished regions are encoded into the store (:meth:`record_region`), then the
        lane tasks this thread claimed meanwhile (:meth:`on_lane`) run here."""
        local = self._local
        with self.lock:
            local.depth = getattr(local, "depth", 0) + 1
            if local.depth == 1:
                local.outbox, local.claimed = [], []
            try:
                yield
            finally:
                local.depth -= 1
                outbox, claimed = ((local.outbox, local.claimed) if local.depth == 0
                                   else ([], []))
        for session, message in outbox:
            session.push(message)
        if self._unrecorded and local.depth == 0:
            self._record_pending()
        for run in claimed:
            run()

    def on_lane(self, device: str, task: Callable[[], None], here: bool = False) -> None:
        """Run ``task`` on ``device``'s lane (locked).  ``here``: when the lane is idle
        (or this thread is running the lane's current task, nothing queued behind it),
        this thread runs the task itself once the lock is released (no wake-up of the
        lane's thread on the way to a grant); else it queues."""
        local = self._local
        if not (here and getattr(local, "session_thread", False)):
            self.lanes.submit(device, task)
            return
        run = self.lanes.claim(device, task)
        if run is not None:
            local.claimed.append(run)

    def push(self, session: Session, message: m.Message) -> None:
        """Send now, or once the lock is released when it is held here."""
        local = self._local
        if getattr(local, "depth", 0):
            local.outbox.append((session, message))
        else:
            session.push(message)

    # -- dispatch ------------------------------------------------------------------------

    def handle(self, session: Session, msg: m.Message) -> dict[str, Any] | None:
        """Handle one request; return reply data, or None when the reply comes later."""
        handler = getattr(self, "_on_" + msg.type, None)
        if handler is None:
            raise BadRequest(f"{msg.type} is not a request")
        self._local.session_thread = True  # a session's reader: it may run lane tasks
        with self.locked():
            self.last_activity_mono_s = time.monotonic()
            return handler(session, msg)

    def _on_register(self, session: Session, msg: m.Register) -> dict[str, Any]:
        self.warmer.touch()  # a job registers to take regions (krex.enforce.warm)
        me = self._pid_of(session)
        if msg.job_id is not None:
            job = self._member_job(session, msg.job_id)
            job.members.add(me)
            return {"job_id": job.job_id, "device": job.device, "mode": job.mode}
        adhoc = self.jobs.adhoc_for(me)
        if adhoc is None:
            self._admitting()
            device = self._device(msg.device)
            tenant = self.access.tenant(session.peer, msg.tenant)
            adhoc = self._new_job(session, _text(msg.name, "name") or f"pid-{me.pid}", device,
                                  "region", "adhoc", me, tenant)
            adhoc.cgroups = self.exclusivity.create_cgroups(adhoc.job_id, adhoc.device)
            self.exclusivity.adopt(adhoc.cgroups, me)
        return {"job_id": adhoc.job_id, "device": adhoc.device, "mode": adhoc.mode,
                "tenant": adhoc.tenant}

    def _on_create_job(self, session: Session, msg: m.CreateJob) -> dict[str, Any]:
        self._admitting()
        if msg.mode not in MODES:
            raise BadRequest(f"unknown mode {msg.mode!r}: expected one of {', '.join(MODES)}")
        device = self._device(msg.device)
        tenant = self.access.tenant(session.peer, msg.tenant)
        job = self._new_job(session, _text(msg.name, "name") or "job", device, msg.mode,
                            "managed", self._pid_of(session), tenant)
        job.cgroups = self.exclusivity.create_cgroups(job.job_id, job.device)
        return {"job_id": job.job_id, "device": device, "mode": job.mode, "tenant": tenant,
                **self.job_env(job)}

    def _on_attach_job(self, session: Session, msg: m.AttachJob) -> dict[str, Any]:
        job = self._owned_job(session, msg.job_id)
        if not is_descendant(msg.pid, session.peer.pid):
            raise AccessDenied(
                f"process {msg.pid} is not process {session.peer.pid} or its descendant",
                pid=msg.pid,
            )
        owner = process_uid(msg.pid)
        if owner is not None and owner != session.peer.uid and \
                not self.access.operator(session.peer):
            raise AccessDenied(
                f"process {msg.pid} runs as uid {owner}, not as uid {session.peer.uid}: a "
                "job's processes are its owner's (a set-user-ID child is not)",
                pid=msg.pid, hint="attach a process of your own")
        try:
            job.root = ProcessRef.of(msg.pid)
        except ProcessGone:
            return {"attached": False}
        job.group = ProcessGroup.of(msg.pid)
        self.events.emit("job_attached", job_id=job.job_id, pid=msg.pid,
                         pgid=job.group.pgid if job.group else None)
        return {"attached": True}

    def _on_end_job(self, session: Session, msg: m.EndJob) -> dict[str, Any]:
        job = self._owned_job(session, msg.job_id)
        job.exit_code = msg.exit_code
        self._remove_job(job, "ended")
        return {}

    def _on_acquire(self, session: Session, msg: m.Acquire, requeue: bool = False) -> None:
        """Queue a region (``requeue``: one the daemon asks for at a release, on the job's
        behalf: :mod:`krex.daemon.holds`)."""
        self._admitting()
        job = self._member_job(session, msg.job_id)
        device = self._device(msg.device or job.device)
        if msg.whole_job and session.peer.pid != job.owner.pid:
            raise AccessDenied("only the job's owner may hold its device for the whole job")
        tenant = (self.access.tenant(session.peer, msg.tenant) if msg.tenant is not None
                  else job.tenant)
        if job.mode != "none":
            self.ledger.check(tenant, self.quota.region_s_per_min, time.monotonic())
        requeued = None if requeue else self.holds.requeued(session, job.job_id, device,
                                                            msg.claim)
        if msg.claim is not None:  # an offer taken: the region is granted, or lapsed
            ok = requeued is not None and requeued.region == msg.claim and \
                not msg.whole_job and requeued.request.tenant == tenant and \
                requeued.phase is Phase.HELD
            if ok:
                assert requeued is not None
                req = self._request(session, job, device, msg, tenant, number=False)
                ok = self.holds.claim(requeued, msg, req.max_hold_s, req.timeout_s, req.label)
            if not ok:
                self.counters.offers_lapsed += 1
                raise OfferLapsed(f"region {msg.claim}: its offer lapsed before this claim "
                                  "arrived (the device moved on)", region=msg.claim)
            self.counters.offers_claimed += 1
            return None
        if requeued is not None and not msg.whole_job and requeued.request.tenant == tenant:
            req = self._request(session, job, device, msg, tenant, number=False)
            if self.holds.claim(requeued, msg, req.max_hold_s, req.timeout_s, req.label):
                return None
        if len(self.holds.by_session.get(session, ())) >= self.config.max_acquires_per_connection:
            raise LimitExceeded(f"this connection already holds or waits for "
                                f"{self.config.max_acquires_per_connection} regions (the "
                                "daemon's --max-acquires-per-connection)")
        req = self._request(session, job, device, msg, tenant)
        self.holds.acquire(session, msg, req, job.uid,
                           self.config.requeue_ms / 1e3 if requeue else None)
        return None

    def _on_release(self, session: Session, msg: m.Release) -> dict[str, Any] | None:
        st = self.holds.releasable(session, msg.region)
        if msg.again is not None and st.asked is not None:
            again = dataclasses.replace(st.asked, id=msg.again, claim=None)  # its parameters
            try:  # queued before the release hands the device on (and freezes this job)
                self._on_acquire(session, again)
            except KrexError as exc:  # the release goes ahead; the new acquire is answered
                self.push(session, m.ErrorReply.of(exc, msg.again))
        elif self.config.requeue_ms > 0 and st.asked is not None:
            job = self.jobs.get(st.request.job_id)
            if job is not None and self.holds.may_requeue(st, job):
                asked = st.asked

                def requeue() -> None:
                    """The job's likely next region, queued once the device is handed on
                    (off the grant path: the handoff's choice and chain bound leave the
                    releasing job out).  Not when the job has asked already: a client that
                    does not wait for the release's reply may ask before this runs (when
                    the handoff was the lane's, not this session thread's, say)."""
                    if self.holds.asked_again(session, st.request.job_id,
                                              st.request.device, st.region):
                        return
                    try:
                        self._on_acquire(session, dataclasses.replace(asked, id=None, claim=None),
                                         requeue=True)
                    except KrexError:  # nobody asked: nothing to answer
                        pass

                st.requeue = requeue
        return self.holds.release(session, msg)

    def _on_cancel(self, session: Session, msg: m.Cancel) -> dict[str, Any]:
        return self.holds.cancel(session, msg)

    def _on_revoke(self, session: Session, msg: m.Revoke) -> dict[str, Any]:
        st = self.holds.regions.get(msg.region)
        if st is None:
            raise UnknownRegion(f"region {msg.region} is not held or queued", region=msg.region)
        self.access.check_owner(session.peer, st.uid, f"region {msg.region}")
        why = _text(msg.reason, "reason") or f"revoked by uid {session.peer.uid}"
        phase = self.holds.revoke(st, why)
        self.events.emit("revoke_requested", region=msg.region, by_uid=session.peer.uid,
                         phase=phase)
        return {"region": msg.region, "phase": phase,
                "revoked": phase in ("queued", "entering", "held")}

    def _on_status(self, session: Session, msg: m.Status) -> dict[str, Any]:
        return self.status(session.peer)

    def _on_ping(self, session: Session, msg: m.Ping) -> dict[str, Any]:
        return {"pong": True}

    def _on_regions(self, session: Session, msg: m.Regions) -> dict[str, Any]:
        if msg.limit < 0:
            raise BadRequest("limit must not be negative")
        self._record_pending()
        rows, more = self.finished.page(lambda uid: self.access.visible(session.peer, uid),
                                        msg.job_ids, min(msg.limit, m.PAGE_MAX), msg.before,
                                        PAGE_BYTES)
        return {"regions": rows, "next_before": more}

    def _on_jobs(self, session: Session, msg: m.Jobs) -> dict[str, Any]:
        live = [(LIVE + j.job_id, j.uid, j.record()) for j in
                sorted(self.jobs.jobs.values(), key=lambda j: j.job_id)]
        rows, more = self._page(list(self.ended_jobs) + live, session.peer, msg.job_ids,
                                msg.limit, msg.before)
        return {"jobs": rows, "next_before": more}

    def _on_exec(self, session: Session, msg: m.Exec) -> None:
        self._admitting()
        self.access.may_exec(session.peer)
        tenant = self.access.tenant(session.peer, msg.tenant) if msg.tenant else None
        self.pools.run(session, msg, self._device(msg.device), tenant)
        return None

    def _on_stop_program(self, session: Session, msg: m.StopProgram) -> dict[str, Any]:
        """Kill the worker running the program started in ``msg.cwd`` and everything in its
        cgroup, on a thread of its own (never under the lock); the worker is replaced."""
        self.access.require_operator(session.peer, "stop a program in the warm workers")
        pid = self.pools.running_in(msg.cwd)
        job = next((j for j in self.jobs.jobs.values() if j.kind == "worker" and j.root
                    and j.root.pid == pid), None) if pid else None
        if pid is None or job is None or job.root is None:
            return {"stopped": False}
        # stopped first, then asked again: a worker that finished the program and took
        # the next one (another job's) meanwhile is let go
        if not job.root.send_signal(signal.SIGSTOP):
            return {"stopped": False}
        if self.pools.running_in(msg.cwd) != pid:
            job.root.send_signal(signal.SIGCONT)
            return {"stopped": False}
        cgroups, root = job.cgroups, job.root
        threading.Thread(target=stop_worker, args=(cgroups, root), daemon=True,
                         name=f"krex-stop-{pid}").start()
        return {"stopped": True, "worker_pid": pid, "by": "cgroup" if cgroups else "tree"}

    def _on_stop(self, session: Session, msg: m.Stop) -> dict[str, Any]:
        self.access.require_operator(session.peer, "stop the daemon")
        self.accepting = False
        self.wakeup.notify_all()
        return {"stopping": True}

    # -- workers --------------------------------------------------------------------------

    def new_worker_job(self, device: str, index: int, user: TenantUser | None = None) -> Job:
        """A job for a pool worker about to be spawned (its pid comes in worker_started):
        the daemon's user's, or a tenant's as its uid."""
        uid = user.run_as.uid if user else os.getuid()
        with self.locked():
            me = ProcessRef.of(os.getpid())
            job = self.jobs.add(Job(self.jobs.new_id(), f"worker-{device}-{index}", device,
                                    "region", "worker", me, uid=uid,
                                    tenant=user.tenant if user else f"daemon:{uid}"))
            self._job_created(job)
            job.cgroups = self.exclusivity.create_cgroups(job.job_id, device)
            return job

    def tenant_user(self, tenant: str | None) -> TenantUser | None:
        """Whom a program run for ``tenant`` runs as: None for the daemon's own user (no
        tenant named, or a daemon that is not root); never root for a tenant."""
        if tenant is None:
            return None
        if self.users is not None:
            user = TenantUser(tenant, self.users.run_as(tenant))
            why = user.run_as.cannot_reach([sys.executable, *_KREX_FILES],
                                           [os.path.dirname(self.config.socket_path)])
            if why:
                raise AccessDenied(
                    f"tenant {tenant[:40]!r}'s code would run as uid {user.run_as.uid}, "
                    f"which cannot run krex here: {why}",
                    hint="install krex (and its Python) where every user may read it -- a "
                         "venv under /opt from the system's Python -- or, where every tenant "
                         "may have a shell as this daemon's user, start the daemon yourself "
                         "with krex serve --tenant-uids daemon (krex doctor)")
            return user
        if os.geteuid() == 0 and self.config.tenant_uids != DAEMON:
            raise AccessDenied(
                f"this daemon runs as root and has no tenant uids (--tenant-uids "
                f"{self.config.tenant_uids}): it does not run tenant {tenant[:40]!r}'s code "
                "as root",
                hint="restart it with krex serve --tenant-uids FIRST-LAST (krex doctor), or "
                     "run the service and the daemon as a service user")
        return None

    def _on_program_user(self, session: Session, msg: m.ProgramUser) -> dict[str, Any]:
        """Whom ``msg.tenant``'s programs run as (operators: a service giving a tenant's
        program its folder)."""
        self.access.require_operator(session.peer, "ask whom a tenant's programs run as")
        tenant = self.access.tenant(session.peer, msg.tenant) if msg.tenant else None
        user = self.tenant_user(tenant)
        return {"run_as": user.run_as.to_dict() if user else None, "daemon_uid": os.getuid()}

    def worker_started(self, job_id: int, pid: int) -> None:
        with self.locked():
            job = self.jobs.get(job_id)
            try:
                root = ProcessRef.of(pid)
            except ProcessGone:
                return
            if job is not None:
                job.root, job.group = root, ProcessGroup.of(pid)

    def worker_exited(self, pid: int) -> None:
        with self.locked():
            for job in list(self.jobs.jobs.values()):
                if job.kind == "worker" and job.root and job.root.pid == pid:
                    self._remove_job(job, "worker exited")

    # -- for holds ---------------------------------------------------------------------------

    def deadlines_changed(self) -> None:
        """Wake the ticker when a deadline moved earlier than it planned to wake (locked)."""
        if self._next_deadline() < self.planned_wake_mono_s:
            self.wakeup.notify_all()

    def _next_deadline(self) -> float:
        return min(self.scheduler.next_deadline(), self.holds.keeper.next_deadline())

    def siblings(self, req: Request) -> tuple[list[Job], list[Job]]:
        """(jobs to gate and freeze, other jobs to keep off the holder's cores)."""
        return self.siblings_of(req.job_id, req.device)

    def siblings_of(self, job_id: int, device: str) -> tuple[list[Job], list[Job]]:
        """:meth:`siblings` of a region ``job_id`` would hold on ``device`` (locked)."""
        node = self.config.freeze_scope == "node"
        siblings: list[Job] = []
        others: list[Job] = []
        for job in self.jobs.jobs.values():
            if job.job_id != job_id:
                (siblings if node or job.device == device else others).append(job)
        return siblings, others

    def record_region(self, uid: int, report: RegionReport) -> None:
        """Keep a finished region's report for ``regions`` (locked).  Its place is taken
        now; its encoding into the store (JSON, and every so many regions a zlib block)
        is done once the lock is released and the replies queued meanwhile are sent —
        after the release's reply, which does not depend on it — or before any read of
        the store, whichever comes first."""
        self._unrecorded.append((next(self._seq), uid, report))

    def _record_pending(self) -> None:
        with self.lock:
            rows, self._unrecorded = self._unrecorded, []
            for seq, uid, report in rows:
                self.finished.append((seq, uid, report.record()))

    def foreign_reasons(self, start: float, end: float) -> list[Reason]:
        """Another user's krex daemon ran on this node during [start, end]."""
        seen = self.neighbours.during(start, end)
        if not seen:
            return []
        uids = sorted({s.uid for s in seen})
        who = ", ".join("uid ?" if u < 0 else f"uid {u}" for u in uids)
        return [Reason(ReasonCode.FOREIGN_DAEMON,
                       f"another user's krex daemon ({who}) served on this node during the "
                       "region: its jobs may have used the device (one node daemon, "
                       "`krex serve --node`, makes them exclusive)",
                       {"uids": uids, "sockets": sorted(s.path for s in seen)})]

    # -- connection and job life cycle ----------------------------------------------------

    def session_closed(self, session: Session) -> None:
        """The connection is gone: every region it held or waited for ends now."""
        with self.locked():
            self.holds.session_closed(session)
            self.pools.session_closed(session)
            self.last_activity_mono_s = time.monotonic()

    def tick(self) -> float:
        """Revoke overdue holders, cancel overdue waiters, close fair windows; return the
        next deadline."""
        with self.locked():
            now = time.monotonic()
            decisions = self.scheduler.expire(now)
            if decisions:
                self.holds.apply(decisions)
            self.holds.expire_kept(now)
            return self._next_deadline()

    def housekeeping(self) -> None:
        """Off the lock: a dead guardian restarted, other users' daemons looked for."""
        if self.exclusivity.check_guardian():
            log.warning("the guardian had died: restarted, with every active lease")
        self.neighbours.look()

    def reap_jobs(self) -> None:
        """Drop jobs none of whose processes is alive any more (looked at off the lock)."""
        with self.locked():
            jobs = list(self.jobs.jobs.values())
        dead = [j for j in jobs if not j.alive()]
        if dead:
            with self.locked():
                for job in dead:
                    if self.jobs.get(job.job_id) is job:
                        self._remove_job(job, "process gone")

    def shutdown(self) -> None:
        """Release everything: every held region's enforcement is undone."""
        with self.locked():
            if getattr(self, "_shut", False):
                return
            self._shut = True
            self.accepting = False
            self.holds.stop_all()
        self.lanes.wait_idle(max(self.config.shutdown_grace_s, 1.0))
        self.pools.shutdown()  # outside the lock: workers' exits call back into the daemon
        with self.locked():
            for job in list(self.jobs.jobs.values()):
                self._remove_job(job, "daemon stopped")
        self.lanes.wait_idle(10.0)
        self.lanes.close()
        self.warmer.stop()
        with self.locked():
            self.exclusivity.close()
        self.events.close()

    def emergency_stop(self) -> None:
        """The second signal: exit now, yet leave nothing frozen (the guardian undoes
        every active lease when its pipe closes)."""
        try:
            self.exclusivity.close()
        except Exception:
            log.exception("emergency stop")

    def held_regions(self) -> int:
        with self.locked():
            return self.holds.held()

    def idle(self) -> bool:
        """Nothing to serve: no region, no job but the warm workers, no program in them.
        Warm workers alone do not keep an idle daemon (and their devices' contexts) alive."""
        with self.locked():
            if self.holds.regions or any(j.kind != "worker" for j in self.jobs.jobs.values()):
                return False
        return self.pools.idle()

    # -- helpers ---------------------------------------------------------------------------

    def _admitting(self) -> None:
        if not self.accepting:
            raise ShuttingDown("the daemon is stopping and admits no new work")

    def _device(self, text: str | None) -> str:
        return parse_device(text, self.devices)

    def _pid_of(self, session: Session) -> ProcessRef:
        return session.process

    def _new_job(self, session: Session, name: str, device: str, mode: str, kind: str,
                 owner: ProcessRef, tenant: str) -> Job:
        self.quota.check_jobs(tenant, self.jobs.of_tenant(tenant))
        job = self.jobs.add(Job(self.jobs.new_id(), name, device, mode, kind, owner,
                                uid=session.peer.uid, tenant=tenant))
        self._job_created(job)
        return job

    def _job_created(self, job: Job) -> None:
        self.events.emit("job_created", job_id=job.job_id, name=job.name, device=job.device,
                         mode=job.mode, kind=job.kind, owner_pid=job.owner.pid, uid=job.uid,
                         tenant=job.tenant)

    def _remove_job(self, job: Job, why: str) -> None:
        if self.jobs.remove(job.job_id) is None:
            return
        job.ended_wall_s = time.time()
        self.ended_jobs.append((next(self._seq), job.uid, job.record()))
        self.holds.apply(self.scheduler.forget_job(job.job_id, time.monotonic()))
        self.holds.job_removed(job.job_id)  # its kept enforcement first, on the same lane
        cgroups, job_id = job.cgroups, job.job_id

        def gone() -> None:  # on the device's lane: never under a region's set-up
            self.exclusivity.remove_cgroups(cgroups)
            self.exclusivity.job_ended(job_id)

        self.lanes.submit(job.device, gone)
        self.events.emit("job_ended", job_id=job.job_id, why=why, exit_code=job.exit_code,
                         **job.account.to_dict())

    def job_env(self, job: Job) -> dict[str, Any]:
        env = {"KREX_SOCKET": self.config.socket_path, "KREX_JOB_ID": str(job.job_id),
               "KREX_DEVICE": job.device}
        env.update(self.exclusivity.job_env(job))
        cg = self.exclusivity.cgroup_paths(job.cgroups)
        return {"env": env, "cgroups": cg}

    def _member_job(self, session: Session, job_id: int) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"job {job_id} does not exist (it ended, or the id is wrong)")
        # The peer of a connection never changes, so one check per (connection, job) holds.
        verified = session.verified
        if (job_id, id(job)) not in verified:
            self.access.check_owner(session.peer, job.uid, f"job {job_id}")
            if not job.contains(session.peer.pid):
                raise AccessDenied(f"process {session.peer.pid} is not part of job {job_id}",
                                   pid=session.peer.pid)
            verified.add((job_id, id(job)))
        return job

    def _owned_job(self, session: Session, job_id: int) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"job {job_id} does not exist")
        if job.owner.pid != session.peer.pid:
            raise AccessDenied(f"process {session.peer.pid} does not own job {job_id}",
                               pid=session.peer.pid)
        return job

    def _request(self, session: Session, job: Job, device: str, msg: m.Acquire,
                 tenant: str, number: bool = True) -> Request:
        """The scheduler's request for ``msg`` (``number``: with a region id of its own;
        without, only its checked fields are used)."""
        if msg.max_hold_s is not None and msg.max_hold_s <= 0:
            raise BadRequest("max_hold_s must be positive")
        if msg.timeout_s is not None and msg.timeout_s < 0:
            raise BadRequest("timeout_s must not be negative")
        return Request(
            region=next(self._region_ids) if number else 0, job_id=job.job_id, device=device,
            owner=session,
            requested_mono_s=time.monotonic(), max_hold_s=self._max_hold(msg, tenant),
            timeout_s=msg.timeout_s if msg.timeout_s is not None else math.inf,
            exclusive=job.mode != "none", whole_job=msg.whole_job,
            label=_text(msg.label, "label"), tenant=tenant,
        )

    def _max_hold(self, msg: m.Acquire, tenant: str) -> float:
        """``--max-hold-s`` is a ceiling: a request for more (or for none) gets it.

        A whole-job hold (``krex run --mode command``) lasts as long as its job
        unless it asks for a bound, which is then capped the same way.  A
        tenant's maximum hold caps both; asking for more than it is an error.
        """
        ceiling = self.config.max_hold_s
        if msg.whole_job and msg.max_hold_s is None:
            ceiling = math.inf
        return self.quota.hold(tenant, msg.max_hold_s, ceiling)

    def _page(self, rows: list[tuple[int, int, dict[str, Any]]], peer: Peer,
              job_ids: list[int] | None, limit: int,
              before: int | None) -> tuple[list[dict[str, Any]], int | None]:
        """The newest ``limit`` rows (in order) older than ``before`` that ``peer`` may see,
        within one page, and the cursor of the next page (None: no more)."""
        if limit < 0:
            raise BadRequest("limit must not be negative")
        wanted = set(job_ids) if job_ids is not None else None
        end = bisect.bisect_left(rows, before, key=lambda r: r[0]) if before else len(rows)
        out: list[tuple[int, dict[str, Any]]] = []
        size = 0
        for seq, uid, rec in reversed(rows[:end]):
            if (wanted is not None and rec.get("job_id") not in wanted) \
                    or not self.access.visible(peer, uid):
                continue
            if len(out) >= min(limit, m.PAGE_MAX) or size > PAGE_BYTES:
                return [r for _, r in reversed(out)], out[-1][0] if out else seq + 1
            out.append((seq, rec))
            size += len(json.dumps(rec, default=str))
        return [r for _, r in reversed(out)], None

    def status(self, peer: Peer | None = None) -> dict[str, Any]:
        see_all = peer is None or self.access.operator(peer)
        holders = {}
        for name, dq in self.scheduler.devices.items():
            holders[name] = {
                "holder": self._req_summary(dq.holder, peer, see_all) if dq.holder else None,
                "queue": [self._req_summary(r, peer, see_all) for r in dq.waiting()],
            }
        jobs = [j.summary() for j in self.jobs.jobs.values()
                if see_all or (peer is not None and j.uid == peer.uid)]
        return {
            "daemon": {"pid": os.getpid(), "socket": self.config.socket_path, **installation(),
                       "uptime_s": time.monotonic() - self.started_mono_s,
                       "event_log": self.config.event_log,
                       "event_log_rotations": self.events.rotations, "accepting": self.accepting,
                       "node": self.config.node, "uid": os.getuid(),
                       "lanes_busy": self.lanes.busy(), "priority": priority.describe(),
                       "keep": self.holds.keeper.describe(),
                       "warm_moves": self.warmer.describe()},
            "devices": [d.to_dict() for d in self.devices],
            "scheduler": holders,
            "jobs": jobs,
            "other_jobs": len(self.jobs.jobs) - len(jobs),
            "counters": {**vars(self.counters), "events_lost": self.events.lost,
                         "guardian_restarts": self.exclusivity.guardian_restarts()},
            "tenant": self._tenant_status(peer),
            "limits": {"max_hold_s": self.config.max_hold_s,
                       "max_acquires_per_connection": self.config.max_acquires_per_connection,
                       "max_connections_per_uid": self.config.max_connections_per_uid,
                       "max_execs_per_connection": self.config.max_execs_per_connection},
            "enforcement": self.exclusivity.describe(),
            "pools": self.pools.status(),
        }

    def _tenant_status(self, peer: Peer | None) -> dict[str, Any] | None:
        if peer is None:
            return None
        tenant = self.access.tenant(peer, None)
        return {"tenant": tenant, "jobs": self.jobs.of_tenant(tenant),
                "region_s_last_min": round(self.ledger.used(tenant, time.monotonic()), 3),
                "quota": {"max_jobs": self.quota.max_jobs,
                          "region_s_per_min": self.quota.region_s_per_min,
                          "max_hold_s": self.quota.max_hold_s}}

    def _req_summary(self, r: Request, peer: Peer | None, see_all: bool) -> dict[str, Any]:
        st: RegionState | None = self.holds.regions.get(r.region)
        uid = st.uid if st is not None else None
        now = time.monotonic()
        out = {"region": r.region, "job_id": r.job_id, "label": r.label, "tenant": r.tenant,
               "whole_job": r.whole_job, "uid": uid,
               "phase": st.phase.value if st is not None else Phase.CLOSED.value,
               "waiting_s": None if r.granted_mono_s else now - r.requested_mono_s,
               "held_s": now - r.granted_mono_s if r.granted_mono_s else None}
        if not see_all and (peer is None or uid != peer.uid):
            out.update(region=None, job_id=None, label=None, tenant=None)
        return out


def _text(value: str | None, what: str) -> str | None:
    if value is not None and len(value) > m.MAX_TEXT:
        raise BadRequest(f"{what} is {len(value)} characters long; at most {m.MAX_TEXT}")
    return value


def stop_worker(cgroups: Any, root: Any) -> None:
    """Kill a worker and what it started: its whole cgroup where it has one (a double
    fork's processes are still in it), else its process tree as seen now."""
    if cgroups is not None and cgroups.own():
        cgroups.kill_all()
        return
    import psutil

    try:
        worker = psutil.Process(root.pid)
        family = [*worker.children(recursive=True), worker]
    except psutil.Error:
        return
    for p in family:
        with contextlib.suppress(psutil.Error):
            p.kill()
