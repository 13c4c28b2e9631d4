"""What the service keeps in memory stays bounded over a long run of regions and jobs.

``benchmarks/bench_service_load.py`` saw the service grow by ~1 MiB/min: the node
watcher kept every region of its 10-minute timeline (~2 KB each, a few hundred a
minute) and every daemon job's pid it ever saw.  Here a watcher is fed far more
regions, jobs and results than its limits, all recent (so time does not trim
them): a second batch as large as the first must add next to nothing (traced
memory), and each structure sits at its limit — which also shows the feed was
large enough to pass it (the negative control: without a bound, the second
batch adds as much as the first).
"""

from __future__ import annotations

import collections
import json
import os
import time
import tracemalloc

import pytest

from krex.service import node
from krex.service.jobs import Job, JobStore
from krex.service.tenants import Quotas, Tenant

PER_POLL = node.REGIONS_PER_POLL


class FakeDaemon:
    """A daemon client that, at each poll, has run PER_POLL new ad-hoc jobs, each with
    one region just released."""

    def __init__(self) -> None:
        self.next = 1

    def __enter__(self) -> FakeDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _ids(self) -> range:
        return range(self.next, self.next + PER_POLL)

    def status(self) -> dict:
        return {"jobs": [{"job_id": i, "kind": "region", "owner_pid": 100000 + i}
                         for i in self._ids()]}

    def regions(self, limit: int) -> list[dict]:
        now_mono, now_wall = time.monotonic(), time.time()
        out = [{"region": i, "job_id": i, "label": f"r{i}", "tenant": f"t{i % 7}",
                "device": "cpu", "requested_mono_s": now_mono - 0.01,
                "granted_mono_s": now_mono - 0.005, "released_mono_s": now_mono,
                "requested_wall_s": now_wall - 0.01, "waited_s": 0.005, "held_s": 0.005,
                "clean": True, "reasons": []} for i in self._ids()]
        self.next += PER_POLL
        return out[-limit:]


def _batch(watcher: node.NodeWatcher, daemon: FakeDaemon, polls: int) -> None:
    for _ in range(polls):
        first = daemon.next
        for i in range(first, first + PER_POLL):  # each region's job result, as a bench's
            watcher.job_finished(Job(f"j{i}", "alice", "bench", {}), {"region_id": i})
        watcher.poll_once()


def test_the_node_watcher_stays_bounded_over_a_long_run():
    daemon = FakeDaemon()
    watcher = node.NodeWatcher(lambda: daemon, poll_s=1.0, timeline_s=3600.0)
    polls = 2 * max(node.MAX_REGIONS, node.MAX_REMEMBERED) // PER_POLL + 2
    tracemalloc.start()
    try:
        _batch(watcher, daemon, polls)  # fills every structure to its limit
        first = tracemalloc.get_traced_memory()[0]
        _batch(watcher, daemon, polls)  # as many again
        grew = tracemalloc.get_traced_memory()[0] - first
    finally:
        tracemalloc.stop()
    assert first > node.MAX_REGIONS * 300, first  # control: what it holds is counted
    assert len(watcher.regions) == node.MAX_REGIONS
    assert len(watcher._job_pids) <= node.MAX_REMEMBERED
    assert len(watcher._by_region) <= node.MAX_REMEMBERED
    per_region = 2000  # bytes a region dict takes here (~2 KB measured)
    assert grew < 0.05 * polls * PER_POLL * per_region, grew
    # The newest are what is kept: the latest regions, attributed to their jobs' tenant.
    newest = watcher.snapshot()["regions"][-1]
    assert newest["region"] == daemon.next - 1 and newest["tenant"] == "alice"


