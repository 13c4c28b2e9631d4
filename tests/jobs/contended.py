"""A holder that times a fixed amount of CPU work in each of N regions.

argv: OUT_FILE N WORK_MS MODE   (MODE: plain | thread-nested)
``plain``: N regions of its own (under ``krex run --mode command`` they are
nested in the job's whole hold); ``thread-nested``: N regions inside one outer
region of this thread.  Writes JSON: per region the stopwatch time of the work
(``elapsed_ms``) and the region's report.
"""

import contextlib
import json
import sys
import time

import krex

out, n, work_ms, mode = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]


def spin(iterations: int) -> None:
    x = 0
    for i in range(iterations):
        x ^= i


t0 = time.perf_counter()
spin(100_000)
iterations = int(100_000 * work_ms / 1e3 / (time.perf_counter() - t0))
rows = []
outer = krex.region(label="outer") if mode == "thread-nested" else contextlib.nullcontext()
with outer:
    for _ in range(n):
        with krex.region(label="timed") as r:
            t = time.perf_counter()
            spin(iterations)
            elapsed = time.perf_counter() - t
        rows.append({"elapsed_ms": elapsed * 1e3, "report": r.report.to_dict()})
with open(out, "w") as f:
    json.dump(rows, f)
