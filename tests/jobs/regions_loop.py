"""Take ``n`` regions of ``hold_ms`` (busy) back to back, the plain way (``with
krex.region()`` in a loop) or pipelined (``krex.regions(n)``); wait for ``start``
(monotonic) first.  Print one JSON line: each region's daemon times."""

import json
import sys
import time

import krex

how, n, hold_ms, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])


def busy(ms: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < ms / 1e3:
        pass


with krex.region("cpu", label="warm-up"):
    pass
while time.monotonic() < start:
    time.sleep(0.001)
done = []
if how == "pipelined":
    for r in krex.regions(n, "cpu"):
        busy(hold_ms)
        done.append(r)
else:
    for _ in range(n):
        with krex.region("cpu") as r:
            busy(hold_ms)
        done.append(r)
print(json.dumps([{"job": r.report.job_id, "requested": r.report.requested_mono_s,
                   "granted": r.report.granted_mono_s, "released": r.report.released_mono_s,
                   "handed_over": bool(r.report.host and r.report.host.handed_over)}
                  for r in done]), flush=True)
