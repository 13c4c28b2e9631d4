"""Who gets a device next: pure logic, no syscalls, no clock of its own.

Every call takes ``now`` and returns a list of decisions (:class:`Grant`,
:class:`Revoke`, :class:`Cancel`) for the daemon to act on.  Per device
there is at most one exclusive holder.  Waiting jobs form a ring: the next
grant goes to the job after the one served last, so a job with many queued
regions cannot starve others (round-robin between jobs, FIFO within a job).
A region is revoked when it outlives its maximum hold; a queued request is
cancelled when its wait timeout passes.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field


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
    granted_mono_s: float | None = None
    nested: bool = False
    revoked: bool = False
    jobs_served_while_waiting: int = field(default=0)

    @property
    def deadline(self) -> float:
        if self.granted_mono_s is None:
            return self.requested_mono_s + self.timeout_s
        return self.granted_mono_s + self.max_hold_s


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
class DeviceQueue:
    holder: Request | None = None
    ring: OrderedDict[int, deque[Request]] = field(default_factory=OrderedDict)

    def waiting(self) -> Iterator[Request]:
        for q in self.ring.values():
            yield from q


class Scheduler:
    """Per-device exclusive grants, fair across jobs."""

    def __init__(self) -> None:
        self.devices: dict[str, DeviceQueue] = {}
        self.live: dict[int, Request] = {}

    def queue(self, device: str) -> DeviceQueue:
        return self.devices.setdefault(device, DeviceQueue())

    def submit(self, req: Request, now: float) -> list[Decision]:
        self.live[req.region] = req
        dq = self.queue(req.device)
        if not req.exclusive or self._inside_whole_job_hold(dq, req):
            req.nested = req.exclusive
            req.granted_mono_s = now
            return [Grant(req)]
        dq.ring.setdefault(req.job_id, deque()).append(req)
        return self._dispatch(dq, now)

    def release(self, region: int, now: float) -> list[Decision]:
        req = self.live.pop(region, None)
        if req is None:
            return []
        return self._remove(req, now)

    def drop_owner(self, owner: Hashable, now: float) -> list[Decision]:
        """The owner's connection is gone: its held and queued regions end now."""
        gone = [r for r in self.live.values() if r.owner == owner]
        gone.sort(key=lambda r: r.granted_mono_s is not None)  # waiters first: none gets granted
        out: list[Decision] = []
        for req in gone:
            out.extend(self.release(req.region, now))
        return out

    def expire(self, now: float) -> list[Decision]:
        """Revoke holders past their maximum hold; cancel waiters past their timeout."""
        out: list[Decision] = []
        for req in list(self.live.values()):
            if req.deadline > now or req.revoked:
                continue
            if req.granted_mono_s is None:
                self.live.pop(req.region)
                out.append(Cancel(req, f"not granted within {req.timeout_s:g} s"))
                out.extend(self._remove(req, now))
            elif not req.nested and req.exclusive:
                req.revoked = True
                out.append(Revoke(req, f"held longer than its maximum of {req.max_hold_s:g} s"))
                out.extend(self._remove(req, now))
        return out

    def next_deadline(self) -> float:
        pending = [r.deadline for r in self.live.values() if not r.revoked and not r.nested]
        return min(pending, default=math.inf)

    def _inside_whole_job_hold(self, dq: DeviceQueue, req: Request) -> bool:
        h = dq.holder
        return h is not None and h.whole_job and h.job_id == req.job_id and not req.whole_job

    def _remove(self, req: Request, now: float) -> list[Decision]:
        dq = self.queue(req.device)
        if dq.holder is req:
            dq.holder = None
            return self._dispatch(dq, now)
        q = dq.ring.get(req.job_id)
        if q is not None and req in q:
            q.remove(req)
            if not q:
                del dq.ring[req.job_id]
        return []

    def _dispatch(self, dq: DeviceQueue, now: float) -> list[Decision]:
        if dq.holder is not None or not dq.ring:
            return []
        job_id, q = next(iter(dq.ring.items()))
        req = q.popleft()
        if q:
            dq.ring.move_to_end(job_id)
        else:
            del dq.ring[job_id]
        for other in dq.waiting():
            if other.job_id != job_id:
                other.jobs_served_while_waiting += 1
        req.granted_mono_s = now
        dq.holder = req
        out: list[Decision] = [Grant(req)]
        # Regions of this job that wait behind a whole-job hold are nested in it.
        if req.whole_job:
            for waiting in list(dq.ring.get(job_id, ())):
                out.extend(self._nest(dq, waiting, now))
        return out

    def _nest(self, dq: DeviceQueue, req: Request, now: float) -> list[Decision]:
        dq.ring[req.job_id].remove(req)
        if not dq.ring[req.job_id]:
            del dq.ring[req.job_id]
        req.nested = True
        req.granted_mono_s = now
        return [Grant(req)]
