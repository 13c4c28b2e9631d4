"""Benchmark the gate: cost per launch, close -> quiesced, and drain ack latency.

Runs on the fake GPU (no device needed).  Writes results/bench_gate.json:

    launch_ns        per-launch cost of a 0-duration kernel through the fake
                     driver, without the interposer and with it (gate open),
                     interleaved runs, medians; the difference is the gate cost
                     (dominated here by the fake driver's socket round trip, so
                     also see gate_ns: the wrapper measured on a null driver)
    quiesce_us       close -> no launch inside the driver, 4 launching threads
    drain_ack_us     close -> the sibling's drain ack (queued work = a few us)

Usage: python benchmarks/bench_gate.py [--cycles 300] [--out results/bench_gate.json]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from krex import resultfile  # noqa: E402
from krex.devices import native  # noqa: E402
from krex.devices.fakegpu import FakeGpu  # noqa: E402
from krex.enforce.gate import GateFile  # noqa: E402
from krex.measure import stats  # noqa: E402

NULL_DRIVER = r"""
int cuLaunchKernel(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e,
                   unsigned g, unsigned h, void *s, void **p, void **x) { return 0; }
"""
NULL_CALLER = r"""
#include <stdio.h>
#include <time.h>
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   unsigned, void *, void **, void **);
int main(void) {
    struct timespec a, b; long n = 5000000;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) cuLaunchKernel(0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
}
"""


def build(tmp: Path) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "tests"))
    from test_native import build_launcher

    (tmp / "null.c").write_text(NULL_DRIVER)
    (tmp / "caller.c").write_text(NULL_CALLER)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp / "libcuda.so.1"),
                    str(tmp / "null.c")], check=True)
    subprocess.run(["cc", "-O2", "-o", str(tmp / "caller"), str(tmp / "caller.c"),
                    f"-L{tmp}", "-l:libcuda.so.1", f"-Wl,-rpath,{tmp}"], check=True)
    return build_launcher(tmp), tmp / "caller"


def gate_ns(caller: Path, gate: GateFile, runs: int = 5) -> dict[str, float]:
    """Wrapper cost on a null driver: no interposer vs interposer with an open gate."""
    plain, gated = [], []
    env_gated = native.preload_env(gate.path)
    for _ in range(runs):
        plain.append(float(subprocess.check_output([str(caller)], text=True)))
        gated.append(float(subprocess.check_output([str(caller)], env=env_gated, text=True)))
    p, g = stats.median(plain), stats.median(gated)
    return {"no_interposer": p, "open_gate": g, "gate_cost": g - p}


def launch_ns(launcher: Path, gpu: FakeGpu, gate: GateFile, runs: int = 5) -> dict[str, float]:
    """Per-launch time through the fake driver, interleaved with and without the interposer."""
    out: dict[str, list[float]] = {"no_interposer": [], "open_gate": []}
    args = [str(launcher), "cuda", "getproc", "1", "300", "spin_ns_1", "64"]
    for _ in range(runs):
        for key, env in (("no_interposer", gpu.env()),
                         ("open_gate", native.preload_env(gate.path, base=gpu.env()))):
            line = subprocess.check_output(args, env=env, text=True).splitlines()[-1]
            n = int(re.search(r"launches=(\d+)", line).group(1))
            out[key].append(0.3e9 / n)
    return {k: stats.median(v) for k, v in out.items()}


def cycles(launcher: Path, gpu: FakeGpu, gate: GateFile, n: int) -> dict[str, dict[str, float]]:
    env = native.preload_env(gate.path, base=gpu.env())
    proc = subprocess.Popen([str(launcher), "cuda", "direct", "4", "600000", "spin_us_5", "16"],
                            env=env, stdout=subprocess.PIPE, text=True)
    quiesce, ack = [], []
    try:
        proc.stdout.readline()
        while proc.pid not in gate.pids(0):
            time.sleep(0.001)
        for _ in range(n):
            gen = gate.close(0)
            quiesce.append(gate.wait_quiesced(0) * 1e6)
            ack.append(gate.wait_drained(0, gen)[proc.pid] * 1e6)
            gate.open(0)
            time.sleep(0.001)
    finally:
        gate.open(0)
        proc.send_signal(signal.SIGUSR1)
        proc.communicate(timeout=30)
    return {"quiesce_us": _summary(quiesce), "drain_ack_us": _summary(ack)}


def _summary(values: list[float]) -> dict[str, float]:
    return {**stats.quantiles(values, (0.5, 0.95)), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--out", default=str(REPO / "results" / "bench_gate.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir, FakeGpu() as gpu, \
            GateFile.create(Path(tmpdir) / "gate") as gate:
        launcher, caller = build(Path(tmpdir))
        result = {
            "benchmark": "gate", "cycles": args.cycles,
            "gate_ns": gate_ns(caller, gate), "launch_ns": launch_ns(launcher, gpu, gate),
            **cycles(launcher, gpu, gate, args.cycles),
        }
    resultfile.write(args.out, result, format=1, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
