"""``make bench``: every benchmarks/bench_*.py script, then ``krex eval`` on cpu and fakegpu.

    python benchmarks/run_all.py [--quick] [--only NAME[,NAME]] [--skip-eval]

Each script writes its own results/<name>.json; the eval writes
results/eval-cpu.{json,md,*.png} and results/eval-fakegpu0.*.  ``--quick`` is
passed to the scripts that accept it and makes the eval ``--quick``.  A
failing script does not stop the others; the exit code is 1 if any failed.
Plots need matplotlib (``pip install -e '.[dev,plot]'``); without it the
eval writes JSON and markdown and says that PNGs were skipped.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _accepts_quick(script: str) -> bool:
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    return "--quick" in out.stdout


def _run(name: str, argv: list[str]) -> tuple[str, int, float]:
    print(f"== {name}: {' '.join(argv)}", flush=True)
    t0 = time.monotonic()
    code = subprocess.call(argv, cwd=REPO)
    return name, code, time.monotonic() - t0


def _fakegpu_built() -> bool:
    try:
        from krex.devices.fakegpu import available
    except ImportError:
        return False
    return available()


def plan(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    jobs = []
    only = set(filter(None, (args.only or "").split(",")))
    for script in sorted(glob.glob(os.path.join(HERE, "bench_*.py"))):
        name = os.path.splitext(os.path.basename(script))[0]
        if only and name not in only:
            continue
        quick = ["--quick"] if args.quick and _accepts_quick(script) else []
        jobs.append((name, [sys.executable, script, *quick]))
        if name == "bench_fidelity" and _fakegpu_built():  # the GPU half, on the fake device
            jobs.append((name + "-fakegpu", [sys.executable, script, "--device", "fakegpu:0"]))
    if not args.skip_eval:
        devices = ["cpu"] + (["fakegpu:0"] if _fakegpu_built() else [])
        for dev in devices:
            name = "eval-" + dev.replace(":", "")
            if only and name not in only:
                continue
            extra = ["--quick"] if args.quick else []
            jobs.append((name, [sys.executable, "-m", "krex", "eval", "--device", dev,
                                "--out", os.path.join(REPO, "results"), *extra]))
    return jobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short variants (smoke, not figures)")
    ap.add_argument("--only", help="comma-separated names, e.g. bench_gate,eval-cpu")
    ap.add_argument("--skip-eval", action="store_true", help="only the bench_*.py scripts")
    args = ap.parse_args()
    done = [_run(name, argv) for name, argv in plan(args)]
    print("\n== summary")
    for name, code, secs in done:
        print(f"  {name:<20} {'ok' if code == 0 else f'FAILED ({code})':<12} {secs:7.1f} s")
    return 1 if any(code for _, code, _ in done) else 0


if __name__ == "__main__":
    sys.exit(main())
