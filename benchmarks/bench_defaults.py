"""What krex's defaults cost a newcomer, before and after a change, side by side.

Runs the same snippet against two krex trees — ``--before REV`` (a git revision,
extracted with ``git archive``; default ``main``) and this checkout — alternating
the two in every round, each in a fresh process with its own auto-started daemon
(private runtime directories).  Per round and tree:

- ``bench_wall_s``: wall time of ``krex.bench(lambda: sum(range(20000)))`` (defaults);
- ``flush_ms``: one default cpu cache flush (``CpuCacheFlusher()``), median of 20;
- ``flush_mib``: its size;
- ``compare_hold_s``: the region hold of ``krex.compare(f, g, max_time_s=0.3)``
  as the daemon recorded it;
- ``measure_1ms_warnings``: warnings of ``krex.measure`` of a 1 ms busy loop.

Usage: python benchmarks/bench_defaults.py [--before REV] [--rounds N]
Writes results/defaults.json and prints a markdown table (median / p95 / max per tree).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from common import md_table, percentiles, write_results  # noqa: E402

SNIPPET = r"""
import json, statistics, time, warnings
warnings.simplefilter("ignore")
import krex
from krex.measure.cache import CpuCacheFlusher

def f():
    return sum(range(20000))

def g():
    return sum(range(20000))

def busy():
    end = time.perf_counter() + 1e-3
    while time.perf_counter() < end:
        pass

t0 = time.perf_counter()
krex.bench(f)
bench_wall_s = time.perf_counter() - t0
flusher = CpuCacheFlusher()
flusher.flush()
costs = []
for _ in range(20):
    t0 = time.perf_counter()
    flusher.flush()
    costs.append((time.perf_counter() - t0) * 1e3)
c = krex.compare(f, g, max_time_s=0.3)
m = krex.measure(busy)
print(json.dumps({"bench_wall_s": bench_wall_s, "flush_ms": statistics.median(costs),
                  "flush_mib": flusher.size_bytes / 2**20,
                  "compare_hold_s": c.region.held_s,
                  "measure_1ms_warnings": len(m.warnings)}))
"""

METRICS = ("bench_wall_s", "flush_ms", "flush_mib", "compare_hold_s", "measure_1ms_warnings")


def extract(rev: str) -> str:
    """``git archive rev`` into a temp dir, with this checkout's built native parts."""
    root = tempfile.mkdtemp(prefix="krex-before-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
    native = os.path.join(ROOT, "krex", "_native")
    shutil.copytree(native, os.path.join(root, "krex", "_native"), dirs_exist_ok=True)
    return root


def env_for(tree: str, runtime: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
    env.update(PYTHONPATH=tree, KREX_RUNTIME_DIR=runtime, KREX_IDLE_EXIT_S="120")
    return env


def run(tree: str, runtime: str, code: str = SNIPPET) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", code], env=env_for(tree, runtime), cwd="/",
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]) if code is SNIPPET else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="main", help="git revision of the 'before' tree")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    trees = {"before": extract(args.before), "after": ROOT}
    runtimes = {name: tempfile.mkdtemp(prefix=f"krex-{name}-") for name in trees}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        for name, tree in trees.items():  # start each daemon outside the rounds
            run(tree, runtimes[name], "import krex; krex.Client().close()")
        for _ in range(args.rounds):
            for name, tree in trees.items():
                rows[name].append(run(tree, runtimes[name]))
    finally:
        for name, tree in trees.items():
            subprocess.run([sys.executable, "-m", "krex", "stop"], cwd="/", capture_output=True,
                           env=env_for(tree, runtimes[name]), timeout=60)
        shutil.rmtree(trees["before"], ignore_errors=True)
    summary = {name: {k: percentiles([r[k] for r in rs], (50, 95, 100)) for k in METRICS}
               for name, rs in rows.items()}
    path = write_results("defaults", {"before": args.before, "rounds": rows, "summary": summary,
                                      "load_avg": os.getloadavg()})
    table = [[k, *(f"{summary[n][k]['p50']:.4g} / {summary[n][k]['p95']:.4g} / "
                   f"{summary[n][k]['p100']:.4g}" for n in trees)] for k in METRICS]
    print(md_table(["metric", f"before ({args.before}) p50 / p95 / max",
                    "after p50 / p95 / max"], table))
    print(f"\n{args.rounds} rounds, interleaved; load average {os.getloadavg()}; wrote {path}")


if __name__ == "__main__":
    main()
