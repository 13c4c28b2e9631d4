"""Fairness when freezing replaces queueing (issues 11 item 5, 14): shares of the device.

Jobs take back-to-back regions on ``cpu`` (tests/jobs/back_to_back.py: busy
``--hold-ms`` inside each region, then busy ``--gap-ms`` outside it) for
``--seconds``.  A job frozen by another's region cannot ask for the next one,
so a job that asks again the instant it releases (gap 0) can take the device
again and again.  Scenarios, each with the fair window on (``--window-ms``,
50 ms: longer than the jobs' work between regions) and off
(``--fair-window-ms 0``):

* ``jobs``: N jobs, one greedy (gap 0), the rest with ``--gap-ms``;
* ``tenants``: tenant A with 1 job, tenant B with 6 (all gap 0).

Shares come from the jobs' own counts and clocks.  Writes
results/fairness.json and prints a markdown table.

Usage: python benchmarks/bench_fairness.py [--quick] [--jobs 4] [--seconds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, private_daemon, write_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "tests", "jobs", "back_to_back.py")


def run(jobs: list[tuple[float, str | None]], seconds: float, hold_ms: float) -> list[dict]:
    start = time.monotonic() + 2.0
    procs = []
    for gap_ms, tenant in jobs:
        env = dict(os.environ)
        if tenant is not None:
            env["KREX_TENANT"] = tenant
        procs.append(subprocess.Popen(
            [sys.executable, JOB, str(start), str(seconds), str(hold_ms), str(gap_ms)],
            stdout=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=seconds + 120)[0] for p in procs]
    return [json.loads(o) for o in outs]


def spread(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(abs(v - mean) for v in values) / mean if mean else 0.0


def scenario_jobs(n: int, gap_ms: float, seconds: float, hold_ms: float,
                  window_ms: float) -> dict:
    with private_daemon("--fair-window-ms", str(window_ms)):
        res = run([(0.0, None)] + [(gap_ms, None)] * (n - 1), seconds, hold_ms)
    counts = [r["regions"] for r in res]
    return {"scenario": "jobs", "window_ms": window_ms, "regions": counts,
            "held_s": [round(r["held_s"], 3) for r in res], "spread": round(spread(counts), 3),
            "greedy_vs_others": round(counts[0] / (sum(counts[1:]) / (n - 1)), 3),
            "total_held_s": round(sum(r["held_s"] for r in res), 3)}


def scenario_tenants(seconds: float, hold_ms: float, window_ms: float) -> dict:
    with private_daemon("--fair-window-ms", str(window_ms)):
        res = run([(0.0, "A")] + [(0.0, "B")] * 6, seconds, hold_ms)
    a, b = res[0]["held_s"], sum(r["held_s"] for r in res[1:])
    return {"scenario": "tenants 1 vs 6 jobs", "window_ms": window_ms,
            "held_s": [round(a, 3), round(b, 3)], "spread": round(spread([a, b]), 3),
            "total_held_s": round(a + b, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--gap-ms", type=float, default=30.0)
    ap.add_argument("--window-ms", type=float, default=50.0)
    ap.add_argument("--hold-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 repeat of 2 s")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.seconds = 1, 2.0
    rows = []
    for _ in range(args.repeats):
        for window in (args.window_ms, 0.0):
            rows.append(scenario_jobs(args.jobs, args.gap_ms, args.seconds, args.hold_ms,
                                      window))
            rows.append(scenario_tenants(args.seconds, args.hold_ms, window))
    path = write_results("fairness", {"params": vars(args), "runs": rows}, args.out)
    print(md_table(["scenario", "fair window ms", "regions / held s", "spread vs equal",
                    "greedy ÷ others", "device held s"],
                   [[r["scenario"], f"{r['window_ms']:g}", r.get("regions", r["held_s"]),
                     f"{r['spread']:.0%}", r.get("greedy_vs_others", "-"), r["total_held_s"]]
                    for r in rows]))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
