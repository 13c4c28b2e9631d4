"""Timing fidelity under interference (issues 3 and 4): p50/p95/p99 inflation per bucket.

Mode "alone" compares a second run without siblings with the first: the noise
floor of the method on this machine, against which the other modes are read.

One job times kernels of ~0.1, 1 and 10 ms (benchmarks/programs/fidelity_probe.py)
while 4 sibling jobs run heavy work; inflation = each sample ÷ the median of the
same kernel timed alone in the same round (rounds interleave alone and loaded
runs, so machine drift cancels).

cpu modes:      none (free sharing), isolate (CPU isolation only), region (freeze + isolation)
fakegpu modes:  none, freeze (freeze + isolation, no gate/drain), region (gate + drain + freeze
                + isolation); siblings there keep 2 ms kernels queued on the device.

Usage: python benchmarks/bench_fidelity.py [--device cpu|fakegpu:0] [--rounds 3]
Writes results/fidelity-<device>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import md_table, percentiles, private_daemon, write_results  # noqa: E402

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


def inflation(alone: dict, loaded: dict) -> dict[float, list[float]]:
    per_bucket: dict[float, list[float]] = {}
    for name, run in loaded.items():
        ref = statistics.median(alone[name]["samples_ms"])
        per_bucket.setdefault(run["bucket_ms"], []).extend(
            (s / ref - 1) * 100 for s in run["samples_ms"])
    return per_bucket


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
    pooled: dict[str, dict[float, list[float]]] = {m: {} for m in ("alone", *modes)}
    clean: dict[str, list[bool]] = {m: [] for m in ("alone", *modes)}
    with contextlib.ExitStack() as stack:
        extra = args.serve_args.split()
        socks = {m: stack.enter_context(private_daemon(*flags, *extra))
                 for m, flags in modes.items()}
        for r in range(args.rounds):
            alone = probe(socks["region"], args.device, "region")
            again = probe(socks["region"], args.device, "region")
            for bucket, xs in inflation(alone, again).items():
                pooled["alone"].setdefault(bucket, []).extend(xs)
            clean["alone"] += [bool(v["clean"]) for v in again.values()]
            for mode, sock in socks.items():
                with siblings(sock, args.device, kind):
                    loaded = probe(sock, args.device, mode)
                for bucket, xs in inflation(alone, loaded).items():
                    pooled[mode].setdefault(bucket, []).extend(xs)
                clean[mode] += [bool(v["clean"]) for v in loaded.values()]
                print(f"round {r + 1}/{args.rounds} mode {mode} done", file=sys.stderr)
    table = {m: {f"{b:g}ms": percentiles(xs) for b, xs in sorted(buckets.items())}
             for m, buckets in pooled.items()}
    name = f"fidelity-{kind}"
    path = write_results(name, {"device": args.device, "rounds": args.rounds,
                                "serve_args": args.serve_args,
                                "inflation_pct": table,
                                "clean_fraction": {m: sum(c) / max(len(c), 1)
                                                   for m, c in clean.items()}})
    rows = [[m, b, *(f"{v:+.2f}" for v in p.values())]
            for m, buckets in table.items() for b, p in buckets.items()]
    print(md_table(["mode", "bucket", "p50 %", "p95 %", "p99 %"], rows))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
