"""A region's life at the daemon: queued, entering, held, closing, closed.

In: acquires, releases, cancels, revocations and lost connections (from
:mod:`krex.daemon.core`, under its lock), and the scheduler's decisions.
Out: grants, replies and revocation notices (queued on the core's outbox,
sent once its lock is released), enforcement set up and undone on each
device's :class:`~krex.daemon.lanes.Lane` — never under the lock — and for
every region a :class:`~krex.protocol.report.RegionReport` plus the jobs'
time accounts.

Whatever ends a region first (its release, a revocation, a cancel, its
connection closing, the daemon stopping) decides its outcome; a region whose
requester is gone is still set up and undone in order, never granted to
nobody and left frozen.

Re-queued regions.  A job that releases while other jobs wait on the device
is frozen by the next holder's region before it can ask again, so with plain
``with krex.region()`` loops every chain of handoffs ended with the device
idle while the frozen jobs were thawed and asked (``krex.regions`` avoids it
by asking with the release).  So the daemon queues such a job again itself
(``--requeue-ms``): the region goes through the queue in its turn like any
other, without a requester.  If the job asks (an ``acquire`` on the same
connection, same device and tenant) while it is queued or after it was
granted, it is the job's region: the grant is answered at once, its maximum
hold counts from then and its report from then (``waited_s`` 0 when it was
already set up).  Granted and not asked for within the claim window, it
*lapses*: it ends with no report (an event ``requeue_lapsed`` and a counter;
the time stays charged to the tenant), the device moves on, and the job is
re-queued less often (after ``n`` lapses in a row, ``2**n - 1`` releases are
let pass, at most 63) until it asks for one again.

Offers.  At the grant (the job being thawed) the job's connection is sent an
``offer``: its next plain acquire takes the region at once, sending a *claim*
it does not wait for (:meth:`krex.client.connection.Connection.acquire`).  A
claim sent within the window must never find the region lapsed, or the job
would have run its region's body without the device: so a region offered lapses
only after twice the window (the second window is the claim's time to be read),
later still while its job's connection has input the daemon has not handled (a
daemon short of CPU reads late: :meth:`Holds._claim_may_wait`), and a client whose
claim left after the window waits for its answer.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from krex.daemon.exclusivity import Evidence, Held, is_gpu
from krex.daemon.jobs import Job
from krex.daemon.keep import Keeper, Kept, configured_keep_s
from krex.daemon.scheduler import Cancel, Decision, Grant, Request, Revoke
from krex.enforce.handoff import job_key
from krex.errors import (
    EnforcementFailed,
    KrexError,
    RegionRevoked,
    RegionTimeout,
    ShuttingDown,
    UnknownJob,
    UnknownRegion,
)
from krex.protocol import messages as m
from krex.protocol.report import (
    HostEvidence,
    Outcome,
    Reason,
    ReasonCode,
    RegionReport,
    finite_or_none,
)

if TYPE_CHECKING:
    from krex.daemon.core import Daemon, Session

log = logging.getLogger("krex.daemon")

MAX_LAPSE_WAITS = 8  # claim windows an offered region's lapse may wait for unread input
MAX_REQUEUED_CHAIN = 32  # handoffs in a row after which a release re-queues nobody and
# hands over to nobody (while the chain keeps a job frozen that has no place in the queue)


class Phase(enum.Enum):
    QUEUED = "queued"  # in the scheduler's queue
    ENTERING = "entering"  # chosen; its enforcement is being set up on the device's lane
    HELD = "held"  # granted: the requester was told
    CLOSING = "closing"  # its enforcement is being undone
    CLOSED = "closed"  # report written; kept until its holder releases it (revoked)


@dataclass(eq=False)
class RegionState:
    request: Request
    session: Session
    acquire_id: int | None
    uid: int
    requested_wall_s: float
    phase: Phase = Phase.QUEUED
    held: Held | None = None
    report: RegionReport | None = None
    enter_mono_s: float | None = None  # its enforcement set-up began
    granted_mono_s: float | None = None  # the grant was sent
    ending_mono_s: float | None = None  # released, revoked or abandoned
    outcome: Outcome | None = None  # what ends it, once something has
    why: str | None = None
    release_id: int | None = None  # a release waiting for the report
    gone: bool = False  # nobody to answer: cancelled, or the connection closed
    frozen_jobs: list[int] = field(default_factory=list)  # siblings it stopped
    handed_mono_s: float | None = None  # its enforcement passed to the next holder then
    chain: tuple[int, ...] = ()  # jobs that held the device before it, handed over to it
    asked: m.Acquire | None = None  # its request, as sent (a release's ``again`` repeats it)
    requeued: bool = False  # queued again by the daemon at a release; its job has not asked
    # granted by a handoff while re-queued: the outgoing region's undo, run once it is
    # claimed or ends (see Holds._hand_over)
    after_claim: Callable[[], None] | None = None
    claim_window_s: float = 0.0  # a re-queued region's: its offer's claim window
    # its release re-queues its job (Daemon._on_release): done (locked) after the handoff's
    # grant, off the grant path, or before its undo when there is no handoff
    requeue: Callable[[], None] | None = None
    claimed_mono_s: float | None = None  # re-queued, granted, then asked for by its job
    lapse_waits: int = 0  # claim windows its lapse waited for unread input (_claim_may_wait)
    # the node's jobs its enforcement was set up for (handoff.job_key): kept for its job's
    # next region only while they are the same (krex.daemon.keep)
    enforced_for: tuple = ()

    @property
    def region(self) -> int:
        return self.request.region

    @property
    def start_mono_s(self) -> float | None:
        """When the region became its requester's: its grant, or its claim (re-queued)."""
        return self.claimed_mono_s if self.claimed_mono_s is not None else self.granted_mono_s


