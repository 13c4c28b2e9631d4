"""Tenants and their quotas: pure bookkeeping, no syscalls, no clock of its own.

A *tenant* is whoever a device's region time is shared between and whose
quotas apply: ``uid:N`` for a local client (its ``SO_PEERCRED`` uid), or an id
a trusted peer (root, the daemon's own uid: the HTTP/MCP service) passes on
behalf of an API token.  :class:`Quota` is what one tenant may use: jobs at
once, region-seconds in any minute, one region's hold.  :class:`Ledger`
counts region-seconds per tenant over the last minute and answers, for a
tenant over its budget, how long until it is under again.
"""

from __future__ import annotations

import math
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from krex.errors import BadRequest, QuotaExceeded

_TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+=-]{0,127}")
WINDOW_S = 60.0


def uid_tenant(uid: int) -> str:
    """The tenant of a local client."""
    return f"uid:{uid}"


def checked_tenant(text: str) -> str:
    """A tenant id a trusted peer passed, validated (1-128 printable id characters)."""
    if not _TENANT_ID.fullmatch(text):
        raise BadRequest(f"tenant id {text[:40]!r} is not valid: 1-128 characters of "
                         "letters, digits and ._:@/+=-, starting with a letter or digit")
    return text


@dataclass(frozen=True)
class Quota:
    """Per-tenant limits; ``None``: unlimited."""

    max_jobs: int | None = None  # jobs at once (workers are the daemon's, not counted)
    region_s_per_min: float | None = None  # region-seconds held in any 60 s
    max_hold_s: float | None = None  # one region's maximum hold

    def check_jobs(self, tenant: str, jobs_now: int) -> None:
        if self.max_jobs is not None and jobs_now >= self.max_jobs:
            raise QuotaExceeded(
                f"tenant {tenant} already runs {jobs_now} jobs, its quota of concurrent jobs",
                hint="end one of your jobs first, or ask the node's operator for a larger "
                     "quota (krex serve --tenant-max-jobs)")

    def hold(self, tenant: str, asked_s: float | None, ceiling_s: float) -> float:
        """The maximum hold a region gets: what it asked, within the daemon's ceiling
        and this quota.  Asking for more than the quota is an error, not a cap."""
        limit = self.max_hold_s
        if limit is not None and asked_s is not None and asked_s > limit:
            raise QuotaExceeded(
                f"tenant {tenant} asked for a {asked_s:g} s hold; its quota is {limit:g} s",
                seconds=None, hint=f"ask for max_hold_s <= {limit:g}")
        asked = asked_s if asked_s is not None else ceiling_s
        return min(asked, ceiling_s, limit if limit is not None else math.inf)


class _Spans:
    """One tenant's ended regions, (start, end) in order of their ends: two arrays of
    floats (16 B a span, not a tuple of two float objects) and the index of the
    first one still kept."""

    __slots__ = ("starts", "ends", "first")

    def __init__(self) -> None:
        self.starts, self.ends, self.first = array("d"), array("d"), 0

    def add(self, start: float, end: float) -> None:
        self.starts.append(start)
        self.ends.append(end)

    def drop_ended(self, by: float) -> None:
        """Let go of the spans that ended at or before ``by``."""
        i, n = self.first, len(self.ends)
        while i < n and self.ends[i] <= by:
            i += 1
        self.first = i
        if i >= 64 and 2 * i >= n:  # the arrays shrink once half of them is let go
            del self.starts[:i], self.ends[:i]
            self.first = 0

    def __len__(self) -> int:
        return len(self.ends) - self.first

    def __iter__(self) -> Iterator[tuple[float, float]]:
        return zip(self.starts[self.first:], self.ends[self.first:], strict=True)


class Ledger:
    """Region-seconds per tenant in the last :data:`WINDOW_S` seconds.

    It keeps the spans that end inside the window and no others: a span is let go
    as its tenant's next one ends, and every tenant's at least once a window.
    (Trimmed only when a quota or a status asked, a daemon without quotas kept one
    span per region for ever: ≈ 0.2 MiB a minute under the service's load.)"""

    def __init__(self) -> None:
        self._done: dict[str, _Spans] = {}
        self._open: dict[int, tuple[str, float]] = {}  # region -> (tenant, start)
        self._swept = -math.inf

    def start(self, tenant: str, region: int, now: float) -> None:
        self._open[region] = (tenant, now)

    def end(self, region: int, now: float) -> None:
        opened = self._open.pop(region, None)
        if opened is not None:
            tenant, start = opened
            spans = self._done.get(tenant)
            if spans is None:
                spans = self._done[tenant] = _Spans()
            spans.add(start, now)
            self._forget(tenant, now)
        if now - self._swept >= WINDOW_S:  # tenants that stopped asking
            self._swept = now
            for tenant in list(self._done):
                self._forget(tenant, now)

    def spans(self) -> int:
        """Spans kept (for tests and status)."""
        return sum(len(d) for d in self._done.values())

    def used(self, tenant: str, now: float) -> float:
        """Seconds of the tenant's regions inside ``[now - 60 s, now]``."""
        self._forget(tenant, now)
        return self._used(tenant, now)

    def _used(self, tenant: str, now: float) -> float:
        since = now - WINDOW_S
        done = sum(min(e, now) - max(s, since) for s, e in self._done.get(tenant, ()) if e > since)
        held = sum(now - max(s, since) for t, s in self._open.values() if t == tenant)
        return max(0.0, done + held)

    def check(self, tenant: str, budget_s: float | None, now: float) -> None:
        """Refuse a new region when the tenant has used its budget in the last minute."""
        if budget_s is None:
            return
        used = self.used(tenant, now)
        if used < budget_s:
            return
        wait = self._under_budget_in(tenant, budget_s, now)
        raise QuotaExceeded(
            f"tenant {tenant} held regions for {used:.1f} s in the last minute, its quota "
            f"of {budget_s:g} region-seconds per minute",
            seconds=None if math.isinf(wait) else round(wait, 3),
            hint="retry after `seconds` (regions held now count until they end), or ask the "
                 "node's operator for a larger quota (krex serve --tenant-region-s-per-min)")

    def _under_budget_in(self, tenant: str, budget_s: float, now: float) -> float:
        """How long, with no new region, until the tenant is under budget (inf while one
        of its regions is held: that one keeps counting)."""
        if any(t == tenant for t, _ in self._open.values()):
            return math.inf
        lo, hi = 0.0, WINDOW_S
        for _ in range(30):  # used() only falls as time passes: bisect
            mid = (lo + hi) / 2
            if self._used(tenant, now + mid) < budget_s:
                hi = mid
            else:
                lo = mid
        return hi

    def _forget(self, tenant: str, now: float) -> None:
        spans = self._done.get(tenant)
        if spans is not None:
            spans.drop_ended(now - WINDOW_S)
            if not spans:
                del self._done[tenant]
