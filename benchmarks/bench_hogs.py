"""Unmanaged hogs: does a region that says ``clean`` time cleanly? (issue 11)

Two plain CPU loops and one memory-bound copy loop run beside a private
daemon, started outside krex (no job, never frozen or moved).  This process
times bench_fidelity's C compute kernels of ~1 ms and ~10 ms inside
``krex.region()`` on ``cpu``: rounds of regions with the hogs running,
interleaved with rounds of the same kernels alone (same daemon, same run).

Readings per kernel, in %:

- ``floor``: p95 of the second alone half against the first (what the machine
  itself moves);
- ``all``: p95 of every loaded sample against the alone samples;
- ``clean``: p95 of the samples of loaded regions reported clean;
- not clean: the fraction of loaded regions reported not clean, and by reason;
- missed: loaded regions reported clean whose own p95 is more than 1.5 % plus
  the floor above the alone p95 (interference the report did not see).

The claim to show: either ``clean`` within 1.5 % of the floor, or every
affected region reported not clean.

``--shield off|on|both`` (default both): the daemon's shield
(``KREX_SHIELD``, :mod:`krex.enforce.shield`) off, on, or one daemon of each
(each with its own alone reference).  With the shield on, the hogs are moved
off the reserved core for each region; ``shielded`` counts the loaded regions
whose report says the shield acted.

Usage: python benchmarks/bench_hogs.py [--rounds 2] [--regions 20] [--shield both]
Writes results/hogs.json and prints a markdown table.

``--cost N``: no hogs; N regions of 10 ms with the shield on, then off, and
the enforcement steps' apply / revert latency per region (p50 / p95 ms):
what the shield adds to every grant and release.  Writes results/shield_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "programs"))
from ckernels import cpu_kernels  # noqa: E402
from common import md_table, private_daemon, write_results  # noqa: E402

import krex  # noqa: E402
from krex.measure import stats  # noqa: E402

KERNELS = {"compute-1ms": 50, "compute-10ms": 10}  # samples per region
MARGIN_PCT = 1.5


# The hogs' launcher is started before this process takes its first region: this
# process then joins its ad-hoc job's cgroup, and whatever it spawned afterwards (even
# detached) would belong to the holder's job -- isolated with it, counted as its own.
LAUNCHER = r"""
import json, subprocess, sys
argvs, hogs = json.loads(sys.argv[1]), []
try:
    for line in sys.stdin:
        for h in hogs:
            h.kill()
            h.wait()
        hogs = []
        if line.strip() == "start":
            hogs = [subprocess.Popen(a, stdout=subprocess.DEVNULL) for a in argvs]
        print(" ".join(str(h.pid) for h in hogs), flush=True)
finally:
    for h in hogs:
        h.kill()
"""


class Hogs:
    """Two plain CPU loops and one memory-bound copy loop, outside krex."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KREX_")}
        cpu = [sys.executable, "-c", "while 1: pass"]
        mem = [sys.executable, os.path.join(HERE, "programs", "cpu_sibling.py"), "mem"]
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, json.dumps([cpu, cpu, mem])],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def _say(self, what: str) -> list[int]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return [int(x) for x in self.proc.stdout.readline().split()]

    def start(self) -> list[int]:
        pids = self._say("start")
        time.sleep(0.5)  # let them get going
        return pids

    def stop(self) -> None:
        self._say("stop")

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait(10)


