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

And the floor under a handoff (issue 18), which is made of wake-ups and of Python
run once per region:

- cold code: the same small piece of Python (a region report's JSON decoded, an
  acquire encoded) timed back to back (warm), and after the core idled 1, 5 or
  15 ms (what a daemon thread or a thawed job runs when a region ends).  The
  control: after 15 ms idle, the same work run once first, then timed;
- wake-up: a ping-pong between two processes on two cores over a socketpair,
  with the replier blocked in ``recv`` (its core idles: what every handoff's
  wake-up is) and spinning on a non-blocking ``recv`` (never idle).

Usage: python benchmarks/bench_floor.py [--core N] [--seconds S] [--quick]
Writes results/floor.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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


# A region report's size and shape (docs/protocol.md: ~2 KB of JSON per release reply)
_REPORT = json.dumps({"report": {
    "host": {"steps": [{"name": f"step{i}", "backend": "cgroup", "ok": True, "apply_ms": 0.1 * i,
                        "revert_ms": 0.05 * i, "detail": {"count": i, "note": "x" * 40}}
                       for i in range(12)]},
    "granted_mono_s": 1.0, "released_mono_s": 1.005, "clean": True, "reasons": [],
    "counters": {"frozen_jobs": list(range(16)), "holder_run_delay_ns": 1234}}})


def _region_work() -> float:
    """µs to decode a release reply's report and encode the next acquire."""
    t0 = time.perf_counter_ns()
    rep = json.loads(_REPORT)["report"]
    steps = {st["name"]: st["apply_ms"] for st in rep["host"]["steps"]}
    json.dumps({"op": "acquire", "job": 3, "device": "cpu", "steps": len(steps)}).encode()
    return (time.perf_counter_ns() - t0) / 1e3


def cold_code(n: int) -> dict[str, dict[str, float]]:
    """The same work warm, after idling, and (control) after idling but run once first."""
    out = {}
    for name, idle_s, first in (("warm", 0.0, False), ("idle 1 ms", 0.001, False),
                                ("idle 5 ms", 0.005, False), ("idle 15 ms", 0.015, False),
                                ("idle 15 ms, run once first", 0.015, True)):
        xs = []
        for _ in range(n):
            if idle_s:
                time.sleep(idle_s)
            if first:
                _region_work()
            xs.append(_region_work())
        out[name] = stats.quantiles(xs, (0.5, 0.9))
    warm = out["warm"]["p50"]
    for q in out.values():
        q["x_warm"] = q["p50"] / warm
    return out


def wake_rtt(n: int, cores: tuple[int, int]) -> dict[str, dict[str, float]]:
    """Round trips (µs) over a socketpair to a process on another core, blocking or
    spinning there; the caller sleeps 1 ms between them (so its own core idles too)."""
    out = {}
    for mode in ("blocked", "spinning"):
        a, b = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the replier
            try:
                a.close()
                os.sched_setaffinity(0, {cores[1]})
                b.setblocking(mode == "blocked")
                while True:
                    try:
                        data = b.recv(64)
                    except BlockingIOError:
                        continue
                    if not data or data == b"q":
                        break
                    b.send(data)
            finally:
                os._exit(0)
        b.close()
        xs = []
        try:
            for _ in range(n):
                time.sleep(0.001)
                t0 = time.perf_counter_ns()
                a.send(b"x")
                a.recv(64)
                xs.append((time.perf_counter_ns() - t0) / 1e3)
        finally:
            a.send(b"q")
            a.close()
            os.waitpid(pid, 0)
        out[mode] = stats.quantiles(xs, (0.5, 0.95))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--core", type=int, default=(os.cpu_count() or 1) - 1,
                    help="core to pin to (default: the last, krex's default measure core)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per kernel")
    ap.add_argument("--quick", action="store_true", help="0.5 s per kernel, fewer wake-ups")
    args = ap.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 0.5)
    n = 60 if args.quick else 300
    os.sched_setaffinity(0, {args.core})
    cold = cold_code(n)
    others = [c for c in range(os.cpu_count() or 1) if c != args.core]
    wake = wake_rtt(n, (args.core, others[0])) if others else {}
    sizes: dict[str, int] = {}
    kernels = cpu_kernels(BUCKETS_MS, sizes)
    out = {name: {"bucket_ms": ms, **floor(fn, args.seconds)}
           for name, (ms, fn) in kernels.items()}
    path = write_results("floor", {"core": args.core, "seconds": args.seconds,
                                   "load_average": os.getloadavg(), "kernels": out,
                                   "cold_code_us": cold, "wake_rtt_us": wake})
    rows = [[name, f"{r['median_ms']:.3f}",
             f"{r['sample_p95_pct']:+.2f} / {r['sample_p99_pct']:+.2f}",
             f"{r['window_drift_p50_pct']:.2f} / {r['window_drift_p95_pct']:.2f}", r["windows"]]
            for name, r in out.items()]
    print(md_table(["kernel", "median ms", "per sample p95 / p99 %",
                    "window drift p50 / p95 %", "windows"], rows))
    print()
    print(md_table(["the same Python (a report decoded, an acquire encoded)", "p50 µs",
                    "p90 µs", "p50 / warm p50"],
                   [[k, f"{q['p50']:.1f}", f"{q['p90']:.1f}", f"{q['x_warm']:.1f}"]
                    for k, q in cold.items()]))
    if wake:
        print()
        print(md_table(["replier on the other core", "round trip p50 µs", "p95 µs"],
                       [[k, f"{q['p50']:.0f}", f"{q['p95']:.0f}"] for k, q in wake.items()]))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