class Holds:
    """Every region of one daemon; each method is called under the core's lock."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.regions: dict[int, RegionState] = {}
        self.by_session: dict[Any, set[int]] = {}
        self.keeper = Keeper(configured_keep_s())  # a lone job's enforcement between regions

    # -- requests ------------------------------------------------------------------

    def acquire(self, session: Session, msg: m.Acquire, req: Request, uid: int,
                claim_window_s: float | None = None) -> None:
        """Queue a request; ``claim_window_s``: a re-queued one (module docstring), held
        at most that long before its job asks for it."""
        self.d.warmer.touch()  # its set-up's cgroup moves should not wait (krex.enforce.warm)
        st = RegionState(req, session, msg.id, uid, time.time(), asked=msg)
        if claim_window_s is not None:
            st.requeued = st.gone = True  # nobody to answer until the job asks
            st.claim_window_s = claim_window_s
            req.max_hold_s = 2 * claim_window_s  # the offer's window, then its grace
        self.regions[req.region] = st
        self.by_session.setdefault(session, set()).add(req.region)
        self.d.counters.requeued += st.requeued
        self.d.events.emit("requeued" if st.requeued else "requested", region=req.region,
                           job_id=req.job_id, device=req.device, label=req.label,
                           tenant=req.tenant)
        self.apply(self.d.scheduler.submit(req, time.monotonic()))

    def may_requeue(self, st: RegionState, job: Job) -> bool:
        """Whether ``st``'s release should queue its job again (module docstring): a
        plain exclusive region, other jobs waiting on the device, no back-off."""
        req = st.request
        if st.phase is not Phase.HELD or st.asked is None or not req.exclusive \
                or req.nested or req.whole_job:
            return False
        if job.requeue_skip > 0:
            job.requeue_skip -= 1
            return False
        queued = self.d.scheduler.queue(req.device).queued_jobs()
        if self._chain_must_end(st, queued):
            return False
        return bool(queued - {req.job_id})

    @staticmethod
    def _chain_must_end(st: RegionState, queued: set[int]) -> bool:
        """Whether the handoff chain ``st`` ends now (no re-queue, no handoff).  A chain
        keeps every job frozen that is not queued; with jobs re-queued, or pipelined
        (``krex.regions``: each release asks for the next region), it need never end,
        and a job frozen before it asked (at its registration, say) would wait for ever
        to be thawed and ask.  So a long chain that keeps such a job frozen ends:
        everyone is thawed before the next region is set up.  (Where every job it froze
        is queued, each gets its turn in the chain: ending it would only cost a set-up.)"""
        return len(st.chain) >= MAX_REQUEUED_CHAIN and bool(
            set(st.frozen_jobs) - queued - {st.request.job_id})

    def asked_again(self, session: Session, job_id: int, device: str, but: int) -> bool:
        """Whether this connection's job has a region on ``device`` queued, being set up or
        held, other than region ``but`` (the one just released)."""
        return any(s.region != but and s.request.job_id == job_id and s.request.device == device
                   and s.phase in (Phase.QUEUED, Phase.ENTERING, Phase.HELD) and not s.gone
                   for s in self.of_session(session))

    def requeued(self, session: Session, job_id: int, device: str,
                 region: int | None = None) -> RegionState | None:
        """The region the daemon re-queued for this connection's job on ``device`` (the
        one numbered ``region``, for a claim of its offer)."""
        return next((s for s in self.of_session(session) if s.requeued
                     and s.request.job_id == job_id and s.request.device == device
                     and region in (None, s.region)), None)

    def claim(self, st: RegionState, msg: m.Acquire, max_hold_s: float, timeout_s: float,
              label: str | None) -> bool:
        """The job asks for its re-queued region ``st``: it is the job's from now (False:
        it has lapsed meanwhile; the acquire is queued as usual)."""
        if st.phase in (Phase.CLOSING, Phase.CLOSED):
            return False
        now = time.monotonic()
        req = st.request
        st.requeued = st.gone = False
        st.acquire_id, st.asked, st.requested_wall_s = msg.id, msg, time.time()
        req.label, req.timeout_s, req.requested_mono_s = label, timeout_s, now
        self.d.counters.requeue_claimed += 1
        job = self.d.jobs.get(req.job_id)
        if job is not None:
            job.requeue_lapses = 0
        self.d.events.emit("requested", region=req.region, job_id=req.job_id,
                           device=req.device, label=req.label, tenant=req.tenant,
                           requeued=True)
        if st.phase is Phase.HELD:
            st.claimed_mono_s = now
            self.d.scheduler.claimed(req.region, now, max_hold_s)
            self._announce(st)
            deferred, st.after_claim = st.after_claim, None
            if deferred is not None:  # run by this thread after the grant is sent, when the
                self.d.on_lane(req.device, deferred, here=True)  # lane is idle, else queued
        else:
            req.max_hold_s = max_hold_s  # the hold's clock has not started
        self.d.deadlines_changed()
        return True

    def of_session(self, session: Session) -> list[RegionState]:
        return [self.regions[r] for r in self.by_session.get(session, ()) if r in self.regions]

    def releasable(self, session: Session, region: int) -> RegionState:
        """The region ``session`` may release now (else :class:`UnknownRegion`)."""
        st = self.regions.get(region)
        if st is None or st.session is not session or st.gone:
            raise UnknownRegion(f"region {region} is not held by this connection",
                                region=region)
        if st.phase in (Phase.QUEUED, Phase.ENTERING):
            raise UnknownRegion(f"region {region} has not been granted yet", region=region)
        return st

    def release(self, session: Session, msg: m.Release) -> dict[str, Any] | None:
        st = self.releasable(session, msg.region)
        self.d.warmer.touch()  # nor its undo's
        if st.phase is Phase.CLOSED:
            self._forget(st)
            assert st.report is not None
            return {"report": st.report.to_dict()}
        st.release_id = msg.id
        if st.phase is Phase.HELD:
            self._end(st, Outcome.RELEASED, here=True)
        return None  # the reply comes when its enforcement is undone

    def cancel(self, session: Session, msg: m.Cancel) -> dict[str, Any]:
        """The requester gives up on an acquire (interrupted while it waited)."""
        st = next((s for s in self.of_session(session) if s.acquire_id == msg.acquire), None)
        if st is None or st.gone:
            return {"cancelled": "none", "region": None}
        phase = st.phase
        self.d.counters.cancelled += 1
        self.d.events.emit("cancelled", region=st.region, job_id=st.request.job_id,
                           reason="cancelled by its requester", phase=phase.value)
        st.gone = True
        if phase is Phase.QUEUED:
            self._drop_queued(st)
        elif phase is Phase.ENTERING:
            st.outcome = st.outcome or Outcome.CANCELLED
        elif phase is Phase.HELD:
            self._end(st, Outcome.CANCELLED)
        elif phase is Phase.CLOSED:
            self._forget(st)
        return {"cancelled": "granted" if phase in (Phase.HELD, Phase.CLOSING, Phase.CLOSED)
                else phase.value, "region": st.region}

    def _claim_may_wait(self, st: RegionState) -> bool:
        """An offered region due to lapse whose job's connection has input not handled
        yet (its session's thread, short of CPU, has not read it): the claim may be in
        it, sent in time, and must not find the region lapsed.  The lapse waits another
        claim window, at most MAX_LAPSE_WAITS times (a connection that keeps sending
        other requests cannot hold the device).  Not seen: bytes a session's thread has
        just taken from the socket and not yet put in its reader's buffer (between
        ``recv`` returning and its thread running Python again)."""
        pending = getattr(st.session, "input_pending", None)
        if st.lapse_waits >= MAX_LAPSE_WAITS or pending is None or not pending():
            return False
        st.lapse_waits += 1
        st.request.revoked = False  # due again one window from now
        st.request.max_hold_s += st.claim_window_s
        self.d.counters.lapses_waited += 1
        return True

    def revoke(self, st: RegionState, reason: str) -> str:
        """End a region now (maximum hold passed, or a revoke request)."""
        phase = st.phase
        if st.requeued:  # not asked for within its claim window: it lapses
            if phase is Phase.QUEUED:
                self._drop_queued(st)
            elif phase is Phase.ENTERING:
                st.outcome = st.outcome or Outcome.CANCELLED
            elif phase is Phase.HELD:
                self._end(st, Outcome.CANCELLED, "not asked for within its claim window")
            return phase.value
        if phase is Phase.QUEUED:
            self._drop_queued(st)
            if not st.gone:
                self.d.push(st.session, m.ErrorReply.of(
                    RegionRevoked(f"region {st.region} revoked before its grant: {reason}",
                                  region=st.region), st.acquire_id))
        elif phase is Phase.ENTERING:
            st.outcome, st.why = st.outcome or Outcome.REVOKED, st.why or reason
        elif phase is Phase.HELD:
            self.d.counters.revoked += 1
            self._end(st, Outcome.REVOKED, reason)
            self.d.push(st.session, m.Revoked(region=st.region, reason=reason))
        return phase.value

    def session_closed(self, session: Session) -> None:
        for st in self.of_session(session):
            st.gone = True
            if st.phase is Phase.QUEUED:
                self._drop_queued(st)
            elif st.phase is Phase.ENTERING:
                st.outcome = st.outcome or Outcome.OWNER_GONE
            elif st.phase is Phase.HELD:
                self._end(st, Outcome.OWNER_GONE)
            elif st.phase is Phase.CLOSED:
                self._forget(st)
        self.by_session.pop(session, None)

    def stop_all(self) -> None:
        """The daemon is stopping: waiters get ``shutting_down``, holders are released."""
        for st in [s for s in self.regions.values() if s.phase is Phase.QUEUED]:
            self._drop_queued(st)
            if not st.gone:
                self.d.push(st.session, m.ErrorReply.of(
                    ShuttingDown("the daemon is stopping"), st.acquire_id))
        for st in list(self.regions.values()):
            if st.phase is Phase.ENTERING:
                st.outcome = st.outcome or Outcome.DAEMON_STOPPED
            elif st.phase is Phase.HELD:
                self._end(st, Outcome.DAEMON_STOPPED)
        for device, kept in self.keeper.all():
            self._drop_later(device, kept)

    # -- kept enforcement (krex.daemon.keep) ------------------------------------------

    def expire_kept(self, now: float) -> None:
        """Undo the kept enforcements whose time is over (on their devices' lanes)."""
        for device, kept in self.keeper.due(now):
            self._drop_later(device, kept)

    def job_removed(self, job_id: int) -> None:
        """A job ended: its kept enforcement is undone before its cgroups go."""
        for device, kept in self.keeper.of_job(job_id):
            self._drop_later(device, kept)

    def _drop_later(self, device: str, kept: Kept) -> None:
        self.d.on_lane(device, lambda: self._drop(kept))

    def _drop(self, kept: Kept) -> None:
        """Undo a kept enforcement nobody took (its evidence was reported already)."""
        try:
            kept.held.exit()
            self._moved(kept.held)
        except Exception:
            log.exception("undoing the kept enforcement of job %d failed", kept.job_id)
        with self.d.lock:
            self.keeper.undone += 1

    def _keep(self, st: RegionState) -> bool:
        """A released region's enforcement kept for its job's next region (nobody queued:
        see :mod:`krex.daemon.keep`); its report is made now, from its checkpoint."""
        keep = getattr(self.d.exclusivity, "keep", None)
        if self.keeper.keep_s <= 0 or keep is None or st.held is None \
                or st.outcome not in (None, Outcome.RELEASED):
            return False
        if not st.enforced_for:
            return False
        try:
            evidence = keep(st.held)
        except Exception:  # its undo then says what failed, as any undo's
            log.exception("region %d: keeping its enforcement failed", st.region)
            return False
        if evidence is None:
            return False
        with self.d.locked():
            self.keeper.put(st.request.device, st.request.job_id, st.held, st.enforced_for,
                            time.monotonic())
            self.d.deadlines_changed()
            self._closed(st, evidence)
        return True

    def _resume(self, st: RegionState, kept: Kept | None, key: tuple) -> Held | None:
        """The region on its job's kept enforcement, if it is the same job on the same
        node; else that enforcement is undone first (None: set up anew)."""
        if kept is None:
            return None
        if kept.job_id == st.request.job_id and kept.key == key:
            try:
                held = self.d.exclusivity.resume(kept.held, st.request)
            except Exception:
                log.exception("region %d: resuming job %d's kept enforcement failed",
                              st.region, kept.job_id)
            else:
                with self.d.lock:
                    self.keeper.reused += 1
                return held
        self._drop(kept)
        return None

    def held(self) -> int:
        return sum(st.phase in (Phase.ENTERING, Phase.HELD, Phase.CLOSING)
                   for st in self.regions.values())

    # -- the scheduler's decisions -------------------------------------------------------

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            st = self.regions.get(d.request.region)
            if st is None:
                continue
            if isinstance(d, Grant):
                self._chosen(st)
            elif isinstance(d, Revoke):
                if not (st.requeued and st.phase is Phase.HELD and self._claim_may_wait(st)):
                    self.revoke(st, d.reason)
            elif isinstance(d, Cancel):
                self._timed_out(st, d.reason)
        self.d.deadlines_changed()

    def _chosen(self, st: RegionState) -> None:
        """Set the region up on its device's lane.  An acquire that finds the lane idle
        sets up on its own session's thread when the enforcement allows it (a cpu
        device; :meth:`Exclusivity.sets_up_on_caller`): no wake-up of the lane's thread
        on the way to an uncontended grant — on a loaded 2-core machine that hop and the
        two threads' convoy on the GIL were a third of the bare round trip.  Its
        connection closing meanwhile is seen once the set-up is done (the grant is
        then ended as ``owner_gone``).  A set-up decided on another thread (a release,
        the ticker) queues on the lane."""
        req = st.request
        if req.nested or not req.exclusive:  # nothing to set up: granted as it is
            st.phase = Phase.HELD
            self._granted(st, time.monotonic())
            return
        st.phase = Phase.ENTERING
        on_caller = getattr(self.d.exclusivity, "sets_up_on_caller", None)
        self.d.on_lane(req.device, lambda: self._enter(st),
                       here=on_caller is not None and on_caller(req.device))

    def _timed_out(self, st: RegionState, reason: str) -> None:
        self.d.counters.cancelled += 1
        self._forget(st)
        self.d.events.emit("cancelled", region=st.region, job_id=st.request.job_id,
                           reason=reason)
        if not st.gone:
            err = RegionTimeout(f"region on {st.request.device} {reason}",
                                device=st.request.device, seconds=st.request.timeout_s)
            self.d.push(st.session, m.ErrorReply.of(err, st.acquire_id))

    # -- on the device's lane (never under the lock) ---------------------------------------

    def _enter(self, st: RegionState) -> None:
        with self.d.locked():
            holder = self.d.jobs.get(st.request.job_id)
            if st.outcome is not None or holder is None:
                self._abort(st, UnknownJob(f"job {st.request.job_id} ended before its region "
                                           "started") if holder is None else None)
                return
            siblings, others = self.d.siblings(st.request)
            st.enter_mono_s = time.monotonic()
            kept = self.keeper.take(st.request.device)
            st.enforced_for = job_key(holder, siblings, others)
        try:
            held = self._resume(st, kept, st.enforced_for)
            if held is None:
                held = self.d.exclusivity.enter(holder, siblings, st.request, others)
        except KrexError as exc:
            with self.d.locked():
                self._abort(st, exc if isinstance(exc, EnforcementFailed)
                            else EnforcementFailed(exc.message))
            return
        except Exception as exc:
            log.exception("region %d: enforcement set-up failed", st.region)
            with self.d.locked():
                self._abort(st, EnforcementFailed(f"enforcement could not be set up: {exc!r}"))
            return
        self._moved(held)
        with self.d.locked():
            st.held = held
            st.frozen_jobs = [j.job_id for j in siblings if j.may_have_processes()]
            granted = st.outcome is None
            if granted:
                st.phase = Phase.HELD
                self._granted(st, time.monotonic())
            else:
                st.phase = Phase.CLOSING  # abandoned while it was being set up
                st.ending_mono_s = time.monotonic()
        if granted:
            self._prefetch(st)
        else:
            self._exit(st)

    def _prefetch(self, st: RegionState) -> None:
        """After a grant (sent), still in the lane's turn: the counters of the job the
        scheduler would grant next on the device, frozen now, are read for its handoff
        (:meth:`krex.enforce.enforcer.Enforcement.prefetch`) — one read less on the next
        handed-over grant's path — and that handoff's operations are worked out
        (:func:`krex.enforce.handoff.prepare`), used if the jobs are the same then."""
        prefetch = getattr(self.d.exclusivity, "prefetch", None)
        if prefetch is None or st.held is None:
            return
        with self.d.locked():
            job_id = self.d.scheduler.next_job(st.request.device)
            job = self.d.jobs.get(job_id) if job_id is not None else None
            if job is None or job.job_id == st.request.job_id:
                return
            siblings, others = self.d.siblings_of(job.job_id, st.request.device)
        try:
            prefetch(st.held, job, siblings, others)
        except Exception:  # a job that just ended, say: its handoff reads them itself
            log.debug("region %d: prefetch for job %d failed", st.region, job.job_id,
                      exc_info=True)

    def _exit(self, st: RegionState) -> None:
        nxt = self._next_holder(st)
        if nxt is not None:
            self._hand_over(st, *nxt)
            return
        self._requeue(st)
        if not self._keep(st):
            self._undo(st)

    def _requeue(self, st: RegionState) -> None:
        """The re-queueing its release asked for, now (see :attr:`RegionState.requeue`).
        Its job is frozen (or about to be) and cannot ask before its release's reply."""
        requeue, st.requeue = st.requeue, None
        if requeue is not None:
            with self.d.locked():
                requeue()

    def _next_holder(self, st: RegionState) -> tuple[RegionState, Job, list[Job],
                                                    list[Job]] | None:
        """The region granted next on this device, when its holder can take the
        enforcement over (see :meth:`_hand_over`): the scheduler is told of the
        release now, before anything is undone."""
        if st.held is None or not getattr(st.held, "can_hand_over", lambda: False)():
            self._chain_end("not_carriable" if st.held is not None else "nothing_enforced")
            return None
        with self.d.locked():
            if _stopped_held(st.held) and self._chain_must_end(
                    st, self.d.scheduler.queue(st.request.device).queued_jobs()):
                self._chain_end("chain_bound")
                return None  # undone, then the next grant set up: the frozen are thawed
            now = time.monotonic()
            frozen = st.frozen_jobs if _stopped_held(st.held) else []
            decisions = self.d.scheduler.release(st.region, now, frozen, st.chain)
            pick = next((d for d in decisions if isinstance(d, Grant)
                         and self._takes_over(st, self.regions.get(d.request.region))), None)
            self.apply([d for d in decisions if d is not pick])
            if pick is None:
                self._chain_end("next_not_exclusive" if any(
                    isinstance(d, Grant) for d in decisions) else "nobody_queued")
                return None
            nxt = self.regions[pick.request.region]
            holder = self.d.jobs.get(nxt.request.job_id)
            assert holder is not None  # checked by _takes_over
            siblings, others = self.d.siblings(nxt.request)
            nxt.phase = Phase.ENTERING
            nxt.enter_mono_s = now
            nxt.chain = (*st.chain, st.request.job_id)
            st.handed_mono_s = now
            return nxt, holder, siblings, others

    def _chain_end(self, why: str) -> None:
        """A release after which the device is not handed over, counted by why (``krex
        status``: a loaded machine's lapses and refused handoffs end chains)."""
        with self.d.lock:
            ends = self.d.counters.chain_ends
            ends[why] = ends.get(why, 0) + 1

    def _takes_over(self, st: RegionState, nxt: RegionState | None) -> bool:
        if nxt is None or nxt.outcome is not None or nxt.phase is not Phase.QUEUED:
            return False
        req = nxt.request
        return (req.device == st.request.device and req.exclusive and not req.nested
                and self.d.jobs.get(req.job_id) is not None)

    def _hand_over(self, st: RegionState, nxt: RegionState, holder: Job, siblings: list[Job],
                   others: list[Job]) -> None:
        """Overlapped handoff: the next holder's grant is sent before the outgoing
        region's report is made; nothing both need is undone and redone.  When the
        enforcement cannot be carried over, it is undone and set up again, in order."""
        assert st.held is not None
        try:
            held = self.d.exclusivity.hand_over(st.held, holder, siblings, nxt.request, others)
        except Exception:
            log.exception("region %d: handoff to region %d failed", st.region, nxt.region)
            held = None
        if held is None:
            self._chain_end("handoff_refused")
            st.handed_mono_s = None
            nxt.chain = ()
            self._requeue(st)
            self._undo(st)
            self._enter(nxt)
            return
        self._moved(held)
        with self.d.locked():
            self.d.counters.handed_over += 1
            nxt.held = held
            nxt.frozen_jobs = [j.job_id for j in siblings if j.may_have_processes()]
            gone = nxt.outcome is not None
            if not gone:
                nxt.phase = Phase.HELD
                self._granted(nxt, time.monotonic())  # sent as the lock is released
            else:
                nxt.phase = Phase.CLOSING
                nxt.ending_mono_s = time.monotonic()
        self._requeue(st)  # the grant is sent: the outgoing job's next region queued now
        def rest() -> None:
            held.lease()  # the guardian's records, after the grant (krex.enforce.handoff)
            self._undo(st)  # the outgoing report: confirmation, counts, contention
            if gone:
                self._exit(nxt)
            else:
                self._prefetch(nxt)

        with self.d.locked():
            # A re-queued grant's job must still run to ask for it, and its ask (a session
            # thread's wake-up) waited ≈ 0.5 ms for a CPU behind this report's reads on a
            # small machine: they come after the claim (or the lapse) instead, and the new
            # lease with them (until it is sent the guardian holds the old one, whose
            # records are the same: test_sigkill_of_the_daemon_mid_chain_thaws_everything).
            # The outgoing job is frozen meanwhile; its counters do not move.
            defer = not gone and nxt.requeued and nxt.phase is Phase.HELD
            if defer:
                nxt.after_claim = rest
        if not defer:
            rest()

    def _moved(self, held: Held) -> None:
        """Enforcement with a holder slot moves processes between cgroups: those moves
        keep cgroup moves fast as the warm pings do (krex.enforce.warm)."""
        if slot_paths(held):
            self.d.warmer.moved()

    def _undo(self, st: RegionState) -> None:
        evidence: Evidence | None = None
        if st.held is not None:
            try:
                evidence = st.held.exit()
                self._moved(st.held)  # the undo moved its holder back (unless handed over)
            except Exception as exc:
                log.exception("region %d: undoing its enforcement failed", st.region)
                evidence = Evidence(HostEvidence(), None, [Reason(
                    ReasonCode.STEP_FAILED, f"undo: {exc!r}", {"step": "undo",
                                                               "error": repr(exc)})])
        with self.d.locked():
            self._closed(st, evidence)

    # -- transitions (under the lock) -----------------------------------------------------------

    def _granted(self, st: RegionState, now: float) -> None:
        req = st.request
        st.granted_mono_s = now
        self.d.scheduler.started(req.region, now)
        if req.exclusive and not req.nested:  # what holds the device counts to its quota
            self.d.ledger.start(str(req.tenant), req.region, now)
        if not st.requeued:  # a re-queued region is announced when its job asks
            self._announce(st)
        else:  # its claim window runs from now: the ticker must wake for it
            self._offer(st, now)
            self.d.deadlines_changed()

    def _offer(self, st: RegionState, now: float) -> None:
        """Tell the job its re-queued region is granted (it is being thawed): its next
        plain acquire may take it without waiting for a reply (docs/protocol.md)."""
        req = st.request
        job = self.d.jobs.get(req.job_id)
        if job is None:
            return
        self.d.counters.offered += 1
        self.d.push(st.session, m.Offer(
            region=st.region, job_id=req.job_id, device=req.device, tenant=str(req.tenant),
            claim_by_mono_s=now + st.claim_window_s, job_device=req.device == job.device,
            job_tenant=req.tenant == job.tenant))

    def _announce(self, st: RegionState) -> None:
        req = st.request
        self.d.counters.granted += 1
        self.d.events.emit("granted", region=req.region, job_id=req.job_id, device=req.device,
                           waited_s=self._waited_s(st), enforce_s=self._enforce_s(st),
                           nested=req.nested)
        if not st.gone:
            self.d.push(st.session, m.Reply(re=st.acquire_id, data=self._grant_data(st)))

    def _grant_data(self, st: RegionState) -> dict[str, Any]:
        req = st.request
        return {"region": req.region, "device": req.device, "waited_s": self._waited_s(st),
                "enforce_s": self._enforce_s(st), "nested": req.nested,
                "exclusive": req.exclusive, "max_hold_s": finite_or_none(req.max_hold_s),
                "granted_mono_s": st.start_mono_s, "tenant": req.tenant,
                # where the holder's processes are for its region: a process it starts
                # meanwhile (``krex run --mode command``'s child) joins these, not its
                # job's cgroups under the frozen device subtree
                "cgroups": slot_paths(st.held)}

    def _end(self, st: RegionState, outcome: Outcome, why: str | None = None,
             here: bool = False) -> None:
        """A held region ends: undo its enforcement on its lane (or now, when it has none);
        ``here``: on the releasing thread, when the lane is idle."""
        st.outcome, st.why = outcome, why
        st.ending_mono_s = time.monotonic()
        st.phase = Phase.CLOSING
        deferred, st.after_claim = st.after_claim, None
        if deferred is not None:  # the outgoing region's undo first, in order
            self.d.on_lane(st.request.device, deferred)
        if st.held is None:
            self._requeue(st)
            self._closed(st, None)
        else:
            self._on_lane(st.request.device, lambda: self._exit(st), here)

    def _on_lane(self, device: str, task: Callable[[], None], here: bool) -> None:
        """A release is carried out by its own session's thread when the device's lane
        is idle (its client waits for the reply, which comes after the undo anyway):
        a handed-over grant then takes no hop through the lane's thread.  Not for GPU
        devices, whose handoff may wait seconds for a drain.  An acquire's set-up
        likewise, where the enforcement says it may (:meth:`_chosen`)."""
        self.d.on_lane(device, task, here=here and not is_gpu(device))

    def _closed(self, st: RegionState, evidence: Evidence | None) -> None:
        now = time.monotonic()
        req = st.request
        st.held = None
        st.phase = Phase.CLOSED
        outcome = st.outcome or Outcome.RELEASED
        if st.requeued:  # its job never asked for it
            self._lapsed(st, evidence, now)
        elif st.granted_mono_s is None:  # abandoned while entering: it was never granted
            self._unentered(st, outcome)
        else:
            st.report = self._report(st, evidence, outcome)
            self.d.counters.released += outcome is Outcome.RELEASED
            self.d.record_region(st.uid, st.report)
            self._account(st)
            self.d.events.emit(outcome.value, region=req.region, job_id=req.job_id,
                               device=req.device, held_s=st.report.held_s, reason=st.why)
        self.d.ledger.end(req.region, now)
        frozen = st.frozen_jobs if evidence is not None and _stopped(evidence) else []
        decisions = self.d.scheduler.release(req.region, now, frozen)
        if st.release_id is not None and not st.gone and st.report is not None:
            self.d.push(st.session, m.Reply(re=st.release_id,
                                            data={"report": st.report.to_dict()}))
            self._forget(st)
        elif st.gone or st.report is None or outcome is not Outcome.REVOKED:
            self._forget(st)
        self.apply(decisions)

    def _lapsed(self, st: RegionState, evidence: Evidence | None, now: float) -> None:
        """A re-queued region ends unclaimed: no report (its siblings' frozen time is still
        theirs); its job is re-queued less often."""
        req = st.request
        self._frozen_through(st, self._frozen_s(st, evidence.host if evidence else None, now))
        self.d.counters.requeue_lapsed += 1
        job = self.d.jobs.get(req.job_id)
        if job is not None:
            job.requeue_lapses += 1
            job.requeue_skip = min(2 ** job.requeue_lapses - 1, 63)
        held = (st.ending_mono_s or time.monotonic()) - st.granted_mono_s \
            if st.granted_mono_s is not None else 0.0
        self.d.events.emit("requeue_lapsed", region=req.region, job_id=req.job_id,
                           device=req.device, held_s=held)

    def _unentered(self, st: RegionState, outcome: Outcome) -> None:
        """Set up and undone without a grant: the requester (if any) gets an error."""
        self.d.events.emit("abandoned", region=st.region, job_id=st.request.job_id,
                           outcome=outcome.value)
        if st.gone:
            return
        err: KrexError = (RegionRevoked(f"region {st.region} revoked before its grant: "
                                        f"{st.why}", region=st.region)
                          if outcome is Outcome.REVOKED
                          else ShuttingDown("the daemon is stopping"))
        self.d.push(st.session, m.ErrorReply.of(err, st.acquire_id))

    def _abort(self, st: RegionState, exc: KrexError | None) -> None:
        """The region could not be (or need not be) set up: it ends without a grant."""
        if exc is not None:
            self.d.counters.errors += 1
            self.d.events.emit("aborted", region=st.region, job_id=st.request.job_id,
                               error=exc.code, message=exc.message)
            if not st.gone:
                self.d.push(st.session, m.ErrorReply.of(exc, st.acquire_id))
        elif not st.gone:
            self._unentered(st, st.outcome or Outcome.DAEMON_STOPPED)
        self._forget(st)
        self.apply(self.d.scheduler.release(st.region, time.monotonic()))

    def _drop_queued(self, st: RegionState) -> None:
        self._forget(st)
        self.apply(self.d.scheduler.release(st.region, time.monotonic()))

    def _forget(self, st: RegionState) -> None:
        self.regions.pop(st.region, None)
        mine = self.by_session.get(st.session)
        if mine is not None:
            mine.discard(st.region)

    # -- evidence -------------------------------------------------------------------------

    def _waited_s(self, st: RegionState) -> float:
        if st.claimed_mono_s is not None:  # set up before its job asked
            return 0.0
        req = st.request
        chosen = st.enter_mono_s or req.granted_mono_s or req.requested_mono_s
        return max(0.0, chosen - req.requested_mono_s)

    def _enforce_s(self, st: RegionState) -> float:
        if st.enter_mono_s is None or st.granted_mono_s is None:
            return 0.0
        return max(0.0, st.granted_mono_s - st.enter_mono_s)

    def _account(self, st: RegionState) -> None:
        assert st.report is not None
        job = self.d.jobs.get(st.request.job_id)
        if job is not None:
            a = job.account
            a.regions += 1
            a.waited_s += st.report.waited_s
            a.enforce_s += st.report.enforce_s
            a.held_s += st.report.held_s
        self._frozen_through(st, st.report.frozen_s)

    def _frozen_through(self, st: RegionState, seconds: float) -> None:
        """Its siblings' time stopped by it (``seconds``: :meth:`_frozen_s`)."""
        for job_id in st.frozen_jobs if seconds else ():
            sibling = self.d.jobs.get(job_id)
            if sibling is not None:
                sibling.account.frozen_s += seconds

    @staticmethod
    def _frozen_s(st: RegionState, host: HostEvidence | None, ended: float) -> float:
        """How long it kept its siblings stopped; handed over, their stop from then on is
        the next region's."""
        if st.enter_mono_s is None or host is None or not _stopped_host(host):
            return 0.0
        until = st.handed_mono_s if st.handed_mono_s is not None else ended
        return max(0.0, until - st.enter_mono_s)

    def _report(self, st: RegionState, evidence: Evidence | None,
                outcome: Outcome) -> RegionReport:
        req = st.request
        job: Job | None = self.d.jobs.get(req.job_id)
        granted = st.start_mono_s or time.monotonic()
        ended = st.ending_mono_s or time.monotonic()
        reasons = list(evidence.reasons) if evidence is not None else []
        reasons += _outcome_reasons(req, outcome, st.why)
        if req.exclusive and not req.nested:
            reasons += self.d.foreign_reasons(granted, ended)
        return RegionReport(
            region=req.region, device=req.device, label=req.label, job_id=req.job_id,
            job=job.name if job else None, mode=job.mode if job else None,
            tenant=str(req.tenant) if req.tenant is not None else None, outcome=outcome,
            nested=req.nested, exclusive=req.exclusive, waited_s=self._waited_s(st),
            enforce_s=self._enforce_s(st), held_s=max(0.0, ended - granted),
            max_hold_s=finite_or_none(req.max_hold_s), requested_mono_s=req.requested_mono_s,
            granted_mono_s=st.start_mono_s, released_mono_s=ended,
            requested_wall_s=st.requested_wall_s,
            jobs_served_while_waiting=req.jobs_served_while_waiting,
            unclaimed_s=(st.claimed_mono_s - st.granted_mono_s
                         if st.claimed_mono_s is not None and st.granted_mono_s is not None
                         else 0.0),
            frozen_s=self._frozen_s(st, evidence.host if evidence else None, ended),
            host=evidence.host if evidence else None,
            device_audit=evidence.device_audit if evidence else None, reasons=reasons)


def slot_paths(held: Held | None) -> dict[str, str]:
    paths = getattr(held, "slot_paths", None)
    return paths() if paths is not None else {}


def _stopped_host(host: HostEvidence) -> bool:
    return bool(host.siblings_frozen or host.gated_jobs or host.locked_pids)


def _stopped_held(held: Held) -> bool:
    """Whether a held region's enforcement stopped its siblings (known before its undo)."""
    stopped = getattr(held, "stopped", None)
    return bool(stopped()) if stopped is not None else False


def _stopped(evidence: Evidence) -> bool:
    """Whether the region's enforcement stopped its siblings (they could not ask meanwhile)."""
    return _stopped_host(evidence.host)


_ENDED = {Outcome.REVOKED: ReasonCode.REVOKED, Outcome.OWNER_GONE: ReasonCode.OWNER_GONE,
          Outcome.DAEMON_STOPPED: ReasonCode.DAEMON_STOPPED,
          Outcome.CANCELLED: ReasonCode.CANCELLED}
_ENDED_WHY = {Outcome.OWNER_GONE: "the holder's connection closed while it held the region",
              Outcome.DAEMON_STOPPED: "the daemon stopped while the region was held",
              Outcome.CANCELLED: "its requester cancelled the acquire as it was granted",
              Outcome.REVOKED: "revoked"}


def _outcome_reasons(req: Request, outcome: Outcome, why: str | None) -> list[Reason]:
    """Why the region is not clean: from its job's mode and its end."""
    out = []
    if not req.exclusive:
        out.append(Reason(ReasonCode.NOT_EXCLUSIVE, "exclusivity: job runs in mode none",
                          {"mode": "none"}))
    if outcome in _ENDED:
        out.append(Reason(_ENDED[outcome], why or _ENDED_WHY[outcome],
                          {"max_hold_s": finite_or_none(req.max_hold_s)}
                          if outcome is Outcome.REVOKED else {}))
    return out
