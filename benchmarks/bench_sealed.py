"""Equal speed, sealed and one-program: are honest candidates' verdicts right?

The cpu gallery's honest candidates (true 2x, 1x and 0.5x against
``kernels.py:reference``, tests/evaluate_gallery/cpu) evaluated with
``isolation="process"`` (the sealed evaluation, cpu's default) and
``isolation="worker"``, interleaved round by round through one private daemon,
``cache="hot"`` as tests/test_evaluate_honest.py times them.  Per isolation and
candidate: the verdicts, the speedup's median and spread over runs, the pairs and
the evaluation's wall time, and for the sealed runs the dispatch's empty call p50.

Usage: python benchmarks/bench_sealed.py [--rounds 20] [--quick]
Writes results/sealed.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import md_table, private_daemon, write_results  # noqa: E402

import krex  # noqa: E402

GALLERY = os.path.join(os.path.dirname(HERE), "tests", "evaluate_gallery", "cpu")
CANDIDATES = {"faster": "faster", "same": "same", "slower": "slower"}  # name -> expected
ISOLATIONS = ("process", "worker")


def one(isolation: str, cand: str) -> dict:
    ev = krex.evaluate(os.path.join(GALLERY, "kernels.py:reference"),
                       os.path.join(GALLERY, f"honest.py:{cand}"),
                       os.path.join(GALLERY, "inputs.py:make"), cache="hot", fresh=True,
                       save=False, isolation=isolation)
    dispatch = ev.integrity.get("dispatch") or {}
    return {"isolation": isolation, "candidate": cand, "verdict": ev.verdict,
            "speedup": ev.speedup, "ci": [ev.ci_low, ev.ci_high],
            "codes": ev.codes(), "pairs": (ev.timing or {}).get("pairs"),
            "elapsed_s": ev.elapsed_s, "dispatch_p50_us": dispatch.get("p50_us"),
            "one_cpu": ev.integrity.get("one_cpu")}


def summary(runs: list[dict]) -> list[list]:
    rows = []
    for iso in ISOLATIONS:
        for cand, expected in CANDIDATES.items():
            mine = [r for r in runs if r["isolation"] == iso and r["candidate"] == cand]
            if not mine:
                continue
            verdicts = collections.Counter(r["verdict"] for r in mine)
            speedups = [r["speedup"] for r in mine if r["speedup"]]
            p50 = [r["dispatch_p50_us"] for r in mine if r["dispatch_p50_us"]]
            rows.append([iso, cand, f"{verdicts[expected]}/{len(mine)}",
                         ", ".join(f"{v} {n}" for v, n in verdicts.items() if v != expected)
                         or "–",
                         f"{statistics.median(speedups):.3f}" if speedups else "–",
                         f"{statistics.pstdev(speedups):.3f}" if len(speedups) > 1 else "–",
                         statistics.median(r["pairs"] or 0 for r in mine),
                         f"{statistics.median(r['elapsed_s'] for r in mine):.2f}",
                         f"{statistics.median(p50):.0f}" if p50 else "–"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="4 rounds")
    args = ap.parse_args()
    rounds = 4 if args.quick else args.rounds
    runs = []
    with private_daemon():
        for _ in range(rounds):
            for cand in CANDIDATES:
                for iso in ISOLATIONS:
                    runs.append(one(iso, cand))
    rows = summary(runs)
    path = write_results("sealed", {"rounds": rounds, "runs": runs, "load_avg": os.getloadavg()})
    print(md_table(["isolation", "candidate", "right", "other verdicts", "speedup p50",
                    "speedup sd", "pairs p50", "eval s p50", "empty call p50 µs"], rows))
    print(f"\n{rounds} rounds, interleaved; load average {os.getloadavg()}; wrote {path}")


if __name__ == "__main__":
    main()
