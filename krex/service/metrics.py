"""``/metrics``: Prometheus text from what the daemon exposes and what the service did.

Counters and histograms are fed once per region by the node watcher (regions
granted, wait / frozen / hold per device and tenant, not-clean regions by
reason code); gauges are read at scrape time from the daemon's last status
(worker pool size, recycles, queues, holders) and from the job store (jobs
by kind, state, verdict).  A private registry: nothing global.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from krex.service.jobs import JobStore
from krex.service.longpoll import LongPolls
from krex.service.node import NodeWatcher, reason_codes

BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
             30, 60)


class Metrics:
    def __init__(self, jobs: JobStore, node: NodeWatcher) -> None:
        self.registry = CollectorRegistry()
        self.jobs = jobs
        self.node = node
        self.long_polls: LongPolls | None = None  # the service's, once it has them
        labels = ["device", "tenant"]
        self.granted = Counter("krex_regions_granted", "Regions granted and finished",
                               labels, registry=self.registry)
        self.not_clean = Counter("krex_regions_not_clean", "Regions not clean, by reason code",
                                 ["device", "reason"], registry=self.registry)
        self.wait = Histogram("krex_region_wait_seconds", "Time a region waited for its grant",
                              labels, buckets=BUCKETS_S, registry=self.registry)
        self.hold = Histogram("krex_region_hold_seconds", "Time a region was held", labels,
                              buckets=BUCKETS_S, registry=self.registry)
        self.frozen = Histogram("krex_region_frozen_seconds",
                                "Time the region's siblings were frozen (daemon's frozen_s)",
                                labels, buckets=BUCKETS_S, registry=self.registry)
        self.evaluations = Counter("krex_evaluations", "Evaluations finished, by verdict",
                                   ["verdict", "tenant"], registry=self.registry)
        self.registry.register(_Live(self))

    def region(self, r: dict[str, Any]) -> None:
        """One finished region (from the node watcher)."""
        device, tenant = str(r.get("device")), str(r.get("tenant"))
        self.granted.labels(device, tenant).inc()
        self.wait.labels(device, tenant).observe(float(r.get("waited_s") or 0.0))
        self.hold.labels(device, tenant).observe(float(r.get("held_s") or 0.0))
        if r.get("frozen_s") is not None:
            self.frozen.labels(device, tenant).observe(float(r["frozen_s"]))
        if r.get("clean") is False:
            for code in reason_codes(r) or ["unknown"]:
                self.not_clean.labels(device, code).inc()

    def evaluation(self, verdict: str | None, tenant: str) -> None:
        self.evaluations.labels(str(verdict), tenant).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Gauges read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Any:
        st = self.m.node.snapshot()["status"] or {}
        pools = st.get("pools") or {}
        size = GaugeMetricFamily("krex_worker_pool_size", "Warm workers", labels=["device"])
        busy = GaugeMetricFamily("krex_worker_pool_busy", "Warm workers running a program",
                                 labels=["device"])
        recycles = CounterMetricFamily("krex_worker_recycles", "Workers recycled, by reason",
                                       labels=["device", "reason"])
        for device, p in pools.items():
            workers = p.get("workers", [])
            size.add_metric([device], len(workers))
            busy.add_metric([device], sum(bool(w.get("busy")) for w in workers))
            for reason, n in (p.get("recycles") or {}).items():
                recycles.add_metric([device, reason], n)
        queued = GaugeMetricFamily("krex_region_queue_length", "Regions waiting per device",
                                   labels=["device"])
        held = GaugeMetricFamily("krex_device_held", "1 while a region holds the device",
                                 labels=["device"])
        for device, sched in (st.get("scheduler") or {}).items():
            queued.add_metric([device], len(sched.get("queue", [])))
            held.add_metric([device], 1 if sched.get("holder") else 0)
        yield from (size, busy, recycles, queued, held)
        yield from self._jobs()

    def _jobs(self) -> Any:
        stats = self.m.jobs.stats()
        active = GaugeMetricFamily("krex_service_jobs_active", "Jobs queued or running",
                                   labels=["tenant", "state"])
        for tenant, per in stats["active"].items():
            for state, n in per.items():
                active.add_metric([tenant, state], n)
        done = CounterMetricFamily("krex_service_jobs", "Jobs finished, by kind and state",
                                   labels=["kind", "state"])
        for name, n in stats["counters"].items():
            kind, _, state = name.partition("_")
            if kind in ("exec", "evaluate", "bench"):
                done.add_metric([kind, state], n)
        yield active
        yield done
        if self.m.long_polls is not None:
            yield GaugeMetricFamily("krex_service_long_polls_waiting",
                                    "Long polls waiting at once (all tenants)",
                                    value=sum(self.m.long_polls.waiting.values()))
