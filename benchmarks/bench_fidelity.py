"""Timing fidelity under interference (issues 3 and 4): p50/p95/p99 inflation per bucket.

One job times kernels of ~0.1, 1 and 10 ms (benchmarks/programs/fidelity_probe.py)
while 4 sibling jobs run heavy work.  Each round times the kernels alone (the
reference), alone again, then loaded under each mode, so machine drift cancels.
Three readings per bucket, all in % against the reference of the same round
(krex.measure.stats defines them and the quantiles):

- per sample: each loaded sample ÷ the reference median (a sample's own jitter
  counts: on a 250 Hz VM a 1 ms sample catches a scheduler tick 1 time in 4);
- quantile: the loaded run's p50/p95/p99 ÷ the reference run's p50/p95/p99
  (same distribution = 0 at every quantile; ticks hit both alike);
- reported value: a measurement's median ÷ the reference median (what krex.measure
  reports), worst of the round's measurements.

Mode "alone" is the second unloaded run against the first: the noise floor of
each reading on this machine, against which the other modes are read.

cpu modes:      none (free sharing), isolate (CPU isolation only), region (freeze + isolation)
fakegpu modes:  none, freeze (freeze + isolation, no gate/drain), region (gate + drain + freeze
                + isolation); siblings there keep 2 ms kernels queued on the device.

Usage: python benchmarks/bench_fidelity.py [--device cpu|fakegpu:0] [--rounds 3]
Writes results/fidelity-<device>.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, private_daemon, write_results

from krex.measure import stats

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.join(HERE, "programs")
MODES = {
    "cpu": {"none": (), "isolate": ("--freeze", "off"), "region": ()},
    "fakegpu": {"none": (), "freeze": ("--no-gate",), "region": ()},
}
SIBLINGS = {"cpu": ["cpu", "cpu", "mem", "mem"], "fakegpu": ["gpu", "gpu", "cpu", "mem"]}


def krex_run(sock: str, device: str, mode: str, argv: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "KREX_SOCKET": sock}
    cmd = [sys.executable, "-m", "krex", "run", "--device", device, "--mode", mode, "--", *argv]
    return subprocess.Popen(cmd, env=env, **kw)


@contextlib.contextmanager
def siblings(sock: str, device: str, kind: str):
    procs = []
    try:
        for s in SIBLINGS[kind]:
            prog = ["gpu_sibling.py"] if s == "gpu" else ["cpu_sibling.py", s]
            procs.append(krex_run(sock, device, "region",
                                  [sys.executable, os.path.join(PROGRAMS, prog[0]), *prog[1:]],
                                  stdout=subprocess.PIPE, text=True))
        for p in procs:
            p.stdout.readline()
        time.sleep(0.3)
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


SIZES = tempfile.mktemp(prefix="krex-fidelity-sizes-", suffix=".json")


def probe(sock: str, device: str, mode: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    job_mode = "none" if mode == "none" else "region"
    p = krex_run(sock, device, job_mode, [sys.executable, os.path.join(PROGRAMS,
                                                                        "fidelity_probe.py"),
                                          device, out, SIZES])
    if p.wait() != 0:
        raise RuntimeError(f"probe failed in mode {mode}")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


class Pooled:
    """One mode's samples of every round, normalised by the round's reference medians.

    Pooled per bucket over all kernels ("1ms"), and per kernel kind ("memory 1ms").
    """

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}  # group -> sample / ref median
        self.ref: dict[str, list[float]] = {}  # group -> reference sample / ref median
        self.reported: dict[str, list[float]] = {}  # group -> reported inflation %

    def add(self, alone: dict, loaded: dict) -> None:
        for name, run in loaded.items():
            for b in (f"{run['bucket_ms']:g}ms", f"{name.split('-')[0]} {run['bucket_ms']:g}ms"):
                self._add(b, run["samples_ms"], alone[name]["samples_ms"])

    def _add(self, group: str, samples: list[float], alone: list[float]) -> None:
        # Normalised by this kernel's own reference median, so kernels of one bucket pool.
        ref = stats.median(alone)
        self.samples.setdefault(group, []).extend(s / ref for s in samples)
        self.ref.setdefault(group, []).extend(s / ref for s in alone)
        self.reported.setdefault(group, []).append(stats.reported_inflation_pct(samples, alone))

    def readings(self) -> dict[str, dict[str, dict[str, float]]]:
        out: dict[str, dict[str, dict[str, float]]] = {"per_sample": {}, "quantile": {},
                                                       "reported": {}}
        kinds = {g.split()[0] for g in self.samples if " " in g}
        for g in sorted(self.samples, key=_group_order):
            if " " in g and len(kinds) < 2:
                continue  # one kind of kernel: its groups repeat the buckets
            out["per_sample"][g] = stats.quantiles(
                stats.per_sample_inflation_pct(self.samples[g], 1.0))
            out["quantile"][g] = stats.quantile_inflation_pct(self.samples[g], self.ref[g])
            meds = self.reported[g]
            out["reported"][g] = {"median": stats.median(meds),
                                  "worst": max(meds, key=abs), "n": len(meds)}
        return out


def _group_order(group: str) -> tuple:
    """"0.1ms" < "1ms" < "10ms", then "compute 0.1ms" ... (all-kernel buckets first)."""
    *kind, bucket = group.split()
    return (bool(kind), kind, float(bucket[:-2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-args", default="",
                    help="extra `krex serve` flags for every mode, e.g. '--fakegpu-core 1'")
    args = ap.parse_args()
    kind = args.device.split(":")[0]
    modes = MODES[kind]
    # "alone" is a second run with no siblings: the noise floor of the method itself.
    pooled = {m: Pooled() for m in ("alone", *modes)}
    clean: dict[str, list[bool]] = {m: [] for m in ("alone", *modes)}
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: os.path.exists(SIZES) and os.unlink(SIZES))
        extra = args.serve_args.split()
        socks = {m: stack.enter_context(private_daemon(*flags, *extra))
                 for m, flags in modes.items()}
        for r in range(args.rounds):
            alone = probe(socks["region"], args.device, "region")
            again = probe(socks["region"], args.device, "region")
            pooled["alone"].add(alone, again)
            clean["alone"] += [bool(v["clean"]) for v in again.values()]
            for mode, sock in socks.items():
                with siblings(sock, args.device, kind):
                    loaded = probe(sock, args.device, mode)
                pooled[mode].add(alone, loaded)
                clean[mode] += [bool(v["clean"]) for v in loaded.values()]
                print(f"round {r + 1}/{args.rounds} mode {mode} done", file=sys.stderr)
    readings = {m: p.readings() for m, p in pooled.items()}
    name = f"fidelity-{kind}"
    path = write_results(name, {"device": args.device, "rounds": args.rounds,
                                "serve_args": args.serve_args,
                                "inflation_pct": {m: r["per_sample"] for m, r in readings.items()},
                                "quantile_inflation_pct": {m: r["quantile"]
                                                           for m, r in readings.items()},
                                "reported_inflation_pct": {m: r["reported"]
                                                           for m, r in readings.items()},
                                "clean_fraction": {m: sum(c) / max(len(c), 1)
                                                   for m, c in clean.items()}})
    print(render(readings))
    print(f"\nwritten {path}")


def render(readings: dict) -> str:
    """Markdown: one table per reading, a row per mode, p50 / p95 / p99 per bucket."""
    parts = []
    for reading, title in (("per_sample", "per sample"), ("quantile", "quantile vs quantile")):
        buckets = list(next(iter(readings.values()))[reading])
        rows = [[m, *(" / ".join(f"{v:+.2f}" for v in r[reading][b].values()) for b in buckets)]
                for m, r in readings.items()]
        parts.append(f"{title}, % (p50 / p95 / p99)\n\n"
                     + md_table(["mode", *buckets], rows))
    buckets = list(next(iter(readings.values()))["reported"])
    rows = [[m, *(f"{r['reported'][b]['median']:+.2f} / {r['reported'][b]['worst']:+.2f}"
                  for b in buckets)] for m, r in readings.items()]
    parts.append("reported value (measurement median ÷ reference median), % (median / worst)"
                 "\n\n" + md_table(["mode", *buckets], rows))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
