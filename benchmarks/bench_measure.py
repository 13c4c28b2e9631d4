"""Benchmark of krex.measure: accuracy, A/B power, cost.  Writes results/bench_measure.json.

    .venv/bin/python benchmarks/bench_measure.py [--quick] [--out results/bench_measure.json]

1. fakegpu accuracy: kernels of known device duration (0.1, 1, 10 ms) measured
   by ``measure`` with FakegpuTimer, in a child process on a private fakegpu
   server (skipped when fakegpu is not built).
2. cpu A/B power: ``compare`` of a Python workload against copies 0 %, 1 %,
   5 % and 10 % slower; verdict counts over repeated runs, pairs and seconds.
3. cpu cost: how much of the region's hold the timed samples fill (hot and cold
   cache) and the per-sample overhead for an empty function.
Ratios only on this machine (it drifts ±30 % between minutes); absolute
times mean something only on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from krex import resultfile  # noqa: E402
from krex.measure import ScriptedRegions, compare, measure  # noqa: E402

FORMAT = 1
FAKEGPU_SCRIPT = r"""
import ctypes, json, sys
from krex.measure import ScriptedRegions, measure
from krex.measure.events import FakegpuTimer
timer = FakegpuTimer(0)
lib = timer.api.lib
mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
lib.cuModuleLoadData(ctypes.byref(mod), b"fake")
name = ("spin_us_%d" % int(float(sys.argv[1]) * 1000)).encode()
lib.cuModuleGetFunction(ctypes.byref(fn), mod, name)
args = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)
out = []
for _ in range(int(sys.argv[2])):
    m = measure(lambda: lib.cuLaunchKernel(fn, *args), timer=timer, device="fakegpu:0",
                region=ScriptedRegions(), warmup_ms=5, min_time_s=0.05, max_time_s=0.5)
    out.append({k: m.to_dict()[k] for k in ("median_ms", "min_ms", "p95_ms", "noise_rel",
                                             "iterations", "stop_reason", "elapsed_s")})
print(json.dumps(out))
"""


def fakegpu_accuracy(repeats: int) -> dict:
    try:
        from krex.devices import fakegpu
    except ImportError:
        return {"skipped": "krex.devices.fakegpu missing"}
    if not fakegpu.available():
        return {"skipped": "fakegpu not built"}
    rows = {}
    for kernel_ms in (0.1, 1.0, 10.0):
        with fakegpu.FakeGpu() as gpu:
            done = subprocess.run(
                [sys.executable, "-c", FAKEGPU_SCRIPT, str(kernel_ms), str(repeats)],
                env=gpu.env(), capture_output=True, text=True, timeout=300, cwd=REPO,
            )  # fmt: skip
        runs = json.loads(done.stdout.strip().splitlines()[-1])
        rows[str(kernel_ms)] = {
            "runs": runs,
            "median_error_rel": [r["median_ms"] / kernel_ms - 1 for r in runs],
            "min_error_rel": [r["min_ms"] / kernel_ms - 1 for r in runs],
        }
    return rows


def _work(n: int):
    def fn():
        return sum(range(n))

    return fn


def ab_power(repeats: int) -> dict:
    base_n = 20_000
    rows = {}
    for slower_pct in (0, 1, 5, 10):
        verdicts, seconds, pairs = [], [], []
        for seed in range(repeats):
            t0 = time.perf_counter()
            c = compare(
                _work(base_n), _work(int(base_n * (1 + slower_pct / 100))), device="cpu",
                cache="hot", region=ScriptedRegions(), seed=seed, warmup_ms=10,
                max_time_s=1.0, timeout_s=3.0,
            )  # fmt: skip
            seconds.append(time.perf_counter() - t0)
            verdicts.append(c.verdict)
            pairs.append(c.pairs)
        counts = {v: verdicts.count(v) for v in ("faster", "slower", "same", "unclear")}
        rows[f"{slower_pct}%"] = {"verdicts": counts, "pairs": pairs, "seconds": seconds}
    return rows


def cost() -> dict:
    rows = {}
    for cache in ("hot", "cold"):
        regions = ScriptedRegions()
        m = measure(_work(20_000), device="cpu", cache=cache, region=regions, warmup_ms=10)
        rows[cache] = {
            "median_ms": m.median_ms,
            "iterations": m.iterations,
            "held_s": m.region.held_s,
            "timed_fraction_of_hold": sum(m.samples_ms) / 1e3 / m.region.held_s,
            "stop_reason": m.stop_reason,
            "noise_rel": m.noise_rel,
        }
    empty = measure(lambda: None, device="cpu", cache="hot", region=ScriptedRegions(), rep_ms=20)
    rows["empty_fn_sample_ms"] = {"median": empty.median_ms, "min": empty.min_ms}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--out", default=os.path.join(REPO, "results", "bench_measure.json"))
    args = parser.parse_args()
    repeats = 3 if args.quick else 10
    data = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fakegpu_accuracy": fakegpu_accuracy(repeats),
        "ab_power_cpu": ab_power(repeats),
        "cost_cpu": cost(),
    }
    resultfile.write(args.out, data, format=FORMAT)
    print(json.dumps(data, indent=1)[:4000])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
