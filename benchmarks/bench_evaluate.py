"""8 agents each evaluating 20 candidates: krex.evaluate and KCoral side by side in one run.

The workload: a reference that does an elementwise float32 kernel 4 times;
candidates that do it k times (true speedup 4/k: k < 4 faster, k = 4 same,
k > 4 slower) or are wrong (zeros; fp16 arithmetic: expected ``invalid``).
Each agent evaluates its candidates one after the other; all agents at once.

- krex: ``krex.evaluate`` (fresh each time) through a private daemon with its
  default settings; on ``cpu`` and on ``fakegpu:0`` (spin kernels of known
  duration, k x 400 us against 2 x 400 us).
- KCoral (cpu only): the same workload as remote functions
  (``Client(url).function(cpu_only=True)``) on ``kcoral server --device cpu
  --max-requests-per-worker 0 --sandbox none``, each call doing an agent's
  usual harness: correctness on the seeds, interleaved A/B timing over
  rotating inputs, the median ratio, the same ±3 % band (programs/kcoral_agents.py).

Reports evaluations per minute and verdict accuracy (against the known
truth) for each, in results/bench_evaluate.json.

    python benchmarks/bench_evaluate.py [--agents 8] [--candidates 20] [--cache hot]
        [--kcoral-python /path/to/kcoral-venv/bin/python] [--devices cpu,fakegpu:0]
        [--rounds N]

With ``--rounds N`` the systems run N times each, their order alternating by
round, and the results hold krex's ratio to KCoral per round and its median.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, private_daemon, stop_process, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
REF_K = 4
KINDS: list[tuple[str, int]] = [("work", 1), ("work", 2), ("work", 3), ("work", 4), ("work", 5),
                                ("work", 6), ("work", 8), ("zeros", 4), ("work", 4),
                                ("half", 4)]
ROWS, COLS, SEEDS, PAIRS = 256, 512, 3, 30
UNIT_US = 400  # fakegpu: one unit of work

GALLERY_KERNELS = os.path.join(os.path.dirname(HERE), "tests", "evaluate_gallery", "cpu",
                               "kernels.py")  # once(x), work(x, times)
HALF = """

def half(x):
    h = x.astype(np.float16)
    return (h * np.sqrt(h * h + np.float16(1.0))).astype(np.float32)
"""

KERNELS_FAKEGPU = """import ctypes, os
import numpy as np

_lib, _fn = [], []
ARGS = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)


def _spin():
    if not _lib:
        _lib.append(ctypes.CDLL(os.environ.get("KREX_FAKEGPU_LIB", "libcuda.so.1")))
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        _lib[0].cuModuleLoadData(ctypes.byref(mod), b"bench")
        _lib[0].cuModuleGetFunction(ctypes.byref(fn), mod, b"spin_us_@US@")
        _fn.append(fn)
    assert _lib[0].cuLaunchKernel(_fn[0], *ARGS) == 0


def work(x, times):
    for _ in range(times):
        _spin()
    return x * np.float32(2.0) + np.float32(1.0)


def half(x):
    _spin()
    return (x.astype(np.float16) * np.float16(2.0) + np.float16(1.0)).astype(np.float32)
""".replace("@US@", str(UNIT_US))

INPUTS = f"""import numpy as np

SHAPES = [({ROWS}, {COLS}), (96, 200)]


def make(seed, shape=({ROWS}, {COLS})):
    return (np.random.default_rng(seed).standard_normal(shape).astype(np.float32),)
