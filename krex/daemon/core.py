"""The daemon's state and request handling, independent of sockets.

In: validated messages from a :class:`Session` (who sent them is known from
``SO_PEERCRED``).  Out: replies, pushed grants and revocations, enforcement
actions and events.  Every state change happens under one lock; the
scheduler decides, :mod:`krex.daemon.exclusivity` acts.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from krex.daemon.config import DaemonConfig
from krex.daemon.eventlog import EventLog
from krex.daemon.exclusivity import Evidence, Exclusivity, Held
from krex.daemon.jobs import MODES, Job, JobRegistry
from krex.daemon.pools import Pools
from krex.daemon.scheduler import Cancel, Decision, Grant, Request, Revoke, Scheduler
from krex.devices import discover, parse_device
from krex.enforce.process import ProcessRef, is_descendant, process_group
from krex.errors import (
    AccessDenied,
    BadRequest,
    EnforcementFailed,
    KrexError,
    ProcessGone,
    RegionTimeout,
    ShuttingDown,
    UnknownJob,
    UnknownRegion,
)
from krex.protocol import messages as m
from krex.protocol.installation import installation
from krex.protocol.peer import Peer
from krex.protocol.report import Outcome, Reason, ReasonCode, RegionReport, finite_or_none


class Session(Protocol):
    """What the core needs from a connection."""

    peer: Peer  # the kernel's credentials
    process: ProcessRef  # the peer's process, with its start time
    verified: set[tuple[int, int]]

    def push(self, message: m.Message) -> None: ...

    def __hash__(self) -> int: ...


@dataclass
class RegionState:
    request: Request
    session: Session
    acquire_id: int | None
    requested_wall_s: float
    held: Held | None = None
    report: RegionReport | None = None
    granted_mono_s: float | None = None


@dataclass
class Counters:
    granted: int = 0
    released: int = 0
    revoked: int = 0
    cancelled: int = 0
    errors: int = 0
    by_code: collections.Counter = field(default_factory=collections.Counter)


class Daemon:
    def __init__(self, config: DaemonConfig, exclusivity: Exclusivity | None = None) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.jobs = JobRegistry()
        self.scheduler = Scheduler()
        self.regions: dict[int, RegionState] = {}
        self.finished: collections.deque[dict[str, Any]] = collections.deque(maxlen=20000)
        self.devices = discover()
        self.events = EventLog(config.event_log)
        self.exclusivity = exclusivity or Exclusivity(config)
        self.counters = Counters()
        self.started_mono_s = time.monotonic()
        self.accepting = True
        self.wakeup = threading.Condition(self.lock)
        self._region_ids = iter(range(1, 1 << 62))
        self.last_activity_mono_s = time.monotonic()
        self.planned_wake_mono_s = 0.0  # when the ticker will next look at deadlines
        self.pools = Pools(self, config.pool_spec())

    # -- dispatch --------------------------------------------------------------

    def handle(self, session: Session, msg: m.Message) -> dict[str, Any] | None:
        """Handle one request; return reply data, or None when the reply comes later."""
        handler = getattr(self, "_on_" + msg.type, None)
        if handler is None:
            raise BadRequest(f"{msg.type} is not a request")
        with self.lock:
            self.last_activity_mono_s = time.monotonic()
            return handler(session, msg)

    def _on_register(self, session: Session, msg: m.Register) -> dict[str, Any]:
        me = self._pid_of(session)
        if msg.job_id is not None:
            job = self._member_job(session, msg.job_id)
            job.members.add(me)
            return {"job_id": job.job_id, "device": job.device, "mode": job.mode}
        adhoc = self.jobs.adhoc_for(me)
        if adhoc is None:
            device = self._device(msg.device)
            adhoc = self._new_job(msg.name or f"pid-{me.pid}", device, "region", "adhoc", me)
            adhoc.cgroups = self.exclusivity.create_cgroups(adhoc.job_id)
            self.exclusivity.adopt(adhoc.cgroups, me)
        return {"job_id": adhoc.job_id, "device": adhoc.device, "mode": adhoc.mode}

    def _on_create_job(self, session: Session, msg: m.CreateJob) -> dict[str, Any]:
        self._admitting()
        if msg.mode not in MODES:
            raise BadRequest(f"unknown mode {msg.mode!r}: expected one of {', '.join(MODES)}")
        device = self._device(msg.device)
        owner = self._pid_of(session)
        job = self._new_job(msg.name or "job", device, msg.mode, "managed", owner)
        job.cgroups = self.exclusivity.create_cgroups(job.job_id)
        return {"job_id": job.job_id, "device": device, "mode": job.mode, **self.job_env(job)}

    def _on_attach_job(self, session: Session, msg: m.AttachJob) -> dict[str, Any]:
        job = self._owned_job(session, msg.job_id)
        if not is_descendant(msg.pid, session.peer.pid):
            raise AccessDenied(
                f"process {msg.pid} is not process {session.peer.pid} or its descendant",
                pid=msg.pid,
            )
        try:
            job.root = ProcessRef.of(msg.pid)
        except ProcessGone:
            return {"attached": False}
        job.pgid = process_group(msg.pid)
        self.events.emit("job_attached", job_id=job.job_id, pid=msg.pid, pgid=job.pgid)
        return {"attached": True}

    def _on_end_job(self, session: Session, msg: m.EndJob) -> dict[str, Any]:
        job = self._owned_job(session, msg.job_id)
        job.exit_code = msg.exit_code
        self._remove_job(job, "ended")
        return {}

    def _on_acquire(self, session: Session, msg: m.Acquire) -> None:
        self._admitting()
        job = self._member_job(session, msg.job_id)
        device = self._device(msg.device or job.device)
        if msg.whole_job and session.peer.pid != job.owner.pid:
            raise AccessDenied("only the job's owner may hold its device for the whole job")
        req = self._request(session, job, device, msg)
        self.regions[req.region] = RegionState(req, session, msg.id, time.time())
        self.events.emit(
            "requested", region=req.region, job_id=job.job_id, device=device, label=msg.label
        )
        self._apply(self.scheduler.submit(req, time.monotonic()))
        return None

    def _on_release(self, session: Session, msg: m.Release) -> dict[str, Any]:
        st = self.regions.get(msg.region)
        if st is None or st.session is not session:
            raise UnknownRegion(f"region {msg.region} is not held by this connection",
                                region=msg.region)
        if st.granted_mono_s is None:
            raise UnknownRegion(f"region {msg.region} has not been granted yet", region=msg.region)
        if st.report is None:
            self._close(st, Outcome.RELEASED)
        del self.regions[msg.region]
        self._apply(self.scheduler.release(msg.region, time.monotonic()))
        assert st.report is not None
        return {"report": st.report.to_dict()}

    def _on_status(self, session: Session, msg: m.Status) -> dict[str, Any]:
        return self.status()

    def _on_regions(self, session: Session, msg: m.Regions) -> dict[str, Any]:
        wanted = set(msg.job_ids) if msg.job_ids is not None else None
        rows = [r for r in self.finished if wanted is None or r["job_id"] in wanted]
        return {"regions": rows[-max(0, msg.limit):]}

    def _on_exec(self, session: Session, msg: m.Exec) -> None:
        self._admitting()
        self.pools.run(session, msg, self._device(msg.device))
        return None

    def new_worker_job(self, device: str, index: int) -> Job:
        """A job for a pool worker about to be spawned (its pid comes in worker_started)."""
        with self.lock:
            job = self._new_job(f"worker-{device}-{index}", device, "region", "worker",
                                ProcessRef.of(os.getpid()))
            job.cgroups = self.exclusivity.create_cgroups(job.job_id)
            return job

    def worker_started(self, job_id: int, pid: int) -> None:
        with self.lock:
            job = self.jobs.get(job_id)
            try:
                root = ProcessRef.of(pid)
            except ProcessGone:
                return
            if job is not None:
                job.root, job.pgid = root, process_group(pid)

    def worker_exited(self, pid: int) -> None:
        with self.lock:
            for job in list(self.jobs.jobs.values()):
                if job.kind == "worker" and job.root and job.root.pid == pid:
                    self._remove_job(job, "worker exited")

    def _on_stop(self, session: Session, msg: m.Stop) -> dict[str, Any]:
        self.accepting = False
        self.wakeup.notify_all()
        return {"stopping": True}

    # -- decisions -------------------------------------------------------------

    def _apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            st = self.regions.get(d.request.region)
            if st is None:
                continue
            if isinstance(d, Grant):
                self._grant(st)
            elif isinstance(d, Revoke):
                self._revoke(st, d.reason)
            elif isinstance(d, Cancel):
                self._cancel(st, d.reason)
        if self.scheduler.next_deadline() < self.planned_wake_mono_s:
            self.wakeup.notify_all()  # the ticker must wake earlier than it planned

    def _grant(self, st: RegionState) -> None:
        req = st.request
        if req.exclusive and not req.nested:
            holder = self.jobs.get(req.job_id)
            if holder is None:
                self._abort(st, UnknownJob(f"job {req.job_id} ended before its region started"))
                return
            siblings, others = self._siblings(req)
            try:
                st.held = self.exclusivity.enter(holder, siblings, req, others)
            except EnforcementFailed as exc:
                self._abort(st, exc)
                return
        st.granted_mono_s = time.monotonic()
        self.counters.granted += 1
        self.events.emit("granted", region=req.region, job_id=req.job_id, device=req.device,
                         waited_s=_waited_s(req), nested=req.nested)
        st.session.push(m.Reply(re=st.acquire_id, data=self._granted_data(st)))

    def _granted_data(self, st: RegionState) -> dict[str, Any]:
        req = st.request
        return {"region": req.region, "device": req.device, "waited_s": _waited_s(req),
                "nested": req.nested, "exclusive": req.exclusive,
                "max_hold_s": finite_or_none(req.max_hold_s),
                "granted_mono_s": st.granted_mono_s}

    def _abort(self, st: RegionState, exc: KrexError) -> None:
        """Enforcement could not be set up: the request fails with that error."""
        self.counters.errors += 1
        self.events.emit("aborted", region=st.request.region, job_id=st.request.job_id,
                         error=exc.code, message=exc.message)
        del self.regions[st.request.region]
        st.session.push(m.ErrorReply.of(exc, st.acquire_id))
        self._apply(self.scheduler.release(st.request.region, time.monotonic()))

    def _revoke(self, st: RegionState, reason: str) -> None:
        self.counters.revoked += 1
        self._close(st, Outcome.REVOKED, reason)
        st.session.push(m.Revoked(region=st.request.region, reason=reason))

    def _cancel(self, st: RegionState, reason: str) -> None:
        self.counters.cancelled += 1
        del self.regions[st.request.region]
        self.events.emit("cancelled", region=st.request.region, job_id=st.request.job_id,
                         reason=reason)
        err = RegionTimeout(f"region on {st.request.device} {reason}",
                            device=st.request.device, seconds=st.request.timeout_s)
        st.session.push(m.ErrorReply.of(err, st.acquire_id))

    def _close(self, st: RegionState, outcome: Outcome, why: str | None = None) -> None:
        """End a granted region: undo enforcement and write its report."""
        req = st.request
        evidence = st.held.exit() if st.held is not None else None
        st.held = None
        st.report = self._report(st, evidence, time.monotonic(), outcome, why)
        self.counters.released += outcome is Outcome.RELEASED
        self.finished.append(st.report.record())
        self.events.emit(outcome.value, region=req.region, job_id=req.job_id, device=req.device,
                         held_s=st.report.held_s, reason=why)

    def _report(self, st: RegionState, evidence: Evidence | None, now: float, outcome: Outcome,
                why: str | None) -> RegionReport:
        req = st.request
        job = self.jobs.get(req.job_id)
        granted = st.granted_mono_s or now
        return RegionReport(
            region=req.region, device=req.device, label=req.label, job_id=req.job_id,
            job=job.name if job else None, mode=job.mode if job else None, outcome=outcome,
            nested=req.nested, exclusive=req.exclusive, waited_s=_waited_s(req),
            held_s=now - granted, max_hold_s=finite_or_none(req.max_hold_s),
            requested_mono_s=req.requested_mono_s, granted_mono_s=st.granted_mono_s,
            released_mono_s=now, requested_wall_s=st.requested_wall_s,
            jobs_served_while_waiting=req.jobs_served_while_waiting,
            host=evidence.host if evidence else None,
            device_audit=evidence.device_audit if evidence else None,
            reasons=_reasons(req, evidence, outcome, why))

    # -- connection and job life cycle ----------------------------------------

    def session_closed(self, session: Session) -> None:
        """The connection is gone: every region it held or waited for ends now."""
        with self.lock:
            mine = [st for st in self.regions.values() if st.session is session]
            for st in mine:
                if st.granted_mono_s is not None and st.report is None:
                    self._close(st, Outcome.OWNER_GONE)
                del self.regions[st.request.region]
            self._apply(self.scheduler.drop_owner(session, time.monotonic()))
            self.last_activity_mono_s = time.monotonic()

    def tick(self) -> float:
        """Revoke overdue holders and cancel overdue waiters; return the next deadline."""
        with self.lock:
            decisions = self.scheduler.expire(time.monotonic())
            if decisions:
                self._apply(decisions)
            return self.scheduler.next_deadline()

    def reap_jobs(self) -> None:
        """Drop jobs none of whose processes is alive any more."""
        with self.lock:
            for job in self.jobs.dead():
                self._remove_job(job, "process gone")

    def shutdown(self) -> None:
        """Release everything: every held region's enforcement is undone."""
        with self.lock:
            self.accepting = False
            for st in list(self.regions.values()):
                if st.granted_mono_s is not None and st.report is None:
                    self._close(st, Outcome.DAEMON_STOPPED)
                elif st.granted_mono_s is None:
                    stopping = ShuttingDown("the daemon is stopping")
                    st.session.push(m.ErrorReply.of(stopping, st.acquire_id))
            self.regions.clear()
        self.pools.shutdown()  # outside the lock: workers' exits call back into the daemon
        with self.lock:
            for job in list(self.jobs.jobs.values()):
                self._remove_job(job, "daemon stopped")
            self.exclusivity.close()
            self.events.close()

    def held_regions(self) -> int:
        with self.lock:
            return sum(st.granted_mono_s is not None and st.report is None
                       for st in self.regions.values())

    def idle(self) -> bool:
        with self.lock:
            return not self.regions and not self.jobs.jobs

    # -- helpers ---------------------------------------------------------------

    def _admitting(self) -> None:
        if not self.accepting:
            raise ShuttingDown("the daemon is stopping and admits no new work")

    def _device(self, text: str | None) -> str:
        return parse_device(text, self.devices)

    def _pid_of(self, session: Session) -> ProcessRef:
        return session.process

    def _new_job(self, name: str, device: str, mode: str, kind: str, owner: ProcessRef) -> Job:
        job = self.jobs.add(Job(self.jobs.new_id(), name, device, mode, kind, owner))
        self.events.emit("job_created", job_id=job.job_id, name=name, device=device,
                         mode=mode, kind=kind, owner_pid=owner.pid)
        return job

    def _remove_job(self, job: Job, why: str) -> None:
        if self.jobs.remove(job.job_id) is None:
            return
        self.exclusivity.remove_cgroups(job.cgroups)
        self.exclusivity.job_ended(job.job_id)
        self.events.emit("job_ended", job_id=job.job_id, why=why, exit_code=job.exit_code)

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

    def _request(self, session: Session, job: Job, device: str, msg: m.Acquire) -> Request:
        if msg.max_hold_s is not None and msg.max_hold_s <= 0:
            raise BadRequest("max_hold_s must be positive")
        return Request(
            region=next(self._region_ids), job_id=job.job_id, device=device, owner=session,
            requested_mono_s=time.monotonic(), max_hold_s=self._max_hold(msg),
            timeout_s=msg.timeout_s if msg.timeout_s is not None else math.inf,
            exclusive=job.mode != "none", whole_job=msg.whole_job, label=msg.label,
        )

    def _max_hold(self, msg: m.Acquire) -> float:
        """``--max-hold-s`` is a ceiling: a request for more (or for none) gets it.

        A whole-job hold (``krex run --mode command``) lasts as long as its job
        unless it asks for a bound, which is then capped the same way.
        """
        ceiling = self.config.max_hold_s
        if msg.whole_job and msg.max_hold_s is None:
            return math.inf
        return min(msg.max_hold_s or ceiling, ceiling)

    def _siblings(self, req: Request) -> tuple[list[Job], list[Job]]:
        """(jobs to gate and freeze, other jobs to keep off the holder's cores)."""
        node = self.config.freeze_scope == "node"
        siblings: list[Job] = []
        others: list[Job] = []
        for job in self.jobs.jobs.values():
            if job.job_id != req.job_id:
                (siblings if node or job.device == req.device else others).append(job)
        return siblings, others

    def status(self) -> dict[str, Any]:
        holders = {}
        for name, dq in self.scheduler.devices.items():
            holders[name] = {
                "holder": _req_summary(dq.holder) if dq.holder else None,
                "queue": [_req_summary(r) for r in dq.waiting()],
            }
        return {
            "daemon": {"pid": _getpid(), "socket": self.config.socket_path, **installation(),
                       "uptime_s": time.monotonic() - self.started_mono_s,
                       "event_log": self.config.event_log, "accepting": self.accepting},
            "devices": [d.to_dict() for d in self.devices],
            "scheduler": holders,
            "jobs": [j.summary() for j in self.jobs.jobs.values()],
            "counters": {"granted": self.counters.granted, "released": self.counters.released,
                         "revoked": self.counters.revoked, "cancelled": self.counters.cancelled},
            "enforcement": self.exclusivity.describe(),
            "pools": self.pools.status(),
        }


