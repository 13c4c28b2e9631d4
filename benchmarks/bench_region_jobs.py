"""What a region costs a managed job, by the job's own clock (issue 47).

``krex run --device cpu`` jobs (benchmarks/programs/region_loop.py) take back-to-back
regions of HOLD ms spins for SECONDS, 1, 2, 4 and 8 of them at once, under a private
default daemon with the shield as configured (on as root) and with ``KREX_SHIELD=off``;
one job also with 50 ms regions.  Per run, side by side:

* the job's view: the share of its wall time spent in its regions' work ("device held",
  summed over the jobs: the device's busy share), and the overhead per region,
  (wall - work) / regions, for one job;
* the daemon's view: grant-to-release spans over first grant to last release (what
  ``bench_regions.py`` reports as held);
* where a region's cost goes, p50 per region (ms): the job's enter (call to grant
  received) split into the daemon's wait and set-up and the rest (request and grant on
  the wire, both processes' wake-ups), each set-up step, the job's exit (the release
  sent; its report is not waited for), the steps undone at release, and the job's own
  loop between regions.

Writes results/region_jobs.json (or --out) and prints markdown tables.
Usage: python benchmarks/bench_region_jobs.py [--seconds 4] [--jobs 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, private_daemon, write_results

from krex.measure.stats import quantiles

LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "region_loop.py")


def run_jobs(jobs: int, hold_ms: float, seconds: float) -> dict:
    procs = [subprocess.Popen([sys.executable, "-m", "krex", "run", "--device", "cpu", "--",
                               sys.executable, LOOP, str(hold_ms / 1e3), str(seconds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(jobs)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=seconds * 10 + 60)
        if p.returncode != 0:
            raise RuntimeError(f"job failed ({p.returncode}): {err[-2000:]}")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return summarise(outs, hold_ms)


def summarise(outs: list[dict], hold_ms: float) -> dict:
    work = sum(c - b for o in outs for _, b, c, _ in o["rows"])
    regions = sum(len(o["rows"]) for o in outs)
    # the jobs' common window, by their own clocks: first region entered to last left
    t0 = min(o["rows"][0][0] for o in outs)
    t1 = max(o["rows"][-1][3] for o in outs)
    reps = [r for o in outs for r in o["reports"]]
    spans = sum(r["released"] - r["granted"] for r in reps)
    d0, d1 = min(r["granted"] for r in reps), max(r["released"] for r in reps)
    per = parts([(row, rep) for o in outs for row, rep in zip(o["rows"], o["reports"],
                                                                    strict=True)])
    gaps = [o["rows"][i + 1][0] - o["rows"][i][3] for o in outs
            for i in range(len(o["rows"]) - 1)]
    per["job loop between regions"] = q(gaps)
    one = outs[0]
    one_work = sum(c - b for _, b, c, _ in one["rows"])
    return {"jobs": len(outs), "hold_ms": hold_ms, "regions": regions,
            "job_held": work / (t1 - t0), "daemon_held": spans / (d1 - d0),
            "overhead_ms_per_region_one_job": (one["wall_s"] - one_work) / len(one["rows"]) * 1e3,
            "clean": sum(bool(r["clean"]) for r in reps), "parts_ms": per}


def parts(pairs: list) -> dict:
    enter = [(b - a) * 1e3 for (a, b, _, _), _ in pairs]
    daemon = [rep["waited_ms"] + rep["enforce_ms"] for _, rep in pairs]
    out = {"job enter (call to grant)": q(enter),
           "  daemon: wait": q([rep["waited_ms"] for _, rep in pairs]),
           "  daemon: set-up": q([rep["enforce_ms"] for _, rep in pairs]),
           "  the rest (wire, wake-ups)": q([e - d for e, d in zip(enter, daemon, strict=True)])}
    names = sorted({n for _, rep in pairs for n in rep["apply_ms"]})
    for n in names:
        out[f"    step {n}"] = q([rep["apply_ms"][n] or 0.0 for _, rep in pairs
                                  if n in rep["apply_ms"]])
    out["job exit (release sent)"] = q([(d - c) * 1e3 for (_, _, c, d), _ in pairs])
    for n in names:
        out[f"  undo {n} (after the release)"] = q([rep["revert_ms"][n] or 0.0
                                                    for _, rep in pairs
                                                    if rep["revert_ms"].get(n) is not None])
    return out


def q(xs: list[float]) -> dict:
    return quantiles(xs) if xs else {"p50": float("nan"), "p95": float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--jobs", default="1,2,4,8")
    ap.add_argument("--out", default=None, help="results file (default results/region_jobs.json)")
    args = ap.parse_args()
    counts = [int(x) for x in args.jobs.split(",")]
    load_before = os.getloadavg()
    runs = []
    for shield in (None, "off"):
        old = os.environ.get("KREX_SHIELD")
        if shield is not None:
            os.environ["KREX_SHIELD"] = shield
        try:
            with private_daemon():
                for jobs, hold in [(n, 5.0) for n in counts] + [(1, 50.0)]:
                    r = run_jobs(jobs, hold, args.seconds)
                    r["shield"] = shield or "default"
                    runs.append(r)
        finally:
            if old is None:
                os.environ.pop("KREX_SHIELD", None)
            else:
                os.environ["KREX_SHIELD"] = old
    path = write_results("region_jobs", {"seconds": args.seconds, "runs": runs,
                                         "loadavg_before": load_before,
                                         "loadavg_after": os.getloadavg()}, path=args.out)
    print(md_table(["shield", "jobs x hold", "regions", "device held, jobs' clocks %",
                    "held, daemon's spans %", "one job: ms per region", "clean"],
                   [[r["shield"], f"{r['jobs']} x {r['hold_ms']:g} ms", r["regions"],
                     f"{100 * r['job_held']:.1f}", f"{100 * r['daemon_held']:.1f}",
                     f"{r['overhead_ms_per_region_one_job']:.2f}",
                     f"{r['clean']}/{r['regions']}"] for r in runs]))
    for r in runs:
        if r["jobs"] in (1, 4) and r["hold_ms"] == 5.0:
            print(f"\nshield {r['shield']}, {r['jobs']} x 5 ms: p50 / p95 ms per region")
            print(md_table(["part", "p50", "p95"],
                           [[k, f"{v['p50']:.3f}", f"{v['p95']:.3f}"]
                            for k, v in r["parts_ms"].items()]))
    print(f"\nload average before {load_before}, after {os.getloadavg()}; written {path}")


if __name__ == "__main__":
    main()