def _timeline_bytes(keep) -> float:
    """Traced bytes per region of a watcher fed MAX_REGIONS regions, kept by ``keep``."""
    daemon = FakeDaemon()
    watcher = node.NodeWatcher(lambda: daemon, poll_s=1.0, timeline_s=3600.0)
    tracemalloc.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(node, "_kept", keep)
            for _ in range(node.MAX_REGIONS // PER_POLL):
                watcher.poll_once()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(watcher.regions) == node.MAX_REGIONS // PER_POLL * PER_POLL
    return held / len(watcher.regions)


def test_the_node_timeline_keeps_regions_compactly():
    kept = node._kept
    compact = _timeline_bytes(kept)
    with_dicts = _timeline_bytes(lambda r: (*kept(r), r))  # control: the dict kept too
    # Per region: the timeline's tuple (~0.3 KB) and the job -> pid map's entry.
    assert compact < 600, compact
    assert with_dicts > 600 and with_dicts > 1.5 * compact, (with_dicts, compact)


def test_the_job_store_keeps_no_finished_job_in_memory(tmp_path):
    store = JobStore(str(tmp_path / "jobs.sqlite3"), {"noop": lambda job: {"ok": True}},
                     runners=2)
    tenant = Tenant("alice", Quotas(max_active_jobs=10_000, max_jobs_per_minute=100_000))
    try:
        jobs = [store.submit(tenant, "noop", {"n": i})[0] for i in range(1500)]
        for job in jobs[-20:]:
            assert store.wait("alice", job.id, 30).state == "succeeded"
        deadline = time.monotonic() + 30
        while store.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.stats()["active"] == {} and not store._live and not store._queue
        assert len(store.counters) <= 4, store.counters  # per kind and state, not per job
        assert store.counters["noop_succeeded"] == 1500  # control: they all ran
    finally:
        store.close()


# -- the daemon's finished regions -------------------------------------------------------

def _real_records(daemon, n: int) -> list[dict]:
    """``n`` region records as a real daemon keeps them (regions taken through it)."""
    import krex
    from krex.client.connection import Client

    for i in range(n):
        with krex.region("cpu", label=f"bound-{i}"):
            pass
    with Client(daemon.socket) as client:
        return client.regions(limit=n)


def _varied(templates: list[dict], i: int) -> tuple[int, int, dict]:
    """Region ``i``'s (seq, uid, record): a fresh dict, as ``RegionReport.record()``."""
    rec = {k: (list(v) if isinstance(v, list) else v)
           for k, v in templates[i % len(templates)].items()}
    rec.update(region=i, job_id=i // 3, label=f"candidate-{i}",
               waited_s=rec["waited_s"] + i * 1e-7, held_s=rec["held_s"] + i * 1e-7,
               requested_mono_s=1000.0 + i * 0.01)
    return i, os.getuid(), rec


def _traced(store, templates: list[dict], seqs: range) -> int:
    """Traced bytes that feeding ``store`` the records ``seqs`` left behind."""
    before = tracemalloc.get_traced_memory()[0]
    for i in seqs:
        store.append(_varied(templates, i))
    return tracemalloc.get_traced_memory()[0] - before


def test_the_daemons_finished_regions_stay_compact_and_bounded(daemon):
    from krex.daemon.finished import BLOCK, FinishedRegions

    templates = _real_records(daemon, 8)
    assert len(templates) == 8 and all("held_s" in r for r in templates)
    n = 16 * BLOCK
    first, second = range(1, n + 1), range(n + 1, 2 * n + 1)
    tracemalloc.start()
    try:
        store = FinishedRegions(max_records=n)
        filled = _traced(store, templates, first)
        grew = _traced(store, templates, second)
        ring: collections.deque = collections.deque(maxlen=n)  # the old form: dicts
        as_dicts = _traced(ring, templates, first)
    finally:
        tracemalloc.stop()
    compact = 200  # bytes a kept region may take (measured ≈ 63: arrays + zlib'd JSON)
    assert filled < n * compact, filled / n
    assert as_dicts > n * compact * 2, as_dicts / n  # control (≈ 780): dicts fail it
    assert grew < 0.1 * filled, (grew, filled)  # full: a second batch adds next to nothing
    assert n <= len(store) < n + 2 * BLOCK
    # What is kept is the newest, in order, and pages through as before.
    visible = {"all": lambda uid: True, "none": lambda uid: False}
    rows, before, got = [], None, 0
    while True:
        page, before = store.page(visible["all"], None, 500, before, 1 << 19)
        rows, got = page + rows, got + 1
        if before is None:
            break
    assert got > 1 and [r["region"] for r in rows] == list(second)[-len(rows):]
    assert rows[-1] == json.loads(json.dumps(_varied(templates, second[-1])[2]))
    assert store.page(visible["none"], None, 500, None, 1 << 19) == ([], None)
    last_job = second[-1] // 3
    mine, _ = store.page(visible["all"], [last_job], 500, None, 1 << 19)
    assert [r["region"] for r in mine] == [i for i in second if i // 3 == last_job]
