"""The holder of benchmarks/gpu_check.py's gate/drain check: N regions in a row.

argv: DEVICE N OUT_JSON [HOLD_MS=2]
Each region is held for HOLD_MS of sleep; every region report is written to OUT_JSON,
with the client-side request -> granted latency.
"""

import json
import sys
import time

import krex

device, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
hold_s = (float(sys.argv[4]) if len(sys.argv) > 4 else 2.0) / 1e3
reports = []
for i in range(n):
    t0 = time.perf_counter()
    with krex.region(device=device, label=f"gpu-check-{i}") as r:
        granted = time.perf_counter() - t0
        time.sleep(hold_s)
    reports.append({"client_grant_ms": granted * 1e3, "report": r.report.to_dict()})
    time.sleep(0.02)  # let the sibling queue work again
with open(out, "w") as f:
    json.dump(reports, f)
