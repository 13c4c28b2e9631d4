"""Who gets a device next: pure logic, no syscalls, no clock of its own.

Every call takes ``now`` and returns a list of decisions (:class:`Grant`,
:class:`Revoke`, :class:`Cancel`) for the daemon to act on.  Per device
there is at most one exclusive holder.

Order.  Waiting requests are grouped by *tenant* (an agent: a uid, or a
tenant id a trusted service passes), then by job, then FIFO.  The next grant
goes to the waiting tenant that has held the device least (its region
seconds, charged at release; a tenant that comes back after idling more than
``idle_s`` starts level with the tenants active now, so idling banks
nothing), then to that tenant's job served least recently (round-robin,
whatever order the requests came in: a job that asks again the instant it
releases does not go first), FIFO within a job.  A tenant with ten jobs gets
one share, not ten.

Fair window.  Freezing replaces queueing: a job frozen by another job's
region cannot ask for the device, so a job that releases and asks again at
once would be granted again before the jobs it froze could ask.  After a
release, the jobs that were frozen through it (and that take regions on this
device) get a bounded window, ``window_s``: no grant is made until each of
them has asked or the window has passed; then the order above decides.  A
job that lets ``max_misses`` windows in a row pass without asking is not
waited for again until it asks.

Holds.  The daemon calls :meth:`Scheduler.started` when a grant's
enforcement is in place: the maximum hold counts from then.  A region held
past it is revoked (:class:`Revoke`); it stays the holder until the daemon
has undone its enforcement and calls :meth:`Scheduler.release`.  A queued
request is cancelled when its wait timeout passes.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 0.02
DEFAULT_MAX_MISSES = 2
DEFAULT_IDLE_S = 5.0


@dataclass(eq=False)
class Request:
    region: int
    job_id: int
    device: str
    owner: Hashable
    requested_mono_s: float
    max_hold_s: float = math.inf
    timeout_s: float = math.inf
    exclusive: bool = True
    whole_job: bool = False
    label: str | None = None
    tenant: Hashable = None  # None: the job is a tenant of its own
    granted_mono_s: float | None = None  # chosen by the scheduler
    started_mono_s: float | None = None  # enforcement in place: the hold's clock runs
    nested: bool = False
    revoked: bool = False
    jobs_served_while_waiting: int = field(default=0)

    @property
    def share(self) -> Hashable:
        """Whose share of the device this request uses."""
        return self.tenant if self.tenant is not None else ("job", self.job_id)

    @property
    def deadline(self) -> float:
        if self.granted_mono_s is None:
            return self.requested_mono_s + self.timeout_s
        if self.started_mono_s is None:
            return math.inf  # enforcement is being set up: its own timeouts bound it
        return self.started_mono_s + self.max_hold_s


@dataclass(frozen=True)
class Grant:
    request: Request


@dataclass(frozen=True)
class Revoke:
    request: Request
    reason: str


@dataclass(frozen=True)
class Cancel:
    request: Request
    reason: str


Decision = Grant | Revoke | Cancel


@dataclass
class Window:
    """After a release: no grant until these jobs have asked, or ``until``."""

    until: float
    waiting_for: set[int]


@dataclass
class DeviceQueue:
    holder: Request | None = None
    # tenant -> job -> FIFO of requests; both levels in round-robin order
    shares: OrderedDict[Hashable, OrderedDict[int, deque[Request]]] = field(
        default_factory=OrderedDict)
    usage: dict[Hashable, float] = field(default_factory=dict)  # region seconds per tenant
    last_active: dict[Hashable, float] = field(default_factory=dict)  # tenant -> last release
    window: Window | None = None
    misses: dict[int, int] = field(default_factory=dict)  # jobs that ask here -> windows missed
    served: dict[int, int] = field(default_factory=dict)  # job -> the turn it was last granted
    share_of: dict[int, Hashable] = field(default_factory=dict)  # job -> its tenant, last seen
    turns: int = 0

    def waiting(self) -> Iterator[Request]:
        for jobs in self.shares.values():
            for q in jobs.values():
                yield from q

    def queued_jobs(self) -> set[int]:
        return {job for jobs in self.shares.values() for job in jobs}


class Scheduler:
    """Per-device exclusive grants, fair across tenants and across a tenant's jobs."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S,
                 max_misses: int = DEFAULT_MAX_MISSES, idle_s: float = DEFAULT_IDLE_S) -> None:
        self.devices: dict[str, DeviceQueue] = {}
        self.live: dict[int, Request] = {}
        self.window_s = window_s
        self.max_misses = max_misses
        self.idle_s = idle_s

    def queue(self, device: str) -> DeviceQueue:
        return self.devices.setdefault(device, DeviceQueue())

    # -- requests --------------------------------------------------------------------

    def submit(self, req: Request, now: float) -> list[Decision]:
        self.live[req.region] = req
        dq = self.queue(req.device)
        if not req.exclusive or self._inside_whole_job_hold(dq, req):
            req.nested = req.exclusive
            req.granted_mono_s = now
            return [Grant(req)]
        self._enqueue(dq, req, now)
        dq.misses[req.job_id] = 0
        if dq.window is not None:
            dq.window.waiting_for.discard(req.job_id)
            if dq.window.waiting_for and dq.window.until > now:
                return []
            self._close_window(dq)
        return self._dispatch(dq, now)

    def started(self, region: int, now: float) -> None:
        """The grant's enforcement is in place: its maximum hold counts from ``now``."""
        req = self.live.get(region)
        if req is not None and req.granted_mono_s is not None and req.started_mono_s is None:
            req.started_mono_s = now

    def claimed(self, region: int, now: float, max_hold_s: float) -> None:
        """A re-queued region granted before its job asked is claimed: its maximum hold
        (until now the claim window) counts from ``now``; the time held unclaimed stays
        charged to its tenant."""
        req = self.live.get(region)
        if req is None:
            return
        held = now - req.started_mono_s if req.started_mono_s is not None else 0.0
        req.max_hold_s = max_hold_s + held

    def release(self, region: int, now: float, frozen: Iterable[int] = (),
                served: Iterable[int] = ()) -> list[Decision]:
        """End a region (held, revoked or still queued).  ``frozen``: the jobs its
        enforcement froze; they get the fair window before the next grant.
        ``served``: those of them that held the device earlier in the same handoff
        chain (frozen since their own release, handed over without a thaw): the window
        does not wait for one that would not be picked first if it asked (its tenant
        used the device more than the next queued tenant, or it is of that tenant and
        was served after the job it would pick); otherwise it waits as for any other."""
        req = self.live.pop(region, None)
        if req is None:
            return []
        dq = self.queue(req.device)
        if dq.holder is not req:
            self._unqueue(dq, req)
            return []
        dq.holder = None
        held_from = req.started_mono_s if req.started_mono_s is not None else now
        dq.usage[req.share] = dq.usage.get(req.share, 0.0) + max(0.0, now - held_from)
        dq.last_active[req.share] = now
        self._open_window(dq, req, set(frozen), now, set(served))
        if dq.window is not None:
            return []
        return self._dispatch(dq, now)

    def drop_owner(self, owner: Hashable, now: float) -> list[Decision]:
        """The owner's connection is gone: its held and queued regions end now."""
        gone = [r for r in self.live.values() if r.owner == owner]
        gone.sort(key=lambda r: r.granted_mono_s is not None)  # waiters first: none gets granted
        out: list[Decision] = []
        for req in gone:
            out.extend(self.release(req.region, now))
        return out

    def forget_job(self, job_id: int, now: float) -> list[Decision]:
        """The job ended: windows stop waiting for it."""
        out: list[Decision] = []
        for dq in self.devices.values():
            dq.misses.pop(job_id, None)
            dq.served.pop(job_id, None)
            if dq.window is not None and job_id in dq.window.waiting_for:
                dq.window.waiting_for.discard(job_id)
                if not dq.window.waiting_for:
                    dq.window = None
                    out.extend(self._dispatch(dq, now))
        return out

    def expire(self, now: float) -> list[Decision]:
        """Revoke holders past their maximum hold; cancel waiters past their timeout;
        close fair windows that have passed."""
        out: list[Decision] = []
        for req in list(self.live.values()):
            if req.deadline > now or req.revoked:
                continue
            if req.granted_mono_s is None:
                self.live.pop(req.region)
                self._unqueue(self.queue(req.device), req)
                out.append(Cancel(req, f"not granted within {req.timeout_s:g} s"))
            elif not req.nested and req.exclusive:
                req.revoked = True
                out.append(Revoke(req, f"held longer than its maximum of {req.max_hold_s:g} s"))
        for dq in self.devices.values():
            if dq.window is not None and dq.window.until <= now:
                self._close_window(dq)
                out.extend(self._dispatch(dq, now))
        return out

    def next_deadline(self) -> float:
        """When :meth:`expire` next has something to do (``inf``: nothing pending).

        Holds that cannot be revoked (nested, not exclusive, revoked already,
        or still being set up) have no deadline, so a caller that sleeps until
        the deadline never wakes for them again and again."""
        pending = [r.deadline for r in self.live.values()
                   if not r.revoked and not r.nested and r.exclusive]
        pending += [dq.window.until for dq in self.devices.values() if dq.window is not None]
        return min(pending, default=math.inf)

    # -- order -----------------------------------------------------------------------

    def _inside_whole_job_hold(self, dq: DeviceQueue, req: Request) -> bool:
        h = dq.holder
        return h is not None and h.whole_job and h.job_id == req.job_id and not req.whole_job

    def _enqueue(self, dq: DeviceQueue, req: Request, now: float) -> None:
        share = req.share
        if share not in dq.shares:
            if now - dq.last_active.get(share, -math.inf) > self.idle_s:
                active = self._active_usage(dq, now)
                if active:  # coming back after idling banks no credit
                    dq.usage[share] = max(dq.usage.get(share, 0.0), min(active))
            dq.shares[share] = OrderedDict()
        dq.shares[share].setdefault(req.job_id, deque()).append(req)

    def _active_usage(self, dq: DeviceQueue, now: float) -> list[float]:
        """Usage of the tenants queued, holding, or active within ``idle_s``."""
        active = set(dq.shares)
        active.update(t for t, at in dq.last_active.items() if now - at <= self.idle_s)
        if dq.holder is not None:
            active.add(dq.holder.share)
        return [dq.usage.get(t, 0.0) for t in active]

    def _close_window(self, dq: DeviceQueue) -> None:
        assert dq.window is not None
        for job in dq.window.waiting_for:
            dq.misses[job] = dq.misses.get(job, 0) + 1
        dq.window = None

    def _unqueue(self, dq: DeviceQueue, req: Request) -> None:
        jobs = dq.shares.get(req.share)
        q = jobs.get(req.job_id) if jobs is not None else None
        if jobs is None or q is None or req not in q:
            return
        q.remove(req)
        if not q:
            del jobs[req.job_id]
            if not jobs:
                del dq.shares[req.share]

    def _open_window(self, dq: DeviceQueue, released: Request, frozen: set[int],
                     now: float, served: set[int] | None = None) -> None:
        if self.window_s <= 0 or not frozen:
            return
        queued = dq.queued_jobs()
        skip = {j for j in served or () if queued and not self._would_go_first(dq, j)}
        waiting_for = {j for j in frozen
                       if j != released.job_id and j not in queued and j not in skip
                       and dq.misses.get(j, self.max_misses) < self.max_misses}
        if waiting_for:
            dq.window = Window(now + self.window_s, waiting_for)

    def _would_go_first(self, dq: DeviceQueue, job_id: int) -> bool:
        """Whether ``job_id``, had it asked, might be picked before every queued job:
        its tenant has used the device no more than the next tenant, and (same tenant)
        it was not served after the job that tenant would pick."""
        share = dq.share_of.get(job_id)
        best = min(dq.shares, key=lambda t: dq.usage.get(t, 0.0))
        if share is None or dq.usage.get(share, 0.0) < dq.usage.get(best, 0.0):
            return True
        if share != best:
            return dq.usage.get(share, 0.0) <= dq.usage.get(best, 0.0)
        first = min(dq.shares[best], key=lambda j: dq.served.get(j, 0))
        return dq.served.get(job_id, 0) <= dq.served.get(first, 0)

    def next_job(self, device: str) -> int | None:
        """The job whose request :meth:`_pick` would grant next on ``device`` if the
        holder released now (no state changes; a prediction: requests may still come)."""
        dq = self.devices.get(device)
        if dq is None or not dq.shares:
            return None
        share = min(dq.shares, key=lambda t: dq.usage.get(t, 0.0))
        return min(dq.shares[share], key=lambda j: dq.served.get(j, 0))

    def _pick(self, dq: DeviceQueue) -> Request:
        share = min(dq.shares, key=lambda t: dq.usage.get(t, 0.0))  # first of equals: RR
        jobs = dq.shares[share]
        job_id = min(jobs, key=lambda j: dq.served.get(j, 0))  # first of equals: asked first
        q = jobs[job_id]
        req = q.popleft()
        dq.turns += 1
        dq.served[job_id] = dq.turns
        dq.share_of[job_id] = share
        if not q:
            del jobs[job_id]
        if jobs:
            dq.shares.move_to_end(share)
        else:
            del dq.shares[share]
        return req

    def _dispatch(self, dq: DeviceQueue, now: float) -> list[Decision]:
        if dq.holder is not None or not dq.shares or dq.window is not None:
            return []
        req = self._pick(dq)
        for other in dq.waiting():
            if other.job_id != req.job_id:
                other.jobs_served_while_waiting += 1
        req.granted_mono_s = now
        dq.holder = req
        out: list[Decision] = [Grant(req)]
        # Regions of this job that wait behind a whole-job hold are nested in it.
        if req.whole_job:
            for waiting in [r for r in dq.waiting() if r.job_id == req.job_id]:
                self._unqueue(dq, waiting)
                waiting.nested = True
                waiting.granted_mono_s = now
                out.append(Grant(waiting))
        return out
