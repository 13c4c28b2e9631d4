"""Take ``n`` regions of ``hold_ms`` (busy) back to back, the plain way (``with
krex.region()`` in a loop), the plain way reading each report before the next region
(``plain-read``: the loop waits for the daemon's report of each release), or pipelined
(``krex.regions(n)``); wait for ``start`` (monotonic) first.  Print one JSON line: each
region's daemon times."""

import sys

from b2b_common import busy, emit, warm_up_then_wait

import krex

how, n, hold_ms, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])

warm_up_then_wait(start)
done = []
if how == "pipelined":
    for r in krex.regions(n, "cpu"):
        busy(hold_ms)
        done.append(r)
else:
    for _ in range(n):
        with krex.region("cpu") as r:
            busy(hold_ms)
        if how == "plain-read":
            assert r.report is not None
        done.append(r)
emit([{"job": r.report.job_id, "requested": r.report.requested_mono_s,
                   "granted": r.report.granted_mono_s, "released": r.report.released_mono_s,
                   "unclaimed": r.report.unclaimed_s,
                   "handed_over": bool(r.report.host and r.report.host.handed_over),
                   "prepared": bool(r.report.host and r.report.host.handover_prepared),
                   "siblings_frozen": r.report.host.siblings_frozen if r.report.host else 0}
                  for r in done])
