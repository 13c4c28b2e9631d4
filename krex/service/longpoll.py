"""Long polls (``GET /v1/jobs/{id}?wait_s=N``) waiting at once: bounded, per tenant too.

Each waiting long poll holds a thread.  Past ``limit`` of them, or past half of that
for one tenant (so one tenant cannot take them all), a new one is refused at once
with 503 ``service_busy`` and ``Retry-After`` instead of queueing behind the others:
a client told to come back is better served than one whose wait silently begins
later than it asked.  Used on the event loop's thread only (no lock).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import anyio

from krex.errors import ServiceBusy

RETRY_S = 1.0


class LongPolls:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.per_tenant = max(1, limit // 2)
        self.threads = anyio.CapacityLimiter(limit)  # the threads they wait on
        self.waiting: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        total = sum(self.waiting.values())
        if total >= self.limit:
            raise ServiceBusy(f"{total} long polls are waiting already (at most "
                              f"{self.limit})", seconds=RETRY_S)
        if self.waiting[tenant] >= self.per_tenant:
            raise ServiceBusy(f"tenant {tenant!r} has {self.waiting[tenant]} long polls "
                              f"waiting already (at most {self.per_tenant} each)",
                              seconds=RETRY_S)
        self.waiting[tenant] += 1
        try:
            yield
        finally:
            self.waiting[tenant] -= 1
            if self.waiting[tenant] <= 0:
                del self.waiting[tenant]