def regions(fn, samples: int, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        with krex.region("cpu", label="hogs") as r:
            times = []
            for _ in range(samples):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        report = r.report
        shield = (report.host.shield or {}) if report.host else {}
        out.append({"samples_ms": times, "clean": report.clean,
                    "shielded": shield.get("mode") == "cpuset-shield",
                    "reasons": [x.code.value for x in report.reasons],
                    "run_delay_ms": report.host.holder_run_delay_ms if report.host else None})
    return out


def run(hogs: Hogs, rounds: int, n: int) -> dict[str, dict]:
    sizes: dict[str, int] = {}
    kernels = {k: fn for k, (_, fn) in cpu_kernels((1.0, 10.0), sizes).items() if k in KERNELS}
    data: dict[str, dict[str, list]] = {k: {"alone": [], "hogs": []} for k in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            data[name]["alone"].append(regions(fn, KERNELS[name], n))
        hogs.start()
        try:
            for name, fn in kernels.items():
                data[name]["hogs"].append(regions(fn, KERNELS[name], n))
        finally:
            hogs.stop()
    return {name: summarize(d["alone"], d["hogs"]) for name, d in data.items()}


def _p95(samples: list[float], ref: list[float]) -> float:
    return stats.quantile_inflation_pct(samples, ref, (0.95,))["p95"]


def summarize(alone_rounds: list[list[dict]], hog_rounds: list[list[dict]]) -> dict:
    flat = [r for rnd in alone_rounds for r in rnd]
    alone = [s for r in flat for s in r["samples_ms"]]
    half = len(flat) // 2
    first = [s for r in flat[:half] for s in r["samples_ms"]]
    second = [s for r in flat[half:] for s in r["samples_ms"]]
    floor = _p95(second, first)
    loaded = [r for rnd in hog_rounds for r in rnd]
    clean = [r for r in loaded if r["clean"]]
    alone_p95 = stats.quantile(alone, 0.95)
    limit = alone_p95 * (1 + (MARGIN_PCT + max(floor, 0.0)) / 100)
    missed = [r for r in clean if stats.quantile(r["samples_ms"], 0.95) > limit]
    reasons = Counter(code for r in loaded for code in set(r["reasons"]))
    return {
        "alone_median_ms": stats.median(alone), "floor_p95_pct": floor,
        "all_p95_pct": _p95([s for r in loaded for s in r["samples_ms"]], alone),
        "clean_p95_pct": _p95([s for r in clean for s in r["samples_ms"]], alone)
        if clean else None,
        "regions": len(loaded), "not_clean": len(loaded) - len(clean),
        "shielded": sum(bool(r.get("shielded")) for r in loaded),
        "reasons": dict(reasons), "missed": len(missed),
        "alone_regions_not_clean": sum(not r["clean"] for r in flat),
        "alone_reasons": dict(Counter(c for r in flat for c in set(r["reasons"]))),
        "loaded_run_delay_ms_p50": stats.median([r["run_delay_ms"] or 0.0 for r in loaded]),
    }


def cost(n: int) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for mode in ("on", "off"):
        os.environ["KREX_SHIELD"] = mode
        steps: dict[str, list[float]] = {}
        with private_daemon():
            for _ in range(n):
                with krex.region("cpu", label="cost") as r:
                    time.sleep(0.01)
                for s in r.report.host.steps if r.report.host else []:
                    steps.setdefault(f"{s.name} apply", []).append(s.apply_ms or 0.0)
                    steps.setdefault(f"{s.name} revert", []).append(s.revert_ms or 0.0)
                steps.setdefault("grant set-up", []).append(r.report.enforce_s * 1e3)
        out[mode] = steps
    os.environ.pop("KREX_SHIELD", None)
    return out


def show_cost(n: int) -> None:
    out = cost(n)
    path = write_results("shield_cost", {"regions": n, "load_average": os.getloadavg(),
                                         "steps_ms": out})
    rows = [[mode, step, f"{stats.median(v):.3f}", f"{stats.quantile(v, 0.95):.3f}"]
            for mode, steps in out.items() for step, v in steps.items()]
    print(md_table(["shield", "step", "p50 ms", "p95 ms"], rows))
    print(f"\nwritten {path}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--regions", type=int, default=20, help="per kernel, phase and round")
    ap.add_argument("--shield", choices=("off", "on", "both"), default="both")
    ap.add_argument("--cost", type=int, default=0, help="only the shield's cost, N regions")
    args = ap.parse_args()
    if args.cost:
        return show_cost(args.cost)
    modes = ("off", "on") if args.shield == "both" else (args.shield,)
    hogs = Hogs()
    out: dict[str, dict] = {}
    old = os.environ.get("KREX_SHIELD")
    try:
        for mode in modes:
            os.environ["KREX_SHIELD"] = mode  # the private daemon inherits it
            with private_daemon():
                out[mode] = run(hogs, args.rounds, args.regions)
    finally:
        hogs.close()
        if old is None:
            os.environ.pop("KREX_SHIELD", None)
        else:
            os.environ["KREX_SHIELD"] = old
    path = write_results("hogs", {"rounds": args.rounds, "regions": args.regions,
                                  "load_average": os.getloadavg(), "shield": out})
    print(md_table(["shield", "kernel", "floor p95 %", "all loaded p95 %",
                    "clean loaded p95 %", "not clean", "shielded", "reasons (regions)",
                    "missed", "alone not clean"], _rows(out)))
    print(f"\nwritten {path}")


def _rows(out: dict[str, dict]) -> list[list]:
    return [[mode, name, f"{r['floor_p95_pct']:+.2f}", f"{r['all_p95_pct']:+.1f}",
             "-" if r["clean_p95_pct"] is None else f"{r['clean_p95_pct']:+.2f}",
             f"{r['not_clean']}/{r['regions']}", f"{r['shielded']}/{r['regions']}",
             ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())) or "-",
             r["missed"], f"{r['alone_regions_not_clean']}/{r['regions']}"]
            for mode, kernels in out.items() for name, r in kernels.items()]


if __name__ == "__main__":
    main()
