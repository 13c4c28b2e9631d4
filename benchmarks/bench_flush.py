"""How cold does a cpu cache flush leave the next call, and what does it cost?

For working sets of 1, 8 and 32 MiB (a numpy sum over an array of that size),
the call is timed right after a flush of each size — none (hot), the default
(the timed core's caches, capped: ``krex.measure.cache.default_flush_bytes()``),
the last level alone, and krex's earlier default, 2 x the last level — in
interleaved rounds (the machine drifts between minutes).  A flush is "enough"
when the call after it is as slow as after the largest flush.

Usage: python benchmarks/bench_flush.py [--rounds 9] [--calls 15]
Writes results/flush.json and prints a markdown table (medians over rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from common import md_table, write_results  # noqa: E402

from krex.measure import cache  # noqa: E402

MiB = 1 << 20
WORKING_SETS_MIB = (1, 8, 32)


def flush_sizes() -> dict[str, int]:
    llc = cache.last_level_cache_bytes()
    return {"none (hot)": 0, "default": cache.default_flush_bytes(), "1 x LLC": llc,
            "2 x LLC (before)": 2 * llc}


def one_round(arrays, flushers, calls: int) -> dict[tuple[int, str], tuple[float, float]]:
    """{(working set MiB, flush name): (median call ms, median flush ms)} for one round."""
    out = {}
    for mib, a in arrays.items():
        for name, fl in flushers.items():
            call_ms, flush_ms = [], []
            for _ in range(calls):
                t0 = time.perf_counter()
                if fl is not None:
                    fl.flush()
                t1 = time.perf_counter()
                a.sum()
                t2 = time.perf_counter()
                call_ms.append((t2 - t1) * 1e3)
                flush_ms.append((t1 - t0) * 1e3)
            out[(mib, name)] = (statistics.median(call_ms), statistics.median(flush_ms))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args()
    sizes = flush_sizes()
    flushers = {n: cache.CpuCacheFlusher(b) if b else None for n, b in sizes.items()}
    for fl in flushers.values():
        if fl is not None:
            fl.flush()  # touch the buffers once
    arrays = {mib: np.ones(mib * MiB // 8) for mib in WORKING_SETS_MIB}
    rounds = [one_round(arrays, flushers, args.calls) for _ in range(args.rounds)]
    rows, data = [], []
    for mib in WORKING_SETS_MIB:
        for name in sizes:
            calls = [r[(mib, name)][0] for r in rounds]
            flushes = [r[(mib, name)][1] for r in rounds]
            hot = statistics.median(r[(mib, "none (hot)")][0] for r in rounds)
            biggest = statistics.median(r[(mib, "2 x LLC (before)")][0] for r in rounds)
            call = statistics.median(calls)
            data.append({"working_set_mib": mib, "flush": name, "flush_mib": sizes[name] / MiB,
                         "call_ms_p50": call, "call_ms_max_round": max(calls),
                         "flush_ms_p50": statistics.median(flushes)})
            rows.append([mib, name, f"{sizes[name] / MiB:.0f}", f"{statistics.median(flushes):.2f}",
                         f"{call:.3f}", f"{call / hot:.2f}",
                         f"{(call - hot) / (biggest - hot) * 100:.0f}" if biggest > hot else "–"])
    path = write_results("flush", {"rounds": args.rounds, "calls": args.calls, "rows": data,
                                   "load_avg": os.getloadavg()})
    print(md_table(["working set MiB", "flush", "flush MiB", "flush ms p50", "call ms p50",
                    "× hot", "% of the 2 x LLC effect"], rows))
    print(f"\n{args.rounds} rounds x {args.calls} calls, interleaved; load average "
          f"{os.getloadavg()}; wrote {path}")


if __name__ == "__main__":
    main()
