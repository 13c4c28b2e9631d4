"""The machine's own timing floor: krex's fidelity kernels with no krex at all.

The compute and memory kernels of bench_fidelity (benchmarks/programs/ckernels.py),
pinned to one core of an otherwise idle machine, no daemon, no siblings.  Two
readings per kernel, in %:

- per sample: p95 / p99 of each sample over the run's median (what a timer
  tick, an interrupt or a hypervisor exit costs a sample of that size);
- window drift: the median of consecutive ~0.1 s windows over the whole run's
  median, p95 of |that| (how far the machine itself moves between two
  measurements a moment apart: the floor of any comparison of medians).

No tool can time a kernel more steadily than this on the machine; read
bench_fidelity's and krex eval's inflation against it.

Usage: python benchmarks/bench_floor.py [--core N] [--seconds S]
Writes results/floor.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "programs"))
from ckernels import cpu_kernels  # noqa: E402
from common import md_table, write_results  # noqa: E402

from krex.measure import stats  # noqa: E402

BUCKETS_MS = (0.1, 1.0, 10.0)
WINDOW_S = 0.1


def floor(fn, seconds: float) -> dict[str, float]:
    for _ in range(3):
        fn()
    samples: list[float] = []
    windows: list[float] = []
    current: list[float] = []
    t_window = end = time.perf_counter()
    end += seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        current.append((t1 - t0) * 1e3)
        if t1 - t_window >= WINDOW_S and len(current) >= 3:
            windows.append(stats.median(current))
            samples += current
            current, t_window = [], t1
    med = stats.median(samples)
    per = stats.quantiles(stats.per_sample_inflation_pct(samples, med), (0.95, 0.99))
    drift = stats.quantiles([abs(x) for x in stats.per_sample_inflation_pct(windows, med)],
                            (0.5, 0.95))
    return {"median_ms": med, "samples": len(samples), "windows": len(windows),
            "sample_p95_pct": per["p95"], "sample_p99_pct": per["p99"],
            "window_drift_p50_pct": drift["p50"], "window_drift_p95_pct": drift["p95"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1,
                    help="core to pin to (default: the last, krex's default measure core)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per kernel")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    sizes: dict[str, int] = {}
    kernels = cpu_kernels(BUCKETS_MS, sizes)
    out = {name: {"bucket_ms": ms, **floor(fn, args.seconds)}
           for name, (ms, fn) in kernels.items()}
    path = write_results("floor", {"core": args.core, "seconds": args.seconds,
                                   "load_average": os.getloadavg(), "kernels": out})
    rows = [[name, f"{r['median_ms']:.3f}",
             f"{r['sample_p95_pct']:+.2f} / {r['sample_p99_pct']:+.2f}",
             f"{r['window_drift_p50_pct']:.2f} / {r['window_drift_p95_pct']:.2f}", r["windows"]]
            for name, r in out.items()]
    print(md_table(["kernel", "median ms", "per sample p95 / p99 %",
                    "window drift p50 / p95 %", "windows"], rows))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
