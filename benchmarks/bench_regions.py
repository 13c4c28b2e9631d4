"""Region round trip and handoff latency (issue: krex core, issue 18).

* round trip: one process, uncontended ``acquire`` + ``release`` (p50/p95/p99);
* handoff: two processes contend; time from the holder sending ``release`` to
  the waiter returning from ``acquire`` (both on CLOCK_MONOTONIC);
* held fraction: JOBS processes take back-to-back HOLD_MS regions for
  SECONDS; the share of that time the device was held (sum of grant → release
  spans over first grant → last release).

Each bare (every mechanism off) and enforced (the default daemon).
Writes results/regions.json and prints a markdown table.
Usage: python benchmarks/bench_regions.py [--n 2000] [--jobs 4] [--hold-ms 5] [--seconds 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, private_daemon, write_results

from krex.measure.stats import quantiles


def round_trip(n: int) -> list[float]:
    from krex.client.connection import Client

    c = Client(autostart=False)
    job = c.register()["job_id"]
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        rid = c.acquire(job)["region"]
        c.release(rid)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
    c.close()
    return samples


# argv: regions (or 0: run for SECONDS), hold seconds, SECONDS
CONTENDER = r"""
import json, sys, time
from krex.client.connection import Client
n, hold_s, seconds = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
c = Client(autostart=False)
job = c.register()["job_id"]
rows = []
print("ready", flush=True)
sys.stdin.readline()
stop = time.monotonic() + seconds
while (len(rows) < n) if n else (time.monotonic() < stop):
    rid = c.acquire(job)["region"]
    granted = time.monotonic_ns()
    end = time.perf_counter() + hold_s
    while time.perf_counter() < end:
        pass
    released = time.monotonic_ns()
    c.release(rid)
    rows.append((granted, released))
print(json.dumps(rows), flush=True)
"""


def contend(jobs: int, n: int, hold_s: float = 0.0005,
            seconds: float = 0.0) -> list[tuple[int, int, int]]:
    """(granted ns, released ns, which process) of every region, in grant order."""
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(n), str(hold_s),
                               str(seconds)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(jobs)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    spans = []
    for who, p in enumerate(procs):
        rows = json.loads(p.stdout.readline())
        spans += [(g, r, who) for g, r in rows]
        p.wait()
    spans.sort()
    return spans


def handoff(n: int) -> list[float]:
    spans = contend(2, n)
    # A handoff is a grant to one process right after the other released.
    return [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(spans) if a[2] != b[2]]


def held_fraction(jobs: int, hold_ms: float, seconds: float) -> dict:
    """Back-to-back regions of ``jobs`` processes: how much of the time the device was held."""
    spans = contend(jobs, 0, hold_ms / 1e3, seconds)
    held = sum(r - g for g, r, _ in spans)
    wall = spans[-1][1] - spans[0][0]
    overlaps = sum(b[0] < a[1] for a, b in itertools.pairwise(spans))
    per_job = [sum(1 for s in spans if s[2] == j) for j in range(jobs)]
    return {"jobs": jobs, "hold_ms": hold_ms, "seconds": round(wall / 1e9, 3),
            "regions": len(spans), "held_fraction": round(held / wall, 4),
            "regions_per_job": per_job, "overlaps": overlaps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--hold-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    with private_daemon("--freeze", "off", "--no-isolate", "--no-gate"):
        rt = round_trip(args.n)
        ho = handoff(args.n // 2)
        held = held_fraction(args.jobs, args.hold_ms, args.seconds)
    with private_daemon():
        rt_enf = round_trip(args.n // 4)
        ho_enf = handoff(args.n // 4)
        held_enf = held_fraction(args.jobs, args.hold_ms, args.seconds)
    rows = {"round_trip_us": quantiles(rt), "handoff_us": quantiles(ho),
            "round_trip_enforced_us": quantiles(rt_enf),
            "handoff_enforced_us": quantiles(ho_enf)}
    path = write_results("regions", {"n": args.n, "results": rows,
                                     "handoffs_measured": len(ho),
                                     "held": {"bare": held, "enforced": held_enf}})
    print(md_table(["metric (µs)", "p50", "p95", "p99"],
                   [[k, *(f"{v:.0f}" for v in r.values())] for k, r in rows.items()]))
    print(md_table(["back-to-back regions", "jobs", "hold ms", "regions", "held %",
                    "regions per job", "overlaps"],
                   [[name, h["jobs"], h["hold_ms"], h["regions"],
                     f"{100 * h['held_fraction']:.1f}", h["regions_per_job"], h["overlaps"]]
                    for name, h in (("bare", held), ("enforced", held_enf))]))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
