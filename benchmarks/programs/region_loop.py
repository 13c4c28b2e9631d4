"""A managed job's own view of its regions (benchmarks/bench_region_jobs.py).

Run as ``krex run --device cpu -- python region_loop.py HOLD_S SECONDS``: back-to-back
``with krex.region()`` blocks, each spinning HOLD_S on the job's own clock, for SECONDS.
Prints one JSON line: the job's wall time, the work inside its regions, and per region
how long entering and leaving took by its own clock; then (after the loop, off the timed
path) the daemon's reports of the same regions: wait, set-up and each step's time.
"""

import json
import sys
import time

import krex

hold, seconds = float(sys.argv[1]), float(sys.argv[2])
clock = time.monotonic  # the daemon's clock (CLOCK_MONOTONIC): comparable with its reports
rows, regions = [], []
t0 = clock()
end = t0 + seconds
while clock() < end:
    a = clock()
    with krex.region() as r:
        b = clock()
        while clock() - b < hold:
            pass
        c = clock()
    d = clock()
    rows.append((a, b, c, d))
    regions.append(r)
wall = clock() - t0
reports = []
for r in regions:
    rep = r.report
    host = rep.host
    steps = {s.name: s.apply_ms for s in host.steps} if host else {}
    reverts = {s.name: s.revert_ms for s in host.steps} if host else {}
    reports.append({"waited_ms": rep.waited_s * 1e3, "enforce_ms": rep.enforce_s * 1e3,
                    "held_ms": rep.held_s * 1e3, "clean": rep.clean,
                    "granted": rep.granted_mono_s, "released": rep.released_mono_s,
                    "apply_ms": steps, "revert_ms": reverts})
print(json.dumps({"wall_s": wall, "rows": rows, "reports": reports}))
