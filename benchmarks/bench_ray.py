"""krex on Ray: throughput of 1 vs 2 local nodes, and submission overhead per program.

Workload: N programs, each 50 ms of CPU time outside a region and ~5 ms inside
one (the region part serialises per node's cpu device).  Overhead: a trivial
program, submit -> result through krex.ray vs Client.exec on the node's daemon.
Usage: .venv/bin/python benchmarks/bench_ray.py [--n 40] [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import md_table, write_results

from krex.measure.stats import quantiles

WORK = """import sys, time, krex
def spin(ms):  # CPU time, not wall time: a fixed amount of work per program
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass
spin(float(sys.argv[1]))
with krex.region(label="bench"):
    spin(float(sys.argv[2]))
"""


def _write(directory: str, name: str, text: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def throughput(n_nodes: int, n: int, work: str) -> dict:
    import ray

    import krex.ray
    from krex.integrations.ray.local import LocalCluster

    with LocalCluster(n_nodes, serve_args=["--no-isolate"]):
        ray.get(krex.ray.map([(work, [200, 1])] * (4 * n_nodes)))  # grow every pool to its max
        t0 = time.monotonic()
        results = ray.get(krex.ray.map([(work, [50, 5])] * n))
        wall = time.monotonic() - t0
    ok = sum(r["status"] == "ok" for r in results)
    per_node = {}
    for r in results:
        per_node[r["node_id"][:8]] = per_node.get(r["node_id"][:8], 0) + 1
    return {"nodes": n_nodes, "programs": n, "ok": ok, "wall_s": wall,
            "programs_per_s": n / wall, "per_node": per_node}


def overhead(reps: int, noop: str) -> dict:
    import ray

    import krex.ray
    from krex.client.connection import Client
    from krex.integrations.ray.local import LocalCluster

    quiet = lambda stream, text: None  # noqa: E731
    with LocalCluster(1, serve_args=["--no-isolate"]) as lc:
        sock = os.path.join(lc.infos[0]["runtime_dir"], "krexd.sock")
        ray.get(krex.ray.submit(noop))
        via_ray, direct = [], []
        for _ in range(reps):  # interleaved: the machine's speed drifts
            t0 = time.perf_counter()
            ray.get(krex.ray.submit(noop))
            via_ray.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with Client(sock, autostart=False) as c:
                c.exec(noop, [], on_output=quiet)
            direct.append(time.perf_counter() - t0)
    return {"krex_ray_submit_s": quantiles(via_ray), "client_exec_s": quantiles(direct)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=40, help="programs per throughput run")
    parser.add_argument("--reps", type=int, default=30, help="trivial programs for overhead")
    opts = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="krex-bench-ray-")
    work, noop = _write(tmp, "work.py", WORK), _write(tmp, "noop.py", "pass\n")
    runs = [throughput(k, opts.n, work) for k in (1, 2)]
    over = overhead(opts.reps, noop)
    path = write_results("bench_ray", {"throughput": runs, "overhead": over,
                                       "workload": {"outside_ms": 50, "inside_ms": 5}})
    print(md_table(["nodes", "programs", "ok", "wall (s)", "programs/s", "per node"],
                   [[r["nodes"], r["programs"], r["ok"], f"{r['wall_s']:.2f}",
                     f"{r['programs_per_s']:.1f}", r["per_node"]] for r in runs]))
    print()
    print(md_table(["submit -> result, trivial program (ms)", "p50", "p95", "p99"],
                   [[name, *(f"{v * 1e3:.2f}" for v in over[key].values())]
                    for name, key in (("krex.ray.submit", "krex_ray_submit_s"),
                                      ("Client.exec (same daemon)", "client_exec_s"))]))
    print(f"\nwritten: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
