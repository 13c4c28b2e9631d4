"""Region round trip and handoff latency (issue: krex core).

* round trip: one process, uncontended ``acquire`` + ``release`` (p50/p95/p99);
* handoff: two processes contend; time from the holder sending ``release`` to
  the waiter returning from ``acquire`` (both on CLOCK_MONOTONIC).

Writes results/regions.json and prints a markdown table.
Usage: python benchmarks/bench_regions.py [--n 2000] [--enforce]
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


CONTENDER = r"""
import json, sys, time
from krex.client.connection import Client
n = int(sys.argv[1])
c = Client(autostart=False)
job = c.register()["job_id"]
rows = []
print("ready", flush=True)
sys.stdin.readline()
for _ in range(n):
    rid = c.acquire(job)["region"]
    granted = time.monotonic_ns()
    end = time.perf_counter() + 0.0005
    while time.perf_counter() < end:
        pass
    released = time.monotonic_ns()
    c.release(rid)
    rows.append((granted, released))
print(json.dumps(rows), flush=True)
"""


def handoff(n: int) -> list[float]:
    procs = [subprocess.Popen([sys.executable, "-c", CONTENDER, str(n)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
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
    # A handoff is a grant to one process right after the other released.
    return [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(spans) if a[2] != b[2]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    with private_daemon("--freeze", "off", "--no-isolate", "--no-gate"):
        rt = round_trip(args.n)
        ho = handoff(args.n // 2)
    with private_daemon():
        rt_enf = round_trip(args.n // 4)
        ho_enf = handoff(args.n // 4)
    rows = {"round_trip_us": quantiles(rt), "handoff_us": quantiles(ho),
            "round_trip_enforced_us": quantiles(rt_enf),
            "handoff_enforced_us": quantiles(ho_enf)}
    path = write_results("regions", {"n": args.n, "results": rows,
                                     "handoffs_measured": len(ho)})
    print(md_table(["metric (µs)", "p50", "p95", "p99"],
                   [[k, *(f"{v:.0f}" for v in r.values())] for k, r in rows.items()]))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
