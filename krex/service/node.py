"""The node daemon, watched: its status and its recent regions, attributed to tenants.

A thread reads the daemon's ``status`` and its finished regions (``regions``)
every ``node_poll_s`` — what the daemon exposes to any client, nothing of its
internals.  Regions are kept for ``timeline_s`` (the node page's timeline),
at most :data:`MAX_REGIONS` of them, each as a tuple of the fields the page shows
(:data:`KEPT`), and handed to the metrics once.  What
the watcher remembers is bounded by count, not only by time: at a few hundred
regions a minute a 10-minute timeline alone grew the service by ~1 MiB/min
(``benchmarks/bench_service_load.py``); the daemon's job → pid map and the
region → tenant map keep their newest :data:`MAX_REMEMBERED` entries, and exec
runs, like daemon jobs no status lists any more, are kept :data:`RUN_KEEP_S` after
they end (``tests/test_service_memory.py``).

Attribution: a region belongs to a tenant when the service knows it — an
evaluation's regions by their ids, an exec's by its worker's pid and the
program's run (``started_mono_s`` … ``ended_mono_s``) — else by the tenant the
daemon's record names (the service runs each job as its tenant), other than
the daemon's default ``uid:N``.  Regions not
attributed within ``ATTRIBUTION_S`` of their end are ``local`` (not the
service's).
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from krex.errors import KrexError
from krex.service.jobs import Job

ATTRIBUTION_S = 10.0  # how long a finished region waits for its job's result
REGIONS_PER_POLL = 256  # the newest regions read per poll (the daemon keeps its last N)
LOCAL = "local"
MAX_REGIONS = 3000  # the timeline's regions, newest kept (~0.3 KB each as a tuple)
# What the timeline keeps of a region (a tuple in this order, not the daemon's dict of
# ~20 fields: ≈ 0.3 KB instead of 1-2 KB; ``tests/test_service_memory.py``).
KEPT = ("region", "device", "job", "tenant", "requested_mono_s", "requested_wall_s",
        "waited_s", "held_s", "frozen_s", "clean", "reasons", "label")
_WALL = KEPT.index("requested_wall_s")
MAX_REMEMBERED = 5000  # daemon job -> pid, region -> tenant: newest entries kept
# An exec's run is looked up only by regions that end before it and are read within
# ATTRIBUTION_S after their end: older runs are let go (at ~400 execs a minute a 5000-run
# ring held ~0.7 MiB and took 13 minutes to fill; docs/notes/service-memory.md).
RUN_KEEP_S = 3 * ATTRIBUTION_S


class NodeWatcher:
    def __init__(self, connect: Callable[[], Any], poll_s: float = 1.0,
                 timeline_s: float = 600.0,
                 on_region: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.connect = connect  # -> a krex Client (autostart as configured)
        self.poll_s = poll_s
        self.timeline_s = timeline_s
        self.on_region = on_region
        self._lock = threading.Lock()
        self.status: dict[str, Any] | None = None
        self.error: str | None = None
        self.regions: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=MAX_REGIONS)
        self._pending: list[dict[str, Any]] = []
        self._last_region = 0
        # daemon job id -> (its process: a worker's pid, when a status last listed it)
        self._job_pids: dict[int, tuple[int, float]] = {}
        self._by_region: dict[int, str] = {}
        self._runs: collections.deque[tuple[int, float, float, str]] = collections.deque(
            maxlen=5000)  # (worker pid, started, ended, tenant) of exec jobs
        self.evaluations: collections.deque[dict[str, Any]] = collections.deque(maxlen=50)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="krex-service-node",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    # -- what the jobs tell ----------------------------------------------------------

    def job_finished(self, job: Job, result: dict[str, Any]) -> None:
        with self._lock:
            if job.kind == "exec" and result.get("started_mono_s") is not None:
                self._runs.append((int(result.get("worker_pid") or 0),
                                   float(result["started_mono_s"]),
                                   float(result.get("ended_mono_s") or time.monotonic()),
                                   job.tenant))
            if result.get("region_id") is not None:
                self._by_region[int(result["region_id"])] = job.tenant
            if job.kind == "evaluate":
                self.evaluations.appendleft({**result, "tenant": job.tenant, "job": job.id,
                                             "ended_wall_s": time.time()})

    # -- reading ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"status": self.status, "error": self.error,
                    "regions": [dict(zip(KEPT, r, strict=False)) for r in self.regions],
                    "evaluations": list(self.evaluations)}

    def poll_once(self) -> None:
        try:
            with self.connect() as client:
                status = client.status()
                fresh = [r for r in client.regions(limit=REGIONS_PER_POLL)
                         if int(r.get("region") or 0) > self._last_region]
        except KrexError as exc:
            with self._lock:
                self.error = f"{exc.message} ({exc.hint})" if exc.hint else exc.message
            return
        with self._lock:
            self.status, self.error, seen = status, None, time.monotonic()
            for j in status.get("jobs", []):
                jid = int(j["job_id"])
                self._job_pids.pop(jid, None)  # a live job stays among the newest
                self._job_pids[jid] = (int(j.get("root_pid") or j.get("owner_pid") or 0), seen)
            if fresh:
                self._last_region = max(int(r.get("region") or 0) for r in fresh)
            self._pending.extend(fresh)
            ready = self._attribute_locked()
            self._trim_locked()
        for region in ready:
            if self.on_region is not None:
                self.on_region(region)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_s)

    def _attribute_locked(self) -> list[dict[str, Any]]:
        now, ready, waiting = time.monotonic(), [], []
        for r in self._pending:
            tenant = self._tenant_locked(r)
            ended = r.get("released_mono_s") or r.get("granted_mono_s") or now
            if tenant is None and now - ended < ATTRIBUTION_S:
                waiting.append(r)
                continue
            r = {**r, "tenant": tenant or LOCAL,
                 "requested_wall_s": r.get("requested_wall_s") or _wall(r, now)}
            self.regions.append(_kept(r))
            ready.append(r)
        self._pending = waiting
        return ready

    def _tenant_locked(self, r: dict[str, Any]) -> str | None:
        found = self._by_region.pop(int(r.get("region") or 0), None)
        if found:
            return found
        pid = self._job_pids.get(int(r.get("job_id") or 0), (0, 0.0))[0]
        at = r.get("requested_mono_s")
        if pid and at is not None:
            for wpid, start, end, tenant in reversed(self._runs):
                if wpid == pid and start <= at <= end:
                    return tenant
        named = str(r.get("tenant") or "")
        # The daemon names every region's tenant; ``uid:N`` is only its default (the
        # peer's uid — the service's own for its workers), so it does not tell.
        if named and not named.startswith("uid:"):
            return named
        return None

    def _trim_locked(self) -> None:
        horizon = time.time() - self.timeline_s
        while self.regions and (self.regions[0][_WALL] or 0) < horizon:
            self.regions.popleft()
        ended = time.monotonic() - RUN_KEEP_S
        while self._runs and self._runs[0][2] < ended:
            self._runs.popleft()
        # A job no status has listed for RUN_KEEP_S has no region left to attribute (the
        # dict is in last-seen order).  By count alone, the ad-hoc jobs of a few hundred
        # execs a minute took the map to its limit only after a quarter hour.
        while self._job_pids and next(iter(self._job_pids.values()))[1] < ended:
            del self._job_pids[next(iter(self._job_pids))]
        for memo in (self._job_pids, self._by_region):
            _keep_newest(memo, MAX_REMEMBERED)

    # -- views --------------------------------------------------------------------------

    def summary(self, seconds: float = 300.0) -> dict[str, Any]:
        """What the node page shows: devices and holders, queues, workers, the timeline,
        recent evaluations, each tenant's share of region time."""
        snap = self.snapshot()
        st = snap["status"] or {}
        now_wall, now_mono = time.time(), time.monotonic()
        regions = [r for r in snap["regions"]
                   if (r.get("requested_wall_s") or 0) >= now_wall - seconds]
        return {"daemon_error": snap["error"], "devices": _devices(st),
                "timeline": [_bar(r, now_mono) for r in regions],
                "shares": shares(regions), "evaluations": snap["evaluations"][:20],
                "counters": st.get("counters", {}), "now_wall_s": now_wall}