"""


def expected(kind: str, k: int) -> str:
    if kind != "work":
        return "invalid"
    return "faster" if k < REF_K else "same" if k == REF_K else "slower"


def workload(agents: int, candidates: int) -> list[list[dict[str, Any]]]:
    out = []
    for a in range(agents):
        row = []
        for j in range(candidates):
            kind, k = KINDS[(a * 3 + j) % len(KINDS)]
            row.append({"agent": a, "index": j, "kind": kind, "k": k,
                        "expected": expected(kind, k)})
        out.append(row)
    return out


def write_task(folder: str, device: str, work: list[list[dict[str, Any]]]) -> None:
    if device.startswith("fakegpu"):
        kernels = KERNELS_FAKEGPU
    else:
        with open(GALLERY_KERNELS) as f:
            kernels = f.read() + HALF
    files = {"kernels.py": kernels, "inputs.py": INPUTS,
             "ref.py": f"from kernels import work\n\n\ndef fn(x):\n    return work(x, {REF_K})\n"}
    for row in work:
        for c in row:
            body = {"work": f"work(x, {c['k']})", "zeros": "np.zeros_like(x)",
                    "half": "half(x)"}[c["kind"]]
            files[f"cand_{c['agent']}_{c['index']}.py"] = (
                f"# agent {c['agent']} candidate {c['index']}\nimport numpy as np\n"
                f"from kernels import half, work\n\n\ndef fn(x):\n    return {body}\n")
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


# -- krex ----------------------------------------------------------------------------------


def run_krex(device: str, work: list[list[dict[str, Any]]], cache: str,
             daemon_args: tuple[str, ...] = ()) -> dict[str, Any]:
    import krex

    folder = tempfile.mkdtemp(prefix="krex-bench-evaluate-")
    write_task(folder, device, work)
    db = os.path.join(folder, "records.sqlite3")
    results: list[list[dict[str, Any]]] = [[] for _ in work]

    def agent(i: int) -> None:
        for c in work[i]:
            t0 = time.monotonic()
            try:
                ev = krex.evaluate(f"{folder}/ref.py:fn", f"{folder}/cand_{c['agent']}_"
                                   f"{c['index']}.py:fn", f"{folder}/inputs.py:make",
                                   device=device, cache=cache, fresh=True, records=db)
                out = {"verdict": ev.verdict, "correct": ev.correct, "speedup": ev.speedup,
                       "findings": ev.codes(), **breakdown(ev),
                       "why_invalid": [f"{f.code.name}: {f.message[:300]}" for f in ev.findings
                                       if f.severity == "invalid"]}  # a false alarm's evidence
            except Exception as exc:  # noqa: BLE001  (a failed evaluation is counted as one)
                out = {"verdict": "error", "error": repr(exc)[:300]}
            results[i].append({**c, **out, "seconds": time.monotonic() - t0})

    with private_daemon(*daemon_args):
        krex.evaluate(f"{folder}/ref.py:fn", f"{folder}/ref.py:fn", f"{folder}/inputs.py:make",
                      device=device, cache=cache, save=False)  # pool and device up: not timed
        cpu0 = cpu_split()
        t0 = time.monotonic()
        threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        cpu = cpu_split(cpu0, wall)
    shutil.rmtree(folder, ignore_errors=True)
    return {**summarize("krex", device, wall, results), "cpu": cpu}


def cpu_split(before: dict[str, float] | None = None, wall_s: float = 0.0) -> dict[str, float]:
    """CPU seconds by whom: the daemon (with its workers, the fake device server and the
    guardian: its children, live and reaped), this evaluating process, everything else;
    and the machine's idle time.  ``daemon_alone_s`` and ``guardian_s`` are parts of
    ``daemon_and_workers_s``.  With ``before``: the differences over the run
    (``busy_fraction``: the share of all cores' time that was not idle)."""
    import psutil

    from krex.client.connection import Client

    with Client(autostart=False) as c:
        daemon = psutil.Process(c.status()["daemon"]["pid"])
    t = daemon.cpu_times()
    own_daemon = t.user + t.system
    krexd = own_daemon + t.children_user + t.children_system
    guardian = 0.0
    for child in daemon.children(recursive=True):
        try:
            ct = child.cpu_times()
            krexd += ct.user + ct.system
            if "krex.enforce.guardian" in " ".join(child.cmdline()):
                guardian += ct.user + ct.system
        except psutil.NoSuchProcess:
            pass
    own = sum(os.times()[:2])
    machine = psutil.cpu_times()
    now = {"daemon_and_workers_s": krexd, "daemon_alone_s": own_daemon,
           "guardian_s": guardian,
           "evaluating_process_s": own,
           "machine_idle_s": machine.idle + machine.iowait,
           "machine_total_s": sum(machine)}
    if before is None:
        return now
    d = {k: round(now[k] - before[k], 3) for k in now}
    busy = d["machine_total_s"] - d["machine_idle_s"]
    d["other_s"] = round(busy - d["daemon_and_workers_s"] - d["evaluating_process_s"], 3)
    d["busy_fraction"] = round(busy / d["machine_total_s"], 3) if d["machine_total_s"] else 0
    d["wall_s"] = round(wall_s, 3)
    return d


def breakdown(ev: Any) -> dict[str, Any]:
    """Where one evaluation's time went: the program's stages, the region's wait and hold."""
    region = (ev.timing or {}).get("region") or {}
    return {"elapsed_s": ev.elapsed_s, "log_ratio_mad": log_ratio_mad(ev.timing or {}),
            "stage_s": (ev.integrity or {}).get("stage_s", {}),
            "pairs": (ev.timing or {}).get("pairs"), "regions": (ev.timing or {}).get("attempts"),
            "discarded_pairs": (ev.timing or {}).get("discarded_pairs"),
            "region_waited_s": region.get("waited_s"), "region_enforce_s": region.get("enforce_s"),
            "region_held_s": region.get("held_s"),
            "rejected_reasons": [[r.get("code") for r in rep.get("reasons") or []]
                                 for rep in (ev.timing or {}).get("rejected_regions") or []]}


def log_ratio_mad(timing: dict[str, Any]) -> float | None:
    """The pairs' noise: median absolute deviation of ln(reference / candidate)."""
    import statistics

    pairs = zip(timing.get("reference_samples_ms") or [], timing.get("candidate_samples_ms")
                or [], strict=False)
    logs = [math.log(a / b) for a, b in pairs if a > 0 and b > 0]
    if len(logs) < 2:
        return None
    mid = statistics.median(logs)
    return statistics.median(abs(x - mid) for x in logs)


# -- KCoral --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_kcoral(python: str, work: list[list[dict[str, Any]]]) -> dict[str, Any]:
    port = free_port()
    cwd = tempfile.mkdtemp(prefix="kcoral-bench-")
    kcoral = os.path.join(os.path.dirname(python), "kcoral")
    server = subprocess.Popen([kcoral, "server", "--host", "127.0.0.1", "--port", str(port),
                               "--device", "cpu", "--max-requests-per-worker", "0",
                               "--sandbox", "none"], cwd=cwd, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    params = {"seeds": SEEDS, "pairs": PAIRS, "rows": ROWS, "cols": COLS, "ref_k": REF_K}
    prog = os.path.join(HERE, "programs", "kcoral_agents.py")
    try:
        _wait_port(port, server)
        warm = [[{"agent": 0, "index": -1, "kind": "work", "k": REF_K}]]
        subprocess.run([python, prog, "--url", url, "--workload", json.dumps(warm), "--params",
                        json.dumps(params)], check=True, capture_output=True, timeout=300)
        done = subprocess.run([python, prog, "--url", url, "--workload", json.dumps(work),
                               "--params", json.dumps(params)], check=True, capture_output=True,
                              text=True, timeout=1800)
    finally:
        stop_process(server)
        shutil.rmtree(cwd, ignore_errors=True)
    data = json.loads(done.stdout)
    return summarize("kcoral", "cpu", data["wall_s"], data["results"])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kcoral server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError("kcoral server did not listen")


# -- results -------------------------------------------------------------------------------


def summarize(system: str, device: str, wall_s: float,
              results: list[list[dict[str, Any]]]) -> dict[str, Any]:
    flat = [r for row in results for r in row]
    right = [r for r in flat if r["verdict"] == r["expected"]]
    by_expected: dict[str, list[int]] = {}
    for r in flat:
        counts = by_expected.setdefault(r["expected"], [0, 0])
        counts[0] += r["verdict"] == r["expected"]
        counts[1] += 1
    return {"system": system, "device": device, "evaluations": len(flat), "wall_s": wall_s,
            "per_minute": len(flat) / wall_s * 60, "accuracy": len(right) / max(len(flat), 1),
            "by_expected": {k: f"{v[0]}/{v[1]}" for k, v in sorted(by_expected.items())},
            "errors": sum(r["verdict"] == "error" for r in flat), "phases": phases(flat),
            "results": flat}


def phases(flat: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds summed over all evaluations: each program stage, the region's wait and hold
    (the hold is exclusive: the sum of holds is time no other evaluation could time)."""
    out: dict[str, float] = {}
    for r in flat:
        for name, seconds in (r.get("stage_s") or {}).items():
            out[f"stage:{name}"] = out.get(f"stage:{name}", 0.0) + seconds
        for key in ("elapsed_s", "region_waited_s", "region_enforce_s", "region_held_s",
                    "seconds"):
            out[key] = out.get(key, 0.0) + (r.get(key) or 0.0)
    pairs = [r["pairs"] for r in flat if r.get("pairs")]
    return {**{k: round(v, 3) for k, v in sorted(out.items())},
            "pairs_mean": round(sum(pairs) / len(pairs), 1) if pairs else None,
            "regions_taken": sum(r.get("regions") or 0 for r in flat)}


def ratios_to_kcoral(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """krex on cpu over KCoral, evaluations per minute, by round (each round runs both
    back to back on the same workload), and their median: one 8-second run moves by
    ±15 % on a shared machine, so one round's ratio is not a result."""
    import statistics

    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r["system"] == "kcoral" or r["device"] == "cpu":
            by_round.setdefault(r["round"], {})[r["system"]] = r["per_minute"]
    ratios = [round(v["krex"] / v["kcoral"], 3) for _, v in sorted(by_round.items())
              if "krex" in v and v.get("kcoral")]
    if not ratios:
        return {}
    return {"by_round": ratios, "median": round(statistics.median(ratios), 3),
            "lowest": min(ratios)}


def compile_krex() -> None:
    """Write krex's bytecode, as pip does for KCoral's installed package: with
    PYTHONDONTWRITEBYTECODE set (as in this project's sessions) an editable checkout is
    otherwise compiled from source on every import, e.g. each evaluation's
    ``krex.client.region`` in its worker (~20 ms here)."""
    import compileall

    import krex

    compileall.compile_dir(os.path.dirname(os.path.abspath(krex.__file__)), quiet=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--candidates", type=int, default=20)
    p.add_argument("--cache", default="hot", choices=("hot", "cold"),
                   help="krex's cache setting (KCoral's harness does not flush)")
    p.add_argument("--devices", default="cpu,fakegpu:0")
    p.add_argument("--kcoral-python", help="Python of a venv with kcoral[server] deps; "
                                           "omitted: krex alone")
    p.add_argument("--quick", action="store_true", help="2 agents x 5 candidates")
    p.add_argument("--rounds", type=int, default=1,
                   help="the whole workload this many times, the systems' order alternating "
                        "by round; with KCoral, the ratio per round and its median")
    p.add_argument("--daemon-args", default="", help="extra `krex serve` flags for krex's "
                                                      "private daemon, e.g. '--workers-max 3'")
    args = p.parse_args()
    if args.quick:
        args.agents, args.candidates = 2, 5
    work = workload(args.agents, args.candidates)
    compile_krex()
    load_before = os.getloadavg()
    runs = []
    for i in range(args.rounds):
        one = [lambda: run_kcoral(args.kcoral_python, work)] if args.kcoral_python else []
        one += [lambda d=d: run_krex(d, work, args.cache, tuple(args.daemon_args.split()))
                for d in args.devices.split(",")]
        for run in one if i % 2 == 0 else one[::-1]:  # each system first in every other round
            runs.append({**run(), "round": i + 1})
    rows = [(r["round"], r["system"], r["device"], r["evaluations"], f"{r['wall_s']:.1f}",
             f"{r['per_minute']:.1f}", f"{r['accuracy']:.1%}",
             " ".join(f"{k} {v}" for k, v in r["by_expected"].items()), r["errors"])
            for r in runs]
    table = md_table(["round", "system", "device", "evaluations", "wall s", "per minute",
                      "accuracy", "right by truth", "errors"], rows)
    ratios = ratios_to_kcoral(runs)
    load = {"before": load_before, "after": os.getloadavg()}
    path = write_results("bench_evaluate", {"agents": args.agents, "load_average": load,
                                            "daemon_args": args.daemon_args,
                                            "candidates": args.candidates, "cache": args.cache,
                                            "rounds": args.rounds, "ratios": ratios,
                                            "runs": runs, "table": table})
    print(table)
    if ratios:
        print(f"\nkrex cpu / KCoral evaluations per minute, by round: {ratios['by_round']}; "
              f"median {ratios['median']}, lowest {ratios['lowest']}")
    for r in runs:
        if r["system"] == "krex":
            print(f"\nround {r['round']}, krex {r['device']} phases (s, summed over "
                  "evaluations): "
                  + json.dumps(r["phases"]))
            print(f"krex {r['device']} CPU (s over the run): " + json.dumps(r["cpu"]))
    print(f"\nload average (1/5/15 min) before {load['before']}, after {load['after']}")
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
