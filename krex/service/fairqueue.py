"""The service's queue of jobs: fair between tenants, first come first served within one.

One FIFO let a tenant that submitted 32 long jobs hold every runner while another
tenant's one job waited behind all of them.  Here the next job is the oldest of the
tenant with the fewest jobs running (ties: whose oldest queued job came first), so
another tenant's job waits at most until a runner frees: one job's time.  Within a
tenant, jobs run in the order they were submitted.

In: ``push(job_id, tenant)``; ``pop()`` when a runner is free, ``finished(tenant)`` when
its job ends; ``remove(job_id)`` for a cancelled queued job.  Not thread-safe: the job
store calls it under its lock.
"""

from __future__ import annotations

import collections
import itertools


class FairQueue:
    def __init__(self) -> None:
        self._queued: dict[str, collections.deque[tuple[int, str]]] = {}
        self._tenant_of: dict[str, str] = {}
        self._running: collections.Counter[str] = collections.Counter()
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._tenant_of)

    def push(self, job_id: str, tenant: str) -> None:
        self._queued.setdefault(tenant, collections.deque()).append((next(self._seq), job_id))
        self._tenant_of[job_id] = tenant

    def pop(self) -> str:
        """The next job to run (counted running for its tenant); the queue must not be
        empty."""
        tenant = min(self._queued, key=lambda t: (self._running[t], self._queued[t][0][0]))
        jobs = self._queued[tenant]
        _, job_id = jobs.popleft()
        if not jobs:
            del self._queued[tenant]
        del self._tenant_of[job_id]
        self._running[tenant] += 1
        return job_id

    def remove(self, job_id: str) -> None:
        """A queued job that will not run (cancelled)."""
        tenant = self._tenant_of.pop(job_id)
        jobs = self._queued[tenant]
        jobs.remove(next(item for item in jobs if item[1] == job_id))
        if not jobs:
            del self._queued[tenant]

    def finished(self, tenant: str) -> None:
        """A job that :meth:`pop` gave ended."""
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]

    def running(self) -> dict[str, int]:
        return dict(self._running)