def _kept(r: dict[str, Any]) -> tuple[Any, ...]:
    """The timeline's compact form of a region record (names shared, reasons as codes)."""
    out = [r.get(k) for k in KEPT]
    for i in (1, 2, 3):  # device, job, tenant: few distinct names
        name = out[i]
        if isinstance(name, str):
            out[i] = sys.intern(name)
    out[KEPT.index("reasons")] = tuple(reason_codes(r))
    return tuple(out)


def _keep_newest(memo: dict[int, Any], limit: int) -> None:
    """Drop the oldest entries (dicts keep insertion order) until ``limit`` are left."""
    for key in list(itertools.islice(memo, max(0, len(memo) - limit))):
        del memo[key]


def _wall(r: dict[str, Any], now_mono: float) -> float:
    """When the region was asked for, in Unix time: the daemon's records carry its
    ``time.monotonic()``, the same clock as ours on one node."""
    asked = r.get("requested_mono_s")
    return time.time() - (now_mono - float(asked)) if asked is not None else time.time()


def _devices(st: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for dev in st.get("devices", []):
        name = dev["name"]
        sched = (st.get("scheduler") or {}).get(name, {})
        pool = (st.get("pools") or {}).get(name, {})
        out.append({"name": name, "description": dev.get("description"),
                    "holder": sched.get("holder"), "queue": sched.get("queue", []),
                    "workers": len(pool.get("workers", [])),
                    "busy": sum(bool(w.get("busy")) for w in pool.get("workers", [])),
                    "recycles": pool.get("recycles", {})})
    return out


def _bar(r: dict[str, Any], now_mono: float) -> dict[str, Any]:
    """One region on the timeline: seconds ago it was asked for, waited, held."""
    asked = r.get("requested_mono_s") or now_mono
    reasons = reason_codes(r)
    return {"region": r.get("region"), "device": r.get("device"), "job": r.get("job"),
            "tenant": r.get("tenant"), "ago_s": round(now_mono - asked, 3),
            "waited_s": r.get("waited_s", 0.0), "held_s": r.get("held_s", 0.0),
            "frozen_s": r.get("frozen_s"), "clean": r.get("clean"), "reasons": reasons,
            "label": r.get("label")}


def reason_codes(r: dict[str, Any]) -> list[str]:
    """Why a region was not clean: its reasons' codes (a record lists codes or objects)."""
    return [str(x.get("code") if isinstance(x, dict) else x) for x in r.get("reasons") or []]


def shares(regions: list[dict[str, Any]]) -> dict[str, float]:
    """Each tenant's fraction of the region time held in ``regions``."""
    held: collections.defaultdict[str, float] = collections.defaultdict(float)
    for r in regions:
        held[str(r.get("tenant") or LOCAL)] += float(r.get("held_s") or 0.0)
    total = sum(held.values())
    return {t: (h / total if total else 0.0) for t, h in sorted(held.items())}
