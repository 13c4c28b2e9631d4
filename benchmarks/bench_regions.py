"""Region round trip and handoff latency (issue: krex core, issue 18).

* round trip: one process, uncontended ``acquire`` + ``release`` (p50/p95/p99);
* handoff: two processes contend; time from the holder sending ``release`` to
  the waiter returning from ``acquire`` (both on CLOCK_MONOTONIC);
* held fraction: JOBS processes take back-to-back HOLD_MS regions for
  SECONDS; the share of that time the device was held (sum of grant → release
  spans over first grant → last release).

Bare (every mechanism off: the machine floor, measured in the same run) and
enforced (the default daemon, with the shield as configured by default and
with ``KREX_SHIELD=off``).  For the enforced runs also the gap between
regions and each enforcement step's p50 apply time, for grants handed over
(overlapped handoff, issue 18) and grants set up from scratch apart.
Writes results/regions.json (or --out) and prints markdown tables.
Usage: python benchmarks/bench_regions.py [--n 2000] [--jobs 4] [--hold-ms 5] [--seconds 5]
       [--out results/regions.json]
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
    host = (c.release(rid).get("report") or {}).get("host") or {}
    steps = {st["name"]: st["apply_ms"] for st in host.get("steps", [])}
    rows.append((granted, released, steps))
print(json.dumps(rows), flush=True)
"""


def contend(jobs: int, n: int, hold_s: float = 0.0005,
            seconds: float = 0.0) -> list[tuple[int, int, int, dict]]:
    """(granted ns, released ns, which process, {step: apply ms}) of every region,
    in grant order."""
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
        spans += [(g, r, who, steps) for g, r, steps in rows]
        p.wait()
    spans.sort()
    return spans


def handoff(n: int) -> list[float]:
    spans = contend(2, n)
    # A handoff is a grant to one process right after the other released.
    return [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(spans) if a[2] != b[2]]


def carried(steps: dict) -> bool:
    """A grant handed over without a freeze write (its freeze step took ~nothing)."""
    return "freeze" in steps and steps["freeze"] is not None and steps["freeze"] < 0.02


def breakdown(spans: list) -> dict:
    """Per enforcement step, p50 apply ms, for handed-over and set-up grants apart."""
    out: dict = {}
    for kind, rows in (("handed_over", [s[3] for s in spans if carried(s[3])]),
                       ("set_up", [s[3] for s in spans if s[3] and not carried(s[3])])):
        names = sorted({k for r in rows for k in r})
        out[kind] = {"regions": len(rows), **{
            k: round(quantiles([r[k] for r in rows if r.get(k) is not None])["p50"], 3)
            for k in names}}
    return out


def held_fraction(jobs: int, hold_ms: float, seconds: float) -> dict:
    """Back-to-back regions of ``jobs`` processes: how much of the time the device was held."""
    spans = contend(jobs, 0, hold_ms / 1e3, seconds)
    held = sum(s[1] - s[0] for s in spans)
    wall = spans[-1][1] - spans[0][0]
    overlaps = sum(b[0] < a[1] for a, b in itertools.pairwise(spans))
    per_job = [sum(1 for s in spans if s[2] == j) for j in range(jobs)]
    gaps = [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(spans)]
    return {"jobs": jobs, "hold_ms": hold_ms, "seconds": round(wall / 1e9, 3),
            "regions": len(spans), "held_fraction": round(held / wall, 4),
            "regions_per_job": per_job, "overlaps": overlaps,
            "gap_us": quantiles(gaps), **split_gaps(spans), "steps_p50_ms": breakdown(spans)}


def split_gaps(spans: list) -> dict:
    """Release-to-next-grant gaps (µs) before handed-over grants and set-up grants."""
    pairs = list(itertools.pairwise(spans))
    return {"gap_us_handed_over": quantiles([(b[0] - a[1]) / 1e3 for a, b in pairs
                                             if carried(b[3])]),
            "gap_us_set_up": quantiles([(b[0] - a[1]) / 1e3 for a, b in pairs
                                        if not carried(b[3])])}


def enforced(args: argparse.Namespace, shield: str | None) -> dict:
    """The default daemon (every mechanism on); ``shield``: KREX_SHIELD for it."""
    old = os.environ.get("KREX_SHIELD")
    if shield is not None:
        os.environ["KREX_SHIELD"] = shield
    try:
        with private_daemon():
            rt = round_trip(args.n // 4)
            spans = contend(2, args.n // 4)
            ho = [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(spans) if a[2] != b[2]]
            ho_split = split_gaps(spans)
            held = held_fraction(args.jobs, args.hold_ms, args.seconds)
    finally:
        if old is None:
            os.environ.pop("KREX_SHIELD", None)
        else:
            os.environ["KREX_SHIELD"] = old
    return {"round_trip_us": quantiles(rt), "handoff_us": quantiles(ho),
            "handoffs_measured": len(ho), "handoff_steps_p50_ms": breakdown(spans),
            "handoff_us_handed_over": ho_split["gap_us_handed_over"],
            "handoff_us_set_up": ho_split["gap_us_set_up"],
            "held": held}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--hold-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="results file (default results/regions.json)")
    args = ap.parse_args()
    load_before = os.getloadavg()
    # The machine floor: the bare protocol (every mechanism off) in the same run.
    with private_daemon("--freeze", "off", "--no-isolate", "--no-gate"):
        rt = round_trip(args.n)
        ho = handoff(args.n // 2)
        held = held_fraction(args.jobs, args.hold_ms, args.seconds)
    runs = {"shield default": enforced(args, None), "KREX_SHIELD=off": enforced(args, "off")}
    floor = {"round_trip_us": quantiles(rt), "handoff_us": quantiles(ho),
             "handoffs_measured": len(ho), "held": held}
    path = write_results("regions", {"n": args.n, "floor": floor, "enforced": runs,
                                     "loadavg_before": load_before,
                                     "loadavg_after": os.getloadavg()}, path=args.out)
    rows = [["bare (floor)", floor]] + [[f"enforced, {k}", v] for k, v in runs.items()]
    print(md_table(["daemon", "round trip p50/p95 µs", "handoff p50/p95/p99 µs",
                    "held % (jobs x hold)", "gap p50/p95 µs", "handed over"],
                   [[name, f"{r['round_trip_us']['p50']:.0f} / {r['round_trip_us']['p95']:.0f}",
                     "{p50:.0f} / {p95:.0f} / {p99:.0f}".format(**r["handoff_us"]),
                     f"{100 * r['held']['held_fraction']:.1f} "
                     f"({r['held']['jobs']} x {r['held']['hold_ms']:g} ms)",
                     f"{r['held']['gap_us']['p50']:.0f} / {r['held']['gap_us']['p95']:.0f}",
                     _handed(r["held"])]
                    for name, r in rows]))
    for name, r in runs.items():
        print(f"\n{name}: step p50 ms (held runs): {json.dumps(r['held']['steps_p50_ms'])}")
        print(f"{name}: handoff µs handed over {_q(r['handoff_us_handed_over'])}, set up "
              f"{_q(r['handoff_us_set_up'])}; held-run gap µs handed over "
              f"{_q(r['held']['gap_us_handed_over'])}, set up {_q(r['held']['gap_us_set_up'])}")
    print(f"\nload average before {load_before}, after {os.getloadavg()}; written {path}")


def _q(q: dict) -> str:
    return "p50 {p50:.0f} / p95 {p95:.0f}".format(**q)


def _handed(held: dict) -> str:
    b = held["steps_p50_ms"]
    return f"{b['handed_over']['regions']}/{held['regions']}"


if __name__ == "__main__":
    main()
