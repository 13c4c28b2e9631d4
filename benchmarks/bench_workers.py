"""Warm workers against cold processes.

1. ``cpu``: start-to-first-instruction latency of a program that imports
   numpy, run in a warm worker (``WorkerPool.submit``) and as a cold
   ``python prog.py``, interleaved; p50/p95 of the first line and of the
   first line after ``import numpy``.
2. ``fakegpu`` (when the fake driver is built): 8 concurrent programs that
   each use the device, with context creation serialised behind
   KREX_FAKEGPU_CTX_DELAY_MS=300: total time cold vs warm.

Writes results/bench_workers.json (atomically, with a format version).
Usage: python benchmarks/bench_workers.py [--runs N] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from krex import resultfile
from krex.measure import stats
from krex.workers import ExecRequest, PoolSpec, WorkerPool

FORMAT_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "krex" / "_native"

PROG = """import time
T0 = time.monotonic()
import numpy
T1 = time.monotonic()
print(T0, T1)
"""

GPU_PROG = """import ctypes, os, time
T0 = time.monotonic()
lib = ctypes.CDLL(os.environ["KREX_LIBCUDA"])
ctx, dev, mod, fn = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
assert lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert lib.cuCtxSetCurrent(ctx) == 0
T1 = time.monotonic()
assert lib.cuModuleLoadData(ctypes.byref(mod), b"x") == 0
assert lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_us_2000") == 0
for _ in range(10):
    lib.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
assert lib.cuCtxSynchronize() == 0
print(T0, T1)
"""


def quantiles(xs: list[float]) -> dict[str, float]:
    q = stats.quantiles(xs, (0.5, 0.95))
    return {"p50_ms": 1e3 * q["p50"], "p95_ms": 1e3 * q["p95"], "n": len(xs)}


def cold(path: str, env: dict[str, str] | None = None) -> tuple[float, float, float]:
    t = time.monotonic()
    out = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env,
                         check=True).stdout
    t0, t1 = map(float, out.split())
    return t0 - t, t1 - t, time.monotonic() - t


def warm(pool: WorkerPool, path: str) -> tuple[float, float, float]:
    out: list[str] = []
    t = time.monotonic()
    result = pool.submit(ExecRequest.for_path(path), lambda s, text: out.append(text))
    assert result.ok, result
    t0, t1 = map(float, "".join(out).split())
    return t0 - t, t1 - t, time.monotonic() - t


def bench_cpu(runs: int, tmp: str) -> dict:
    path = os.path.join(tmp, "prog.py")
    Path(path).write_text(PROG)
    samples: dict[str, list[tuple[float, float, float]]] = {"cold": [], "warm": []}
    with WorkerPool(PoolSpec("cpu", min_workers=1, max_workers=1, preload=["numpy"])) as pool:
        for _ in range(3):
            warm(pool, path), cold(path)
        for _ in range(runs):  # interleaved: the machine drifts between minutes
            samples["warm"].append(warm(pool, path))
            samples["cold"].append(cold(path))
    out = {}
    for mode, xs in samples.items():
        out[mode] = {"first_instruction": quantiles([x[0] for x in xs]),
                     "after_import_numpy": quantiles([x[1] for x in xs]),
                     "total": quantiles([x[2] for x in xs])}
    out["speedup_after_import_numpy_p50"] = (out["cold"]["after_import_numpy"]["p50_ms"]
                                             / out["warm"]["after_import_numpy"]["p50_ms"])
    return out


def fakegpu_available() -> bool:
    return (NATIVE / "fakegpu" / "libcuda.so.1").exists() and \
        (NATIVE / "bin" / "krex-fakegpu-server").exists()


def bench_fakegpu(tmp: str, concurrency: int = 8, delay_ms: int = 300) -> dict:
    sock = os.path.join(tmp, "fakegpu.sock")
    env = {**os.environ, "KREX_FAKEGPU_SOCKET": sock, "KREX_FAKEGPU_CTX_DELAY_MS": str(delay_ms),
           "KREX_LIBCUDA": str(NATIVE / "fakegpu" / "libcuda.so.1")}
    server = subprocess.Popen([str(NATIVE / "bin" / "krex-fakegpu-server"), sock], env=env,
                              stdout=subprocess.DEVNULL)
    try:
        while not os.path.exists(sock):
            time.sleep(0.01)
        path = os.path.join(tmp, "gpu_prog.py")
        Path(path).write_text(GPU_PROG)
        return {"concurrency": concurrency, "ctx_delay_ms": delay_ms,
                "cold": _concurrent(lambda: cold(path, env), concurrency),
                "warm": _warm_concurrent(path, env, concurrency)}
    finally:
        server.kill()
        server.wait()


def _warm_concurrent(path: str, env: dict[str, str], n: int) -> dict:
    class Launcher:
        def prepare(self, index):
            return env, None

        def started(self, pid):
            pass

        def exited(self, pid):
            pass

    spec = PoolSpec("fakegpu:0", min_workers=n, max_workers=n, preload=[])
    t = time.monotonic()
    with WorkerPool(spec, launcher=Launcher()) as pool:
        pool_start_s = time.monotonic() - t
        result = _concurrent(lambda: warm(pool, path), n)
    result["pool_start_s"] = pool_start_s
    return result


def _concurrent(fn, n: int) -> dict:
    results: list[tuple[float, float, float]] = []
    threads = [threading.Thread(target=lambda: results.append(fn())) for _ in range(n)]
    t = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    total = time.monotonic() - t
    return {"total_s": total, "context_ready": quantiles([r[1] for r in results]),
            "per_program": quantiles([r[2] for r in results])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_workers.json"))
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = {"benchmark": "workers",
                "python": sys.version.split()[0], "cpus": os.cpu_count(),
                "cpu": bench_cpu(opts.runs, tmp)}
        data["fakegpu"] = bench_fakegpu(tmp) if fakegpu_available() else None
    resultfile.write(opts.out, data, format=FORMAT_VERSION, indent=2)
    print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
