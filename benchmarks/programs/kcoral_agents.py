"""KCoral side of bench_evaluate.py: N agents, each evaluating its candidates remotely.

Run with the Python of a venv that has kcoral (not krex's).  The kernels are
written out inside ``kc_evaluate``: a KCoral remote function must be
self-contained (no globals, no imports of local files).  Each evaluation
is one ``Client(url).function(cpu_only=True)`` call doing what an agent's
harness does on a plain execution service: correctness on the seeds (fresh
inputs per call, allclose at fp32 tolerances), then interleaved A/B timing
over rotating input sets, the median of the paired ratios, and a verdict with
the same ±3 % materiality band krex uses.  Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time


def kc_evaluate(kind: str, k: int, ref_k: int, seeds: int, pairs: int, rows: int,
                cols: int) -> dict:
    import time

    import numpy as np

    def once(x):
        return x * np.sqrt(x * x + np.float32(1.0))

    def work(x, times):
        out = None
        for _ in range(times):
            out = once(x)
        return out

    def ref(x):
        return work(x, ref_k)

    def cand(x):
        if kind == "zeros":
            return np.zeros_like(x)
        if kind == "half":
            h = x.astype(np.float16)
            return (h * np.sqrt(h * h + np.float16(1.0))).astype(np.float32)
        return work(x, k)

    def make(seed):
        return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)

    correct = all(np.allclose(cand(make(s)), ref(make(s)), atol=1e-4, rtol=1e-4)
                  for s in range(seeds))
    if not correct:
        return {"verdict": "invalid", "correct": False, "speedup": None}
    ref_sets = [make(1000 + i) for i in range(4)]
    cand_sets = [make(1000 + i) for i in range(4)]
    for i in range(3):
        ref(ref_sets[i]), cand(cand_sets[i])
    ratios = []
    for i in range(pairs):
        t0 = time.perf_counter()
        ref(ref_sets[i % 4])
        t1 = time.perf_counter()
        cand(cand_sets[i % 4])
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / max(t2 - t1, 1e-9))
    ratios.sort()
    speedup = ratios[len(ratios) // 2]
    verdict = "faster" if speedup >= 1.03 else "slower" if speedup <= 1 / 1.03 else "same"
    return {"verdict": verdict, "correct": True, "speedup": speedup}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--workload", required=True, help="JSON: list per agent of candidate dicts")
    p.add_argument("--params", required=True, help="JSON: seeds, pairs, rows, cols, ref_k")
    args = p.parse_args()
    from kcoral.client import Client

    workload = json.loads(args.workload)
    params = json.loads(args.params)
    results: list[list[dict]] = [[] for _ in workload]

    def agent(i: int) -> None:
        with Client(args.url) as client:
            fn = client.function(cpu_only=True)(kc_evaluate)
            for cand in workload[i]:
                t0 = time.monotonic()
                try:
                    out = fn.remote(cand["kind"], cand["k"], params["ref_k"], params["seeds"],
                                    params["pairs"], params["rows"], params["cols"])
                except Exception as exc:  # noqa: BLE001  (recorded as a failed evaluation)
                    out = {"verdict": "error", "error": repr(exc)[:300]}
                results[i].append({**cand, **out, "seconds": time.monotonic() - t0})

    t0 = time.monotonic()
    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(workload))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    json.dump({"wall_s": time.monotonic() - t0, "results": results}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