def _waited_s(req: Request) -> float:
    return (req.granted_mono_s or req.requested_mono_s) - req.requested_mono_s


_ENDED = {Outcome.REVOKED: ReasonCode.REVOKED, Outcome.OWNER_GONE: ReasonCode.OWNER_GONE,
          Outcome.DAEMON_STOPPED: ReasonCode.DAEMON_STOPPED}
_ENDED_WHY = {Outcome.OWNER_GONE: "the holder's connection closed while it held the region",
              Outcome.DAEMON_STOPPED: "the daemon stopped while the region was held"}


def _reasons(req: Request, evidence: Evidence | None, outcome: Outcome,
             why: str | None) -> list[Reason]:
    """Why the region is not clean: from its job's mode, its enforcement and its end."""
    out = list(evidence.reasons) if evidence is not None else []
    if not req.exclusive:
        out.append(Reason(ReasonCode.NOT_EXCLUSIVE, "exclusivity: job runs in mode none",
                          {"mode": "none"}))
    if outcome in _ENDED:
        out.append(Reason(_ENDED[outcome], why or _ENDED_WHY[outcome],
                          {"max_hold_s": finite_or_none(req.max_hold_s)}
                          if outcome is Outcome.REVOKED else {}))
    return out


def _req_summary(r: Request) -> dict[str, Any]:
    return {"region": r.region, "job_id": r.job_id, "label": r.label, "whole_job": r.whole_job,
            "waiting_s": None if r.granted_mono_s else time.monotonic() - r.requested_mono_s,
            "held_s": time.monotonic() - r.granted_mono_s if r.granted_mono_s else None}


def _getpid() -> int:
    return os.getpid()

